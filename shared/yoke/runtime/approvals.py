"""Approvals: a person decides before a call of a gated tool runs (docs/approvals.md).

A gated call waits in the store as an open call awaiting approval (:mod:`yoke.runtime.open_calls`
keeps its state, its decision and how each decision is carried out). This module is the
deciding side: who may decide (:func:`may_decide`: the services' own RabbitMQ user, which the
CLI speaks as, the HTTP gateway's (YOKE_GATEWAY_AMQP_USER), or a publisher made with ``yoke
publisher create --can-approve``, each naming its person in ``by`` within its own namespace as
for lines, :mod:`yoke.speakers`), the door's answer to ``tool.approval.submit``
(:class:`Approvals`), and the list of what waits (:func:`pending_approvals`, for ``yoke
approvals`` and the gateway's ``GET /v1/forums/{id}/approvals``).
"""

from __future__ import annotations

from datetime import UTC, datetime

from pydantic import Field, JsonValue

from yoke.models import (
    CommandAuthor,
    Document,
    RejectCode,
    SubmitApproval,
    SubmitReply,
    WireModel,
    as_utc,
)
from yoke.runtime.open_calls import (
    TOOL_CALL_DECISIONS_COLLECTION,
    TOOL_CALLS_COLLECTION,
    CallDecision,
    OpenCall,
    OpenCalls,
)
from yoke.speakers import DoorUsers, ForeignNamespace
from yoke.store import Store

# The publishers (RabbitMQ users) that may decide, one document each; written by the CLI.
APPROVERS_COLLECTION = "approvers"


class PendingApproval(WireModel):
    """A call waiting for a person's decision, as ``yoke approvals`` and the gateway list it."""

    call_id: str
    forum_id: str
    agent_actor_id: str
    tool: str
    input: dict[str, JsonValue] = Field(default_factory=dict)
    requested_at: datetime
    deadline: datetime


class Approver(Document):
    """A publisher that may decide on approvals; ``id`` is its RabbitMQ user name."""

    granted_at: datetime = Field(default_factory=lambda: datetime.now(UTC))


async def pending_approvals(store: Store, forum_id: str | None = None) -> list[PendingApproval]:
    """The calls of ``forum_id`` (every forum's, if None) waiting for a decision, oldest
    first. A call decided a moment ago but not yet run or ended is not listed."""
    query = {"forumId": forum_id} if forum_id is not None else {"state": "awaiting_approval"}
    calls = [OpenCall.from_document(d) async for d in store.db[TOOL_CALLS_COLLECTION].find(query)]
    decisions = store.db[TOOL_CALL_DECISIONS_COLLECTION]
    pending = []
    for call in sorted(calls, key=lambda call: as_utc(call.opened_at)):
        if not call.awaiting_approval or call.forum_id is None or call.agent_actor_id is None:
            continue
        if await decisions.find_one({"_id": call.id}, projection={"_id": 1}) is not None:
            continue
        pending.append(
            PendingApproval(
                call_id=call.id,
                forum_id=call.forum_id,
                agent_actor_id=call.agent_actor_id,
                tool=call.tool,
                input=call.input,
                requested_at=call.opened_at,
                deadline=call.deadline,
            )
        )
    return pending


async def grant_approver(store: Store, user: str) -> None:
    """Let the publisher ``user`` decide on approvals (idempotent)."""
    await store.insert_if_absent(store.db[APPROVERS_COLLECTION], Approver(id=user).to_document())


async def revoke_approver(store: Store, user: str) -> bool:
    """Take the right away (at once: the door reads it on every decision); False if ``user``
    had none."""
    result = await store.db[APPROVERS_COLLECTION].delete_one({"_id": user})
    return result.deleted_count > 0


async def is_approver(store: Store, user: str) -> bool:
    found = await store.db[APPROVERS_COLLECTION].find_one({"_id": user}, projection={"_id": 1})
    return found is not None


def _rejected(code: RejectCode, error: str) -> SubmitReply:
    return SubmitReply(status="rejected", code=code, error=error)


def _name(by: CommandAuthor | None) -> str:
    return by.display_name if by is not None else "nobody"


class Approvals:
    """The door's side of ``tool.approval.submit``: who may decide, and the first decision
    standing (a unique insert, :meth:`OpenCalls.decide`)."""

    def __init__(self, open_calls: OpenCalls, users: DoorUsers) -> None:
        self.open_calls = open_calls
        self.store = open_calls.store
        # The services' own RabbitMQ user (the CLI's) and the HTTP gateway's: each names its
        # person; every other user is a publisher, whose people are its own.
        self.users = users

    async def may_decide(self, user: str) -> bool:
        """The mesh's own users, or a publisher granted it; never a tool worker's user."""
        if self.users.is_worker(user):
            return False
        return self.users.is_mesh(user) or await is_approver(self.store, user)

    async def submit(self, command: SubmitApproval, user: str | None) -> SubmitReply:
        """Decide on the call as ``command.by``, speaking through the RabbitMQ ``user`` that
        RabbitMQ verified (None: the command had no ``user_id``)."""
        if not user:
            return _rejected(
                "missing_user_id",
                "the decision has no AMQP user_id: publish it with user_id set to your "
                "RabbitMQ user, which the broker verifies",
            )
        if self.users.is_worker(user):
            return _rejected("not_allowed", self.users.worker_only(user))
        if not await self.may_decide(user):
            return _rejected(
                "not_allowed",
                f"RabbitMQ user {user!r} may not decide on approvals (a publisher made with "
                "yoke publisher create --can-approve may)",
            )
        if command.by is not None:
            try:
                by = self.users.own(user, command.by.external_id, "by.externalId")
            except ForeignNamespace as error:
                return _rejected("foreign_namespace", str(error))
            command = command.model_copy(
                update={"by": command.by.model_copy(update={"external_id": by})}
            )
        call_id = command.call_id
        call = await self.open_calls.get(call_id)
        decided = await self.open_calls.get_decision(call_id)
        if decided is not None:
            return await self._after_decision(decided, command, call)
        if call is None:
            if await self.open_calls.get_end(call_id) is not None:
                return _rejected(
                    "not_awaiting_approval", f"call {call_id!r} has ended; nothing to decide"
                )
            return _rejected("unknown_call", f"no tool call {call_id!r} waits for a decision")
        if not call.awaiting_approval:
            return _rejected(
                "not_awaiting_approval", f"call {call_id!r} is not one that waits for approval"
            )
        if datetime.now(UTC) > as_utc(call.deadline):
            # The reaper would decide it so in a moment: the deadline stands, whoever asks first.
            _, decided = await self.open_calls.decide(call, "expired")
            return await self._after_decision(decided, command, call)
        won, decided = await self.open_calls.decide(
            call, command.decision, by=command.by, reason=command.reason
        )
        if won:
            return SubmitReply(status="accepted")
        return await self._after_decision(decided, command, call)

    async def _after_decision(
        self, decided: CallDecision, command: SubmitApproval, call: OpenCall | None
    ) -> SubmitReply:
        """The same decision again from the same person is a duplicate (and what it does is
        done again, in case the first attempt died half-way); any other is too late."""
        if (
            decided.decision == command.decision
            and decided.by == command.by
            and decided.reason == command.reason
        ):
            if call is not None and call.awaiting_approval:
                await self.open_calls.carry_out(call, decided)
            return SubmitReply(status="accepted", duplicate=True)
        how = {
            "approve": f"approved by {_name(decided.by)}",
            "reject": f"rejected by {_name(decided.by)}",
            "expired": "expired: nobody decided in time",
            "stopped": f"stopped by {_name(decided.by)}",
        }[decided.decision]
        return _rejected("already_decided", f"call {command.call_id!r} was decided first: {how}")

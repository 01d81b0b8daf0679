"""A gated call from its request to what its decision does (docs/approvals.md).

A call of a tool the join gates has not run: it is an open call *awaiting approval*, its
deadline the approval's. Its life, in the order of this module:

1. **Requested** (:meth:`Approvals.request`): recorded, and the forum's approvers asked.
2. **A person decides** (:meth:`Approvals.submit`), once the door has checked who sent it
   (:mod:`yoke.runtime.calls.approvers`).
3. **Decided, once** (:meth:`Approvals.decide`): a :class:`CallDecision` is a unique insert, so a
   person's approve or reject, the deadline (:meth:`Approvals.expire`, from the reaper) and a
   stop (:mod:`yoke.runtime.calls.stops`) cannot all win.
4. **Carried out** (:meth:`Approvals.carry_out`): a rejection, expiry or stop ends the call with
   its error result; an approval publishes ``tool.call.approved`` keyed by the call's monologue,
   so the processor owning that conversation runs it in its lane. Idempotent: a decision a crash
   left half done is carried out again, by the reaper or by the same decision sent again.
5. **Approved, handed to what runs it** (:meth:`Approvals.mark_approved`, from
   :meth:`yoke.runtime.dispatch.ToolDispatch.run_approved`): its deadline is now the tool's own.
   From there it ends as any open call does (:mod:`yoke.runtime.calls.repository`).

Every decision is announced on ``yoke.forum`` as ``tool.approval.decided``.
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime
from typing import Any

from pydantic import Field, JsonValue

from yoke.core import tracing
from yoke.core.ids import derive_id
from yoke.core.metrics import APPROVAL_SECONDS, APPROVALS_DECIDED, APPROVALS_REQUESTED, tool_label
from yoke.core.models import (
    ApprovalDecided,
    ApprovalDecision,
    ApprovalRequested,
    CommandAuthor,
    Envelope,
    EventPayload,
    SubmitApproval,
    SubmitReply,
    ToolCallApproved,
    WireModel,
    as_utc,
)
from yoke.runtime.calls.records import (
    TOOL_CALL_DECISIONS_COLLECTION,
    TOOL_CALLS_COLLECTION,
    CallDecision,
    OpenCall,
)
from yoke.runtime.calls.repository import OpenCalls
from yoke.runtime.calls.texts import no_decision_text
from yoke.store.database import Store

log = logging.getLogger(__name__)


class Approvals:
    """The approval of the gated calls of this database."""

    def __init__(self, open_calls: OpenCalls) -> None:
        self.open_calls = open_calls
        self.decisions = open_calls.store.db[TOOL_CALL_DECISIONS_COLLECTION]

    # --- 1. requested ------------------------------------------------------------------------

    async def request(self, call: OpenCall) -> None:
        """Record a gated call as awaiting approval and ask the forum's approvers.

        The request is published again on a redelivered step (the store is the truth; the
        event's id is derived, so readers take it once)."""
        assert call.awaiting_approval and call.forum_id and call.agent_actor_id
        if await self.open_calls.get_end(call.id) is not None:
            return  # a redelivered step of a call decided and ended since: not asked again
        if await self.open_calls.open(call):
            APPROVALS_REQUESTED.labels(tool_label(call.tool)).inc()
        else:  # asked before: the deadline is the one it was given then, if still waiting
            stored = await self.open_calls.get(call.id)
            if stored is None or not stored.awaiting_approval:
                return
            call = stored
        request = ApprovalRequested(
            forum_id=call.forum_id,
            agent_actor_id=call.agent_actor_id,
            call_id=call.id,
            tool=call.tool,
            input=call.input,
            deadline=call.deadline,
        )
        await self._publish_forum(request, derive_id("approval-requested", call.id))

    # --- 2. a person decides -----------------------------------------------------------------

    async def submit(self, command: SubmitApproval) -> SubmitReply:
        """A person's decision (``command.by``), its sender already allowed to decide."""
        call_id = command.call_id
        call = await self.open_calls.get(call_id)
        decided = await self.get_decision(call_id)
        if decided is not None:
            return await self._after_decision(decided, command, call)
        if call is None:
            if await self.open_calls.get_end(call_id) is not None:
                return SubmitReply.rejected(
                    "not_awaiting_approval", f"call {call_id!r} has ended; nothing to decide"
                )
            return SubmitReply.rejected(
                "unknown_call", f"no tool call {call_id!r} waits for a decision"
            )
        if not call.awaiting_approval:
            return SubmitReply.rejected(
                "not_awaiting_approval", f"call {call_id!r} is not one that waits for approval"
            )
        if datetime.now(UTC) > as_utc(call.deadline):
            # The reaper would decide it so in a moment: the deadline stands, whoever asks first.
            _, decided = await self.decide(call, "expired")
            return await self._after_decision(decided, command, call)
        won, decided = await self.decide(
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
                await self.carry_out(call, decided)
            return SubmitReply(status="accepted", duplicate=True)
        how = {
            "approve": f"approved by {_name(decided.by)}",
            "reject": f"rejected by {_name(decided.by)}",
            "expired": "expired: nobody decided in time",
            "stopped": f"stopped by {_name(decided.by)}",
        }[decided.decision]
        return SubmitReply.rejected(
            "already_decided", f"call {command.call_id!r} was decided first: {how}"
        )

    # --- 3. decided, once --------------------------------------------------------------------

    async def decide(
        self,
        call: OpenCall,
        decision: ApprovalDecision,
        *,
        by: CommandAuthor | None = None,
        reason: str | None = None,
    ) -> tuple[bool, CallDecision]:
        """Take ``decision`` on ``call`` unless one was taken first (a unique insert), and carry
        out the one that stands; returns (this one won, the decision that stands)."""
        record = CallDecision(
            id=call.id,
            tool=call.tool,
            forum_id=call.forum_id,
            decision=decision,
            by=by,
            reason=reason,
        )
        store = self.open_calls.store
        if not await store.insert_if_absent(self.decisions, record.to_document()):
            existing = await self.get_decision(call.id)
            assert existing is not None  # decisions are pruned only long after their call
            return False, existing
        APPROVALS_DECIDED.labels(decision).inc()
        seconds = (record.decided_at - as_utc(call.opened_at)).total_seconds()
        APPROVAL_SECONDS.observe(max(0.0, seconds), tracing.exemplar())
        log.info(
            "approval of %s: %s",
            call.tool,
            decision,
            extra={"conversationId": call.conversation_id, "messageId": call.call_line_id},
        )
        await self.carry_out(call, record)
        return True, record

    async def expire(self, call: OpenCall) -> None:
        """Nobody decided before the deadline: ``expired``, unless a decision came first, which
        is then seen carried out."""
        won, record = await self.decide(call, "expired")
        if not won:
            await self.carry_out(call, record)

    async def get_decision(self, call_id: str) -> CallDecision | None:
        document = await self.decisions.find_one({"_id": call_id})
        return CallDecision.from_document(document) if document is not None else None

    async def decisions_of(self, call_ids: list[str]) -> dict[str, CallDecision]:
        """The decisions taken on those of ``call_ids`` decided, in one read."""
        if not call_ids:
            return {}
        query: dict[str, Any] = {"_id": {"$in": call_ids}}
        return {
            document["_id"]: CallDecision.from_document(document)
            async for document in self.decisions.find(query)
        }

    # --- 4. carried out ----------------------------------------------------------------------

    async def carry_out(self, call: OpenCall, record: CallDecision) -> None:
        """What a decision does (idempotent: a crash half-way is finished by doing it again).

        Approved: the processor owning the call's monologue is told to run it, in that
        conversation's lane. Otherwise the call ends with its error result. Then the forum's
        approvers are told."""
        name = record.by.display_name if record.by is not None else "someone"
        if record.decision == "approve":
            approved = ToolCallApproved(conversation_id=call.conversation_id, call_id=call.id)
            # Not yoke-kind forum: this one stays inside the mesh.
            await self.open_calls.poster.bus.publish_event(
                Envelope.wrap(derive_id("call-approved", call.id), approved), approved.key
            )
        elif record.decision == "reject":
            why = f": {record.reason}" if record.reason else ""
            await self.open_calls.end(
                call, outcome="rejected", output=f"rejected by {name}{why}", is_error=True, by=name
            )
        elif record.decision == "expired":
            await self.open_calls.end(
                call, outcome="timeout", output=no_decision_text(call), is_error=True
            )
        else:
            await self.open_calls.end(
                call, outcome="stopped", output=f"stopped by {name}", is_error=True, by=name
            )
        if call.forum_id:
            decided = ApprovalDecided(
                forum_id=call.forum_id,
                call_id=call.id,
                decision=record.decision,
                by=record.by,
                reason=record.reason,
            )
            await self._publish_forum(decided, derive_id("approval-decided", call.id))

    # --- 5. approved: handed to what runs it -------------------------------------------------

    async def mark_approved(
        self, call: OpenCall, deadline: datetime, runner: str | None = None
    ) -> OpenCall:
        """The approved call handed to what runs it (``runner``, for an in-process or MCP
        call): its deadline is now the tool's own.

        An update, safe because only the lane of the call's conversation writes an approved
        call; a call ended meanwhile is not brought back."""
        approved = call.model_copy(
            update={"state": "approved", "deadline": deadline, "runner": runner}
        )
        await self.open_calls.update(approved)
        return approved

    async def _publish_forum(self, payload: EventPayload, event_id: str) -> None:
        """On ``yoke.forum`` (yoke-kind forum, keyed by the forum), like the forum's lines."""
        await self.open_calls.poster.bus.publish_forum_event(event_id, payload)


def _name(by: CommandAuthor | None) -> str:
    return by.display_name if by is not None else "nobody"


class PendingApproval(WireModel):
    """A call waiting for a person's decision, as ``yoke approvals`` and the gateway list it."""

    call_id: str
    forum_id: str
    agent_actor_id: str
    tool: str
    input: dict[str, JsonValue] = Field(default_factory=dict)
    requested_at: datetime
    deadline: datetime


async def pending_approvals(store: Store, forum_id: str | None = None) -> list[PendingApproval]:
    """The calls of ``forum_id`` (every forum's, if None) waiting for a decision, oldest
    first, for ``yoke approvals`` and the gateway's ``GET /v1/forums/{id}/approvals``. A call
    decided a moment ago but not yet run or ended is not listed."""
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

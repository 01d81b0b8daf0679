"""Tool calls that wait in the store, and how each one ends exactly once.

A call whose answer is not immediate (a worker's, an MCP call past the inline bound) is an
:class:`OpenCall` document with a deadline; the step that made it ends at once, and nothing
in memory waits for it (docs/architecture.md, invariant 12). It ends when whoever settles it
first inserts its :class:`CallEnd` (a unique insert: docs/architecture.md, invariant 8): the
worker's answer at the door, the deadline (:meth:`OpenCalls.reap`, run by every processor), the
MCP call finishing, a stop or a rejected approval. The winner then writes the result line
(its id derived from the call, so a second writer's copy is a no-op), which wakes the processor
like any tool result, and deletes the open call. A crash between those steps is finished by
the next reap, which finds an open call that has an end.

A call of a gated tool (docs/approvals.md) is an open call *awaiting approval*: it has not run,
and its deadline is the approval's. The first decision on it is a :class:`CallDecision`, again
a unique insert, so a person's approve or reject, the deadline (``expired``) and a stop cannot
all win: a rejection, expiry or stop then ends the call as above; an approval publishes
``tool.call.approved`` keyed by the call's monologue, and the processor owning that
conversation runs the call (:meth:`yoke.runtime.dispatch.ToolDispatch.run_approved`), its own
timeout starting then. Every decision is announced on ``yoke.forum`` as
``tool.approval.decided``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any, Literal

from pydantic import Field, JsonValue

from yoke import topology
from yoke.ages import day_bucket
from yoke.ids import SYSTEM_ACTOR_ID, derive_id
from yoke.metrics import (
    APPROVAL_SECONDS,
    APPROVALS_DECIDED,
    APPROVALS_REQUESTED,
    OPEN_TOOL_CALLS,
    OVERDUE_TOOL_CALLS,
    PENDING_APPROVALS,
    STORE_ORIGIN,
    TOOL_CALL_SECONDS,
    TOOL_CALLS,
    tool_label,
)
from yoke.models import (
    ApprovalDecided,
    ApprovalDecision,
    ApprovalRequested,
    CommandAuthor,
    Document,
    Envelope,
    EventPayload,
    Message,
    MessageMeta,
    SubmitReply,
    ToolCallApproved,
    ToolResultPart,
    as_utc,
)
from yoke.ownership import weight
from yoke.retention import Rule
from yoke.runtime.posting import Poster
from yoke.store import Store
from yoke.text import storable
from yoke.tools.catalog import ToolSource

log = logging.getLogger(__name__)

TOOL_CALLS_COLLECTION = "tool_calls"
TOOL_CALL_ENDS_COLLECTION = "tool_call_ends"
TOOL_CALL_DECISIONS_COLLECTION = "tool_call_decisions"
# How often the reaper looks for calls past their deadline.
REAP_SECONDS = 1.0
# A call is filed under its deadline's bucket this wide (``dueBucket``): a round reads the calls
# of the buckets due now, by equality (FerretDB pushes only top-level equality down; a range on
# the deadline reads the whole collection), not every open call. Each bucket is reaped by one
# live processor (:class:`ReapShare`).
DUE_BUCKET_SECONDS = 10
# One processor reads every open call (and each at start): what the buckets do not show (a
# bucket gone by while no processor ran, an end or a decision a crash left undone, the gauges of
# open calls and pending approvals). It comes round the sooner the fewer calls are open: every
# round while few are, and on average at most this many documents a second while many are
# (10,000 approvals pending: a sweep every 100 s).
SWEEP_DOCUMENTS_PER_SECOND = 100
# A round reads at most this many buckets behind; further behind, it sweeps instead.
MAX_BUCKETS_BEHIND = 30
# A decision whose call still awaits approval this long after it was taken (its decider died
# half-way, say) is carried out again by the reaper, at most this often per call.
REAPPLY_SECONDS = 30.0

EndOutcome = Literal["answered", "timeout", "stopped", "rejected", "failed"]
# ``running``: what ran it answers (or its deadline); ``awaiting_approval``: a gated call not run
# yet, its deadline the approval's; ``approved``: handed to what runs it, its deadline the tool's.
CallState = Literal["running", "awaiting_approval", "approved"]


class OpenCall(Document):
    """``id`` is the call's id as its worker sees it (``callId``): derived from the step."""

    tool: str
    source: ToolSource
    conversation_id: str
    call_line_id: str
    # The model's id for the call (``ToolCallPart.call_id``): what the result answers.
    model_call_id: str
    input: dict[str, JsonValue] = Field(default_factory=dict)
    timeout_seconds: float
    deadline: datetime
    opened_at: datetime = Field(default_factory=lambda: datetime.now(UTC))
    # The result line's routing meta (forum, cause, the forum line answered, hops).
    meta: MessageMeta = Field(default_factory=MessageMeta)
    # Extra routing headers of the result line (topology.GUARDED_HEADER).
    route: dict[str, str] = Field(default_factory=dict)
    # The join's forum and agent (a forum's pending approvals, a stop in the forum).
    forum_id: str | None = None
    agent_actor_id: str | None = None
    state: CallState = "running"
    # Set on a gated call: how long a person had to decide (the error text's N).
    approval_timeout_seconds: float | None = None
    # The process running an in-process or MCP call (its claim, invariant 15): a claim found
    # unfinished and not running here was cut short by a crash, and is ended, never run again.
    runner: str | None = None
    # The round's results line (``round_results_id``): a claim cut short once that line is
    # written missed it, and ends in a line of its own.
    round_line_id: str | None = None

    def to_document(self) -> dict[str, Any]:
        # ``dueBucket``, the reaper's key, is derived from ``deadline`` at every write.
        document = super().to_document()
        document["dueBucket"] = due_bucket(self.deadline)
        return document

    @property
    def idempotency_key(self) -> str:
        return derive_id("tool-idempotency", self.id)

    @property
    def awaiting_approval(self) -> bool:
        return self.state == "awaiting_approval"


class CallEnd(Document):
    """How a call ended; ``id`` is the call's."""

    tool: str
    outcome: EndOutcome
    output: str
    is_error: bool
    # Who ended it: the worker's RabbitMQ user, a person's name, or None (the mesh).
    by: str | None = None
    ended_at: datetime = Field(default_factory=lambda: datetime.now(UTC))
    # Ended within its round's step: the result goes in the round's results line (a retried
    # step reuses it), never in a line of its own.
    in_round: bool = False
    age_bucket: str = Field(default_factory=day_bucket)  # yoke.retention: call_rules


class CallDecision(Document):
    """The first decision on a gated call (``id`` is the call's): who, what and why."""

    tool: str
    forum_id: str | None = None
    decision: ApprovalDecision
    by: CommandAuthor | None = None
    reason: str | None = None
    decided_at: datetime = Field(default_factory=lambda: datetime.now(UTC))
    age_bucket: str = Field(default_factory=day_bucket)  # yoke.retention: call_rules


def due_bucket(moment: datetime) -> int:
    return int(as_utc(moment).timestamp() // DUE_BUCKET_SECONDS)


class ReapShare:
    """Which buckets this processor reaps: rendezvous hashing over the live processors (the
    shard owners' live set, :class:`yoke.ownership.Ownership`), so each is reaped by one; the
    sweep too. Without a live set (one process, tests) it reaps everything."""

    def __init__(self, me: Callable[[], tuple[str, list[str]] | None] = lambda: None) -> None:
        self.me = me

    def owns(self, bucket: int) -> bool:
        found = self.me()
        if found is None or not found[1]:
            return True
        me, live = found
        return max(live, key=lambda replica: weight("reaper", bucket, replica)) == me


# The sweep's own key among the buckets (no deadline falls in it).
SWEEP_KEY = -1


def open_call_id(instance_id: str, call_line_id: str, model_call_id: str) -> str:
    return derive_id("tool-call", instance_id, call_line_id, model_call_id)


def result_line_id(call_id: str) -> str:
    """The id of the line holding a waiting call's result (one line per call)."""
    return derive_id("tool-result", call_id)


def round_results_id(instance_id: str, call_line_id: str) -> str:
    """The id of the line holding a round's results that came in the step (one per call line):
    a call has its result there or, if it waited in the store, in its own line."""
    return derive_id("tool-results", instance_id, call_line_id)


def _rejected(code: Any, error: str) -> SubmitReply:
    return SubmitReply(status="rejected", code=code, error=error)


class OpenCalls:
    """The open calls of this database: open, end, answer at the door, reap past deadlines."""

    def __init__(
        self, store: Store, poster: Poster, *, vhost: str = "/", share: ReapShare | None = None
    ) -> None:
        self.store = store
        self.poster = poster
        self.share = share or ReapShare()
        # The first bucket a round still reads (None: sweep first), and when we last swept.
        self._next_bucket: int | None = None
        self._sweep_at = 0.0  # time.monotonic() of the next sweep
        # The mesh's vhost, which its worker users' names carry (topology.tool_user).
        self.vhost = vhost
        self.calls = store.db[TOOL_CALLS_COLLECTION]
        self.ends = store.db[TOOL_CALL_ENDS_COLLECTION]
        self.decisions = store.db[TOOL_CALL_DECISIONS_COLLECTION]
        # When the reaper last carried out a decision again, by call (only calls still open).
        self._reapplied: dict[str, float] = {}

    async def open(self, call: OpenCall) -> bool:
        """Record the call (``False``: a redelivered step had recorded it already)."""
        return await self.store.insert_if_absent(self.calls, call.to_document())

    async def get(self, call_id: str) -> OpenCall | None:
        document = await self.calls.find_one({"_id": call_id})
        return OpenCall.from_document(document) if document is not None else None

    async def get_end(self, call_id: str) -> CallEnd | None:
        document = await self.ends.find_one({"_id": call_id})
        return CallEnd.from_document(document) if document is not None else None

    async def exists(self, call_id: str) -> bool:
        """Open, or ended with its result line not yet written: either way on its way."""
        if await self.calls.find_one({"_id": call_id}, projection={"_id": 1}) is not None:
            return True
        return await self.store.get_message(result_line_id(call_id)) is not None

    async def end(
        self,
        call: OpenCall,
        *,
        outcome: EndOutcome,
        output: str,
        is_error: bool,
        by: str | None = None,
        in_round: bool = False,
    ) -> tuple[bool, CallEnd]:
        """End ``call`` unless something ended it first; returns (this ended it, the end).
        ``in_round``: the step running it writes the result, in its round's results line."""
        end = CallEnd(
            id=call.id,
            tool=call.tool,
            outcome=outcome,
            output=output,
            is_error=is_error,
            by=by,
            in_round=in_round,
        )
        if not await self.store.insert_if_absent(self.ends, end.to_document()):
            existing = await self.get_end(call.id)
            assert existing is not None  # ends are pruned only long after their call
            await self.finish(call, existing)
            return False, existing
        await self.finish(call, end)
        seconds = (end.ended_at - as_utc(call.opened_at)).total_seconds()
        TOOL_CALLS.labels(tool_label(call.tool), call.source, metric_outcome(end)).inc()
        TOOL_CALL_SECONDS.labels(call.source).observe(max(0.0, seconds))
        log.info(
            "tool call %s (%s) ended: %s",
            call.tool,
            call.source,
            outcome,
            extra={"conversationId": call.conversation_id, "messageId": call.call_line_id},
        )
        return True, end

    async def finish(self, call: OpenCall, end: CallEnd) -> None:
        """Write the result line of an ended call (idempotent; none for a call ended in its
        round, whose step writes it), then forget the open call."""
        if end.in_round:
            await self.calls.delete_one({"_id": call.id})
            return
        await self.poster.post(
            Message(
                id=result_line_id(call.id),
                conversation_id=call.conversation_id,
                author_actor_id=SYSTEM_ACTOR_ID,
                role="user",
                parts=[
                    ToolResultPart(
                        call_id=call.model_call_id,
                        name=call.tool,
                        output=end.output,
                        is_error=end.is_error,
                    )
                ],
                meta=call.meta.model_copy(deep=True),
            ),
            route=call.route,
        )
        await self.calls.delete_one({"_id": call.id})

    # --- the door: a worker's answer --------------------------------------------------------

    async def answer(
        self,
        call_id: str,
        user: str | None,
        output: str,
        is_error: bool,
        *,
        outcome: EndOutcome = "answered",
    ) -> SubmitReply:
        """A worker's ``tool.result.submit``, checked against the call and who sent it
        (``failed``: an answer the door could not take, whose error ends the call instead)."""
        if not user:
            return _rejected(
                "missing_user_id",
                "the answer has no AMQP user_id: publish it with user_id set to your RabbitMQ "
                "user (the one yoke tools add-worker named), which the broker verifies",
            )
        tool = topology.tool_of_user(user, self.vhost)
        call = await self.get(call_id)
        if call is None:
            end = await self.get_end(call_id)
            if end is None:
                return _rejected("unknown_call", f"no tool call {call_id!r} was made")
            return self._after_end(end, tool, user)
        if call.source != "worker" or tool != call.tool:
            return _rejected(
                "wrong_tool",
                f"call {call_id!r} is a call of {call.tool}, which user {user!r} does not serve",
            )
        if call.awaiting_approval:
            return _rejected(
                "awaiting_approval",
                f"call {call_id!r} waits for a person's approval and was never sent to a worker",
            )
        if datetime.now(UTC) > as_utc(call.deadline):
            _, end = await self.end(
                call, outcome="timeout", output=timeout_text(call), is_error=True
            )
            return self._after_end(end, tool, user)
        won, end = await self.end(
            call, outcome=outcome, output=storable(output), is_error=is_error, by=user
        )
        if won:
            return SubmitReply(status="accepted", message_id=result_line_id(call.id))
        return self._after_end(end, tool, user)

    @staticmethod
    def _after_end(end: CallEnd, tool: str | None, user: str) -> SubmitReply:
        if tool != end.tool:
            return _rejected(
                "wrong_tool",
                f"call {end.id!r} is a call of {end.tool}, which user {user!r} does not serve",
            )
        if end.outcome == "answered" and end.by == user:
            return SubmitReply(status="accepted", message_id=result_line_id(end.id), duplicate=True)
        return _rejected(
            "call_closed", f"call {end.id!r} has ended already ({end.outcome}): {end.output}"
        )

    # --- approvals ---------------------------------------------------------------------------

    async def request_approval(self, call: OpenCall) -> None:
        """Record a gated call as awaiting approval and ask the forum's approvers.

        The request is published again on a redelivered step (the store is the truth; the
        event's id is derived, so readers take it once)."""
        assert call.awaiting_approval and call.forum_id and call.agent_actor_id
        if await self.get_end(call.id) is not None:
            return  # a redelivered step of a call decided and ended since: not asked again
        if await self.open(call):
            APPROVALS_REQUESTED.labels(tool_label(call.tool)).inc()
        else:  # asked before: the deadline is the one it was given then, if still waiting
            stored = await self.get(call.id)
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

    async def get_decision(self, call_id: str) -> CallDecision | None:
        document = await self.decisions.find_one({"_id": call_id})
        return CallDecision.from_document(document) if document is not None else None

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
        if not await self.store.insert_if_absent(self.decisions, record.to_document()):
            existing = await self.get_decision(call.id)
            assert existing is not None  # decisions are pruned only long after their call
            return False, existing
        APPROVALS_DECIDED.labels(decision).inc()
        seconds = (record.decided_at - as_utc(call.opened_at)).total_seconds()
        APPROVAL_SECONDS.observe(max(0.0, seconds))
        log.info(
            "approval of %s: %s",
            call.tool,
            decision,
            extra={"conversationId": call.conversation_id, "messageId": call.call_line_id},
        )
        await self.carry_out(call, record)
        return True, record

    async def carry_out(self, call: OpenCall, record: CallDecision) -> None:
        """What a decision does (idempotent: a crash half-way is finished by doing it again).

        Approved: the processor owning the call's monologue is told to run it, in that
        conversation's lane. Otherwise the call ends with its error result. Then the forum's
        approvers are told."""
        name = record.by.display_name if record.by is not None else "someone"
        if record.decision == "approve":
            approved = ToolCallApproved(conversation_id=call.conversation_id, call_id=call.id)
            # Not yoke-kind forum: this one stays inside the mesh.
            await self.poster.bus.publish_event(
                Envelope.wrap(derive_id("call-approved", call.id), approved), approved.key
            )
        elif record.decision == "reject":
            why = f": {record.reason}" if record.reason else ""
            await self.end(
                call, outcome="rejected", output=f"rejected by {name}{why}", is_error=True, by=name
            )
        elif record.decision == "expired":
            await self.end(call, outcome="timeout", output=no_decision_text(call), is_error=True)
        else:
            await self.end(
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

    async def mark_approved(
        self, call: OpenCall, deadline: datetime, runner: str | None = None
    ) -> OpenCall:
        """The approved call handed to what runs it (``runner``, for an in-process or MCP
        call): its deadline is now the tool's own.

        An update, safe because only the lane of the call's conversation writes an approved
        call; a call ended meanwhile is not brought back (no upsert)."""
        approved = call.model_copy(
            update={"state": "approved", "deadline": deadline, "runner": runner}
        )
        await self.calls.replace_one({"_id": call.id}, approved.to_document())
        return approved

    async def end_for_forum(
        self, forum_id: str, by: CommandAuthor, *, agent_actor_id: str | None = None
    ) -> int:
        """End every open call of the forum (of one agent there, if given) with
        ``stopped by NAME``: what a stop does. A call awaiting approval is decided ``stopped``
        (unless a decision came first), so its approvers are told. Returns how many this
        ended."""
        ended = 0
        async for document in self.calls.find({"forumId": forum_id}):
            call = OpenCall.from_document(document)
            if agent_actor_id is not None and call.agent_actor_id != agent_actor_id:
                continue
            if call.awaiting_approval:
                won, record = await self.decide(call, "stopped", by=by)
                if won:
                    ended += 1
                    continue
                if record.decision != "approve":
                    await self.carry_out(call, record)
                    continue
            won, _ = await self.end(
                call,
                outcome="stopped",
                output=f"stopped by {by.display_name}",
                is_error=True,
                by=by.display_name,
            )
            ended += won
        return ended

    async def _publish_forum(self, payload: EventPayload, event_id: str) -> None:
        """On ``yoke.forum`` (yoke-kind forum, keyed by the forum), like the forum's lines."""
        await self.poster.bus.publish_event(
            Envelope.wrap(event_id, payload), payload.key, {topology.KIND_HEADER: "forum"}
        )

    # --- deadlines ---------------------------------------------------------------------------

    async def reap(self) -> int:
        """End every call past its deadline and finish ends a crash left; returns how many
        calls this round saw still open. Whatever ran a call may be gone: the deadline holds.

        A round reads the buckets due since the last one (those this processor owns); now and
        then (:data:`SWEEP_DOCUMENTS_PER_SECOND`) one processor reads every open call instead.
        A call awaiting
        approval past its deadline is decided ``expired``; one whose decision was taken but
        not carried out (its decider died half-way) is carried out again."""
        now = datetime.now(UTC)
        current = due_bucket(now)
        sweep = (
            self._next_bucket is None
            or current - self._next_bucket > MAX_BUCKETS_BEHIND
            or time.monotonic() >= self._sweep_at
        ) and self.share.owns(SWEEP_KEY)
        if sweep:
            queries: list[dict[str, Any]] = [{}]
        else:
            first = current if self._next_bucket is None else min(self._next_bucket, current)
            buckets = range(max(first, current - MAX_BUCKETS_BEHIND), current + 1)
            queries = [{"dueBucket": bucket} for bucket in buckets if self.share.owns(bucket)]
        if not self.share.owns(SWEEP_KEY):  # the sweeper reports them (aggregated with max)
            OPEN_TOOL_CALLS.set(0)
            PENDING_APPROVALS.set(0)
        still, read = await self._reap(now, queries, sweep)
        if sweep:  # half a round early: the next round that comes after it sweeps
            every = max(REAP_SECONDS, read / SWEEP_DOCUMENTS_PER_SECOND)
            self._sweep_at = time.monotonic() + every - REAP_SECONDS / 2
        # Buckets before the current one are done (their calls all ended): never read again.
        self._next_bucket = current
        return still

    async def _reap(
        self, now: datetime, queries: list[dict[str, Any]], sweep: bool
    ) -> tuple[int, int]:
        """(calls still open, documents read) of one round."""
        still = pending = 0
        overdue: list[OpenCall] = []
        expired: list[OpenCall] = []
        undone: list[tuple[OpenCall, CallDecision]] = []
        calls: list[OpenCall] = []
        documents = [document for query in queries async for document in self.calls.find(query)]
        for document in documents:
            try:
                calls.append(OpenCall.from_document(document))
            except ValueError as error:
                log.error("dropping an unreadable open tool call %s: %s", document["_id"], error)
                await self.calls.delete_one({"_id": document["_id"]})
        seen = {call.id for call in calls}
        # One read each for the calls' ends and decisions, not two reads a call every round.
        waiting = sorted(call.id for call in calls if call.awaiting_approval)
        ends = (
            {
                document["_id"]: CallEnd.from_document(document)
                async for document in self.ends.find({"_id": {"$in": sorted(seen)}})
            }
            if seen
            else {}
        )
        decisions = (
            {
                document["_id"]: CallDecision.from_document(document)
                async for document in self.decisions.find({"_id": {"$in": waiting}})
            }
            if waiting
            else {}
        )
        for call in calls:
            end = ends.get(call.id)
            if end is not None:
                await self.finish(call, end)
                continue
            decision = decisions.get(call.id)
            if decision is not None:
                if self._due_again(call.id, decision, now):
                    undone.append((call, decision))
                still += 1
            elif now > as_utc(call.deadline):
                (expired if call.awaiting_approval else overdue).append(call)
            else:
                still += 1
                pending += call.awaiting_approval
        if sweep:  # every open call seen
            OPEN_TOOL_CALLS.set(still)
            PENDING_APPROVALS.set(pending)
            self._reapplied = {k: v for k, v in self._reapplied.items() if k in seen}
        # Counted before they are ended: calls that cannot be ended (the store refusing the
        # end, the broker the result line) fail the round, whose buckets are read again the
        # next, and are counted again (YokeToolCallsOverdue).
        OVERDUE_TOOL_CALLS.set(len(overdue) + len(expired))
        for call in overdue:
            await self.end(call, outcome="timeout", output=overdue_text(call), is_error=True)
        for call in expired:
            won, record = await self.decide(call, "expired")
            if not won:  # decided meanwhile: see that it is carried out
                await self.carry_out(call, record)
        for call, record in undone:
            log.warning(
                "carrying out again the %s decision on %s taken at %s",
                record.decision,
                call.tool,
                record.decided_at,
                extra={"conversationId": call.conversation_id},
            )
            await self.carry_out(call, record)
        return still, len(documents)

    def _due_again(self, call_id: str, decision: CallDecision, now: datetime) -> bool:
        """A decision left undone long enough, and not carried out again just now."""
        if (now - as_utc(decision.decided_at)).total_seconds() < REAPPLY_SECONDS:
            return False
        last = self._reapplied.get(call_id)
        if last is not None and time.monotonic() - last < REAPPLY_SECONDS:
            return False
        self._reapplied[call_id] = time.monotonic()
        return True

    async def run_reaper(self, stopping: asyncio.Event) -> None:
        """Reap every :data:`REAP_SECONDS` until ``stopping``; a failing round is retried."""
        STORE_ORIGIN.set("reaper")  # this task's store operations, told apart in the metrics
        while not stopping.is_set():
            try:
                await self.reap()
            except Exception as error:  # the store away: next round
                log.warning("could not check open tool calls' deadlines: %r", error)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stopping.wait(), REAP_SECONDS)


def metric_outcome(end: CallEnd) -> str:
    """The words calls answered in the step use too: ``ok`` and ``error`` for an answer."""
    if end.outcome == "answered":
        return "error" if end.is_error else "ok"
    return end.outcome


def timeout_text(call: OpenCall) -> str:
    return f"{call.tool} gave no answer within {call.timeout_seconds:g} s"


def overdue_text(call: OpenCall) -> str:
    """A call past its deadline: a worker's is late; an in-process or MCP call's own timeout
    would have ended it, so what ran it stopped."""
    if call.source == "worker":
        return timeout_text(call)
    return f"{timeout_text(call)}: {CUT_SHORT}"


# How a call cut short by a crash ends (invariant 15: never run a second time).
CUT_SHORT = "the run was cut short by a restart of the process running it; it was not run again"


def cut_short_text(tool: str) -> str:
    return f"{tool}: {CUT_SHORT}"


def no_decision_text(call: OpenCall) -> str:
    return f"no decision within {call.approval_timeout_seconds or 0:g} s"


def call_rules(store: Store, days: float) -> list[Rule]:
    """Ends and decisions, kept ``days`` (``YOKE_RETENTION_DECISION_DAYS``: to answer a late
    or repeated answer) and while their call is open: the processor's retention sweep owns
    them, by bucket, in bounded rounds."""
    calls = store.db[TOOL_CALLS_COLLECTION]

    async def call_open(document: dict[str, Any]) -> bool:
        return await calls.find_one({"_id": document["_id"]}, {"_id": 1}) is not None

    return [
        Rule("tool call ends", TOOL_CALL_ENDS_COLLECTION, "day", days, live=call_open),
        Rule("tool call decisions", TOOL_CALL_DECISIONS_COLLECTION, "day", days, live=call_open),
    ]

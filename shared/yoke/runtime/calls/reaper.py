"""The deadline of every open call, and whatever a crash left half done.

Whatever ran a call may be gone; its deadline holds. Every processor runs a :class:`Reaper`:
a call past its deadline ends with an error result, one awaiting approval is decided
``expired``, an end whose result line a crash left unwritten is finished, and a decision a crash
left undone is carried out again. A round reads the buckets due now (``dueBucket``,
:data:`yoke.runtime.calls.records.DUE_BUCKET_SECONDS` wide), each owned by one live processor
(:class:`ReapShare`); now and then one processor sweeps every open call instead, for what the
buckets do not show.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from yoke.coordination.ownership import weight
from yoke.core.metrics import OPEN_TOOL_CALLS, OVERDUE_TOOL_CALLS, PENDING_APPROVALS, STORE_ORIGIN
from yoke.core.models import as_utc
from yoke.runtime.calls.approvals import Approvals
from yoke.runtime.calls.records import CallDecision, OpenCall, due_bucket
from yoke.runtime.calls.repository import OpenCalls
from yoke.runtime.calls.texts import overdue_text

log = logging.getLogger(__name__)

# How often the reaper looks for calls past their deadline.
REAP_SECONDS = 1.0
# One processor reads every open call (and each at start): what the buckets do not show (a
# bucket gone by while no processor ran, an end or a decision a crash left undone, the gauges of
# open calls and pending approvals). It comes round the sooner the fewer calls are open: every
# round while few are, and on average at most this many documents a second while many are.
SWEEP_DOCUMENTS_PER_SECOND = 100
# A round reads at most this many buckets behind; further behind, it sweeps instead.
MAX_BUCKETS_BEHIND = 30
# A decision whose call still awaits approval this long after it was taken (its decider died
# half-way, say) is carried out again by the reaper, at most this often per call.
REAPPLY_SECONDS = 30.0
# The sweep's own key among the buckets (no deadline falls in it).
SWEEP_KEY = -1


class ReapShare:
    """Which buckets this processor reaps: rendezvous hashing over the live processors (the
    shard owners' live set, :class:`yoke.coordination.ownership.Ownership`), so each is reaped by
    one; the sweep too. Without a live set (one process, tests) it reaps everything."""

    def __init__(self, me: Callable[[], tuple[str, list[str]] | None] = lambda: None) -> None:
        self.me = me

    def owns(self, bucket: int) -> bool:
        found = self.me()
        if found is None or not found[1]:
            return True
        me, live = found
        return max(live, key=lambda replica: weight("reaper", bucket, replica)) == me


class Reaper:
    """Ends what is past its deadline; one per processor."""

    def __init__(self, open_calls: OpenCalls, share: ReapShare | None = None) -> None:
        self.open_calls = open_calls
        self.approvals = Approvals(open_calls)
        self.share = share or ReapShare()
        # The first bucket a round still reads (None: sweep first), and when we last swept.
        self._next_bucket: int | None = None
        self._sweep_at = 0.0  # time.monotonic() of the next sweep
        # When the reaper last carried out a decision again, by call (only calls still open).
        self._reapplied: dict[str, float] = {}

    async def run(self, stopping: asyncio.Event) -> None:
        """Reap every :data:`REAP_SECONDS` until ``stopping``; a failing round is retried."""
        STORE_ORIGIN.set("reaper")  # this task's store operations, told apart in the metrics
        while not stopping.is_set():
            try:
                await self.reap()
            except Exception as error:  # the store away: next round
                log.warning("could not check open tool calls' deadlines: %r", error)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stopping.wait(), REAP_SECONDS)

    async def reap(self) -> int:
        """One round; returns how many calls it saw still open.

        A round reads the buckets due since the last one (those this processor owns); now and
        then (:data:`SWEEP_DOCUMENTS_PER_SECOND`) one processor reads every open call instead."""
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
        stored = self.open_calls.calls
        documents = [document for query in queries async for document in stored.find(query)]
        for document in documents:
            try:
                calls.append(OpenCall.from_document(document))
            except ValueError as error:
                log.error("dropping an unreadable open tool call %s: %s", document["_id"], error)
                await stored.delete_one({"_id": document["_id"]})
        seen = {call.id for call in calls}
        # One read each for the calls' ends and decisions, not two reads a call every round.
        ends = await self.open_calls.ends_of(sorted(seen))
        decisions = await self.approvals.decisions_of(
            sorted(call.id for call in calls if call.awaiting_approval)
        )
        for call in calls:
            end = ends.get(call.id)
            if end is not None:
                await self.open_calls.finish(call, end)
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
            await self.open_calls.end(
                call, outcome="timeout", output=overdue_text(call), is_error=True
            )
        for call in expired:
            await self.approvals.expire(call)
        for call, record in undone:
            log.warning(
                "carrying out again the %s decision on %s taken at %s",
                record.decision,
                call.tool,
                record.decided_at,
                extra={"conversationId": call.conversation_id},
            )
            await self.approvals.carry_out(call, record)
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

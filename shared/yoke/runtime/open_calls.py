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
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from datetime import UTC, datetime, timedelta
from typing import Any, Literal

from pydantic import Field, JsonValue

from yoke import topology
from yoke.ids import SYSTEM_ACTOR_ID, derive_id
from yoke.metrics import (
    OPEN_TOOL_CALLS,
    OVERDUE_TOOL_CALLS,
    TOOL_CALL_SECONDS,
    TOOL_CALLS,
    tool_label,
)
from yoke.models import Document, Message, MessageMeta, SubmitReply, ToolResultPart, as_utc
from yoke.runtime.posting import Poster
from yoke.store import Store
from yoke.tools.catalog import ToolSource

log = logging.getLogger(__name__)

TOOL_CALLS_COLLECTION = "tool_calls"
TOOL_CALL_ENDS_COLLECTION = "tool_call_ends"
# How often each processor looks for calls past their deadline, and for ends left unfinished.
REAP_SECONDS = 1.0
# Ends are kept this long to answer a late or repeated answer (then pruned, hourly).
END_RETENTION = timedelta(days=7)
PRUNE_SECONDS = 3600.0

EndOutcome = Literal["answered", "timeout", "stopped", "rejected", "failed"]


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

    @property
    def idempotency_key(self) -> str:
        return derive_id("tool-idempotency", self.id)


class CallEnd(Document):
    """How a call ended; ``id`` is the call's."""

    tool: str
    outcome: EndOutcome
    output: str
    is_error: bool
    # Who ended it: the worker's RabbitMQ user, a person's name, or None (the mesh).
    by: str | None = None
    ended_at: datetime = Field(default_factory=lambda: datetime.now(UTC))


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

    def __init__(self, store: Store, poster: Poster) -> None:
        self.store = store
        self.poster = poster
        self.calls = store.db[TOOL_CALLS_COLLECTION]
        self.ends = store.db[TOOL_CALL_ENDS_COLLECTION]
        self._pruned_at = 0.0

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
    ) -> tuple[bool, CallEnd]:
        """End ``call`` unless something ended it first; returns (this ended it, the end)."""
        end = CallEnd(
            id=call.id, tool=call.tool, outcome=outcome, output=output, is_error=is_error, by=by
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

    async def finish(self, call: OpenCall, end: CallEnd) -> Message:
        """Write the result line of an ended call (idempotent), then forget the open call."""
        line = await self.poster.post(
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
        return line

    # --- the door: a worker's answer --------------------------------------------------------

    async def answer(
        self, call_id: str, user: str | None, output: str, is_error: bool
    ) -> SubmitReply:
        """A worker's ``tool.result.submit``, checked against the call and who sent it."""
        if not user:
            return _rejected(
                "missing_user_id",
                "the answer has no AMQP user_id: publish it with user_id set to your RabbitMQ "
                "user (tool-NAME), which the broker verifies",
            )
        tool = user.removeprefix(topology.TOOL_USER_PREFIX) if self._is_tool_user(user) else None
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
        if datetime.now(UTC) > as_utc(call.deadline):
            _, end = await self.end(
                call, outcome="timeout", output=timeout_text(call), is_error=True
            )
            return self._after_end(end, tool, user)
        won, end = await self.end(
            call, outcome="answered", output=output, is_error=is_error, by=user
        )
        if won:
            return SubmitReply(status="accepted", message_id=result_line_id(call.id))
        return self._after_end(end, tool, user)

    @staticmethod
    def _is_tool_user(user: str) -> bool:
        return user.startswith(topology.TOOL_USER_PREFIX)

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

    # --- deadlines ---------------------------------------------------------------------------

    async def reap(self) -> int:
        """End every call past its deadline and finish ends a crash left; returns how many
        calls are still open. Whatever ran a call may be gone: the deadline holds anyway."""
        now = datetime.now(UTC)
        still = 0
        overdue: list[OpenCall] = []
        async for document in self.calls.find({}):
            try:
                call = OpenCall.from_document(document)
            except ValueError as error:
                log.error("dropping an unreadable open tool call %s: %s", document["_id"], error)
                await self.calls.delete_one({"_id": document["_id"]})
                continue
            end = await self.get_end(call.id)
            if end is not None:
                await self.finish(call, end)
            elif now > as_utc(call.deadline):
                overdue.append(call)
            else:
                still += 1
        OPEN_TOOL_CALLS.set(still)
        # Counted before they are ended: calls that cannot be ended (the store refusing the
        # end, the broker the result line) are counted again every round (YokeToolCallsOverdue).
        OVERDUE_TOOL_CALLS.set(len(overdue))
        for call in overdue:
            await self.end(call, outcome="timeout", output=timeout_text(call), is_error=True)
        if time.monotonic() - self._pruned_at > PRUNE_SECONDS:
            self._pruned_at = time.monotonic()
            await self.ends.delete_many({"endedAt": {"$lt": now - END_RETENTION}})
        return still

    async def run_reaper(self, stopping: asyncio.Event) -> None:
        """Reap every :data:`REAP_SECONDS` until ``stopping``; a failing round is retried."""
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

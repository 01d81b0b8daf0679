"""Where each tool call of a round runs, by the catalog's source of its tool.

- ``builtin`` and ``plugin`` tools run here, in the step, under their own timeout (they are
  this process's code, and most answer in microseconds).
- ``mcp`` calls run here for up to :data:`INLINE_SECONDS`; one still running then stays an
  open call (:mod:`yoke.runtime.calls`) that the call itself ends when it returns, so a
  slow server never holds the step.
- either runs once per call id (docs/architecture.md, invariant 15): its open call, inserted
  before it starts (a unique insert), is its claim, and its end is recorded before the step
  writes its result. A retried step reuses the end, leaves a call still running here alone,
  and ends a claim a crash left unfinished with an error result that says so
  (:data:`yoke.runtime.calls.texts.CUT_SHORT`), never running it again.
- ``worker`` calls are always open calls: recorded with their deadline, published to the
  tool's queue, and the step ends.
- a call of a tool the join gates (``approval``) runs nowhere yet: it is an open call awaiting a
  person's decision, and the step ends. Once approved, :meth:`ToolDispatch.run_approved` runs it
  as above, in the lane of its conversation, its own timeout starting then.

Whatever goes wrong (a name the agent may not use, a tool gone from the catalog, bad input)
is an error result the model sees; nothing escapes into the step.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from typing import Protocol

from yoke.bus.broker import Bus
from yoke.core import tracing
from yoke.core.metrics import TOOL_CALLS, tool_label
from yoke.core.models import ToolCallApproved, ToolCallPart, ToolCallRequest, ToolResultPart
from yoke.runtime.calls.approvals import Approvals
from yoke.runtime.calls.records import CallEnd, OpenCall
from yoke.runtime.calls.repository import OpenCalls
from yoke.runtime.calls.texts import cut_short_text
from yoke.runtime.catalog_store import LocalTools, ToolCatalog
from yoke.runtime.join_config import ApprovalConfig
from yoke.tools.base import ToolContext
from yoke.tools.catalog import CatalogEntry
from yoke.tools.run import run_tool_call

log = logging.getLogger(__name__)

# How long an MCP call may run inside the step before it waits in the store instead.
INLINE_SECONDS = 2.0
# MCP calls of this process past the inline bound, still running (a bound: memory).
MAX_BACKGROUND_CALLS = 1000
# An approved call's deadline in the store is its tool's timeout plus this: the tool's own
# timeout (or the MCP host's) speaks first.
APPROVED_GRACE_SECONDS = 1.0


class McpCaller(Protocol):
    async def call(
        self,
        full_name: str,
        arguments: dict[str, object],
        timeout: float,  # noqa: ASYNC109
    ) -> tuple[str, bool]: ...


# Builds the open call of one call of the round (the step knows its ids and routing).
OpenCallMaker = Callable[[ToolCallPart, CatalogEntry], OpenCall]


def error_result(call: ToolCallPart, output: str) -> ToolResultPart:
    return ToolResultPart(call_id=call.call_id, name=call.name, output=output, is_error=True)


def outcome_of(result: ToolResultPart) -> str:
    return "error" if result.is_error else "ok"


def result_of(call: ToolCallPart, end: CallEnd) -> ToolResultPart:
    return ToolResultPart(
        call_id=call.call_id, name=call.name, output=end.output, is_error=end.is_error
    )


# What a run gives: its output and whether it is an error.
Outcome = tuple[str, bool]


class ToolDispatch:
    """Runs a round's calls, inline or as open calls; one per service process."""

    def __init__(
        self,
        catalog: ToolCatalog,
        local: LocalTools,
        open_calls: OpenCalls,
        bus: Bus,
        mcp: McpCaller | None = None,
    ) -> None:
        self.catalog = catalog
        self.local = local
        self.open_calls = open_calls
        self.approvals = Approvals(open_calls)
        self.bus = bus
        self.mcp = mcp
        self._background: set[asyncio.Task[None]] = set()
        # This process, as the runner its claims name (a claim naming another is not running).
        self.runner = uuid.uuid4().hex
        # The calls this process runs whose end is not recorded yet, by call id.
        self._running: dict[str, asyncio.Future[Outcome]] = {}

    async def run_round(
        self,
        calls: list[ToolCallPart],
        allowed: list[str],
        *,
        key_of: Callable[[ToolCallPart], str],
        conversation_id: str,
        make_open: OpenCallMaker,
        approval: ApprovalConfig | None = None,
    ) -> dict[str, ToolResultPart]:
        """Results of the calls answered now, by call id; the others wait in the store (those
        of tools ``approval`` gates, for a person's decision)."""
        offered = await self.catalog.resolve(allowed)
        results = await asyncio.gather(
            *(
                self._one(call, offered, key_of(call), conversation_id, make_open, approval)
                for call in calls
            )
        )
        return {
            call.call_id: result
            for call, result in zip(calls, results, strict=True)
            if result is not None
        }

    async def _one(
        self,
        call: ToolCallPart,
        offered: dict[str, CatalogEntry],
        key: str,
        conversation_id: str,
        make_open: OpenCallMaker,
        approval: ApprovalConfig | None = None,
    ) -> ToolResultPart | None:
        """One call of the round, an ``execute_tool NAME`` span whatever its source (a call
        that waits: until it is recorded, published or handed to the background)."""
        entry = offered.get(call.name)
        with tracing.span(
            # A name the model invented is an attribute only: span names stay a bounded set.
            f"execute_tool {call.name}" if entry is not None else "execute_tool",
            attributes=tool_attributes(
                call.name, call.call_id, entry.source if entry is not None else "none"
            ),
        ):
            result = await self._one_traced(
                call, entry, offered, key, conversation_id, make_open, approval
            )
            if result is not None:
                tracing.annotate({"yoke.tool.is_error": result.is_error})
            else:
                tracing.annotate({"yoke.tool.waits": True})
            return result

    async def _one_traced(
        self,
        call: ToolCallPart,
        entry: CatalogEntry | None,
        offered: dict[str, CatalogEntry],
        key: str,
        conversation_id: str,
        make_open: OpenCallMaker,
        approval: ApprovalConfig | None = None,
    ) -> ToolResultPart | None:
        if entry is None:
            result = await self._not_offered(call, offered)
            TOOL_CALLS.labels(tool_label(call.name, known=False), "none", "error").inc()
            return result
        if call.input_error:
            result = error_result(
                call, f"could not read the input for {call.name}: {call.input_error}"
            )
        elif approval is not None and approval.gates(call.name):
            await self._await_approval(make_open(call, entry), approval)
            return None
        elif entry.source == "mcp" and self.mcp is None:
            result = error_result(call, f"{call.name}: this process does not host MCP servers")
        elif entry.source in ("builtin", "plugin", "mcp"):
            return await self._run_once(call, entry, key, conversation_id, make_open)
        else:
            await self._to_worker(call, entry, make_open)
            return None
        TOOL_CALLS.labels(tool_label(call.name), entry.source, outcome_of(result)).inc()
        return result

    async def _not_offered(
        self, call: ToolCallPart, offered: dict[str, CatalogEntry]
    ) -> ToolResultPart:
        everything = await self.catalog.entries()
        known = everything.get(call.name)
        available = ", ".join(sorted(offered)) or "none"
        if known is not None and not known.ready:
            why = f"tool {call.name} is unavailable: {known.reason or 'no reason given'}"
        elif known is not None:
            why = f"tool {call.name} is not one of this agent's tools"
        else:
            why = f"unknown tool {call.name!r} (not in the catalog)"
        return error_result(call, f"{why}; available: {available}")

    # --- approvals --------------------------------------------------------------------------

    async def _await_approval(self, opened: OpenCall, approval: ApprovalConfig) -> None:
        seconds = approval.timeout_seconds
        awaiting = opened.model_copy(
            update={
                "state": "awaiting_approval",
                "deadline": deadline_after(seconds),
                "approval_timeout_seconds": seconds,
            }
        )
        await self.approvals.request(awaiting)

    async def run_approved(self, event: ToolCallApproved) -> None:
        """Run a call a person approved: the processor's handler of ``tool.call.approved``, in
        the lane of its conversation; a built-in, plugin or MCP call in the background here (its
        result line comes when it ends), a worker's published to its queue.

        Resumable, and once per call (invariant 15): redelivered after the call was marked
        approved, a worker's call is published again (a worker may see a call again after a
        crash, with its idempotency key), one still running here is left alone, and any other
        in-process or MCP call was cut short by a crash: it ends with an error result, never
        run again. A call that ended meanwhile (a stop) or was not approved is left alone.
        Its ``execute_tool`` span links to the step that asked for the call."""
        call_id = event.call_id
        call = await self.open_calls.get(call_id)
        if call is None or call.state == "running":
            return
        with tracing.span(
            f"execute_tool {call.tool}",
            attributes={
                **tool_attributes(call.tool, call.model_call_id, call.source),
                "yoke.approved": True,
                tracing.CONVERSATION_ID: call.conversation_id,
            },
        ):
            tracing.link(call.trace_parent)
            await self._run_approved(call_id, call)

    async def _run_approved(self, call_id: str, call: OpenCall) -> None:
        decision = await self.approvals.get_decision(call_id)
        if decision is None or decision.decision != "approve":
            return
        if call.state == "approved" and call.source != "worker":
            if call.runner != self.runner or call_id not in self._running:
                await self.open_calls.end(
                    call, outcome="failed", output=cut_short_text(call.tool), is_error=True
                )
            return
        entry = (await self.catalog.resolve([call.tool])).get(call.tool)
        if entry is None:
            await self.open_calls.end(
                call,
                outcome="failed",
                output=f"{call.tool} is no longer available (approved, but not in the catalog)",
                is_error=True,
            )
            return
        if call.state == "approved":  # a worker's, marked but perhaps not sent: send it
            await self._publish_call(call, entry)
            return
        if entry.source == "mcp" and self.mcp is None:
            await self.open_calls.end(
                call,
                outcome="failed",
                output=f"{call.tool}: this process does not host MCP servers",
                is_error=True,
            )
            return
        grace = 0.0 if entry.source == "worker" else APPROVED_GRACE_SECONDS
        local = entry.source in ("builtin", "plugin")
        approved = await self.approvals.mark_approved(
            call,
            deadline_after(entry.timeout_seconds + grace),
            runner=None if entry.source == "worker" else self.runner,
        )
        if local:
            part = ToolCallPart(call_id=call.model_call_id, name=call.tool, input=call.input)
            context = ToolContext(call.idempotency_key, call.conversation_id)
            self._in_background(approved, self._run_local(part, context))
        elif entry.source == "mcp":
            assert self.mcp is not None
            self._in_background(
                approved, self.mcp.call(call.tool, dict(call.input), entry.timeout_seconds)
            )
        else:
            await self._publish_call(approved, entry)

    # --- MCP --------------------------------------------------------------------------------

    async def _run_once(
        self,
        call: ToolCallPart,
        entry: CatalogEntry,
        key: str,
        conversation_id: str,
        make_open: OpenCallMaker,
    ) -> ToolResultPart | None:
        """An in-process or MCP call of a round, run once whatever retries the step: ``None``
        when it waits in the store (an MCP call past the inline bound: its own line comes)."""
        opened = make_open(call, entry).model_copy(update={"runner": self.runner})
        end = await self.open_calls.get_end(opened.id)
        if end is not None:  # a retried step: it ran
            return result_of(call, end) if end.in_round else None
        if not await self.open_calls.open(opened):
            return await self._claimed_before(call, opened)
        if entry.source == "mcp":
            assert self.mcp is not None
            running = asyncio.ensure_future(
                self.mcp.call(call.name, dict(call.input), entry.timeout_seconds)
            )
        else:
            running = asyncio.ensure_future(
                self._run_local(call, ToolContext(key, conversation_id))
            )
        self._running[opened.id] = running
        return await self._inline(call, opened, running)

    async def _run_local(self, call: ToolCallPart, context: ToolContext) -> Outcome:
        result = await run_tool_call(call, self.local.runnable, context)
        return result.output, result.is_error

    async def _inline(
        self, call: ToolCallPart, opened: OpenCall, running: asyncio.Future[Outcome]
    ) -> ToolResultPart | None:
        """Wait for the run in the step (an MCP call up to :data:`INLINE_SECONDS`), and record
        its end in the round; one still running goes on in the background."""
        bound = INLINE_SECONDS if opened.source == "mcp" else None
        done, _ = await asyncio.wait({running}, timeout=bound)
        if not done:
            if len(self._background) >= MAX_BACKGROUND_CALLS:
                running.cancel()
                return await self._end_in_round(
                    call, opened, f"{call.name}: too many slow MCP calls in flight here", True
                )
            self._in_background(opened, running)
            return None
        output, is_error = running.result()
        return await self._end_in_round(call, opened, output, is_error)

    async def _end_in_round(
        self, call: ToolCallPart, opened: OpenCall, output: str, is_error: bool
    ) -> ToolResultPart | None:
        _, end = await self.open_calls.end(
            opened, outcome="answered", output=output, is_error=is_error, in_round=True
        )
        self._running.pop(opened.id, None)
        return result_of(call, end) if end.in_round else None

    async def _claimed_before(self, call: ToolCallPart, opened: OpenCall) -> ToolResultPart | None:
        """A retried step found the call's claim: running here still (or run, its end not yet
        recorded), or left unfinished by a crash: then it ends, cut short, and never reruns."""
        running = self._running.get(opened.id)
        stored = await self.open_calls.get(opened.id)
        if stored is None:  # ended meanwhile
            end = await self.open_calls.get_end(opened.id)
            if end is not None:
                return result_of(call, end) if end.in_round else None
            stored = opened
        if stored.runner == self.runner and running is not None:
            if any(task.get_name() == opened.id for task in self._background):
                return None  # its own line comes
            return await self._inline(call, stored, running)
        log.warning(
            "%s was cut short by a crash: ended with an error, not run again",
            call.name,
            extra={"conversationId": stored.conversation_id, "messageId": stored.call_line_id},
        )
        # In the round's results line unless that is written already: the call had gone on
        # past its step (a slow MCP call), and a line of its own is the only way it is answered.
        _, end = await self.open_calls.end(
            stored,
            outcome="failed",
            output=cut_short_text(call.name),
            is_error=True,
            in_round=not await self._round_written(stored),
        )
        return result_of(call, end) if end.in_round else None

    async def _round_written(self, call: OpenCall) -> bool:
        line_id = call.round_line_id
        return line_id is not None and await self.open_calls.store.get_message(line_id) is not None

    def _in_background(self, opened: OpenCall, running: Awaitable[Outcome]) -> None:
        """The call goes on after the step; it ends itself, in a result line of its own."""
        future = asyncio.ensure_future(running)
        self._running[opened.id] = future
        task = asyncio.create_task(self._finish(opened, future), name=opened.id)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _finish(self, opened: OpenCall, running: asyncio.Future[Outcome]) -> None:
        try:
            try:
                output, is_error = await running
            except Exception as error:  # the host never raises; belt and braces
                output, is_error = f"{opened.tool} failed: {error}", True
            for delay in (0.5, 1, 2, 4, 8):
                try:
                    await self.open_calls.end(
                        opened, outcome="answered", output=output, is_error=is_error
                    )
                    return
                except Exception as error:  # the store away: again; the deadline is the bound
                    log.warning(
                        "could not end the call %s yet: %r",
                        opened.tool,
                        error,
                        extra={"conversationId": opened.conversation_id},
                    )
                    await asyncio.sleep(delay)
        finally:
            self._running.pop(opened.id, None)

    # --- workers ----------------------------------------------------------------------------

    async def _to_worker(
        self, call: ToolCallPart, entry: CatalogEntry, make_open: OpenCallMaker
    ) -> None:
        opened = make_open(call, entry)
        await self.open_calls.open(opened)
        await self._publish_call(opened, entry)

    async def _publish_call(self, opened: OpenCall, entry: CatalogEntry) -> None:
        """To the worker tool's queue, expiring at the call's deadline."""
        queue = await self.bus.declare_tool_queue(entry.id)
        request = ToolCallRequest(
            call_id=opened.id,
            tool=entry.id,
            input=opened.input,
            idempotency_key=opened.idempotency_key,
            deadline=opened.deadline,
        )
        remaining = (opened.deadline - datetime.now(UTC)).total_seconds()
        await self.bus.publish(
            "",
            queue,
            request.model_dump_json().encode(),
            message_id=opened.id,
            expiration=max(0.001, remaining),
        )

    async def close(self) -> None:
        """Stop the MCP calls still running here (their deadlines end them in the store)."""
        for task in list(self._background):
            task.cancel()
        for task in list(self._background):
            with contextlib.suppress(BaseException):
                await task


def tool_attributes(name: str, call_id: str, source: str) -> dict[str, str | bool]:
    """An ``execute_tool`` span's, after the GenAI conventions."""
    return {
        "gen_ai.operation.name": "execute_tool",
        "gen_ai.tool.name": name,
        "gen_ai.tool.call.id": call_id,
        "yoke.tool.source": source,
    }


def deadline_after(seconds: float) -> datetime:
    return datetime.now(UTC) + timedelta(seconds=seconds)

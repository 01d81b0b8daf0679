"""Where each tool call of a round runs, by the catalog's source of its tool.

- ``builtin`` and ``plugin`` tools run here, in the step, under their own timeout (they are
  this process's code, and most answer in microseconds).
- ``mcp`` calls run here for up to :data:`INLINE_SECONDS`; one still running then becomes an
  open call (:mod:`yoke.runtime.open_calls`) that the call itself ends when it returns, so a
  slow server never holds the step.
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
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Protocol

from yoke.bus import Bus
from yoke.metrics import TOOL_CALL_SECONDS, TOOL_CALLS, tool_label
from yoke.models import ToolCallPart, ToolCallRequest, ToolResultPart
from yoke.runtime.catalog import LocalTools, ToolCatalog
from yoke.runtime.join_config import ApprovalConfig
from yoke.runtime.open_calls import OpenCall, OpenCalls
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
        self.bus = bus
        self.mcp = mcp
        self._background: set[asyncio.Task[None]] = set()

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
        entry = offered.get(call.name)
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
        elif entry.source in ("builtin", "plugin"):
            started = time.monotonic()
            result = await run_tool_call(
                call, self.local.runnable, ToolContext(key, conversation_id)
            )
            TOOL_CALL_SECONDS.labels(entry.source).observe(time.monotonic() - started)
        elif entry.source == "mcp":
            return await self._mcp(call, entry, make_open)
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
        await self.open_calls.request_approval(awaiting)

    async def run_approved(self, call_id: str) -> None:
        """Run a call a person approved (``tool.call.approved``), in the lane of its
        conversation: a built-in or plugin tool here and now under its own timeout, an MCP
        call in the background, a worker's published to its queue.

        Redelivered, it runs an in-process tool again (as a redelivered step would, with the
        same idempotency key) but never sends an MCP or worker call twice; a call that ended
        meanwhile (a stop) or was not approved is left alone."""
        call = await self.open_calls.get(call_id)
        if call is None or call.state == "running":
            return
        local = call.source in ("builtin", "plugin")
        if call.state == "approved" and not local:
            return  # handed to what runs it already; its deadline is the bound
        decision = await self.open_calls.get_decision(call_id)
        if decision is None or decision.decision != "approve":
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
        grace = 0.0 if entry.source == "worker" else APPROVED_GRACE_SECONDS
        approved = await self.open_calls.mark_approved(
            call, deadline_after(entry.timeout_seconds + grace)
        )
        if entry.source in ("builtin", "plugin"):
            part = ToolCallPart(call_id=call.model_call_id, name=call.tool, input=call.input)
            result = await run_tool_call(
                part, self.local.runnable, ToolContext(call.idempotency_key, call.conversation_id)
            )
            await self.open_calls.end(
                approved, outcome="answered", output=result.output, is_error=result.is_error
            )
        elif entry.source == "mcp":
            if self.mcp is None:
                await self.open_calls.end(
                    approved,
                    outcome="failed",
                    output=f"{call.tool}: this process does not host MCP servers",
                    is_error=True,
                )
                return
            running = asyncio.ensure_future(
                self.mcp.call(call.tool, dict(call.input), entry.timeout_seconds)
            )
            self._in_background(approved, running)
        else:
            await self._publish_call(approved, entry)

    # --- MCP --------------------------------------------------------------------------------

    async def _mcp(
        self, call: ToolCallPart, entry: CatalogEntry, make_open: OpenCallMaker
    ) -> ToolResultPart | None:
        if self.mcp is None:
            return error_result(call, f"{call.name}: this process does not host MCP servers")
        started = time.monotonic()
        mcp = self.mcp
        running = asyncio.ensure_future(
            mcp.call(call.name, dict(call.input), entry.timeout_seconds)
        )
        done, _ = await asyncio.wait({running}, timeout=INLINE_SECONDS)
        if done:
            output, is_error = running.result()
            result = ToolResultPart(
                call_id=call.call_id, name=call.name, output=output, is_error=is_error
            )
            TOOL_CALLS.labels(tool_label(call.name), "mcp", outcome_of(result)).inc()
            TOOL_CALL_SECONDS.labels("mcp").observe(time.monotonic() - started)
            return result
        if len(self._background) >= MAX_BACKGROUND_CALLS:
            running.cancel()
            return error_result(call, f"{call.name}: too many slow MCP calls in flight here")
        opened = make_open(call, entry)
        await self.open_calls.open(opened)
        self._in_background(opened, running)
        return None

    def _in_background(self, opened: OpenCall, running: asyncio.Future[tuple[str, bool]]) -> None:
        task = asyncio.create_task(self._finish_mcp(opened, running))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _finish_mcp(
        self, opened: OpenCall, running: asyncio.Future[tuple[str, bool]]
    ) -> None:
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
            except Exception as error:  # the store away: try again, the deadline is the bound
                log.warning(
                    "could not end the MCP call %s yet: %r",
                    opened.tool,
                    error,
                    extra={"conversationId": opened.conversation_id},
                )
                await asyncio.sleep(delay)

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


def deadline_after(seconds: float) -> datetime:
    return datetime.now(UTC) + timedelta(seconds=seconds)

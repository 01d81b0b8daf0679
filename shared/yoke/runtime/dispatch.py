"""Where each tool call of a round runs, by the catalog's source of its tool.

- ``builtin`` and ``plugin`` tools run here, in the step, under their own timeout (they are
  this process's code, and most answer in microseconds).
- ``mcp`` calls run here for up to :data:`INLINE_SECONDS`; one still running then becomes an
  open call (:mod:`yoke.runtime.open_calls`) that the call itself ends when it returns, so a
  slow server never holds the step.
- ``worker`` calls are always open calls: recorded with their deadline, published to the
  tool's queue, and the step ends.

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
from yoke.runtime.open_calls import OpenCall, OpenCalls
from yoke.tools.base import ToolContext
from yoke.tools.catalog import CatalogEntry
from yoke.tools.run import run_tool_call

log = logging.getLogger(__name__)

# How long an MCP call may run inside the step before it waits in the store instead.
INLINE_SECONDS = 2.0
# MCP calls of this process past the inline bound, still running (a bound: memory).
MAX_BACKGROUND_CALLS = 1000


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
    ) -> dict[str, ToolResultPart]:
        """Results of the calls answered now, by call id; the others wait in the store."""
        offered = await self.catalog.resolve(allowed)
        results = await asyncio.gather(
            *(self._one(call, offered, key_of(call), conversation_id, make_open) for call in calls)
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
        task = asyncio.create_task(self._finish_mcp(opened, running))
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return None

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

"""Tools that take CPU never hold the event loop (docs/tools.md, "How in-process tools run").

The calculator bounds its own work (a result's size, checked before each ``**`` and ``*``);
a plugin's code, sync or async, runs on a thread of its own, so a call past its timeout ends
with an error result at the timeout while the event loop goes on, and at most
``MAX_TOOL_THREADS`` such threads run at once.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from pydantic import BaseModel

from yoke.core.models import ToolCallPart, ToolResultPart
from yoke.tools import threads
from yoke.tools.base import Tool, ToolContext
from yoke.tools.builtin import BUILTIN_TOOLS
from yoke.tools.run import run_tool_call

# Computed as Python wrote it, a 36 MiB integer: minutes of one core, the event loop held.
HOSTILE = "(((9**99)**99)**99)**99"


class Seconds(BaseModel):
    seconds: float


def burn(seconds: float) -> str:
    """Pure CPU for ``seconds``: nothing in it awaits or sleeps."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass
    return f"burned {seconds}"


def _burn_sync(arguments: Seconds, _: ToolContext) -> str:
    return burn(arguments.seconds)


async def _burn_async(arguments: Seconds, _: ToolContext) -> str:
    return burn(arguments.seconds)


async def _sleep_async(arguments: Seconds, _: ToolContext) -> str:
    await asyncio.sleep(arguments.seconds)
    return "slept"


def _thread_name(_: Seconds, __: ToolContext) -> str:
    return threading.current_thread().name


def tool(name: str, run: object, timeout: float = 5.0) -> Tool:
    return Tool(name, f"the {name} test tool", Seconds, run, timeout=timeout)  # type: ignore[arg-type]


async def call(the_tool: Tool, seconds: float = 0.0) -> ToolResultPart:
    part = ToolCallPart(call_id="call-1", name=the_tool.name, input={"seconds": seconds})
    return await run_tool_call(part, {the_tool.name: the_tool}, ToolContext("key", "c"))


async def calculate(expression: str) -> ToolResultPart:
    part = ToolCallPart(call_id="call-1", name="calculator", input={"expression": expression})
    return await run_tool_call(part, dict(BUILTIN_TOOLS), ToolContext("key", "c"))


class Ticker:
    """Counts the event loop's turns while something else runs: a held loop counts none."""

    def __init__(self) -> None:
        self.ticks = 0
        self.longest_gap = 0.0

    async def run(self) -> None:
        last = time.monotonic()
        while True:
            await asyncio.sleep(0.01)
            now = time.monotonic()
            self.ticks += 1
            self.longest_gap = max(self.longest_gap, now - last)
            last = now


async def while_ticking(work: asyncio.Future[ToolResultPart]) -> tuple[ToolResultPart, Ticker]:
    ticker = Ticker()
    ticking = asyncio.create_task(ticker.run())
    try:
        return await work, ticker
    finally:
        ticking.cancel()


async def test_the_hostile_calculator_expression_is_refused_at_once_with_why() -> None:
    started = time.monotonic()
    result = await calculate(HOSTILE)
    assert time.monotonic() - started < 1.0
    assert result.is_error
    assert "too large" in result.output and "4096 bits" in result.output, result.output


@pytest.mark.parametrize(
    ("expression", "expected"),
    [
        ("(2 + 3) * 4 / 5", "4"),
        ("2**100", str(2**100)),
        ("(2**40)**99", str(2**3960)),  # past a float's range, within the bound
        ("(2**20)**100 * (2**20)**100", str(2**4000)),
        ("-7 // 2", "-4"),
        ("1.5 * 2", "3"),
        ("2 ** -1", "0.5"),
    ],
)
async def test_the_calculator_answers_within_its_bound(expression: str, expected: str) -> None:
    result = await calculate(expression)
    assert (result.is_error, result.output) == (False, expected)


@pytest.mark.parametrize(
    "expression", ["(2**30)**100 * (2**30)**100", "(2**100)**50", "(9**99)**99"]
)
async def test_a_product_or_power_past_the_bound_is_refused(expression: str) -> None:
    result = await calculate(expression)
    assert result.is_error and "too large" in result.output, result.output


async def test_a_sync_plugin_tool_runs_on_a_thread_of_its_own() -> None:
    result = await call(tool("where", _thread_name))
    assert (result.is_error, result.output) == (False, "tool where")


@pytest.mark.parametrize("run", [_burn_sync, _burn_async], ids=["sync", "async"])
async def test_a_plugin_hogging_cpu_ends_at_its_timeout_and_the_loop_goes_on(run: object) -> None:
    hog = tool("hog", run, timeout=0.5)
    started = time.monotonic()
    result, ticker = await while_ticking(asyncio.ensure_future(call(hog, 3.0)))
    took = time.monotonic() - started
    assert result.is_error and result.output == "hog timed out after 0.5s", result.output
    assert took < 2.0, took
    # A held loop would not turn at all until the hog is done; a loaded machine turns it less.
    assert ticker.ticks >= 3, ticker.ticks
    assert ticker.longest_gap < 0.4, ticker.longest_gap


async def test_a_plugin_answering_in_time_is_answered_sync_or_async() -> None:
    assert (await call(tool("quick", _burn_sync), 0.01)).output == "burned 0.01"
    assert (await call(tool("quick", _burn_async), 0.01)).output == "burned 0.01"
    assert (await call(tool("nap", _sleep_async), 0.01)).output == "slept"


async def test_an_async_plugin_past_its_timeout_is_cancelled_and_frees_its_thread() -> None:
    napping = tool("nap", _sleep_async, timeout=0.2)
    result = await call(napping, 30.0)
    assert result.is_error and "timed out after 0.2s" in result.output

    async def freed() -> bool:
        return threads.running() == 0

    deadline = time.monotonic() + 5
    while not await freed():
        assert time.monotonic() < deadline, "the cancelled call's thread still runs"
        await asyncio.sleep(0.02)


async def test_threads_past_their_timeout_are_bounded_and_a_call_then_waits_for_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(threads, "MAX_TOOL_THREADS", 2)
    monkeypatch.setattr(threads, "_slots", type(threads._slots)())  # counted anew, by 2
    hog = tool("hog", _burn_sync, timeout=0.2)
    first = await asyncio.gather(call(hog, 1.5), call(hog, 1.5))
    assert all(r.is_error and "timed out" in r.output for r in first)
    assert threads.running() == 2  # still burning: Python cannot stop a thread

    blocked = await call(tool("quick", _burn_sync, timeout=0.2), 0.0)
    assert blocked.is_error, blocked.output
    assert "all 2 threads for tools are busy" in blocked.output, blocked.output
    # Once the runaway threads end, the next call runs.
    waited = await call(tool("quick", _burn_sync, timeout=5.0), 0.0)
    assert (waited.is_error, waited.output) == (False, "burned 0.0")

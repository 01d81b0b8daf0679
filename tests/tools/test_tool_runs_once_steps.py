"""A built-in call runs once (docs/architecture.md, invariant 15), in the processor's steps
against the real store: the round's step fails as it writes its results line (a transient store
error, once), and its retry reuses the recorded end instead of running the tool again; and a
claim another process left unfinished (it died mid-run) ends with an error result that says so.

The built-in ``clock`` is swapped, in this process's own tool set, for one that counts its runs.
"""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime, timedelta

import pytest
from pymongo.errors import AutoReconnect

from tests.processor.test_tool_round_steps import Monologue, StorePoster
from yoke.core.models import Message, ToolResultPart
from yoke.runtime.calls.records import OpenCall, open_call_id, round_results_line_id
from yoke.runtime.calls.repository import OpenCalls
from yoke.runtime.calls.texts import CUT_SHORT
from yoke.runtime.catalog_store import LocalTools, ToolCatalog
from yoke.runtime.dispatch import ToolDispatch
from yoke.store.database import Store
from yoke.tools.base import ToolContext


class FailingOnce(StorePoster):
    """Refuses the first write of ``message_id`` as an unreachable store would."""

    def __init__(self, store: Store) -> None:
        super().__init__(store)
        self.fail: str | None = None

    async def post(self, message: Message, *, route: object = None) -> Message:
        if message.id == self.fail:
            self.fail = None
            raise AutoReconnect("the store went away for a moment")
        return await super().post(message, route=route)


@pytest.fixture
def runs() -> list[str]:
    """The counted clock's runs (their idempotency keys)."""
    return []


def clock_monologue(store: Store, runs: list[str]) -> Monologue:
    """A monologue whose processor's dispatch runs the counted clock as ``clock``."""
    local = LocalTools.load()

    async def clock(arguments: object, context: ToolContext) -> str:
        runs.append(context.idempotency_key)
        return "noon"

    local.runnable["clock"] = dataclasses.replace(local.runnable["clock"], run=clock)
    monologue = Monologue(store)
    open_calls = OpenCalls(store, None)  # type: ignore[arg-type]
    catalog = ToolCatalog(store, local)
    monologue.dispatch = ToolDispatch(catalog, local, open_calls, None)  # type: ignore[arg-type]
    monologue.poster = FailingOnce(store)
    monologue.config.tools = ["clock"]
    return monologue


def results(lines: list[Message]) -> list[ToolResultPart]:
    return [part for line in lines for part in line.parts if isinstance(part, ToolResultPart)]


async def test_a_round_step_retried_after_its_results_line_failed_runs_no_tool_again(
    store: Store, runs: list[str]
) -> None:
    monologue = clock_monologue(store, runs)
    await monologue.say("time?")
    call = await monologue.call()
    assert isinstance(monologue.poster, FailingOnce)
    monologue.poster.fail = round_results_line_id(monologue.context(call).instance_id, call.id)
    with pytest.raises(AutoReconnect):
        await monologue.step(call)
    await monologue.step(call)  # the retry
    await monologue.step(call)  # and a redelivery after it
    assert len(runs) == 1
    [result] = results(await store.history(monologue.id))
    assert (result.output, result.is_error) == ("noon", False)


async def test_a_claim_a_dead_process_left_ends_cut_short_and_is_not_run(
    store: Store, runs: list[str]
) -> None:
    monologue = clock_monologue(store, runs)
    await monologue.say("time?")
    call = await monologue.call()
    claim = OpenCall(
        id=open_call_id("join", call.id, "c1"),
        tool="clock",
        source="builtin",
        conversation_id=monologue.id,
        call_line_id=call.id,
        model_call_id="c1",
        timeout_seconds=30,
        deadline=datetime.now(UTC) + timedelta(seconds=31),
        runner="a process that died",
    )
    assert await OpenCalls(store, monologue.poster).open(claim)  # type: ignore[arg-type]
    await monologue.step(call)  # the round's redelivery, in another process
    assert runs == []
    [result] = results(await store.history(monologue.id))
    assert result.is_error and CUT_SHORT in result.output, result

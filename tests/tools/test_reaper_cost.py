"""The reaper's cost is bounded by what is due, not by what is open (docs/architecture.md,
"Every tool call ends, exactly once"), against the real store.

Two processors' reapers share the open calls' deadline buckets (rendezvous over the live
set): with 1,000 approvals pending for a day, a round reads none of them (an equality query
on the bucket due now, which FerretDB pushes down; one of the two sweeps them all, at most
``SWEEP_DOCUMENTS_PER_SECOND`` a second: here once at start, then not for 10 s), and a call
past its deadline is reaped by one of the two, not by both. Counted from the store's own
operation counters.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta

import pytest
from prometheus_client import REGISTRY

from yoke.core.metrics import STORE_ORIGIN
from yoke.core.models import Message
from yoke.runtime.calls.reaper import Reaper, ReapShare
from yoke.runtime.calls.records import TOOL_CALLS_COLLECTION, OpenCall
from yoke.runtime.calls.repository import OpenCalls
from yoke.store.database import Store

PENDING = 1000
ROUNDS = 5
OVERDUE = 20
SERVICE = "reaper-cost"
LIVE = ["processor-a", "processor-b"]


class Posted:
    """What a reaper posts (the result lines of the calls it ended), kept."""

    def __init__(self) -> None:
        self.lines: list[Message] = []

    async def post(self, message: Message, *, route: object = None) -> Message:
        self.lines.append(message)
        return message


@pytest.fixture
async def store(mongodb_url: str) -> AsyncIterator[Store]:
    store = Store(mongodb_url, app_name=SERVICE)
    await store.ensure_indexes()
    yield store
    await store.close()


def counted(name: str) -> float:
    """A counter of this test's reads (a find and the getMores that page on through it)."""
    return sum(
        REGISTRY.get_sample_value(
            name, {"service": SERVICE, "command": command, "origin": "reaper-test"}
        )
        or 0.0
        for command in ("find", "getMore")
    )


def call(index: int, deadline: datetime, **fields: object) -> OpenCall:
    return OpenCall(
        id=f"call-{index}",
        tool="refund",
        source="worker",
        conversation_id=f"monologue-{index}",
        call_line_id=f"line-{index}",
        model_call_id="c1",
        timeout_seconds=60,
        deadline=deadline,
        **fields,  # type: ignore[arg-type]
    )


async def test_a_round_reads_what_is_due_and_each_due_call_is_reaped_once(store: Store) -> None:
    STORE_ORIGIN.set("reaper-test")
    posted = {name: Posted() for name in LIVE}
    reapers = [
        Reaper(
            OpenCalls(store, posted[name]),  # type: ignore[arg-type]
            ReapShare(lambda name=name: (name, LIVE)),  # type: ignore[misc]
        )
        for name in LIVE
    ]
    tomorrow = datetime.now(UTC) + timedelta(days=1)
    await store.db[TOOL_CALLS_COLLECTION].insert_many(
        [
            call(
                index, tomorrow, state="awaiting_approval", forum_id="f", agent_actor_id="a"
            ).to_document()
            for index in range(PENDING)
        ]
    )
    for reaper in reapers:  # the first rounds (one sweeps: every call is read at start)
        await reaper.reap()

    reads, read = counted("yoke_store_operations_total"), counted("yoke_store_documents_read_total")
    for _ in range(ROUNDS):
        for reaper in reapers:
            await reaper.reap()
    reads = counted("yoke_store_operations_total") - reads
    read = counted("yoke_store_documents_read_total") - read
    print(f"{ROUNDS} rounds of {len(LIVE)} reapers, {PENDING} calls pending: {reads:g} reads, "
          f"{read:g} documents read")  # fmt: skip
    assert read == 0  # before: every round read every open call (10,000 here)
    assert reads <= ROUNDS * 2  # the bucket due now, read by its one owner (two at its edge)

    now = datetime.now(UTC)  # due at once (a deadline is never before the call is opened)
    await store.db[TOOL_CALLS_COLLECTION].insert_many(
        [call(PENDING + index, now).to_document() for index in range(OVERDUE)]
    )
    for reaper in reapers:
        await reaper.reap()
    ended = {name: {line.id for line in posted[name].lines} for name in LIVE}
    assert len(ended[LIVE[0]] | ended[LIVE[1]]) == OVERDUE
    assert not ended[LIVE[0]] & ended[LIVE[1]]  # each reaped by one of them

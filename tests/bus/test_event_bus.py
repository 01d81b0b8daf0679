"""The event bus and store against real servers, with consumers as separate OS processes.

docs/architecture.md, invariants 1-5: FIFO per conversation, parallel across conversations, no lost
events, exactly-once effects, bounded failure.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import aio_pika
import pytest

from tests.support import faults
from tests.support.processes import ROOT, ServiceProcess, eventually
from yoke.bus import topology
from yoke.bus.broker import Bus
from yoke.core.ids import new_id
from yoke.core.models import Message, TextPart
from yoke.runtime.posting import Poster
from yoke.store.database import Store

RECORDER = ["tests/support/recorder.py"]
# The writer dies right after its message is stored, before the event is published.
AFTER_INSERT = faults.fault("after", Store.insert_message)


@pytest.fixture
async def store(mongodb_url: str) -> AsyncIterator[Store]:
    store = Store(mongodb_url)
    await store.ensure_indexes()
    await store.create_collections("handled")  # before traffic (see Store.create_collections)
    yield store
    await store.close()


@pytest.fixture
async def poster(store: Store, amqp_url: str) -> AsyncIterator[Poster]:
    bus = Bus(amqp_url, name="test-publisher")
    await bus.connect()
    yield Poster(store, bus, "test")
    await bus.close()


@pytest.fixture
def spawn(
    amqp_url: str, mongodb_url: str, tmp_path: Path
) -> Iterator[Callable[..., ServiceProcess]]:
    started: list[ServiceProcess] = []

    # A service name of the test's own: shard queues outlive a test in the module's vhost and
    # would otherwise hand this test's consumers the events of earlier tests.
    service = f"recorder-{new_id()[:8]}"

    def start(*args: str, **env: str) -> ServiceProcess:
        base = {
            "YOKE_AMQP_URL": amqp_url,
            "YOKE_MONGODB_URL": mongodb_url,
            "YOKE_SHARDS": "2",
            "RECORDER_SERVICE": service,
        }
        log = tmp_path / f"process-{len(started)}.log"
        process = ServiceProcess(list(args or RECORDER), {**base, **env}, log)
        started.append(process)
        return process

    yield start
    for process in started:
        process.stop(timeout=15)


def line(conversation_id: str, text: str) -> Message:
    return Message(
        id=new_id(),
        conversation_id=conversation_id,
        author_actor_id="someone",
        parts=[TextPart(text=text)],
    )


async def handled_records(store: Store) -> list[dict[str, Any]]:
    return [d async for d in store.db["handled"].find({})]


async def count_handled(store: Store) -> int:
    return await store.db["handled"].count_documents({})


def first_handling_order(records: list[dict[str, Any]]) -> dict[str, list[int]]:
    """Per conversation, the seqs in the order they were first handled."""
    by_conversation: dict[str, list[tuple[float, int]]] = defaultdict(list)
    for record in records:
        by_conversation[record["conversationId"]].append((record["startedAt"], record["seq"]))
    order: dict[str, list[int]] = {}
    for conversation, hits in by_conversation.items():
        seen: list[int] = []
        for _, seq in sorted(hits):
            if seq not in seen:
                seen.append(seq)
        order[conversation] = seen
    return order


async def post_concurrently(poster: Poster, plan: dict[str, list[str]]) -> None:
    """Each conversation's lines in order; conversations in parallel."""

    async def post_all(conversation_id: str, texts: list[str]) -> None:
        for text in texts:
            await poster.post(line(conversation_id, text))

    semaphore = asyncio.Semaphore(50)

    async def bounded(conversation_id: str, texts: list[str]) -> None:
        async with semaphore:
            await post_all(conversation_id, texts)

    await asyncio.gather(*(bounded(c, t) for c, t in plan.items()))


@pytest.mark.slow
async def test_order_per_conversation_holds_over_5000_events_and_two_processes(
    store: Store, poster: Poster, spawn: Callable[..., ServiceProcess]
) -> None:
    consumers = [spawn(), spawn()]
    for consumer in consumers:
        await consumer.wait_healthy()
    plan = {f"conv-{i:03d}": [f"line {j}" for j in range(25)] for i in range(200)}
    plan["conv-slow"] = ["sleep:2"] * 4
    total = sum(len(texts) for texts in plan.values())

    await post_concurrently(poster, plan)
    await eventually(lambda: _at_least(store, total), timeout=240, what=f"{total} events handled")

    records = await handled_records(store)
    order = first_handling_order(records)
    assert sorted(order) == sorted(plan)
    for conversation, texts in plan.items():
        assert order[conversation] == list(range(1, len(texts) + 1)), conversation
    # While the slow conversation slept 2 s per event, the others kept flowing.
    slow = [r for r in records if r["conversationId"] == "conv-slow"]
    window_start, window_end = min(r["startedAt"] for r in slow), max(r["endedAt"] for r in slow)
    assert window_end - window_start >= 8
    slow_pids = {r["pid"] for r in slow}
    flowing = [
        r
        for r in records
        if r["conversationId"] != "conv-slow"
        and r["pid"] in slow_pids  # the very process that was sleeping in the slow lane
        and window_start < r["endedAt"] < window_end
    ]
    assert len({r["conversationId"] for r in flowing}) >= 5, len(flowing)


async def _at_least(store: Store, count: int) -> bool:
    return await count_handled(store) >= count


async def test_a_slow_conversation_does_not_hold_up_its_shard(
    store: Store, poster: Poster, spawn: Callable[..., ServiceProcess]
) -> None:
    # One shard: every conversation shares the slow one's queue, so only the lanes keep it apart.
    consumer = spawn(*RECORDER, YOKE_SHARDS="1")
    await consumer.wait_healthy()
    await poster.post(line("slow", "sleep:3"))
    await poster.post(line("slow", "sleep:0"))
    plan = {f"fast-{i}": [f"line {j}" for j in range(5)] for i in range(20)}
    await post_concurrently(poster, plan)
    await eventually(lambda: _at_least(store, 102), timeout=60, what="all events handled")

    records = await handled_records(store)
    slow_first = next(r for r in records if r["conversationId"] == "slow" and r["seq"] == 1)
    fast = [r for r in records if r["conversationId"].startswith("fast-")]
    assert len(fast) == 100
    assert all(r["endedAt"] < slow_first["endedAt"] for r in fast)
    slow_second = next(r for r in records if r["conversationId"] == "slow" and r["seq"] == 2)
    assert slow_second["startedAt"] >= slow_first["endedAt"]


@pytest.mark.slow
async def test_failover_after_kill_9_loses_nothing_and_writes_no_effect_twice(
    store: Store, poster: Poster, spawn: Callable[..., ServiceProcess]
) -> None:
    consumers = [spawn(*RECORDER, RECORDER_DELAY="0.01"), spawn(*RECORDER, RECORDER_DELAY="0.01")]
    for consumer in consumers:
        await consumer.wait_healthy()
    plan = {f"conv-{i:02d}": [f"line {j}" for j in range(40)] for i in range(40)}
    total = 1600
    publishing = asyncio.create_task(post_concurrently(poster, plan))
    await eventually(lambda: _at_least(store, 300), timeout=120, what="300 events handled")

    records = await handled_records(store)
    busiest = max(consumers, key=lambda c: sum(r["pid"] == c.pid for r in records))
    busiest.kill()
    await publishing
    await eventually(lambda: _all_seqs_handled(store, plan), timeout=180, what="every event")

    records = await handled_records(store)
    survivor = next(c for c in consumers if c is not busiest)
    assert any(r["pid"] == survivor.pid for r in records)  # it took over the killed one's shards
    order = first_handling_order(records)
    for conversation, texts in plan.items():
        assert order[conversation] == list(range(1, len(texts) + 1)), conversation
    effects = [d async for d in store.messages.find({"conversationId": {"$regex": "^effects-"}})]
    sources = [next(iter(d["parts"]))["text"] for d in effects]
    assert len(sources) == len(set(sources)) == total
    for conversation in plan:
        seqs = sorted(d["seq"] for d in effects if d["conversationId"] == f"effects-{conversation}")
        assert seqs == list(range(1, 41)), conversation


async def _all_seqs_handled(store: Store, plan: dict[str, list[str]]) -> bool:
    seen = {(r["conversationId"], r["seq"]) for r in await handled_records(store)}
    return all((c, s) in seen for c, texts in plan.items() for s in range(1, len(texts) + 1))


async def test_outbox_sweep_publishes_what_a_crashed_writer_left(
    store: Store, spawn: Callable[..., ServiceProcess], amqp_url: str, mongodb_url: str
) -> None:
    env = {"YOKE_AMQP_URL": amqp_url, "YOKE_MONGODB_URL": mongodb_url}
    writer = ["-m", "tests.support.faults", "tests.support.post_lines", "outbox", "1", "crasher"]
    crashed = subprocess.run(
        [sys.executable, *writer],
        cwd=ROOT,
        env={**_environ(), **env, faults.VARIABLE: AFTER_INSERT},
        timeout=60,
    )
    assert crashed.returncode == faults.EXIT_CODE
    [written] = await store.history("outbox")
    document = await store.messages.find_one({"_id": written.id})
    assert document is not None
    # The dead writer announced itself before it wrote; its heartbeat has stopped.
    writers = store.db["writers"]
    assert await writers.find_one({"_id": document["writer"]}) is not None

    consumer = spawn(*RECORDER, YOKE_OUTBOX_GRACE_SECONDS="0.5")
    await consumer.wait_healthy()
    await eventually(lambda: _at_least(store, 1), timeout=30, what="the swept event handled")
    [record] = await handled_records(store)
    assert record["messageId"] == written.id

    async def finished() -> bool:
        return await writers.find_one({"_id": document["writer"]}) is None

    await eventually(finished, timeout=30, what="the dead writer finished and forgotten")


def _environ() -> dict[str, str]:
    import os

    return dict(os.environ)


async def test_seq_has_no_gap_or_duplicate_when_two_processes_post_at_once(
    store: Store, amqp_url: str, mongodb_url: str
) -> None:
    env = {**_environ(), "YOKE_AMQP_URL": amqp_url, "YOKE_MONGODB_URL": mongodb_url}
    writers = [
        subprocess.Popen(
            [sys.executable, "tests/support/post_lines.py", "contended", "500", label],
            cwd=ROOT,
            env=env,
        )
        for label in ("left", "right")
    ]
    for writer in writers:
        assert writer.wait(240) == 0
    stored = await store.history("contended")
    assert [m.seq for m in stored] == list(range(1, 1001))
    texts = [m.text for m in stored]
    assert len(set(texts)) == 1000
    for label in ("left", "right"):  # each writer's own lines keep their order
        mine = [t for t in texts if t.startswith(label)]
        assert mine == [f"{label}-{i}" for i in range(500)]


async def dead_letters(amqp_url: str, expected: int, timeout: float = 30) -> list[Any]:
    connection = await aio_pika.connect(amqp_url)
    try:
        channel = await connection.channel()
        queue = await channel.get_queue(topology.DEAD_LETTER_QUEUE)
        found: list[Any] = []
        deadline = time.monotonic() + timeout
        while len(found) < expected and time.monotonic() < deadline:
            message = await queue.get(no_ack=True, fail=False)
            if message is None:
                await asyncio.sleep(0.1)
            else:
                found.append(message)
        return found
    finally:
        await connection.close()


async def test_poison_message_is_dead_lettered_and_the_rest_flows(
    store: Store, poster: Poster, spawn: Callable[..., ServiceProcess], amqp_url: str
) -> None:
    consumer = spawn(*RECORDER, YOKE_RETRY_BACKOFF_SECONDS="0.05")
    await consumer.wait_healthy()
    poison = await poster.post(line("victim", "poison"))
    await poster.post(line("victim", "after the poison"))
    await poster.post(line("bystander", "hello"))
    await eventually(lambda: _at_least(store, 2), timeout=30, what="the other lines handled")

    [dead] = await dead_letters(amqp_url, 1)
    headers = dead.headers
    assert str(headers[topology.DEAD_SERVICE_HEADER]).startswith("recorder-")
    assert "poison line refused" in headers[topology.DEAD_ERROR_HEADER]
    assert headers[topology.DEAD_ATTEMPTS_HEADER] == 3
    assert json.loads(dead.body)["payload"]["messageId"] == poison.id
    handled = {(r["conversationId"], r["seq"]) for r in await handled_records(store)}
    assert handled == {("victim", 2), ("bystander", 1)}
    assert await consumer.healthy()


async def test_malformed_deliveries_are_dead_lettered_with_a_reason(
    store: Store, poster: Poster, spawn: Callable[..., ServiceProcess], amqp_url: str
) -> None:
    consumer = spawn()
    await consumer.wait_healthy()
    bus = Bus(amqp_url, name="test-raw")
    await bus.connect()
    key = "conversation.message.posted.broken"
    # Published as the mesh publishes events: with the header its route exchanges select on.
    header = {
        topology.CONVERSATION_HEADER: "broken",
        topology.EVENT_HEADER: "conversation.message.posted",
    }
    good = line("broken", "fine")
    try:
        await bus.publish(
            topology.EVENTS_EXCHANGE, key, b"{not json", message_id="a", headers=header
        )
        await bus.publish(
            topology.EVENTS_EXCHANGE,
            key,
            json.dumps(
                {"id": "b", "type": "conversation.message.posted", "payload": {"seq": "x"}}
            ).encode(),
            message_id="b",
            headers=header,
        )
        stored = await poster.post(good)
        envelope = {
            "id": "c",
            "type": "conversation.message.posted",
            "payload": {
                "conversationId": "broken",
                "messageId": stored.id,
                "messageType": "message",
                "authorActorId": "x",
                "seq": 1,
                "message": stored.to_wire(),
            },
        }
        await bus.publish(  # no conversation header
            topology.EVENTS_EXCHANGE,
            key,
            json.dumps(envelope).encode(),
            message_id="c",
            headers={topology.EVENT_HEADER: "conversation.message.posted"},
        )
    finally:
        await bus.close()

    dead = await dead_letters(amqp_url, 3)
    errors = {m.message_id: m.headers[topology.DEAD_ERROR_HEADER] for m in dead}
    assert set(errors) == {"a", "b", "c"}
    assert "not an event envelope" in errors["a"]
    assert "payload" in errors["b"] and "conversationId" in errors["b"]
    assert topology.CONVERSATION_HEADER in errors["c"]
    await eventually(lambda: _at_least(store, 1), timeout=30, what="the good event handled")
    assert await consumer.healthy()

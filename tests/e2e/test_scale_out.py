"""Replicas of a service share its shards (docs/architecture.md, invariant 3): real processes,
real servers.

- Three processor replicas over 16 shards under steady load across 100 forums own 16/3 ± 2
  shards each; one is killed with kill -9 and within 15 s every shard has a live owner; a
  fourth starts and takes its share; one stops gracefully and hands its shards over; every
  line is answered exactly once and in order throughout.
- Two ingestion replicas share the command intake (a router moves commands to the shards,
  where the door runs): both do door work, and one idempotency key is still accepted once.

The hand-over times measured are printed (``-s`` shows them).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.chaos.load import Load
from tests.chaos.verdict import account
from tests.support.cli import run_yoke
from tests.support.mesh import service_env
from tests.support.processes import ServiceProcess, eventually
from yoke.bus.broker import Bus
from yoke.cli.supervisor import ReplicasError, parse_replicas
from yoke.client import Client
from yoke.coordination.ownership import EXPIRES_SECONDS, REPLICAS, dead_here
from yoke.core.ids import new_id
from yoke.core.models import Message, SubmitReply
from yoke.core.settings import Settings
from yoke.runtime.joins import create_agent, create_forum, join_conversation
from yoke.runtime.posting import Poster
from yoke.store.database import Store

pytestmark = pytest.mark.slow

PROCESSOR_SHARDS = 16
FORUMS = 100
TAKEOVER_SECONDS = 15.0


class Processes:
    """Service processes of this module, each with its own log; all stopped at the end."""

    def __init__(self, amqp_url: str, mongodb_url: str, log_dir: Path) -> None:
        self.env = service_env(amqp_url, mongodb_url)
        self.log_dir = log_dir
        self.started: list[ServiceProcess] = []

    def start(
        self,
        service: str,
        replica: int = 0,
        *,
        env: dict[str, str] | None = None,
        elsewhere: bool = False,
    ) -> ServiceProcess:
        """``elsewhere``: as if on another machine (others must wait out its heartbeats)."""
        log_path = self.log_dir / f"{service}-{replica}-{len(self.started)}.log"
        args = (
            ["-m", "tests.support.elsewhere", service]
            if elsewhere
            else ["-m", f"services.{service}"]
        )
        process = ServiceProcess(
            args,
            {**self.env, "YOKE_REPLICA": str(replica), **(env or {})},
            log_path,
        )
        self.started.append(process)
        return process

    def stop_all(self) -> None:
        for process in self.started:
            if process.popen.poll() is None:
                process.stop()


@pytest.fixture
async def processes(amqp_url: str, mongodb_url: str, tmp_path: Path) -> AsyncIterator[Processes]:
    running = Processes(amqp_url, mongodb_url, tmp_path)
    try:
        yield running
    finally:
        running.stop_all()


@pytest.fixture
async def store(mongodb_url: str) -> AsyncIterator[Store]:
    store = Store(mongodb_url)
    await store.ensure_indexes()
    yield store
    await store.close()


async def _live(store: Store, service: str) -> dict[int, list[int]]:
    """pid -> shards, of the service's replicas that beat recently (the registry's view)."""
    now = datetime.now(UTC)
    found: dict[int, list[int]] = {}
    async for document in store.db[REPLICAS].find({"service": service}):
        beat = document["beat"]
        beat = beat if beat.tzinfo else beat.replace(tzinfo=UTC)
        if now - beat < timedelta(seconds=EXPIRES_SECONDS) and not dead_here(document):
            found[int(document["pid"])] = sorted(document.get("shards", []))
    return found


def _covered(owners: dict[int, list[int]], pids: set[int], shards: int) -> bool:
    """Exactly ``pids`` are live, they own every shard once between them, each its share."""
    every = sorted(shard for owned in owners.values() for shard in owned)
    fair = shards // max(len(pids), 1)
    return (
        set(owners) == pids
        and every == list(range(shards))
        and all(len(owned) >= fair for owned in owners.values())
    )


async def _handover_seconds(process: ServiceProcess) -> list[float]:
    """[count, sum] of the replica's graceful hand-overs, from its /metrics."""
    text = await process.metrics()
    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in (
                "yoke_shard_handover_seconds_count",
                "yoke_shard_handover_seconds_sum",
            ):
                values[sample.name] = sample.value
    return [
        values.get("yoke_shard_handover_seconds_count", 0.0),
        values.get("yoke_shard_handover_seconds_sum", 0.0),
    ]


def _answer_seconds(
    forums: dict[str, list[Message]], since: datetime, until: datetime
) -> list[float]:
    """Stored answer time minus stored line time, for the lines written in [since, until)."""
    seconds = []
    for lines in forums.values():
        by_id = {line.id: line for line in lines}
        for answer in lines:
            line = by_id.get(answer.meta.in_reply_to or "")
            if line is not None and since <= line.created_at < until:
                seconds.append((answer.created_at - line.created_at).total_seconds())
    return sorted(seconds)


async def _status(env: dict[str, str]) -> list[dict[str, object]]:
    """``yoke status``, parsed: one JSON object per line."""
    code, out, err = await run_yoke(env, "status")
    assert code == 0, err
    return [json.loads(line) for line in out.splitlines() if line.strip()]


async def _joined_forums(store: Store, amqp_url: str, count: int) -> list[str]:
    bus = Bus(amqp_url, name="test-scale-out")
    await bus.connect()
    try:
        poster = Poster(store, bus, "test")
        agent = await create_agent(store, "echo")
        forums = []
        for index in range(count):
            forum = await create_forum(store, f"scale {index}")
            await join_conversation(store, poster, agent.id, forum.id)
            forums.append(forum.id)
        return forums
    finally:
        await bus.close()


async def test_processor_replicas_share_shards_and_take_over_a_killed_one(
    processes: Processes, store: Store, amqp_url: str, mongodb_url: str
) -> None:
    shards = {"YOKE_SHARDS": str(PROCESSOR_SHARDS)}
    forum_ids = await _joined_forums(store, amqp_url, FORUMS)
    plumbing = [processes.start("ingestion"), processes.start("egress")]
    # Replica 1 runs "on another machine": its kill -9 is noticed only by its silence.
    replicas = [processes.start("processor", k, env=shards, elsewhere=k == 1) for k in range(3)]
    for process in (*plumbing, *replicas):
        await process.wait_healthy()
    pids = {process.pid for process in replicas}

    async def spread() -> bool:
        return _covered(await _live(store, "processor"), pids, PROCESSOR_SHARDS)

    await eventually(spread, timeout=30, what="16 shards spread over the three replicas")
    sizes = sorted(len(owned) for owned in (await _live(store, "processor")).values())
    assert all(abs(size - PROCESSOR_SHARDS / 3) <= 2 for size in sizes), sizes

    # yoke status says the same, one line per replica
    lines = [line for line in await _status(processes.env) if line["service"] == "processor"]
    assert {line["pid"] for line in lines} == pids, lines
    assert sorted(int(str(line["replica"])) for line in lines) == [0, 1, 2]
    assert all(set(line) >= {"shards", "queueDepth", "metricsPort"} for line in lines)

    load = Load(amqp_url, forum_ids, interval=8.0, reply_timeout=10.0)
    running = asyncio.create_task(load.run())
    figures: dict[str, float] = {}
    moments: dict[str, datetime] = {"start": datetime.now(UTC)}
    try:
        await asyncio.sleep(8)  # steady load over three replicas

        victim = replicas[1]
        killed_at = time.monotonic()
        moments["kill -9"] = datetime.now(UTC)
        victim.kill()
        pids.discard(victim.pid)
        await eventually(spread, timeout=TAKEOVER_SECONDS, what="every shard owned again")
        figures["kill -9 (another machine): shards owned by the others after (s)"] = (
            time.monotonic() - killed_at
        )
        await asyncio.sleep(6)

        moments["a fourth joins"] = datetime.now(UTC)
        fourth = processes.start("processor", 3, env=shards)
        joined_at = time.monotonic()
        await fourth.wait_healthy()
        pids.add(fourth.pid)
        await eventually(spread, timeout=30, what="the fourth replica taking its share")
        figures["a fourth joins: shards spread over it after (s)"] = time.monotonic() - joined_at
        assert len((await _live(store, "processor"))[fourth.pid]) in (5, 6)
        released: list[list[float]] = []

        async def handed_over() -> bool:
            nonlocal released
            released = [await _handover_seconds(process) for process in (replicas[0], replicas[2])]
            return sum(item[0] for item in released) > 0

        await eventually(handed_over, timeout=15, what="the others handing shards to the fourth")
        count = sum(item[0] for item in released)
        figures["graceful hand-over, gate closed to channel closed, mean (s)"] = (
            sum(item[1] for item in released) / count
        )
        await asyncio.sleep(6)

        leaving = replicas[0]
        stopped_at = time.monotonic()
        moments["SIGTERM"] = datetime.now(UTC)
        leaving.popen.terminate()
        pids.discard(leaving.pid)
        await eventually(spread, timeout=30, what="a stopping replica's shards owned again")
        figures["SIGTERM: shards owned by the others after (s)"] = time.monotonic() - stopped_at
        assert await asyncio.to_thread(leaving.popen.wait, 60) == 0
        await asyncio.sleep(4)

        moments["kill -9 here"] = datetime.now(UTC)
        killed_at = time.monotonic()
        fourth.kill()
        pids.discard(fourth.pid)
        await eventually(spread, timeout=TAKEOVER_SECONDS, what="the last replica owning all")
        figures["kill -9 (this machine): shards owned by the others after (s)"] = (
            time.monotonic() - killed_at
        )
        await asyncio.sleep(4)
    finally:
        load.stopping.set()
        try:
            await asyncio.wait_for(running, timeout=60)
        finally:
            load.giving_up.set()

    async def everything_answered() -> bool:
        forums = {forum_id: await store.history(forum_id) for forum_id in forum_ids}
        found = account(load.lines, forums)
        return not found.lost

    await eventually(everything_answered, timeout=90, what="every line answered", interval=1)
    forums = {forum_id: await store.history(forum_id) for forum_id in forum_ids}
    found = account(load.lines, forums)
    print(f"\n{found.lines} lines over {FORUMS} forums; hand-over figures:")
    for name, value in figures.items():
        print(f"  {name}: {value:.2f}")
    steady = _answer_seconds(forums, moments["start"], moments["kill -9"])
    p50, longest = steady[len(steady) // 2], steady[-1]
    print(f"  answer time before the kill: p50 {p50:.2f} s, max {longest:.2f} s")
    for name in ("kill -9", "a fourth joins", "SIGTERM", "kill -9 here"):
        window = _answer_seconds(forums, moments[name], moments[name] + timedelta(seconds=15))
        if window:
            print(
                f"  answer time of lines written in the 15 s after {name}: max {window[-1]:.2f} s"
            )
    assert found.lines >= FORUMS * 3
    assert not found.lost and not found.duplicated and not found.out_of_order, found
    assert not found.rejected and not found.never_accepted, found
    assert all(
        value < TAKEOVER_SECONDS for name, value in figures.items() if name.startswith("kill")
    )


async def test_two_ingestion_replicas_share_the_intake_and_accept_a_key_once(
    processes: Processes, store: Store, amqp_url: str
) -> None:
    forum_ids = await _joined_forums(store, amqp_url, 12)
    doors = [processes.start("ingestion", k) for k in range(2)]
    for door in doors:
        await door.wait_healthy()
    pids = {door.pid for door in doors}

    async def shared() -> bool:
        return _covered(await _live(store, "ingestion"), pids, 2)

    await eventually(shared, timeout=30, what="ingestion's two shards, one per replica")

    key = new_id()
    keys = [new_id() for _ in forum_ids]

    async def hellos(client: Client) -> list[SubmitReply]:
        return await asyncio.gather(
            *(
                client.submit(
                    forum_id,
                    f"hello {n}",
                    external_id="test:ada",
                    display_name="ada",
                    idempotency_key=keys[n],
                )
                for n, forum_id in enumerate(forum_ids)
            )
        )

    async with Client(amqp_url) as client:
        # The same line five times at once, then a line for every forum.
        repeats = await asyncio.gather(
            *(
                client.submit(
                    forum_ids[0],
                    "once",
                    external_id="test:ada",
                    display_name="ada",
                    idempotency_key=key,
                )
                for _ in range(5)
            )
        )
        others = await hellos(client)
    assert all(reply.status == "accepted" for reply in [*repeats, *others])
    assert len({reply.message_id for reply in repeats}) == 1
    assert sum(not reply.duplicate for reply in repeats) == 1, repeats
    stored = [line for line in await store.history(forum_ids[0]) if line.text == "once"]
    assert len(stored) == 1

    async def commands(door: ServiceProcess) -> float:
        total = 0.0
        for family in text_string_to_metric_families(await door.metrics()):
            for sample in family.samples:
                if sample.name == "yoke_commands_total":
                    total += sample.value
        return total

    handled = [await commands(door) for door in doors]
    assert sum(handled) == 5 + len(forum_ids), handled
    assert all(count > 0 for count in handled), f"both replicas answer commands: {handled}"

    # One replica killed: the other takes its shard (and the intake, if it had it), and every
    # key is still the line it was, whichever replica answered it first.
    doors[0].kill()
    await eventually(
        lambda: _owns_all(store, doors[1].pid), timeout=TAKEOVER_SECONDS, what="the takeover"
    )
    async with Client(amqp_url) as client:
        again = await hellos(client)
    assert [reply.message_id for reply in again] == [reply.message_id for reply in others]
    assert all(reply.duplicate for reply in again), again
    for n, forum_id in enumerate(forum_ids):
        lines = [line for line in await store.history(forum_id) if line.text == f"hello {n}"]
        assert len(lines) == 1, (forum_id, lines)


async def _owns_all(store: Store, pid: int) -> bool:
    return _covered(await _live(store, "ingestion"), {pid}, 2)


def test_replica_k_serves_metrics_on_the_service_port_plus_ten_k() -> None:
    assert Settings(replica=0).metrics_port_for("ingestion") == 9101
    assert Settings(replica=2).metrics_port_for("processor") == 9122
    assert Settings(replica=1).metrics_port_for("egress") == 9113
    assert Settings(replica=3, metrics_port=9999).metrics_port_for("processor") == 9999


def test_replicas_option() -> None:
    assert parse_replicas("processor=3, ingestion=2") == {"processor": 3, "ingestion": 2}
    assert parse_replicas("") == {}
    for wrong in ("processor", "processor=x", "nobody=2", "processor=0"):
        with pytest.raises(ReplicasError):
            parse_replicas(wrong)

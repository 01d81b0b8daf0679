"""A changed YOKE_SHARDS is refused at start; ``yoke reshard N`` migrates, waiting messages
included and in order, and then the service starts."""

from __future__ import annotations

import asyncio
from collections import defaultdict

import aio_pika
import pytest

from tests.support.cli import cli_env, run_yoke
from tests.support.processes import eventually, free_port
from yoke.bus import topology
from yoke.bus.broker import Bus
from yoke.coordination.reshard import TOPOLOGY, ShardCountChanged, check_shard_count, shard_queues
from yoke.core.ids import derive_id
from yoke.core.models import Envelope, Message, MessagePosted, TextPart
from yoke.core.settings import Settings
from yoke.runtime.service import Service
from yoke.store.database import Store

CONVERSATIONS = 24
LINES = 4


def service(name: str, amqp_url: str, mongodb_url: str, shards: int) -> Service:
    settings = Settings(
        amqp_url=amqp_url,
        mongodb_url=mongodb_url,
        shards=shards,
        metrics_port=free_port(),
        retry_backoff_seconds=0.05,
    )
    return Service(name, settings)


def recording(svc: Service) -> dict[str, list[int]]:
    seen: dict[str, list[int]] = defaultdict(list)

    async def handle(event: MessagePosted) -> None:
        seen[event.conversation_id].append(event.seq)

    svc.on_event(MessagePosted, handle)
    return seen


async def publish_lines(amqp_url: str, prefix: str) -> None:
    bus = Bus(amqp_url, name="test-reshard")
    await bus.connect()
    try:
        for seq in range(1, LINES + 1):
            for c in range(CONVERSATIONS):
                message = Message(
                    id=derive_id(prefix, str(c), str(seq)),
                    conversation_id=f"{prefix}-c{c}",
                    seq=seq,
                    author_actor_id="h",
                    parts=[TextPart(text=f"line {seq}")],
                )
                event = MessagePosted.of(message)
                await bus.publish_event(Envelope.wrap(message.id, event), event.key)
    finally:
        await bus.close()


async def depths(amqp_url: str, name: str) -> list[int]:
    connection = await aio_pika.connect(amqp_url)
    try:
        return [queue.messages for queue in await shard_queues(connection, name)]
    finally:
        await connection.close()


@pytest.mark.parametrize(("name", "declared", "wanted"), [("processor", 4, 2), ("egress", 2, 3)])
async def test_a_changed_shard_count_is_refused_until_resharded(
    amqp_url: str, mongodb_url: str, name: str, declared: int, wanted: int
) -> None:
    first = service(name, amqp_url, mongodb_url, declared)
    recording(first)
    await first.start(health=False)
    await first.stop()
    await publish_lines(amqp_url, name)  # waiting in the old shards while nothing runs
    before = await depths(amqp_url, name)
    assert len(before) == declared and sum(before) == CONVERSATIONS * LINES
    assert all(before), before  # every shard holds some, the retired ones included

    refused = service(name, amqp_url, mongodb_url, wanted)
    recording(refused)
    with pytest.raises(ShardCountChanged, match=rf"`yoke reshard {wanted}`"):
        await refused.start(health=False)
    await refused.stop()
    assert await depths(amqp_url, name) == before  # nothing declared, nothing moved

    code, out, err = await run_yoke(
        cli_env(amqp_url, mongodb_url), "reshard", str(wanted), timeout=120
    )
    assert code == 0, err
    assert f'"service": "{name}", "from": {declared}, "to": {wanted}' in out
    after = await depths(amqp_url, name)
    assert len(after) == wanted and sum(after) == CONVERSATIONS * LINES

    resumed = service(name, amqp_url, mongodb_url, wanted)
    seen = recording(resumed)
    await resumed.start(health=False)
    try:

        async def all_handled() -> bool:
            return sum(len(seqs) for seqs in seen.values()) >= CONVERSATIONS * LINES

        await eventually(all_handled, timeout=60, what="every waiting line handled")
    finally:
        await resumed.stop()
    assert len(seen) == CONVERSATIONS
    assert all(seqs == list(range(1, LINES + 1)) for seqs in seen.values()), dict(seen)


async def test_reshard_refuses_while_a_service_consumes(amqp_url: str, mongodb_url: str) -> None:
    running = service("followup", amqp_url, mongodb_url, 2)
    recording(running)
    await running.start(health=False)
    try:
        code, _, err = await run_yoke(cli_env(amqp_url, mongodb_url), "reshard", "3", timeout=120)
        assert code == 1
        assert "have consumers" in err and "stop every service first" in err
        assert err.startswith("yoke: ") and "Traceback" not in err
        assert len(await depths(amqp_url, "followup")) == 2
    finally:
        await running.stop()


async def test_an_interrupted_reshard_is_refused_until_run_again(
    amqp_url: str, mongodb_url: str
) -> None:
    store = Store(mongodb_url)
    try:
        await store.db[TOPOLOGY].insert_one({"_id": "guardian", "shards": 2, "target": 3})
    finally:
        await store.close()
    svc = service("guardian", amqp_url, mongodb_url, 2)
    recording(svc)
    with pytest.raises(ShardCountChanged, match=r"interrupted.*`yoke reshard 3` again"):
        await svc.start(health=False)
    await svc.stop()
    code, out, err = await run_yoke(
        cli_env(amqp_url, mongodb_url), "reshard", "3", "--service", "guardian", timeout=120
    )
    assert code == 0, err
    assert '"service": "guardian", "from": 2, "to": 3' in out
    svc = service("guardian", amqp_url, mongodb_url, 3)
    recording(svc)
    await svc.start(health=False)
    await svc.stop()


async def test_replicas_starting_together_do_not_refuse_each_others_half_declared_shards(
    amqp_url: str, mongodb_url: str
) -> None:
    """Replicas starting at once on a new broker: one may look while another is still
    declaring the shard queues. A partial, growing set is a declaration under way, not a
    changed shard count (it used to exit 78, which ``yoke up`` does not restart)."""
    name, shards = f"racer{free_port()}", 8
    bus = Bus(amqp_url, name="test-reshard-race")
    await bus.connect()
    store = Store(mongodb_url)
    try:
        connection = await aio_pika.connect(amqp_url)
        try:
            channel = await connection.channel()

            async def declare(indexes: range, pause: float) -> None:
                for index in indexes:
                    await channel.declare_queue(
                        topology.shard_queue(name, index), **topology.QUORUM_QUEUE
                    )
                    await asyncio.sleep(pause)

            await declare(range(3), 0)  # another replica is part-way through
            rest = asyncio.create_task(declare(range(3, shards), 0.2))
            await check_shard_count(bus, store, name, shards)
            await rest
            await check_shard_count(bus, store, name, shards)
            # A count that stays different is still refused.
            with pytest.raises(ShardCountChanged, match=f"holds {shards} shard queues"):
                await check_shard_count(bus, store, name, shards + 4)
        finally:
            await connection.close()
    finally:
        await bus.close()
        await store.close()

"""The dead-letter queue is bounded, and what it drops is counted (invariant 14).

An outside publisher can have its commands dead-lettered at will (a ``reply_to`` that is not its
own, a command that is refused with nobody to tell): without a bound it fills
``yoke.dead-letters`` for ever. The mesh declares the queue with a length bound (oldest dropped
first, ``YOKE_DEAD_LETTERS_MAX_LENGTH``); each letter dropped goes to
``yoke.dead-letters.dropped`` (itself bounded), where ingestion counts it in
``yoke_dead_letters_dropped_total``. Here the door (ingestion) alone runs, with a bound of
``BOUND``, and a flood of refused commands comes in.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from urllib.parse import quote, unquote, urlsplit

import aio_pika
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.broker import dead_letter_count, fresh_vhost
from tests.support.mesh import Mesh
from tests.support.processes import ROOT, ServiceProcess, eventually
from yoke.bus import topology
from yoke.bus.broker import Bus
from yoke.bus.dead_letters import count_dropped_letters, list_dead_letters
from yoke.core.metrics import DEAD_LETTERS_DROPPED

BOUND = 5
FLOOD = 12


@pytest.fixture(scope="module")
async def door(
    amqp_url: str, module_mongodb_url: str, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[ServiceProcess]:
    mesh = Mesh(
        amqp_url,
        module_mongodb_url,
        Path(tmp_path_factory.mktemp("door")),
        {"YOKE_DEAD_LETTERS_MAX_LENGTH": str(BOUND)},
    )
    process = mesh.start("ingestion")
    try:
        await process.wait_healthy()
        yield process
    finally:
        mesh.stop_all()


def sample(metrics: str, name: str, **labels: str) -> float:
    return sum(
        sample.value
        for family in text_string_to_metric_families(metrics)
        for sample in family.samples
        if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items())
    )


async def test_a_flood_of_refused_commands_keeps_the_newest_letters_and_counts_the_rest(
    amqp_url: str, door: ServiceProcess
) -> None:
    connection = await aio_pika.connect(amqp_url)
    try:
        channel = await connection.channel(publisher_confirms=True)
        commands = await channel.get_exchange(topology.COMMANDS_EXCHANGE)
        sent = []
        # One conversation, so one shard's lane refuses them in the order they were sent (one
        # each would spread over the shards, refused and dead-lettered side by side).
        nowhere = f"nowhere-{uuid.uuid4().hex}"
        for index in range(FLOOD):
            body = {
                "conversationId": nowhere,
                "author": {"externalId": "flood", "displayName": "Flood"},
                "text": f"line {index}",
                "idempotencyKey": f"flood-{index}",
            }
            message_id = f"flood-{index}-{uuid.uuid4().hex[:6]}"
            sent.append(message_id)
            # Answered on a queue that is not the publisher's: refused, dead-lettered.
            await commands.publish(
                aio_pika.Message(
                    json.dumps(body).encode(),
                    message_id=message_id,
                    user_id="guest",
                    reply_to="yoke.processor.shard.000",
                ),
                routing_key=topology.SUBMIT_COMMAND,
            )

        async def all_handled() -> bool:
            handled = sample(await door.metrics(), "yoke_commands_total", outcome="rejected")
            return handled >= FLOOD

        await eventually(all_handled, timeout=60, what=f"the door to refuse {FLOOD} commands")

        async def counted() -> bool:
            dropped = sample(await door.metrics(), "yoke_dead_letters_dropped_total")
            return dropped >= FLOOD - BOUND

        await eventually(counted, timeout=30, what="the dropped letters to be counted")
        assert await dead_letter_count(channel) == BOUND
        letters = await list_dead_letters(amqp_url)
        assert [letter["messageId"] for letter in letters] == sent[-BOUND:]  # the newest kept
        dropped = sample(await door.metrics(), "yoke_dead_letters_dropped_total")
        assert dropped == FLOOD - BOUND
        assert sample(await door.metrics(), "yoke_dead_letters_dropped_total", service="ingestion")
    finally:
        await connection.close()


def test_compose_bounds_the_dead_letters_with_the_same_policy() -> None:
    definitions = json.loads((ROOT / "deploy/rabbitmq/definitions.json").read_text())
    [policy] = [p for p in definitions["policies"] if p["name"] == topology.DEAD_LETTERS_POLICY]
    wanted = topology.dead_letters_policy()
    assert {key: policy[key] for key in wanted} == wanted


async def test_an_unbounded_queue_of_an_older_mesh_is_used_as_it_is_and_a_policy_bounds_it(
    servers: tuple[str, str, str],
) -> None:
    """Declared before it had a bound, the queue cannot be declared with one
    (PRECONDITION_FAILED): the bus uses it as it is, and the policy bounds and counts."""
    with fresh_vhost(servers[0], servers[2], f"yoke-test-{uuid.uuid4().hex[:12]}") as url:
        connection = await aio_pika.connect(url)
        try:
            channel = await connection.channel(publisher_confirms=True)
            await channel.declare_queue(
                topology.DEAD_LETTER_QUEUE, durable=True, arguments={"x-queue-type": "quorum"}
            )
            parts = urlsplit(url)
            vhost = quote(unquote(parts.path[1:]), safe="")
            auth = (unquote(parts.username or "guest"), unquote(parts.password or "guest"))
            async with httpx.AsyncClient(base_url=servers[2], auth=auth, timeout=30) as api:
                policy = f"/api/policies/{vhost}/{topology.DEAD_LETTERS_POLICY}"
                answer = await api.put(policy, json=topology.dead_letters_policy(max_length=2))
                answer.raise_for_status()
            bus = Bus(url, name="upgraded")
            await bus.connect()  # declares the core topology: no PRECONDITION_FAILED
            stopping = asyncio.Event()
            before = DEAD_LETTERS_DROPPED.labels("unknown")._value.get()
            counting = asyncio.create_task(count_dropped_letters(bus.connection, stopping))
            try:
                dead = await channel.get_exchange(topology.DEAD_LETTER_EXCHANGE)
                for index in range(5):
                    await dead.publish(aio_pika.Message(f"{index}".encode()), routing_key="x")

                async def counted() -> bool:
                    return DEAD_LETTERS_DROPPED.labels("unknown")._value.get() - before >= 3

                await eventually(counted, timeout=30, what="3 dropped letters counted")
                assert await dead_letter_count(channel) == 2
            finally:
                stopping.set()
                await counting
                await bus.close()
        finally:
            await connection.close()

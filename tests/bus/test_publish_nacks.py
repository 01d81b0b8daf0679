"""A publisher channel the broker keeps nacking is replaced, and the publish still lands.

RabbitMQ 3.10 was seen (a 3-node cluster, a node killed under load: tests/e2e/test_cluster.py) to
nack every publish of one channel to one quorum queue for minutes after that queue's leader
moved, while other channels' publishes to it were confirmed. Here a real broker nacks for a
reason of its own (a queue full, refusing publishes) so the bus's response can be watched.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import aio_pika
import pytest

from tests.support.processes import eventually
from yoke.bus import topology
from yoke.bus.broker import NACKS_BEFORE_NEW_CHANNEL, Bus
from yoke.core.ids import new_id


@pytest.fixture
async def bus(amqp_url: str) -> AsyncIterator[Bus]:
    bus = Bus(amqp_url, name="test-nacks")
    await bus.connect()
    yield bus
    await bus.close()


async def test_a_channel_that_keeps_nacking_is_replaced_and_the_publish_lands(
    bus: Bus, amqp_url: str
) -> None:
    key = f"nack-test.{new_id()}"
    connection = await aio_pika.connect(amqp_url)
    async with connection:
        channel = await connection.channel()
        # A queue that refuses every publish: each one routed to it is nacked.
        refusing = await channel.declare_queue(
            f"test.refusing.{new_id()}",
            arguments={"x-max-length": 0, "x-overflow": "reject-publish"},
        )
        await refusing.bind(topology.EVENTS_EXCHANGE, routing_key=key)
        first = bus.publisher
        publishing = asyncio.create_task(
            bus.publish(topology.EVENTS_EXCHANGE, key, b"{}", message_id=new_id())
        )

        async def renewed() -> bool:
            return bus.publisher_renewals >= 1

        await eventually(renewed, timeout=10, what="a new publisher channel")
        assert not publishing.done(), "a nacked publish must be retried, not given up"
        assert bus.publisher is not first

        async def old_closed() -> bool:
            return first.is_closed

        await eventually(old_closed, timeout=10, what="the nacking channel closed")
        # The broker takes it now (no queue refuses it): the retried publish is confirmed.
        await refusing.unbind(topology.EVENTS_EXCHANGE, routing_key=key)
        await asyncio.wait_for(publishing, timeout=10)
    renewals = bus.publisher_renewals
    # One renewal per NACKS_BEFORE_NEW_CHANNEL nacks in a row, never one per retry.
    assert 1 <= renewals <= 10 // NACKS_BEFORE_NEW_CHANNEL + 1, renewals
    # The new channel publishes as the old one did.
    await bus.publish(topology.EVENTS_EXCHANGE, key, b"{}", message_id=new_id())

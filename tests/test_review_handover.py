"""A shard whose lane lost its queued jobs can still be handed over (pure logic, fakes).

A lane used to drop the jobs queued behind one that raised (a dead letter whose publish failed
after its retries: the broker away; now waited out, see test_dead_letter_outage). The gate
counted those jobs as held for ever, so the
hand-over of their shard waited on ``gate.idle()`` for ever: its channel was never closed and
the new owner stayed idle behind single active consumer.
"""

from __future__ import annotations

import asyncio
from typing import cast

from aio_pika.abc import AbstractIncomingMessage

from tests.support.deliveries import Delivery
from yoke.bus import Bus
from yoke.consumer import Dispatcher, Gate, Malformed, Route, key_from_header
from yoke.errors import RetryPolicy, Transient


class BrokerAway:
    """A bus whose every publish has failed for longer than its retries last."""

    async def publish(self, *args: object, **kwargs: object) -> None:
        raise Transient("publish to yoke.dead-letters failed: the broker is away")


async def test_a_lane_that_lost_its_jobs_lets_the_shard_go() -> None:
    dispatcher = Dispatcher(
        "test", cast(Bus, BrokerAway()), policy=RetryPolicy(attempts=2, backoff=0.01)
    )
    gate = Gate()

    async def handle(message: AbstractIncomingMessage) -> None:
        raise Malformed("a line that can never be handled")

    deliver = dispatcher.on_message(Route("q", key_from_header, handle, gate))
    deliveries = [Delivery(f"a{n}", "A") for n in range(3)]
    for delivery in deliveries:
        await deliver(cast(AbstractIncomingMessage, delivery))
    await asyncio.sleep(0.2)  # a0 fails to be dead-lettered; a1 and a2 are dropped

    gate.open = False  # the shard is handed over
    gate.stopping.set()
    await asyncio.wait_for(gate.idle(), 5)
    assert not any(delivery.acked for delivery in deliveries)  # all return at channel close

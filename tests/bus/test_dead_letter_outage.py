"""A dead letter that cannot be published yet (the broker away) is waited out in its lane.

Before, the publish's error escaped the lane: its worker task died (reported only when garbage
collected), the conversation's queued deliveries were dropped unacked on a live channel, and
the next delivery of that conversation started a new lane and was acked ahead of them.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import cast

import pytest
from aio_pika.abc import AbstractIncomingMessage

from tests.support.deliveries import Delivery
from tests.support.processes import eventually
from yoke.bus._lanes import Lanes
from yoke.bus.broker import Bus
from yoke.bus.consumer import Dispatcher, Malformed, Route, key_from_header
from yoke.core.errors import RetryPolicy, Transient


class BrokerBackSoon:
    """A bus whose publishes fail (transiently) until ``back`` is set."""

    def __init__(self) -> None:
        self.back = asyncio.Event()
        self.published: list[str] = []

    async def publish(self, exchange: str, routing_key: str, body: bytes, **kwargs: object) -> None:
        if not self.back.is_set():
            raise Transient("the broker is away")
        self.published.append(str(kwargs["message_id"]))


async def test_a_dead_letter_waits_out_the_outage_and_its_lane_goes_on_in_order() -> None:
    bus = BrokerBackSoon()
    policy = RetryPolicy(attempts=1, backoff=0.01, cap=0.05)
    dispatcher = Dispatcher("test", cast(Bus, bus), policy=policy)
    handled: list[str] = []

    async def handle(message: AbstractIncomingMessage) -> None:
        if message.message_id == "a0":
            raise Malformed("a line that can never be handled")
        handled.append(str(message.message_id))

    deliver = dispatcher.on_message(Route("q", key_from_header, handle, None))
    first = [Delivery(f"a{n}", "A") for n in range(3)]
    for delivery in first:
        await deliver(cast(AbstractIncomingMessage, delivery))
    await asyncio.sleep(0.3)  # a0's dead letter is being retried; nothing behind it may run
    assert handled == [] and not any(delivery.acked for delivery in first)

    late = Delivery("a3", "A")  # arrives during the outage: still behind a0, a1, a2
    await deliver(cast(AbstractIncomingMessage, late))
    await asyncio.sleep(0.1)
    assert handled == [] and not late.acked

    bus.back.set()

    async def all_acked() -> bool:
        return all(delivery.acked for delivery in [*first, late])

    await eventually(all_acked, timeout=5, what="every delivery acked", interval=0.01)
    assert bus.published == ["a0"]
    assert handled == ["a1", "a2", "a3"]


async def test_a_job_that_raises_is_logged_and_its_lane_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    lanes = Lanes()
    ran: list[str] = []

    async def broken() -> None:
        raise RuntimeError("a bug in a job")

    def job(name: str) -> Callable[[], Awaitable[None]]:
        async def run() -> None:
            ran.append(name)

        return run

    with caplog.at_level(logging.ERROR, logger="yoke.bus._lanes"):
        lanes.submit("A", broken)
        lanes.submit("A", job("after"))
        await asyncio.wait_for(lanes.drain(), 5)
    assert ran == ["after"]
    assert any(
        "a bug in a job" in record.getMessage() or record.exc_info for record in caplog.records
    )

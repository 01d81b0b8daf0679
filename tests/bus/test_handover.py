"""A shard's gate (pure logic, fake deliveries): what a hand-over finishes and what it leaves.

Closing a shard's gate must let the job that runs finish and ack, start nothing more of that
shard (so what is acked of each conversation stays a prefix, and the rest returns in order
when the channel closes), make a job waiting out a failure give up unacked (a dead letter the
broker refuses too), and say when nothing of the shard is left in the lanes.
"""

from __future__ import annotations

import asyncio
from typing import cast

from aio_pika.abc import AbstractIncomingMessage
from pymongo.errors import AutoReconnect

from tests.support.deliveries import Delivery
from yoke.bus.broker import Bus
from yoke.bus.consumer import Dispatcher, Gate, Malformed, Route, key_from_header
from yoke.core.errors import RetryPolicy, Transient


def _dispatcher() -> Dispatcher:
    # The bus is only used to dead-letter, which these deliveries never are.
    return Dispatcher("test", cast(Bus, None), policy=RetryPolicy(attempts=3, backoff=0.01))


class BrokerAway:
    """A bus whose every publish fails: the broker is away for as long as the test lasts."""

    async def publish(self, *args: object, **kwargs: object) -> None:
        raise Transient("publish to yoke.dead-letters failed: the broker is away")


async def test_closing_the_gate_finishes_the_running_job_and_starts_no_other() -> None:
    dispatcher = _dispatcher()
    gate = Gate()
    release_first = asyncio.Event()
    handled: list[str] = []

    async def handle(message: AbstractIncomingMessage) -> None:
        if message.message_id == "a1":
            await release_first.wait()
        handled.append(str(message.message_id))

    deliver = dispatcher.on_message(Route("q", key_from_header, handle, gate))
    a1, a2, b1 = Delivery("a1", "A"), Delivery("a2", "A"), Delivery("b1", "B")
    for delivery in (a1, a2, b1):
        await deliver(cast(AbstractIncomingMessage, delivery))
    await asyncio.sleep(0.05)
    assert handled == ["b1"] and b1.acked
    assert gate.held == 1  # a1 running; a2, waiting behind it in A's lane, is not counted

    gate.open = False  # the shard is handed over
    gate.stopping.set()
    a3 = Delivery("a3", "A")
    await deliver(cast(AbstractIncomingMessage, a3))  # arrives after: never enters a lane
    release_first.set()
    await asyncio.wait_for(gate.idle(), 5)

    assert handled == ["b1", "a1"] and a1.acked
    assert not a2.acked and not a3.acked  # returned to the queue, in order, at channel close
    assert gate.held == 0


async def test_a_job_waiting_out_a_failure_gives_up_unacked_when_its_shard_goes() -> None:
    dispatcher = _dispatcher()
    gate = Gate()
    tries = 0

    async def handle(message: AbstractIncomingMessage) -> None:
        nonlocal tries
        tries += 1
        raise AutoReconnect("the store is away")

    deliver = dispatcher.on_message(Route("q", key_from_header, handle, gate))
    stuck = Delivery("s1", "S")
    await deliver(cast(AbstractIncomingMessage, stuck))
    await asyncio.sleep(0.1)
    assert tries >= 2 and gate.held == 1  # transient: retried, held

    gate.open = False
    gate.stopping.set()
    await asyncio.wait_for(gate.idle(), 5)
    assert not stuck.acked


async def test_a_dead_letter_the_broker_refuses_gives_up_unacked_when_its_shard_goes() -> None:
    # The lane waits the broker out in the failing job, the later jobs of its conversation
    # behind it (so nothing overtakes the line): the hand-over must still end, and promptly.
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
    await asyncio.sleep(0.2)
    assert gate.held == 1  # a0 waits out the dead-letter publish; a1 and a2 wait behind it

    gate.open = False  # the shard is handed over
    gate.stopping.set()
    await asyncio.wait_for(gate.idle(), 5)
    assert not any(delivery.acked for delivery in deliveries)  # all return at channel close


async def test_the_gate_of_one_shard_leaves_other_shards_alone() -> None:
    dispatcher = _dispatcher()
    closing, staying = Gate(), Gate()
    handled: list[str] = []

    async def handle(message: AbstractIncomingMessage) -> None:
        handled.append(str(message.message_id))

    closing.open = False
    await dispatcher.on_message(Route("q1", key_from_header, handle, closing))(
        cast(AbstractIncomingMessage, Delivery("x1", "X"))
    )
    kept = Delivery("y1", "Y")
    await dispatcher.on_message(Route("q2", key_from_header, handle, staying))(
        cast(AbstractIncomingMessage, kept)
    )
    await asyncio.wait_for(staying.idle(), 5)
    assert handled == ["y1"] and kept.acked

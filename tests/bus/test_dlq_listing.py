"""Looking at the dead letters leaves them as they were: listing never returns a letter to its
queue, so its delivery count does not rise (RabbitMQ 4.0-4.2 would drop a letter at the default
delivery limit of 20 after that many looks), and their order stays."""

from __future__ import annotations

import json

import aio_pika
from aio_pika.abc import AbstractIncomingMessage

from tests.support.broker import dead_letter_count
from tests.support.cli import run_yoke_commands
from tests.support.processes import eventually
from yoke.bus import topology
from yoke.bus.broker import Bus

WORK_QUEUE = "yoke.dlqlist.shard.000"
LOOKS = 5


async def broker_dead_letter(connection: aio_pika.abc.AbstractConnection) -> None:
    """A letter RabbitMQ dead-letters itself at a delivery limit (it carries x-death)."""
    channel = await connection.channel()
    await channel.declare_queue(
        WORK_QUEUE,
        durable=True,
        arguments={
            "x-queue-type": "quorum",
            "x-delivery-limit": 1,
            "x-dead-letter-exchange": topology.DEAD_LETTER_EXCHANGE,
        },
    )
    await channel.default_exchange.publish(
        aio_pika.Message(b'{"poison": true}', message_id="broker-1"), routing_key=WORK_QUEUE
    )

    async def reject(message: AbstractIncomingMessage) -> None:
        await message.reject(requeue=True)

    queue = await channel.get_queue(WORK_QUEUE)
    await queue.consume(reject)

    async def dead() -> bool:
        return await dead_letter_count(channel) == 3

    await eventually(dead, timeout=30, what="RabbitMQ to dead-letter the message")
    await channel.close()


async def test_listing_five_times_leaves_counts_and_order_as_they_were(amqp_url: str) -> None:
    bus = Bus(amqp_url, name="test-dlq-listing")
    await bus.connect()  # the dead-letter exchange and queue
    try:
        for n in (1, 2):  # what a service's consumer writes when it gives up on a delivery
            await bus.publish(
                topology.DEAD_LETTER_EXCHANGE,
                f"conversation.message.posted.c-{n}",
                b"{}",
                message_id=f"ours-{n}",
                headers={
                    topology.DEAD_SERVICE_HEADER: "processor",
                    topology.DEAD_ERROR_HEADER: f"ValueError: bad line {n}",
                    topology.DEAD_ATTEMPTS_HEADER: 3,
                },
            )
    finally:
        await bus.close()
    connection = await aio_pika.connect(amqp_url)
    try:
        await broker_dead_letter(connection)

        code, outputs, err = await run_yoke_commands(
            {"YOKE_AMQP_URL": amqp_url}, [["dlq", "list"]] * LOOKS, timeout=120
        )
        assert code == 0, err
        looks = [[json.loads(line) for line in out.splitlines()] for out in outputs]
        first = looks[0]
        assert [letter["messageId"] for letter in first] == ["ours-1", "ours-2", "broker-1"]
        assert [letter["attempts"] for letter in first[:2]] == [3, 3]
        for look in looks[1:]:
            assert look == first  # the same letters, attempts and order at every look

        channel = await connection.channel()
        assert await dead_letter_count(channel) == 3
        seen: list[AbstractIncomingMessage] = []

        async def keep(message: AbstractIncomingMessage) -> None:
            seen.append(message)

        queue = await channel.get_queue(topology.DEAD_LETTER_QUEUE)
        await queue.consume(keep)

        async def all_seen() -> bool:
            return len(seen) == 3

        await eventually(all_seen, timeout=10, what="the three letters")
        by_id = {message.message_id: message for message in seen}
        for name in ("ours-1", "ours-2"):
            headers = by_id[name].headers or {}
            # Never handed back to the queue: RabbitMQ counted no earlier delivery of it.
            assert headers.get("x-delivery-count", 0) == 0, (name, headers)
            assert not by_id[name].redelivered
            assert headers[topology.DEAD_ERROR_HEADER] == f"ValueError: bad line {name[-1]}"
        broker = by_id["broker-1"].headers or {}
        # What the work queue counted when it gave up, as the first look reported it.
        assert broker.get("x-delivery-count") == first[2]["attempts"]
        assert broker.get("x-death")
    finally:
        await connection.close()

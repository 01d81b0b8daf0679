"""Letters RabbitMQ dead-lettered itself (delivery limit): listed with their reason, replayed
to the queue they came from."""

from __future__ import annotations

import json

import aio_pika
from aio_pika.abc import AbstractIncomingMessage

from tests.support.broker import dead_letter_count
from tests.support.cli import run_yoke
from tests.support.processes import eventually
from yoke.bus import topology
from yoke.bus.broker import Bus
from yoke.bus.dead_letters import describe, replay_target

WORK_QUEUE = "yoke.dlqtest.shard.000"


async def test_broker_dead_letters_are_listed_and_replayed_to_their_queue(amqp_url: str) -> None:
    bus = Bus(amqp_url, name="test-dlq")
    await bus.connect()  # yoke.events and the dead-letter queue
    await bus.close()
    connection = await aio_pika.connect(amqp_url)
    try:
        channel = await connection.channel()
        # A quorum queue fed through an exchange (so its routing key is not its name), whose
        # delivery limit RabbitMQ enforces by dead-lettering with x-death and nothing of ours.
        work = await channel.declare_queue(
            WORK_QUEUE,
            durable=True,
            arguments={
                "x-queue-type": "quorum",
                "x-delivery-limit": 1,
                "x-dead-letter-exchange": topology.DEAD_LETTER_EXCHANGE,
            },
        )
        await work.bind(topology.EVENTS_EXCHANGE, routing_key="conversation.message.posted.#")
        events = await channel.get_exchange(topology.EVENTS_EXCHANGE)
        await events.publish(
            aio_pika.Message(
                b'{"poison": true}',
                message_id="crashed-1",
                headers={topology.CONVERSATION_HEADER: "c-1"},
            ),
            routing_key="conversation.message.posted.c-1",
        )

        async def reject(message: AbstractIncomingMessage) -> None:
            await message.reject(requeue=True)  # a consumer that crashes on it, every time

        consumer = await connection.channel()
        crashing = await consumer.get_queue(WORK_QUEUE)
        await crashing.consume(reject)

        async def dead() -> bool:
            return await dead_letter_count(channel) == 1

        await eventually(dead, timeout=30, what="RabbitMQ to dead-letter the message")
        await consumer.close()

        code, out, err = await run_yoke({"YOKE_AMQP_URL": amqp_url}, "dlq", "list")
        assert code == 0, err
        [letter] = [json.loads(line) for line in out.splitlines()]
        assert letter["messageId"] == "crashed-1"
        assert "delivery_limit" in str(letter["error"])
        assert letter["queue"] == WORK_QUEUE
        assert letter["service"] == "dlqtest"

        code, _, err = await run_yoke({"YOKE_AMQP_URL": amqp_url}, "dlq", "replay")
        assert code == 0, err
        assert "replayed 1 " in err
        assert await dead_letter_count(channel) == 0

        back: list[AbstractIncomingMessage] = []
        reader = await connection.channel()
        queue = await reader.get_queue(WORK_QUEUE)

        async def keep(message: AbstractIncomingMessage) -> None:
            back.append(message)
            await message.ack()

        await queue.consume(keep)

        async def returned() -> bool:
            return len(back) == 1

        await eventually(returned, timeout=30, what="the letter back on its queue")
        [message] = back
        assert message.body == b'{"poison": true}'
        assert message.message_id == "crashed-1"
        headers = message.headers or {}
        assert headers.get(topology.CONVERSATION_HEADER) == "c-1"
        assert not [name for name in headers if name.startswith(("x-death", "x-first-death"))]
    finally:
        await connection.close()


def test_a_listing_believes_the_broker_over_headers_an_outside_publisher_set() -> None:
    # An outside command RabbitMQ dead-lettered keeps the headers its publisher set, which may
    # name a service and an error: the broker's x-death says where it really died, as replay
    # decides (yoke.bus.dead_letters.replay_target).
    forged = {
        topology.DEAD_SERVICE_HEADER: "processor",
        topology.DEAD_ERROR_HEADER: "nothing to see",
        "x-death": [{"queue": "yoke.ingestion.commands", "reason": "delivery_limit"}],
    }
    shown = describe(forged)
    assert shown["service"] == "ingestion"
    assert shown["error"] == (
        "dead-lettered by RabbitMQ: delivery_limit in queue yoke.ingestion.commands"
    )
    assert replay_target(forged, "conversation.message.submit") == (
        topology.COMMANDS_EXCHANGE,
        "conversation.message.submit",
    )

"""The dead-letter queue for operators: list what failed and why, replay it where it came from."""

from __future__ import annotations

from collections.abc import Mapping

import aio_pika

from yoke import topology

_OUR_HEADERS = {
    topology.DEAD_SERVICE_HEADER,
    topology.DEAD_ERROR_HEADER,
    topology.DEAD_ATTEMPTS_HEADER,
    topology.DEAD_EXCHANGE_HEADER,
    topology.DEAD_ROUTING_KEY_HEADER,
}


async def list_dead_letters(amqp_url: str, limit: int = 10_000) -> list[dict[str, object]]:
    """Every dead letter, left in the queue (they are read unacked, then returned)."""
    connection = await aio_pika.connect(amqp_url, timeout=10)
    letters: list[dict[str, object]] = []
    try:
        channel = await connection.channel()
        queue = await channel.declare_queue(
            topology.DEAD_LETTER_QUEUE, durable=True, arguments={"x-queue-type": "quorum"}
        )
        while len(letters) < limit:
            message = await queue.get(no_ack=False, fail=False)
            if message is None:
                break
            headers = message.headers or {}
            letters.append(
                {
                    "messageId": message.message_id,
                    "service": headers.get(topology.DEAD_SERVICE_HEADER),
                    "error": headers.get(topology.DEAD_ERROR_HEADER),
                    "attempts": headers.get(topology.DEAD_ATTEMPTS_HEADER),
                    "exchange": headers.get(topology.DEAD_EXCHANGE_HEADER),
                    "routingKey": headers.get(topology.DEAD_ROUTING_KEY_HEADER),
                }
            )
        # Closing the channel with the deliveries unacked puts them all back.
        await channel.close()
    finally:
        await connection.close()
    return letters


def replay_target(headers: Mapping[str, object], routing_key: str) -> tuple[str, str]:
    """Where a letter goes back: to the service that failed it, not to every subscriber.

    Events go to that service's shard exchange (which hashes the conversation header, so the
    letter lands on its conversation's shard); commands go to its intake queue.
    """
    service = str(headers.get(topology.DEAD_SERVICE_HEADER) or "")
    original = str(headers.get(topology.DEAD_EXCHANGE_HEADER) or "")
    original_key = str(headers.get(topology.DEAD_ROUTING_KEY_HEADER) or routing_key)
    if not service:
        return original, original_key
    if original == topology.COMMANDS_EXCHANGE:
        return "", topology.intake_queue(service)
    return topology.shard_exchange(service), original_key


async def replay_dead_letters(amqp_url: str) -> int:
    """Send each dead letter back to the service that failed it, then drop it."""
    connection = await aio_pika.connect(amqp_url, timeout=10)
    replayed = 0
    try:
        channel = await connection.channel(publisher_confirms=True)
        queue = await channel.declare_queue(
            topology.DEAD_LETTER_QUEUE, durable=True, arguments={"x-queue-type": "quorum"}
        )
        # Only what is there now: a letter that fails again comes back behind us, and
        # replaying it in the same run would go round forever.
        waiting = queue.declaration_result.message_count or 0
        while replayed < waiting and (message := await queue.get(no_ack=False, fail=False)):
            headers = dict(message.headers or {})
            exchange_name, routing_key = replay_target(headers, message.routing_key or "")
            for name in _OUR_HEADERS:
                headers.pop(name, None)
            exchange = (
                await channel.get_exchange(exchange_name, ensure=False)
                if exchange_name
                else channel.default_exchange
            )
            await exchange.publish(
                aio_pika.Message(
                    message.body,
                    headers=headers,
                    message_id=message.message_id,
                    content_type=message.content_type,
                    correlation_id=message.correlation_id,
                    reply_to=message.reply_to,
                    delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
                ),
                routing_key=routing_key,
            )
            await message.ack()
            replayed += 1
    finally:
        await connection.close()
    return replayed

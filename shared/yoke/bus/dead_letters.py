"""The dead-letter queue: bounded and counted; for operators, list what failed and why, replay
it where it came from."""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Mapping

import aio_pika
from aio_pika.abc import AbstractChannel, AbstractConnection, AbstractIncomingMessage, AbstractQueue
from aiormq.exceptions import ChannelPreconditionFailed

from yoke.bus import amqp_nodes, topology
from yoke.bus.amqp_nodes import amqp_user
from yoke.core.metrics import DEAD_LETTERS_DROPPED
from yoke.core.settings import SERVICES, Settings

log = logging.getLogger(__name__)

# A letter's AMQP user_id when it is not the lister's own (a re-publish cannot carry it).
ORIGINAL_USER_HEADER = "x-yoke-dead-user-id"

_OUR_HEADERS = {
    topology.DEAD_SERVICE_HEADER,
    topology.DEAD_ERROR_HEADER,
    topology.DEAD_ATTEMPTS_HEADER,
    topology.DEAD_EXCHANGE_HEADER,
    topology.DEAD_ROUTING_KEY_HEADER,
}
# What RabbitMQ adds when it dead-letters (or redelivers) a message itself. Stripped on replay,
# so a replayed letter starts afresh rather than looking like it died again.
_BROKER_HEADERS = {
    "x-death",
    "x-delivery-count",
    "x-first-death-reason",
    "x-first-death-queue",
    "x-first-death-exchange",
    "x-last-death-reason",
    "x-last-death-queue",
    "x-last-death-exchange",
}


async def declare_dead_letter_queue(
    connection: AbstractConnection,
    channel: AbstractChannel,
    max_length: int | None = None,
) -> AbstractQueue:
    """``yoke.dead-letters`` on ``channel``, declared bounded (and the queue its overflow goes
    to, to be counted); ``max_length`` is YOKE_DEAD_LETTERS_MAX_LENGTH unless given.

    A queue declared before it had a bound (an upgraded mesh), or with another bound, cannot
    be declared again with these arguments (PRECONDITION_FAILED, which closes the channel): it
    is tried on a channel of its own, and such a queue is used as it is, passively, bounded by
    the policy ``yoke-dead-letters`` (deploy/rabbitmq/definitions.json) if it has one.
    """
    dropped = await channel.declare_exchange(
        topology.DROPPED_LETTERS_EXCHANGE, aio_pika.ExchangeType.FANOUT, durable=True
    )
    counted = await channel.declare_queue(
        topology.DROPPED_LETTERS_QUEUE,
        durable=True,
        arguments=topology.dropped_letters_queue_arguments(),
    )
    await counted.bind(dropped, routing_key="#")
    if max_length is None:
        max_length = Settings().dead_letters_max_length
    arguments = topology.dead_letter_queue_arguments(max_length)
    trial = await connection.channel()
    try:
        await trial.declare_queue(topology.DEAD_LETTER_QUEUE, durable=True, arguments=arguments)
    except ChannelPreconditionFailed as error:
        log.warning(
            "%s was declared without this bound (%s): used as it is; bound it with the policy "
            "%s (docs/operations.md)",
            topology.DEAD_LETTER_QUEUE,
            error,
            topology.DEAD_LETTERS_POLICY,
        )
        return await channel.declare_queue(topology.DEAD_LETTER_QUEUE, passive=True)
    finally:
        if not trial.is_closed:
            await trial.close()
    return await channel.declare_queue(
        topology.DEAD_LETTER_QUEUE, durable=True, arguments=arguments
    )


def dropped_by(headers: Mapping[str, object]) -> str:
    """The service that dead-lettered a letter the bounded queue dropped (a metric label)."""
    service = str(headers.get(topology.DEAD_SERVICE_HEADER) or "")
    if service not in SERVICES:
        deaths = headers.get("x-death")
        queues = (
            [d.get("queue") for d in deaths if isinstance(d, Mapping)]
            if isinstance(deaths, list)
            else []
        )
        service = next((s for q in queues if (s := service_of_queue(str(q))) in SERVICES), "")
    return service or "unknown"


async def count_dropped_letters(connection: AbstractConnection, stopping: asyncio.Event) -> None:
    """Count each dead letter the bounded queue drops (``yoke_dead_letters_dropped_total``)
    until ``stopping``: they come through ``yoke.dead-letters.dropped``, and go no further."""

    async def dropped(message: AbstractIncomingMessage) -> None:
        DEAD_LETTERS_DROPPED.labels(dropped_by(message.headers or {})).inc()

    channel = await connection.channel()
    try:
        await channel.set_qos(prefetch_count=100)
        queue = await channel.declare_queue(
            topology.DROPPED_LETTERS_QUEUE,
            durable=True,
            arguments=topology.dropped_letters_queue_arguments(),
        )
        await queue.consume(dropped, no_ack=True)
        await stopping.wait()
    finally:
        if not channel.is_closed:
            await channel.close()


def broker_death(headers: Mapping[str, object]) -> Mapping[str, object] | None:
    """The newest ``x-death`` entry of a letter RabbitMQ dead-lettered (delivery limit, ...).

    Such a letter carries none of our headers: the broker gave up on it, not a handler.
    """
    deaths = headers.get("x-death")
    if isinstance(deaths, list) and deaths and isinstance(deaths[0], Mapping):
        return deaths[0]
    return None


def service_of_queue(queue: str) -> str | None:
    """``processor`` for ``yoke.processor.shard.003`` or ``yoke.processor.commands``."""
    parts = queue.split(".")
    if len(parts) >= 3 and parts[0] == "yoke" and parts[2] in ("shard", "commands"):
        return parts[1]
    return None


def describe(headers: Mapping[str, object]) -> dict[str, object]:
    """Service, error and attempts of a letter, ours or the broker's: the broker's ``x-death``
    when there is one (an outside command it dead-lettered keeps whatever headers its publisher
    set), as :func:`replay_target` decides."""
    death = broker_death(headers)
    if death is None:
        return {
            "service": headers.get(topology.DEAD_SERVICE_HEADER),
            "error": headers.get(topology.DEAD_ERROR_HEADER),
            "attempts": headers.get(topology.DEAD_ATTEMPTS_HEADER),
            "exchange": headers.get(topology.DEAD_EXCHANGE_HEADER),
            "routingKey": headers.get(topology.DEAD_ROUTING_KEY_HEADER),
        }
    queue = str(death.get("queue") or "")
    keys = death.get("routing-keys")
    return {
        "service": service_of_queue(queue),
        "error": f"dead-lettered by RabbitMQ: {death.get('reason')} in queue {queue}",
        "attempts": headers.get("x-delivery-count"),
        "exchange": death.get("exchange"),
        "routingKey": keys[0] if isinstance(keys, list) and keys else None,
        "queue": queue,
    }


def _copy_of(message: AbstractIncomingMessage, own_user: str) -> aio_pika.Message:
    """The letter as it was delivered: body, headers (``x-delivery-count`` and ``x-death``
    included: its history stays readable) and properties.

    A ``user_id`` not this connection's cannot be published again (RabbitMQ refuses it): it
    is kept in :data:`ORIGINAL_USER_HEADER` instead.
    """
    headers = dict(message.headers or {})
    user_id = message.user_id
    if user_id and user_id != own_user:
        headers[ORIGINAL_USER_HEADER] = user_id
        user_id = None
    return aio_pika.Message(
        message.body,
        headers=headers,
        content_type=message.content_type,
        content_encoding=message.content_encoding,
        delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
        priority=message.priority,
        correlation_id=message.correlation_id,
        reply_to=message.reply_to,
        expiration=message.expiration,
        message_id=message.message_id,
        timestamp=message.timestamp,
        type=message.type,
        user_id=user_id,
        app_id=message.app_id,
    )


async def list_dead_letters(amqp_url: str, limit: int = 10_000) -> list[dict[str, object]]:
    """The first ``limit`` dead letters, left in the queue as they were, in their order.

    A letter handed back to its queue (a nack, or a channel closed with it unacked) counts as
    a delivery: ``x-delivery-count`` rises at each look, and RabbitMQ 4.0-4.2 drop it at the
    default delivery limit (20). So each letter present when the listing starts is read once,
    published again at the back of the queue (a fresh message: no delivery counted) and only
    then acked; after one pass the queue holds the same letters in the same order. A crash
    between the two leaves a duplicate of one letter, never a loss (its id is the same).
    """
    connection = await amqp_nodes.connect(amqp_url)
    own_user = amqp_user(amqp_url)
    letters: list[dict[str, object]] = []
    try:
        channel = await connection.channel(publisher_confirms=True)
        queue = await declare_dead_letter_queue(connection, channel)
        # Only what is there now (every one of them, so the order comes round whole); letters
        # that arrive meanwhile stay behind them, unread.
        waiting = queue.declaration_result.message_count or 0
        for _ in range(waiting):
            message = await queue.get(no_ack=False, fail=False)
            if message is None:
                break
            if len(letters) < limit:
                letters.append({"messageId": message.message_id, **describe(message.headers or {})})
            await channel.default_exchange.publish(
                _copy_of(message, own_user), routing_key=topology.DEAD_LETTER_QUEUE
            )
            await message.ack()
    finally:
        await connection.close()
    return letters


# A service's name as the mesh writes it in DEAD_SERVICE_HEADER (its queues are yoke.NAME.*).
_SERVICE_NAME = re.compile(r"^[a-z][a-z0-9_-]{0,62}$")
# Headers a command may carry back through yoke.commands: none the mesh would trust.
_MESH_HEADER_PREFIXES = ("x-yoke-", "yoke-")


def replay_target(headers: Mapping[str, object], routing_key: str) -> tuple[str, str] | None:
    """Where a letter goes back: to the service that failed it, not to every subscriber; None
    when the letter names nowhere the mesh could have sent it (it is kept, not replayed).

    Only what the mesh wrote is trusted (invariant 13). A letter RabbitMQ dead-lettered itself
    carries the headers its publisher set, which may claim anything: its newest ``x-death``
    entry, the broker's, says where it died, and that decides. Died in a shard queue (which only
    the mesh publishes to): back to that queue. Died in an intake queue, so an outside command
    as it came: back through ``yoke.commands`` with its command's routing key, where the
    router drops every mesh header again. A letter the mesh dead-lettered (no ``x-death``)
    carries our headers over the router's: its events go to that service's shard exchange (which
    hashes the conversation header onto its shard), its commands to its intake queue, and
    nothing ever to ``yoke.events`` or any other exchange.
    """
    death = broker_death(headers)
    if death is not None:
        queue = str(death.get("queue") or "")
        service = service_of_queue(queue)
        if service is None:
            return None
        if queue == topology.intake_queue(service):
            keys = death.get("routing-keys")
            key = str(keys[0]) if isinstance(keys, list) and keys else routing_key
            return (topology.COMMANDS_EXCHANGE, key) if key in _COMMANDS else None
        return "", queue
    service = str(headers.get(topology.DEAD_SERVICE_HEADER) or "")
    original = str(headers.get(topology.DEAD_EXCHANGE_HEADER) or "")
    original_key = str(headers.get(topology.DEAD_ROUTING_KEY_HEADER) or routing_key)
    if not _SERVICE_NAME.match(service):
        return None
    if original == topology.COMMANDS_EXCHANGE:
        return "", topology.intake_queue(service)
    if original in (topology.EVENTS_EXCHANGE, topology.shard_exchange(service)):
        return topology.shard_exchange(service), original_key
    return None


_COMMANDS = frozenset(
    {
        topology.SUBMIT_COMMAND,
        topology.TOOL_RESULT_COMMAND,
        topology.APPROVAL_COMMAND,
        topology.ESCALATION_COMMAND,
    }
)


async def replay_dead_letters(amqp_url: str) -> int:
    """Send each dead letter back to the service that failed it, then drop it; one that names
    nowhere the mesh could have sent it is kept, at the back of the queue (logged)."""
    connection = await amqp_nodes.connect(amqp_url)
    own_user = amqp_user(amqp_url)
    replayed = 0
    try:
        channel = await connection.channel(publisher_confirms=True)
        queue = await declare_dead_letter_queue(connection, channel)
        # Only what is there now: a letter that fails again comes back behind us, and
        # replaying it in the same run would go round forever.
        waiting = queue.declaration_result.message_count or 0
        for _ in range(waiting):
            message = await queue.get(no_ack=False, fail=False)
            if message is None:
                break
            headers = dict(message.headers or {})
            target = replay_target(headers, message.routing_key or "")
            if target is None:
                log.warning(
                    "dead letter %s kept: it names nowhere the mesh sends (%s)",
                    message.message_id,
                    describe(headers),
                )
                await channel.default_exchange.publish(
                    _copy_of(message, own_user), routing_key=topology.DEAD_LETTER_QUEUE
                )
                await message.ack()
                continue
            exchange_name, routing_key = target
            for name in _OUR_HEADERS | _BROKER_HEADERS:
                headers.pop(name, None)
            if exchange_name == topology.COMMANDS_EXCHANGE:
                headers = {
                    name: value
                    for name, value in headers.items()
                    if not name.lower().startswith(_MESH_HEADER_PREFIXES)
                }
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

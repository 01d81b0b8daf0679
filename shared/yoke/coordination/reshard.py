"""Changing ``YOKE_SHARDS``: refused at start on a mismatch, migrated by ``yoke reshard N``.

A consistent-hash exchange sends every conversation to one of a service's shard queues. With
fewer shards configured than queues bound, the extra queues keep their share of the events and
nobody consumes them; with more, conversations move to new queues while their older events
wait in the old ones. So a service refuses to start when the broker holds a different number
of its shard queues, and ``yoke reshard N`` migrates while the services are stopped: it
declares and binds the new queues, unbinds the retired ones, moves every waiting message
through the shard exchange again (which re-hashes it, in order), deletes the retired queues
(highest index first, so the queues left are always ``0..k``) and records the count.

The broker is the truth about which queues exist; MongoDB's ``topology`` collection records
a migration under way (so an interrupted one is finished by running it again) and the count.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass

import aio_pika
from aio_pika.abc import (
    AbstractChannel,
    AbstractConnection,
    AbstractExchange,
    AbstractIncomingMessage,
)
from aiormq.exceptions import ChannelNotFoundEntity

from yoke.bus import amqp_nodes, topology
from yoke.bus.broker import Bus
from yoke.core.errors import Misconfigured
from yoke.store.database import Store

log = logging.getLogger(__name__)

TOPOLOGY = "topology"
MAX_SHARDS = 1024
# A smaller shard set than configured must hold still this many probes, this far apart, to be
# refused (a replica declaring the queues right now makes it grow instead).
SETTLE_PROBES = 4
SETTLE_SECONDS = 1.0
DRAIN_BATCH = 256
DRAIN_WAIT_SECONDS = 30.0
# Added by RabbitMQ on redelivery or dead-lettering: a moved message starts afresh.
_BROKER_HEADERS = ("x-delivery-count", "x-death")


class ShardCountChanged(Misconfigured):
    """The broker holds a different number of this service's shard queues than configured."""


class ReshardRefused(RuntimeError):
    """``yoke reshard`` cannot run now (services still consuming)."""


@dataclass(frozen=True)
class ShardQueue:
    name: str
    messages: int
    consumers: int


@dataclass(frozen=True)
class Resharded:
    service: str
    before: int
    after: int
    moved: int


@contextlib.asynccontextmanager
async def connection_to(amqp_url: str) -> AsyncIterator[AbstractConnection]:
    """A plain (not robust) connection: a failed passive declare closes its channel for good."""
    connection = await amqp_nodes.connect(amqp_url)
    try:
        yield connection
    finally:
        await connection.close()


async def shard_queues(connection: AbstractConnection, service: str) -> list[ShardQueue]:
    """The service's shard queues present on the broker: ``0..k``, probed passively in turn."""
    found: list[ShardQueue] = []
    channel = await connection.channel()
    try:
        for index in range(MAX_SHARDS + 1):
            name = topology.shard_queue(service, index)
            try:
                queue = await channel.declare_queue(name, passive=True)
            except ChannelNotFoundEntity:
                break  # the broker closed this channel: nothing to close
            result = queue.declaration_result
            found.append(ShardQueue(name, result.message_count or 0, result.consumer_count or 0))
    finally:
        if not channel.is_closed:
            await channel.close()
    return found


async def _settled_shard_count(amqp_url: str, service: str, shards: int) -> int:
    """How many shard queues the service has, once that number holds still.

    Replicas starting together race: one may count while another is still declaring, and a
    partial set that keeps growing toward ``shards`` is that, not a changed shard count. A
    different count has to stay the same for ``SETTLE_PROBES`` probes to count.
    """
    async with connection_to(amqp_url) as connection:
        present = len(await shard_queues(connection, service))
        same = 1
        while 0 < present < shards and same < SETTLE_PROBES:
            await asyncio.sleep(SETTLE_SECONDS)
            again = len(await shard_queues(connection, service))
            same = same + 1 if again == present else 1
            present = again
    return present


async def check_shard_count(bus: Bus, store: Store, service: str, shards: int) -> None:
    """Refuse to start (before declaring anything) when the shard count changed.

    Raises :class:`ShardCountChanged` naming ``yoke reshard N``.
    """
    record = await store.db[TOPOLOGY].find_one({"_id": service})
    target = record.get("target") if record else None
    if target is not None:
        problem = (
            f"{service}: a reshard to {target} shards was interrupted; "
            f"with every service stopped, run `yoke reshard {target}` again"
        )
    else:
        present = await _settled_shard_count(bus.url, service, shards)
        if not present or present == shards:
            return
        problem = (
            f"{service}: the broker holds {present} shard queues but YOKE_SHARDS={shards}; "
            f"stop every service and run `yoke reshard {shards}` to migrate "
            f"(or start with YOKE_SHARDS={present})"
        )
    log.critical(problem)
    raise ShardCountChanged(problem)


async def reshard(
    amqp_url: str, store: Store, shards: int, services: Iterable[str]
) -> list[Resharded]:
    """Migrate each service's shard queues to ``shards``; refuses while any is consumed."""
    if not 1 <= shards <= MAX_SHARDS:
        raise ReshardRefused(f"a shard count is between 1 and {MAX_SHARDS}, not {shards}")
    done: list[Resharded] = []
    async with connection_to(amqp_url) as connection:
        present = {service: await shard_queues(connection, service) for service in services}
        busy = [queue.name for queues in present.values() for queue in queues if queue.consumers]
        if busy:
            raise ReshardRefused(
                f"{len(busy)} shard queues have consumers ({', '.join(busy[:4])}"
                f"{', ...' if len(busy) > 4 else ''}): stop every service first"
            )
        for service, queues in present.items():
            record = await store.db[TOPOLOGY].find_one({"_id": service})
            interrupted = bool(record and record.get("target") is not None)
            if not interrupted and len(queues) in (0, shards):
                continue  # never declared, or already right
            before = int(record["shards"]) if record and interrupted else len(queues)
            await store.db[TOPOLOGY].replace_one(
                {"_id": service}, {"shards": before, "target": shards}, upsert=True
            )
            moved = await _migrate(connection, service, len(queues), shards)
            await store.db[TOPOLOGY].replace_one({"_id": service}, {"shards": shards})
            log.info("%s: %d -> %d shards, %d messages moved", service, before, shards, moved)
            done.append(Resharded(service, before, shards, moved))
    return done


async def _migrate(connection: AbstractConnection, service: str, present: int, shards: int) -> int:
    channel = await connection.channel(publisher_confirms=True)
    try:
        exchange = await channel.declare_exchange(
            topology.shard_exchange(service),
            "x-consistent-hash",
            durable=True,
            arguments={"hash-header": topology.CONVERSATION_HEADER},
        )
        for index in range(shards):
            queue = await channel.declare_queue(
                topology.shard_queue(service, index),
                durable=True,
                arguments=topology.quorum_queue_arguments(),
            )
            await queue.bind(exchange, routing_key="1")
        retired = range(shards, present)
        for index in retired:
            queue = await channel.declare_queue(topology.shard_queue(service, index), passive=True)
            await queue.unbind(exchange, routing_key="1")
        # The ring changed for every queue (added points take keys from the old ones), so
        # every queue's waiting messages go through the exchange again: each conversation's
        # messages sit in one old queue, in order, and arrive in its new one in that order.
        moved = 0
        shard_zero = topology.shard_queue(service, 0)
        for index in range(max(present, shards)):
            name = topology.shard_queue(service, index)
            moved += await _drain(connection, channel, exchange, name, shard_zero)
        for index in reversed(retired):
            queue = await channel.declare_queue(topology.shard_queue(service, index), passive=True)
            # Quorum queues refuse if_unused/if_empty; nothing is bound or consuming by now.
            await queue.delete(if_unused=False, if_empty=False)
        return moved
    finally:
        if not channel.is_closed:
            await channel.close()


async def _drain(
    connection: AbstractConnection,
    publisher: AbstractChannel,
    exchange: AbstractExchange,
    name: str,
    shard_zero: str,
) -> int:
    """Republish the messages waiting in ``name`` (only those) to its shard exchange, in order.

    Single-active-consumer quorum queues refuse ``basic.get``, so each batch is consumed with a
    prefetch of exactly its size, the consumer cancelled, the batch republished with confirms
    and then acked: a message put back into this same queue lands behind the ones still
    waiting and is never taken twice. A crash in between leaves duplicates, never losses
    (handlers are idempotent).
    """
    queue = await publisher.declare_queue(name, passive=True)
    remaining = queue.declaration_result.message_count or 0
    moved = 0
    while remaining > 0:
        take = min(DRAIN_BATCH, remaining)
        consumer, batch = await _take(connection, name, take)
        for message in batch:
            await _republish(publisher, exchange, message, shard_zero)
        await batch[-1].ack(multiple=True)
        await consumer.close()
        remaining -= take
        moved += take
    return moved


async def _take(
    connection: AbstractConnection, name: str, count: int
) -> tuple[AbstractChannel, list[AbstractIncomingMessage]]:
    """Exactly ``count`` deliveries from the head of ``name``, left unacked, consumer cancelled."""
    channel = await connection.channel()
    await channel.set_qos(prefetch_count=count)
    queue = await channel.get_queue(name, ensure=False)
    batch: list[AbstractIncomingMessage] = []
    full = asyncio.Event()

    async def keep(message: AbstractIncomingMessage) -> None:
        batch.append(message)
        if len(batch) >= count:
            full.set()

    tag = await queue.consume(keep)
    try:
        await asyncio.wait_for(full.wait(), DRAIN_WAIT_SECONDS)
    except TimeoutError:
        await channel.close()  # puts them back, unmoved
        raise ReshardRefused(
            f"{name}: expected {count} waiting messages, got {len(batch)}; is a service running?"
        ) from None
    await queue.cancel(tag)
    return channel, sorted(batch, key=lambda message: message.delivery_tag or 0)


async def _republish(
    channel: AbstractChannel,
    exchange: AbstractExchange,
    message: AbstractIncomingMessage,
    fallback_queue: str,
) -> None:
    headers = {k: v for k, v in (message.headers or {}).items() if k not in _BROKER_HEADERS}
    copy = aio_pika.Message(
        message.body,
        headers=headers,
        message_id=message.message_id,
        content_type=message.content_type,
        content_encoding=message.content_encoding,
        correlation_id=message.correlation_id,
        reply_to=message.reply_to,
        timestamp=message.timestamp,
        type=message.type,
        app_id=message.app_id,
        delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
    )
    if topology.CONVERSATION_HEADER in headers:
        await exchange.publish(copy, routing_key=message.routing_key or "", timeout=10)
    else:
        # Nothing to hash on: keep it (in shard 0) rather than let the exchange drop it.
        await channel.default_exchange.publish(copy, routing_key=fallback_queue, timeout=10)

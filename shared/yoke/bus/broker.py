"""RabbitMQ through aio-pika: topology, publishing with confirms, and consuming channels.

Topology is declared idempotently by every process that needs it:
``yoke.events`` and ``yoke.commands`` (topic), a dead-letter exchange and queue, and per
service a consistent-hash exchange feeding ``shards`` quorum queues with single active consumer.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass

import aio_pika
from aio_pika.abc import (
    AbstractChannel,
    AbstractExchange,
    AbstractIncomingMessage,
    AbstractQueue,
    AbstractRobustConnection,
    HeadersType,
)
from aiormq.exceptions import AMQPError, ChannelNotFoundEntity, DeliveryError

from yoke.bus import _upgrades as upgrades
from yoke.bus import amqp_nodes, topology
from yoke.bus.dead_letters import declare_dead_letter_queue
from yoke.core import tracing
from yoke.core.errors import Transient
from yoke.core.models import Envelope, EventPayload

log = logging.getLogger(__name__)

PUBLISH_RETRY_SECONDS = 30.0
# How soon a dropped connection is tried again (aio-pika's default is 5 s).
RECONNECT_INTERVAL_SECONDS = 1.0
# Nacks in a row of one publish after which the publisher channel is replaced. RabbitMQ 3.10
# can leave a channel that published to a quorum queue while its leader was being elected
# nacking every later publish to that queue for minutes, while a new channel's are confirmed.
NACKS_BEFORE_NEW_CHANNEL = 3
RENEW_SECONDS = 5.0

OnMessage = Callable[[AbstractIncomingMessage], Awaitable[None]]


@dataclass
class Subscription:
    """One consumed queue: its own channel, the queue object and the consumer's tag."""

    queue_name: str
    on_message: OnMessage
    prefetch: int
    channel: AbstractChannel
    queue: AbstractQueue
    tag: str

    def problem(self) -> str | None:
        """Why this queue is not being consumed right now, or None when it is."""
        if self.channel.is_closed:
            return f"{self.queue_name}: channel closed"
        underlay = getattr(self.channel, "_channel", None)
        consumers = getattr(getattr(underlay, "channel", None), "consumers", None)
        if consumers is None:
            return f"{self.queue_name}: channel not open"
        if self.tag not in consumers:
            return f"{self.queue_name}: no consumer"
        return None


async def declare_forum_route(channel: AbstractChannel, events: AbstractExchange) -> None:
    """yoke.events -> yoke.forum.route -> yoke.forum (see :meth:`Bus.declare_forum`)."""
    route = await channel.declare_exchange(
        topology.FORUM_ROUTE_EXCHANGE,
        aio_pika.ExchangeType.HEADERS,
        durable=True,
        internal=True,
    )
    await route.bind(events, routing_key="#")
    forum = await channel.declare_exchange(
        topology.FORUM_EXCHANGE, aio_pika.ExchangeType.TOPIC, durable=True, internal=True
    )
    await forum.bind(
        route,
        routing_key="",
        arguments={"x-match": "all", topology.KIND_HEADER: topology.PUBLIC_KIND},
    )


async def ensure_forum_exchange(url: str) -> None:
    """yoke.forum exists before a reader binds to it (the gateway's stream and webhooks).

    Looked up first: the gateway's own RabbitMQ user may not declare it (compose's provisioning
    does). Where it is missing and the user may (the services' user: make run, the tests), it
    is declared with its route, as every Bus does. A throwaway connection: a lookup that fails
    closes its channel, and a robust one would reopen it.
    """
    connection = await amqp_nodes.connect(url)
    try:
        try:
            await (await connection.channel()).get_exchange(topology.FORUM_EXCHANGE)
            return
        except ChannelNotFoundEntity:
            pass
        channel = await connection.channel()
        events = await channel.declare_exchange(
            topology.EVENTS_EXCHANGE, aio_pika.ExchangeType.TOPIC, durable=True
        )
        await declare_forum_route(channel, events)
    finally:
        await connection.close()


def _event_headers(
    envelope: Envelope, key: str, headers: Mapping[str, str] | None
) -> dict[str, str]:
    """An event's headers: the caller's, with the shard key and type the routes select on."""
    return {
        **(headers or {}),
        topology.CONVERSATION_HEADER: key,
        topology.EVENT_HEADER: envelope.type,
    }


class Bus:
    """One robust AMQP connection: a confirming publisher channel plus consumer channels."""

    def __init__(
        self, url: str, *, name: str = "yoke", dead_letters_max_length: int | None = None
    ) -> None:
        self.url = url
        self.name = name
        # The bound yoke.dead-letters is declared with (None: YOKE_DEAD_LETTERS_MAX_LENGTH).
        self.dead_letters_max_length = dead_letters_max_length
        self._connection: AbstractRobustConnection | None = None
        self._publisher: AbstractChannel | None = None
        self._exchanges: dict[str, AbstractExchange] = {}
        self._renewing = asyncio.Lock()
        self._closing: set[asyncio.Task[None]] = set()
        # How many times a nacking publisher channel was replaced (see NACKS_BEFORE_NEW_CHANNEL).
        self.publisher_renewals = 0
        # Worker tools' call queues declared by this process (bounded by the catalog).
        self._tool_queues: set[str] = set()
        self.subscriptions: list[Subscription] = []
        # yoke.events on a channel without confirms, for ephemeral events (publish_hint).
        self._hints: AbstractExchange | None = None
        self._opening_hints = asyncio.Lock()

    async def connect(self, *, declare: bool = True) -> None:
        """``declare=False``: a user that may not configure the core exchanges (the gateway's)."""
        # ``url`` may list a cluster's nodes: each (re)connect tries them in turn (amqp_nodes).
        self._connection = await amqp_nodes.connect_robust(
            self.url, name=self.name, reconnect_interval=RECONNECT_INTERVAL_SECONDS
        )
        self._publisher = await self._connection.channel(publisher_confirms=True)
        if declare:
            await self.declare_core()

    @property
    def connection(self) -> AbstractRobustConnection:
        if self._connection is None:
            raise RuntimeError("Bus.connect() was not called")
        return self._connection

    @property
    def is_connected(self) -> bool:
        """Connected right now (a robust connection that is reconnecting is not)."""
        connection = self._connection
        return (
            connection is not None
            and not connection.is_closed
            and connection.connected.is_set()
            and connection.transport is not None
            and not connection.reconnecting
        )

    async def close(self) -> None:
        """Close consumer channels first, then the rest.

        Never basic.cancel: a cancelled consumer's unacked deliveries can be requeued after the
        next consumer started, out of order; a closed channel returns them in order.
        """
        for subscription in self.subscriptions:
            if not subscription.channel.is_closed:
                await subscription.channel.close()
        self.subscriptions.clear()
        if self._connection is not None and not self._connection.is_closed:
            await self._connection.close()

    # --- topology ----------------------------------------------------------------------

    async def declare_core(self) -> None:
        channel = self._channel()
        for name in (topology.EVENTS_EXCHANGE, topology.COMMANDS_EXCHANGE):
            self._exchanges[name] = await channel.declare_exchange(
                name, aio_pika.ExchangeType.TOPIC, durable=True
            )
        dead = await channel.declare_exchange(
            topology.DEAD_LETTER_EXCHANGE, aio_pika.ExchangeType.FANOUT, durable=True
        )
        self._exchanges[topology.DEAD_LETTER_EXCHANGE] = dead
        queue = await declare_dead_letter_queue(
            self.connection, channel, self.dead_letters_max_length
        )
        await queue.bind(dead, routing_key="#")
        await self.declare_forum()

    async def declare_forum(self) -> None:
        """``yoke.forum``, what bridges read: forum lines and activity, never a monologue.

        yoke.events -> ``yoke.forum.route`` (headers: ``yoke-kind=forum`` only) -> yoke.forum
        (topic). Exchange-to-exchange bindings keep the routing key, so a bridge binds
        ``conversation.message.posted.<forum id>`` here as it did on yoke.events, and the
        broker does the copying: no extra publish on the posting path. Both are internal, so
        only this route feeds them.

        Not RabbitMQ topic permissions: on 3.10.8 a topic permission's ``read`` pattern does
        restrict ``queue.bind`` keys on a topic exchange (ACCESS_REFUSED otherwise), but a forum
        id and a monologue id look alike in a routing key, so only a pattern listing every
        forum (rewritten for each new one) could tell them apart, and a bridge could no longer
        bind ``conversation.message.posted.#``.
        """
        await declare_forum_route(self._channel(), self._exchanges[topology.EVENTS_EXCHANGE])

    async def declare_shards(
        self, service: str, interests: list[topology.Interest], shards: int
    ) -> list[str]:
        """The service's route and consistent-hash exchanges and its shard queues.

        yoke.events feeds the service's headers exchange, which passes on only the events that match
        one of ``interests`` (bridges rely on the public routing keys staying as they are), and that
        feeds the consistent-hash exchange over the shard queues. Returns the queue names.
        """
        channel = self._channel()
        events = self._exchanges[topology.EVENTS_EXCHANGE]
        route = await channel.declare_exchange(
            topology.route_exchange(service), aio_pika.ExchangeType.HEADERS, durable=True
        )
        await route.bind(events, routing_key="#")
        exchange = await channel.declare_exchange(
            topology.shard_exchange(service),
            "x-consistent-hash",
            durable=True,
            arguments={"hash-header": topology.CONVERSATION_HEADER},
        )
        await upgrades.unbind_legacy_routes(exchange, events, route, service, interests)
        for wanted in interests:
            await exchange.bind(route, routing_key="", arguments={"x-match": "all", **wanted})
        names = []
        for index in range(shards):
            name = topology.shard_queue(service, index)
            queue = await channel.declare_queue(name, **topology.QUORUM_QUEUE)
            await queue.bind(exchange, routing_key="1")  # equal weights
            names.append(name)
        return names

    async def declare_intake(self, service: str, bindings: list[tuple[str, str]]) -> str:
        """One single-active-consumer queue for commands that carry their key in the body,
        bound with each (exchange, routing key) of ``bindings``."""
        channel = self._channel()
        name = topology.intake_queue(service)
        queue = await channel.declare_queue(name, **topology.QUORUM_QUEUE)
        for exchange, binding in bindings:
            await queue.bind(self._exchanges[exchange], routing_key=binding)
        return name

    async def declare_tool_queue(self, tool: str) -> str:
        """A worker tool's call queue (workers never declare it); once per process and tool."""
        name = topology.tool_queue(tool)
        if name not in self._tool_queues:
            await self._channel().declare_queue(
                name, durable=True, arguments=topology.tool_queue_arguments()
            )
            self._tool_queues.add(name)
        return name

    def _channel(self) -> AbstractChannel:
        if self._publisher is None:
            raise RuntimeError("Bus.connect() was not called")
        return self._publisher

    @property
    def publisher(self) -> AbstractChannel:
        """The confirming channel publishes go on (replaced when it keeps being nacked)."""
        return self._channel()

    # --- publishing --------------------------------------------------------------------

    async def publish(
        self,
        exchange: str,
        routing_key: str,
        body: bytes,
        *,
        message_id: str,
        headers: Mapping[str, str | int] | None = None,
        reply_to: str | None = None,
        correlation_id: str | None = None,
        expiration: float | None = None,
    ) -> None:
        """Publish and wait for the broker's confirm (``exchange`` "" is the default exchange;
        ``expiration``: seconds until the broker drops the message unconsumed).

        A publish on a channel lost to a reconnect raises; retry it with the same message id
        (consumers deduplicate) until the connection is back or the deadline passes. Inside a
        trace it is a span of its own, and the message carries it as its ``traceparent``.
        """
        message = aio_pika.Message(
            body,
            message_id=message_id,
            headers=dict(headers or {}),
            content_type="application/json",
            delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
            reply_to=reply_to,
            correlation_id=correlation_id,
            expiration=expiration,
        )
        if not tracing.enabled():
            await self._send(exchange, routing_key, message)
            return
        with tracing.span(
            f"publish {exchange or routing_key}",
            kind="producer",
            attributes={
                "messaging.system": "rabbitmq",
                "messaging.operation.type": "send",
                "messaging.destination.name": exchange or routing_key,
                "messaging.rabbitmq.destination.routing_key": routing_key,
                "messaging.message.id": message_id,
            },
            child_only=True,
        ):
            tracing.inject(message.headers)
            await self._send(exchange, routing_key, message)

    async def _send(self, exchange: str, routing_key: str, message: aio_pika.Message) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + PUBLISH_RETRY_SECONDS
        delay = 0.05
        nacks = 0
        while True:
            channel = self._channel()
            try:
                target = self._exchanges.get(exchange)
                if target is None and not exchange:
                    target = channel.default_exchange
                elif target is None:
                    target = await channel.get_exchange(exchange, ensure=False)
                await target.publish(message, routing_key=routing_key, timeout=10)
                return
            except (TimeoutError, AMQPError, ConnectionError, RuntimeError) as error:
                if loop.time() + delay > deadline:
                    # The broker is away: whoever asked should wait and try again, not give up.
                    raise Transient(f"publish to {exchange} failed: {error!r}") from error
                log.warning("publish to %s failed (%s); retrying", exchange, error)
                if isinstance(error, DeliveryError):
                    nacks += 1
                    if nacks % NACKS_BEFORE_NEW_CHANNEL == 0:
                        # Shielded: a publisher given up on (a draft's delta) must not leave
                        # a new channel half made.
                        await asyncio.shield(self._renew_publisher(channel))
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)

    async def _renew_publisher(self, nacking: AbstractChannel) -> None:
        """Replace the publisher channel that keeps nacking (once, however many publishes saw
        it): later publishes, and the retries of those in flight, go on a new channel. Bounded
        in time: if no new channel opens (the broker going away), the retries go on as before.
        """
        async with self._renewing:
            if self._publisher is not nacking:
                return  # another publish replaced it already
            renewed = self.connection.channel(publisher_confirms=True)
            try:
                await asyncio.wait_for(renewed.initialize(), RENEW_SECONDS)
            except (TimeoutError, AMQPError, ConnectionError, RuntimeError) as error:
                log.warning("publisher channel kept nacking; no new one opened (%r)", error)
                self._close_later(renewed)
                return
            self._exchanges = {
                name: await renewed.get_exchange(name, ensure=False) for name in self._exchanges
            }
            self._publisher = renewed
            self.publisher_renewals += 1
        log.warning("publisher channel kept nacking; publishing on a new channel")
        self._close_later(nacking)

    def _close_later(self, channel: AbstractChannel) -> None:
        """Close a channel without waiting for the broker (one wedged may never answer)."""

        async def close() -> None:
            with contextlib.suppress(TimeoutError, AMQPError, ConnectionError, RuntimeError):
                await asyncio.wait_for(channel.close(), RENEW_SECONDS)

        task = asyncio.create_task(close())
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def publish_event(
        self,
        envelope: Envelope,
        key: str,
        headers: Mapping[str, str] | None = None,
        *,
        expiration: float | None = None,
    ) -> None:
        """Publish a domain event to ``yoke.events`` as ``<type>.<key>``, keyed for the shards,
        with the headers the services' route exchanges select on (``expiration``: seconds an
        ephemeral event may wait in a queue)."""
        await self.publish(
            topology.EVENTS_EXCHANGE,
            topology.routing_key(envelope.type, key),
            envelope.to_json(),
            message_id=envelope.id,
            headers=_event_headers(envelope, key, headers),
            expiration=expiration,
        )

    async def publish_forum_event(self, event_id: str, payload: EventPayload) -> None:
        """A domain event routed like a forum's lines (yoke-kind forum, keyed by its forum): it
        reaches ``yoke.forum``, what bridges and the gateway's streams read, as well."""
        await self.publish_event(
            Envelope.wrap(event_id, payload), payload.key, {topology.KIND_HEADER: "forum"}
        )

    async def publish_hint(
        self,
        envelope: Envelope,
        key: str,
        headers: Mapping[str, str] | None = None,
        *,
        expiration: float | None = None,
    ) -> None:
        """Publish an ephemeral event (``agent.activity``, ``agent.delta``: hints for live
        views, never stored) like :meth:`publish_event`, but transient and on a channel without
        confirms: the step that sends it waits for no round trip and the broker writes nothing.

        Raises when the channel is lost (the caller drops the hint: losing one is fine). One
        channel carries them all, so a process's hints reach a queue in the order it sent them;
        they go ahead of the confirmed events published after them, which are routed later.
        """
        exchange = await self._hint_exchange()
        hint_headers: HeadersType = {**_event_headers(envelope, key, headers)}
        tracing.inject(hint_headers)
        message = aio_pika.Message(
            envelope.to_json(),
            message_id=envelope.id,
            headers=hint_headers,
            content_type="application/json",
            delivery_mode=aio_pika.DeliveryMode.NOT_PERSISTENT,
            expiration=expiration,
        )
        # Not mandatory: a hint nobody listens for (no stream open) is dropped by the broker,
        # not returned to be dropped here.
        await exchange.publish(
            message, routing_key=topology.routing_key(envelope.type, key), mandatory=False
        )

    async def _hint_exchange(self) -> AbstractExchange:
        """``yoke.events`` on the hints' channel (opened on first use: most processes send none)."""
        if self._hints is None:
            async with self._opening_hints:
                if self._hints is None:
                    channel = await self.connection.channel(publisher_confirms=False)
                    self._hints = await channel.get_exchange(topology.EVENTS_EXCHANGE, ensure=False)
        return self._hints

    async def reply(self, reply_to: str, correlation_id: str | None, body: bytes) -> None:
        """Answer a request on its ``reply_to`` queue through the default exchange."""
        message = aio_pika.Message(
            body,
            correlation_id=correlation_id,
            content_type="application/json",
            headers=tracing.inject({}) or None,
        )
        await self._channel().default_exchange.publish(message, routing_key=reply_to, timeout=10)

    # --- consuming ---------------------------------------------------------------------

    async def consume(
        self, queue_name: str, on_message: OnMessage, *, prefetch: int
    ) -> Subscription:
        """Consume a queue on a channel of its own, with ``prefetch`` unacked deliveries.

        The queue is declared (not merely looked up) on that channel: aio-pika's robust channel
        restores, after a reconnect, only the queues and consumers it declared itself.
        """
        channel = await self.connection.channel()
        await channel.set_qos(prefetch_count=prefetch)
        queue = await channel.declare_queue(queue_name, **topology.QUORUM_QUEUE)
        tag = await queue.consume(on_message)
        subscription = Subscription(queue_name, on_message, prefetch, channel, queue, tag)
        self.subscriptions.append(subscription)
        return subscription

    def problems(self) -> list[str]:
        """What keeps this process from consuming everything it should (empty: nothing)."""
        if not self.is_connected:
            return ["broker connection down"]
        return [p for s in self.subscriptions if (p := s.problem()) is not None]

    async def unsubscribe(self, subscription: Subscription) -> None:
        """Stop consuming a queue by closing its channel (a shard handed over).

        Unacked deliveries go back to the queue in order, and single active consumer makes
        the next consumer active. A channel the broker already lost is simply forgotten.
        """
        if subscription in self.subscriptions:
            self.subscriptions.remove(subscription)
        if not subscription.channel.is_closed:
            try:
                await subscription.channel.close()
            except Exception as error:
                log.warning("closing %s's channel: %r", subscription.queue_name, error)

    async def resubscribe(self, subscription: Subscription) -> None:
        """Consume ``subscription``'s queue again on a fresh channel (after a lost consumer).

        The old channel is closed, not cancelled: its unacked deliveries go back to the queue
        and return, in order, to whoever consumes it (a cancel could requeue them out of order).
        """
        old = subscription.channel
        if not old.is_closed:
            await old.close()
        fresh = await self.consume(
            subscription.queue_name, subscription.on_message, prefetch=subscription.prefetch
        )
        self.subscriptions.remove(fresh)
        subscription.channel, subscription.queue, subscription.tag = (
            fresh.channel,
            fresh.queue,
            fresh.tag,
        )

"""A service process: wiring of store, bus, handlers, health, outbox sweep and clean shutdown.

Services (``services/<name>``) only register handlers and background work
(:meth:`Service.background`); everything operational lives here.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import signal
import sys
from collections.abc import Awaitable, Callable, Mapping
from contextvars import ContextVar
from typing import TypeVar

from aio_pika.abc import AbstractIncomingMessage
from pydantic import ValidationError

from yoke.bus import topology
from yoke.bus.broker import Bus, OnMessage
from yoke.bus.consumer import Dispatcher, Gate, Malformed, Route, event_type_of, key_from_header
from yoke.coordination.ownership import REPLICAS, Ownership
from yoke.coordination.reshard import check_shard_count
from yoke.coordination.speakers import DoorUsers
from yoke.core import metrics, tracing
from yoke.core.errors import (
    EXIT_MISCONFIGURED,
    Misconfigured,
    RetryPolicy,
    describe_validation_error,
)
from yoke.core.hardening import make_undumpable
from yoke.core.logs import configure_logging
from yoke.core.metrics import EVENT_LAG_SECONDS
from yoke.core.models import Envelope, EventPayload, MessagePosted, utcnow
from yoke.core.settings import Settings
from yoke.core.tls import refused_as_misconfigured
from yoke.runtime.health import HealthServer
from yoke.runtime.posting import Poster
from yoke.store.database import Store
from yoke.store.retention import sweep_for

log = logging.getLogger(__name__)

P = TypeVar("P", bound=EventPayload)
# How often the consumer watchdog looks for queues this process no longer consumes.
CONSUMER_CHECK_SECONDS = 2.0
# How long a stopping service lets the outbox sweep finish its round.
OUTBOX_SWEEP_STOP_SECONDS = 10.0
EventHandler = Callable[[EventPayload], Awaitable[None]]
# Background work: called once the service consumes, cancelled when it stops.
Work = Callable[[], Awaitable[None]]
# Added by RabbitMQ on redelivery and dead-lettering: not carried over by the command router.
_BROKER_HEADERS = frozenset(
    {
        "x-delivery-count",
        "x-death",
        "x-first-death-exchange",
        "x-first-death-queue",
        "x-first-death-reason",
    }
)


# Headers only the mesh sets (routing, dead-letter reasons, the verified user).
_MESH_HEADER_PREFIXES = ("x-yoke-", "yoke-")


# The routing headers of the event being handled: what its publisher said of it beyond its body
# (a forwarded line passes on its join's, topology.FOLLOWED_HEADER and CONFIG_VERSION_HEADER).
_DELIVERY_HEADERS: ContextVar[Mapping[str, object]] = ContextVar("yoke_delivery_headers")


def delivery_headers() -> Mapping[str, object]:
    """The headers of the event this task handles (empty outside a handler)."""
    return _DELIVERY_HEADERS.get({})


def parse_envelope(message: AbstractIncomingMessage) -> Envelope:
    """Decode an event delivery; :class:`Malformed` names what is wrong with it."""
    try:
        return Envelope.model_validate_json(message.body)
    except ValidationError as error:
        raise Malformed(f"not an event envelope: {describe_validation_error(error)}") from error


class Service:
    """One service process. Register handlers, then ``await service.run()``."""

    def __init__(self, name: str, settings: Settings | None = None) -> None:
        self.name = name
        self.settings = settings or Settings()
        self.store = Store(
            self.settings.mongodb_url, app_name=name, pool_size=self.settings.mongodb_pool_size
        )
        self.bus = Bus(
            self.settings.amqp_url,
            name=name,
            dead_letters_max_length=self.settings.dead_letters_max_length,
        )
        self.poster = Poster(self.store, self.bus, name)
        self.stopping = asyncio.Event()
        self.dispatcher = Dispatcher(
            name,
            self.bus,
            policy=RetryPolicy(
                attempts=self.settings.handler_attempts,
                backoff=self.settings.retry_backoff_seconds,
                cap=self.settings.retry_cap_seconds,
            ),
            stopping=self.stopping,
        )
        self._event_handlers: dict[str, EventHandler] = {}
        self._interests: list[topology.Interest] = []
        # Which lane a shard delivery runs in: its conversation, unless a service says otherwise.
        self.lane_key: Callable[[AbstractIncomingMessage], str] = key_from_header
        self._intakes: list[tuple[str, str, Route]] = []
        self._arrivals: list[Callable[[str, AbstractIncomingMessage], None]] = []
        self._handovers: list[Callable[[], None]] = []
        self._commands: dict[str, Callable[[AbstractIncomingMessage], Awaitable[None]]] = {}
        # Which shards this replica consumes (None until started, or with no shards at all).
        self.ownership: Ownership | None = None
        # Taken by whoever changes the subscriptions: ownership rounds and the watchdog.
        self._consumption = asyncio.Lock()
        self._consuming = False
        self._health: HealthServer | None = None
        self._outbox_sweep: asyncio.Task[None] | None = None
        self._work: dict[str, Work] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        # Why background work ended early (its crash): /healthz says it until a restart.
        self._crashed: dict[str, str] = {}
        self._started = False
        self.background("consumer watchdog", self._watch_consumers)
        # What this process owns that is kept only for a while; services add their rules.
        self.retention = sweep_for(name, self.store, self.settings)
        self.background("retention sweep", lambda: self.retention.run(self.stopping))

    # --- registration ------------------------------------------------------------------

    def on_event(
        self,
        event_type: type[P],
        handler: Callable[[P], Awaitable[None]],
        *,
        where: list[dict[str, str]] | None = None,
    ) -> None:
        """Handle ``event_type`` deliveries from this service's shard queues.

        ``where`` narrows what is delivered at all, by the routing headers of posted messages
        (``{"kind": "forum", "type": "message"}``; any one of the dicts matches): a service
        receives nothing it would only look at and drop.
        """

        async def typed(payload: EventPayload) -> None:
            assert isinstance(payload, event_type)
            await handler(payload)

        self._event_handlers[event_type.TYPE] = typed
        self._interests.extend(
            topology.interest(event_type.TYPE, **match) for match in (where or [{}])
        )

    def on_intake(
        self,
        exchange: str,
        binding: str,
        key_of: Callable[[AbstractIncomingMessage], str],
        handle: Callable[[AbstractIncomingMessage], Awaitable[None]],
    ) -> None:
        """Outside commands that carry their key inside (``binding`` on ``exchange``).

        They arrive on one single-active-consumer intake queue; a light router there moves
        each, in order per key, to this service's shards with the key as its
        ``x-yoke-conversation`` header (``reply_to`` and ``correlation_id`` kept), then acks.
        ``handle`` runs on the shards, so the commands' work is shared by the replicas that
        own them, in order per conversation.
        """
        self._intakes.append((exchange, binding, Route("", key_of, self._router(binding, key_of))))
        self._commands[binding] = handle

    def on_arrival(self, look: Callable[[str, AbstractIncomingMessage], None]) -> None:
        """Show ``look`` each shard delivery (with its lane key) that arrives while its lane is
        busy, before it waits there behind the work in progress (synchronous, and it must not
        hold the delivery up: say, to cancel a model call the new line makes moot)."""
        self._arrivals.append(look)

    def on_handover(self, changed: Callable[[], None]) -> None:
        """Call ``changed()`` whenever this process starts consuming a shard queue (gained, or
        consumed again after its consumer was lost): what another consumer did meanwhile is
        unknown here, so memory about its conversations is to be forgotten."""
        self._handovers.append(changed)

    def background(self, name: str, work: Work) -> None:
        """Run ``work()`` for the service's lifetime: from the moment it consumes (work that
        publishes needs the broker) until it stops, when it is cancelled and awaited.

        A crash is logged with ``name`` and keeps ``/healthz`` unhealthy (``<name> stopped:
        <error>``) rather than leaving a process that serves without it: restarting is the
        remedy. Work that returns by itself is simply done.
        """
        if self._started:
            raise RuntimeError(f"background work {name!r}: register it before the service starts")
        if name in self._work:
            raise ValueError(f"background work {name!r} is registered already")
        self._work[name] = work

    def _router(
        self, command: str, key_of: Callable[[AbstractIncomingMessage], str]
    ) -> Callable[[AbstractIncomingMessage], Awaitable[None]]:
        async def forward(message: AbstractIncomingMessage) -> None:
            # Nothing an outside publisher says of itself in headers is trusted later: every
            # mesh header is dropped, and who it is comes from the user_id RabbitMQ verified.
            headers: dict[str, str | int] = {
                name: value
                for name, value in (message.headers or {}).items()
                if isinstance(value, str | int)
                and name not in _BROKER_HEADERS
                and not name.lower().startswith(_MESH_HEADER_PREFIXES)
                # The publish carries the intake delivery's own trace context, if any: never
                # the outsider's (tracing.door).
                and name.lower() not in tracing.TRACE_HEADERS
            }
            headers[topology.CONVERSATION_HEADER] = key_of(message)
            headers[topology.COMMAND_HEADER] = command
            if message.user_id:
                headers[topology.USER_HEADER] = message.user_id
            await self.bus.publish(
                topology.shard_exchange(self.name),
                command,
                message.body,
                message_id=message.message_id or "",
                headers=headers,
                reply_to=message.reply_to,
                correlation_id=message.correlation_id,
            )

        return forward

    # --- lifecycle ---------------------------------------------------------------------

    async def start(self, *, health: bool = True) -> None:
        await self.store.ping()
        await self.store.ensure_indexes()
        await self.retention.ensure_indexes()
        await self.poster.head_hints.load(self.store)
        await self.bus.connect()
        if health:
            port = self.settings.metrics_port_for(self.name)
            self._health = HealthServer(port, self.problems, host=self.settings.metrics_host)
            await self._health.start()
        self._started = True
        self._outbox_sweep = self._launch(
            "outbox sweep",
            lambda: self.poster.run_outbox_sweep(self.settings.outbox_grace_seconds, self.stopping),
        )
        prefetch = self.settings.prefetch
        if self._event_handlers or self._commands:
            await check_shard_count(self.bus, self.store, self.name, self.settings.shards)
            queues = await self.bus.declare_shards(self.name, self._interests, self.settings.shards)
            self.ownership = Ownership(
                self.name,
                queues,
                bus=self.bus,
                replicas=self.store.db[REPLICAS],
                consumer=self._shard_consumer,
                prefetch=prefetch,
                lock=self._consumption,
                replica=self.settings.replica,
                metrics_port=self._health.port if self._health is not None else None,
            )
        if self._intakes:
            # One intake queue (one active consumer: commands keep their order) for every
            # command; each is routed by the key its own command names.
            routes = {binding: route for _, binding, route in self._intakes}
            queue = await self.bus.declare_intake(
                self.name, [(exchange, binding) for exchange, binding, _ in self._intakes]
            )

            first = self._intakes[0][2]

            def route_of(message: AbstractIncomingMessage) -> Route:
                # A letter replayed into the queue by name comes with the queue as its key.
                return routes.get(message.routing_key or "", first)

            def key_of(message: AbstractIncomingMessage) -> str:
                return route_of(message).key_of(message)

            async def route(message: AbstractIncomingMessage) -> None:
                await route_of(message).handle(message)

            users = DoorUsers.of(self.settings)

            def outside(message: AbstractIncomingMessage) -> bool:
                # Only the user_id RabbitMQ verified tells the mesh's own publishers.
                return not (message.user_id and users.is_mesh(message.user_id))

            on_message = self.dispatcher.on_message(Route(queue, key_of, route, outside=outside))
            await self.bus.consume(queue, on_message, prefetch=prefetch)
        if self.ownership is not None:
            await self.ownership.start()
        self._consuming = True
        for name, work in self._work.items():
            self._tasks[name] = self._launch(name, work)
        owned = self.ownership.shards() if self.ownership is not None else []
        log.info(
            "%s consuming %d of its %d shards %s",
            self.name,
            len(owned),
            self.settings.shards,
            owned,
        )

    def _launch(self, name: str, work: Work) -> asyncio.Task[None]:
        async def run() -> None:
            await work()

        def ended(task: asyncio.Task[None]) -> None:
            if task.cancelled() or task.exception() is None:
                return
            error = task.exception()
            log.error("%s stopped", name, exc_info=error)
            self._crashed[name] = f"{name} stopped: {error!r}"[:300]

        task = asyncio.create_task(run(), name=f"{self.name}: {name}")
        task.add_done_callback(ended)
        return task

    def _shard_consumer(self, queue: str, gate: Gate) -> OnMessage:
        for changed in self._handovers:  # a shard gained (Ownership subscribes with this)
            changed()
        peek = self._peek if self._arrivals else None
        return self.dispatcher.on_message(
            Route(queue, self.lane_key, self._handle_event, gate, peek)
        )

    def _peek(self, key: str, message: AbstractIncomingMessage) -> None:
        if not self.dispatcher.lanes.busy(key):
            return  # nothing runs for it: its own turn comes at once
        for look in self._arrivals:
            look(key, message)

    async def stop(self) -> None:
        """Stop taking deliveries, finish the in-flight ones, then close channels (not cancel)."""
        self.stopping.set()
        self._consuming = False
        for task in self._tasks.values():
            task.cancel()
        # Awaited (not merely cancelled): nothing of theirs runs once the connections close.
        await asyncio.gather(*self._tasks.values(), return_exceptions=True)
        if self.ownership is not None:
            # Out of the live set first: the others subscribe to our shards while we drain,
            # and become their active consumers as our channels close.
            await self.ownership.withdraw()
        await self.dispatcher.drain()
        if self._outbox_sweep is not None:
            # Its round may be publishing (another writer's leftovers): let it end while the
            # broker connection is still open, within reason; what it leaves, others finish.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._outbox_sweep, timeout=OUTBOX_SWEEP_STOP_SECONDS)
        await self.bus.close()
        if self._health is not None:
            await self._health.close()
        await self.store.close()
        log.info("%s stopped", self.name)

    async def run(self) -> None:
        """Start, serve until SIGTERM or SIGINT, then stop cleanly."""
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, self.stopping.set)
        await self.start()
        await self.stopping.wait()
        log.info("%s stopping", self.name)
        await self.stop()

    async def problems(self) -> list[str]:
        """Why this process is not fully serving (empty when healthy): ``/healthz`` says these."""
        if not self._consuming:
            return ["not consuming yet" if not self.stopping.is_set() else "stopping"]
        problems = [*self._crashed.values(), *self.bus.problems()]
        try:
            async with asyncio.timeout(2):
                await self.store.ping()
        except Exception as error:
            problems.append(f"store unreachable: {error!r}"[:300])
        return problems

    async def _watch_consumers(self) -> None:
        """Re-consume any queue whose consumer is gone while the connection is up.

        aio-pika's robust channel consumes again by itself after a reconnect, and after a
        broker-side cancel of a queue declared on it (it probes the queue and retries until the
        queue is back); this is the safety net for whatever it misses (a queue left without our
        consumer for two checks in a row is subscribed again on a fresh channel).
        """
        suspects: set[str] = set()
        while not self.stopping.is_set():
            await asyncio.sleep(CONSUMER_CHECK_SECONDS)
            if not self.bus.is_connected:  # aio-pika restores everything when it is back
                suspects.clear()
                continue
            for subscription in list(self.bus.subscriptions):
                problem = subscription.problem()
                if problem is None:
                    suspects.discard(subscription.queue_name)
                elif subscription.queue_name not in suspects:
                    suspects.add(subscription.queue_name)
                else:
                    async with self._consumption:
                        if subscription not in self.bus.subscriptions:
                            continue  # handed over meanwhile
                        log.warning("consuming %s again (%s)", subscription.queue_name, problem)
                        try:
                            await self.bus.resubscribe(subscription)
                            for changed in self._handovers:
                                changed()
                            suspects.discard(subscription.queue_name)
                        except Exception as error:
                            log.warning(
                                "could not consume %s yet: %r", subscription.queue_name, error
                            )

    # --- delivery ----------------------------------------------------------------------

    async def _handle_event(self, message: AbstractIncomingMessage) -> None:
        command = (message.headers or {}).get(topology.COMMAND_HEADER)
        if command is not None:
            handle = self._commands.get(str(command))
            if handle is None:
                raise Malformed(f"this service handles no command {command!r}")
            await handle(message)
            return
        envelope = parse_envelope(message)
        _DELIVERY_HEADERS.set(message.headers or {})
        handler = self._event_handlers.get(envelope.type)
        if handler is None:
            return  # routed here for a handler this process does not have: nothing to do
        try:
            payload = envelope.parse()
        except (ValidationError, ValueError) as error:
            detail = (
                describe_validation_error(error)
                if isinstance(error, ValidationError)
                else str(error)
            )
            raise Malformed(f"{envelope.type} payload: {detail}") from error
        if isinstance(payload, MessagePosted):
            # What this process learns of a conversation's head saves it a lookup when it writes.
            self.store.observe_seq(payload.conversation_id, payload.seq)
            # Where its writer writes next, or (an agent's forum line) the monologue it came
            # from, whose head only the mesh may learn: sealed in a header.
            meta = payload.message.meta
            if meta.source_conversation_id and meta.source_seq:
                self.store.observe_seq(meta.source_conversation_id, meta.source_seq)
            hint = (message.headers or {}).get(topology.HEAD_HEADER)
            if hint is not None and (head := self.poster.head_hints.open(payload.message_id, hint)):
                self.store.observe_seq(*head)
            if tracing.enabled():
                tracing.annotate(
                    {
                        tracing.CONVERSATION_ID: payload.conversation_id,
                        tracing.MESSAGE_ID: payload.message_id,
                    }
                )
        lag = (utcnow() - envelope.occurred_at).total_seconds()
        EVENT_LAG_SECONDS.labels(self.name, event_type_of(message)).observe(
            max(lag, 0.0), tracing.exemplar()
        )
        await handler(payload)


def loop_factory(kind: str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """The event loop a service runs on: uvloop (the default) does the same store and bus work
    for less CPU than the standard library's (``asyncio``), in sockets and callbacks (``make
    bench`` shows the CPU per turn of each service)."""
    if kind == "uvloop":
        import uvloop

        return uvloop.new_event_loop
    return None


def run_service(name: str, register: Callable[[Service], None]) -> None:
    """Entry point of ``python -m services.<name>``."""
    # Before anything is read: the stdio MCP servers it starts must not read its secrets.
    make_undumpable()
    settings = Settings()
    configure_logging(name, settings.log_format, settings.log_level)
    metrics.initialize(name, settings.prices)
    # Off unless OTEL_EXPORTER_OTLP_ENDPOINT is set (yoke.core.tracing).
    if tracing.configure(name, content=settings.trace_content):
        log.info("%s sends traces to %s", name, tracing.endpoint())

    async def main() -> None:
        service = Service(name, settings)
        register(service)
        # What is loaded by now (the modules, their models and schemas) lives as long as the
        # process: left out of every collection, so neither the collector's rounds nor the
        # last one at exit (seconds, on a loaded machine, once the MCP client is imported)
        # walk it again.
        gc.freeze()
        await service.run()

    try:
        with (
            refused_as_misconfigured(),  # a certificate that does not verify never will
            asyncio.Runner(loop_factory=loop_factory(settings.event_loop)) as runner,
        ):
            runner.run(main())
    except Misconfigured as error:
        log.error("%s cannot start: %s", name, error)
        sys.exit(EXIT_MISCONFIGURED)
    finally:
        tracing.shutdown()  # its last spans sent, within a bound


__all__ = ["Service", "delivery_headers", "parse_envelope", "run_service"]

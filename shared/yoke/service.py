"""A service process: wiring of store, bus, handlers, health, sweeper and clean shutdown.

Services (``services/<name>``) only register handlers; everything operational lives here.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable
from typing import TypeVar

from aio_pika.abc import AbstractChannel, AbstractIncomingMessage
from pydantic import ValidationError

from yoke import topology
from yoke.bus import Bus
from yoke.consumer import Dispatcher, Malformed, Route, event_type_of, key_from_header
from yoke.health import HealthServer
from yoke.logs import configure_logging
from yoke.metrics import EVENT_LAG_SECONDS
from yoke.models import Envelope, EventPayload, utcnow
from yoke.posting import Poster
from yoke.settings import Settings
from yoke.store import Store

log = logging.getLogger(__name__)

P = TypeVar("P", bound=EventPayload)
EventHandler = Callable[[EventPayload], Awaitable[None]]


def parse_envelope(message: AbstractIncomingMessage) -> Envelope:
    """Decode an event delivery; :class:`Malformed` names what is wrong with it."""
    try:
        return Envelope.model_validate_json(message.body)
    except ValidationError as error:
        raise Malformed(f"not an event envelope: {describe_validation_error(error)}") from error


def describe_validation_error(error: ValidationError) -> str:
    """Names each failing field, e.g. ``author.externalId: Field required``."""
    problems = []
    for item in error.errors()[:5]:
        where = ".".join(str(part) for part in item["loc"]) or "body"
        problems.append(f"{where}: {item['msg']}")
    return "; ".join(problems)


class Service:
    """One service process. Register handlers, then ``await service.run()``."""

    def __init__(self, name: str, settings: Settings | None = None) -> None:
        self.name = name
        self.settings = settings or Settings()
        self.store = Store(
            self.settings.mongodb_url, app_name=name, pool_size=self.settings.mongodb_pool_size
        )
        self.bus = Bus(self.settings.amqp_url, name=name)
        self.poster = Poster(self.store, self.bus, name)
        self.dispatcher = Dispatcher(
            name,
            self.bus,
            attempts=self.settings.handler_attempts,
            backoff=self.settings.retry_backoff_seconds,
        )
        self.stopping = asyncio.Event()
        self._event_handlers: dict[str, EventHandler] = {}
        # Which lane a shard delivery runs in: its conversation, unless a service says otherwise.
        self.lane_key: Callable[[AbstractIncomingMessage], str] = key_from_header
        self._intakes: list[tuple[str, str, Route]] = []
        self._channels: list[AbstractChannel] = []
        self._consuming = False
        self._health: HealthServer | None = None
        self._sweeper: asyncio.Task[None] | None = None

    # --- registration ------------------------------------------------------------------

    def on_event(self, event_type: type[P], handler: Callable[[P], Awaitable[None]]) -> None:
        """Handle ``event_type`` deliveries from this service's shard queues."""

        async def typed(payload: EventPayload) -> None:
            assert isinstance(payload, event_type)
            await handler(payload)

        self._event_handlers[event_type.TYPE] = typed

    def on_intake(
        self,
        exchange: str,
        binding: str,
        key_of: Callable[[AbstractIncomingMessage], str],
        handle: Callable[[AbstractIncomingMessage], Awaitable[None]],
    ) -> None:
        """Consume a single-active-consumer queue whose deliveries carry their key inside."""
        self._intakes.append((exchange, binding, Route("", key_of, handle)))

    # --- lifecycle ---------------------------------------------------------------------

    async def start(self, *, health: bool = True) -> None:
        await self.store.ping()
        await self.store.ensure_indexes()
        await self.bus.connect()
        if health:
            port = self.settings.metrics_port_for(self.name)
            self._health = HealthServer(port, self.healthy)
            await self._health.start()
        self._sweeper = asyncio.create_task(
            self.poster.run_sweeper(self.settings.outbox_grace_seconds, self.stopping)
        )
        prefetch = self.settings.prefetch
        if self._event_handlers:
            bindings = [f"{event_type}.#" for event_type in self._event_handlers]
            queues = await self.bus.declare_shards(self.name, bindings, self.settings.shards)
            for queue in queues:
                route = Route(queue, self.lane_key, self._handle_event)
                on_message = self.dispatcher.on_message(route)
                self._channels.append(await self.bus.consume(queue, on_message, prefetch=prefetch))
        for exchange, binding, route in self._intakes:
            queue = await self.bus.declare_intake(self.name, exchange, binding)
            on_message = self.dispatcher.on_message(Route(queue, route.key_of, route.handle))
            self._channels.append(await self.bus.consume(queue, on_message, prefetch=prefetch))
        self._consuming = True
        log.info("%s consuming (%d shards)", self.name, self.settings.shards)

    async def stop(self) -> None:
        """Stop taking deliveries, finish the in-flight ones, then close channels (not cancel)."""
        self.stopping.set()
        self._consuming = False
        await self.dispatcher.drain()
        await self.bus.close()
        if self._sweeper is not None:
            await self._sweeper
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

    async def healthy(self) -> bool:
        if not (self._consuming and self.bus.is_connected):
            return False
        if any(channel.is_closed for channel in self._channels):
            return False
        try:
            async with asyncio.timeout(2):
                await self.store.ping()
        except Exception:
            return False
        return True

    # --- delivery ----------------------------------------------------------------------

    async def _handle_event(self, message: AbstractIncomingMessage) -> None:
        envelope = parse_envelope(message)
        handler = self._event_handlers.get(envelope.type)
        if handler is None:
            return  # bound by a wider pattern than this process handles: nothing to do
        try:
            payload = envelope.parse()
        except (ValidationError, ValueError) as error:
            detail = (
                describe_validation_error(error)
                if isinstance(error, ValidationError)
                else str(error)
            )
            raise Malformed(f"{envelope.type} payload: {detail}") from error
        lag = (utcnow() - envelope.occurred_at).total_seconds()
        EVENT_LAG_SECONDS.labels(self.name, event_type_of(message)).observe(max(lag, 0.0))
        await handler(payload)


def run_service(name: str, register: Callable[[Service], None]) -> None:
    """Entry point of ``python -m services.<name>``."""
    settings = Settings()
    configure_logging(name, settings.log_format, settings.log_level)

    async def main() -> None:
        service = Service(name, settings)
        register(service)
        await service.run()

    asyncio.run(main())


__all__ = ["Malformed", "Service", "parse_envelope", "run_service", "topology"]

"""From a delivery to a handler: lanes, bounded retries, dead letters, acks.

docs/architecture.md, invariants 3 and 5: deliveries run serially per conversation key and
concurrently across keys; a transient failure (see :mod:`yoke.core.errors`) is waited out with the
delivery held; a handler that keeps failing for good is dead-lettered with its error after a bounded
number of attempts and its conversation goes on; malformed input is dead-lettered at once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from aio_pika.abc import AbstractIncomingMessage

from yoke.bus import topology
from yoke.bus._lanes import Lanes
from yoke.bus.broker import Bus
from yoke.core import tracing
from yoke.core.errors import Permanent, RetryPolicy, SetAside, Stopping
from yoke.core.metrics import (
    DEAD_LETTERS,
    EVENTS_HANDLED,
    HANDLING_SECONDS,
    IN_DELIVERY,
    LANES_ACTIVE,
)

log = logging.getLogger(__name__)


class Malformed(Permanent):
    """The delivery can never be handled (bad JSON, wrong schema, no key): dead-letter it."""


class Gate:
    """One owned shard's door into the lanes, and a count of its jobs running now.

    Only running jobs are counted: one queued behind them starts nothing once the gate is
    closed, and a draining process drops the jobs its lanes have not started (their
    deliveries return unacked), which, counted, would hold the shard's hand-over up for ever.
    """

    def __init__(self) -> None:
        self.open = True
        # Set when the shard is handed over or the process stops: retries give up, unacked.
        self.stopping = asyncio.Event()
        self.held = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def enter(self) -> None:
        self.held += 1
        self._idle.clear()

    def leave(self) -> None:
        self.held -= 1
        if self.held <= 0:
            self.held = 0
            self._idle.set()

    async def idle(self) -> None:
        await self._idle.wait()


@dataclass(frozen=True)
class Route:
    """How to key, label and handle the deliveries of one queue (a shard's: behind its gate)."""

    queue: str
    key_of: Callable[[AbstractIncomingMessage], str]
    handle: Callable[[AbstractIncomingMessage], Awaitable[None]]
    gate: Gate | None = None
    # Shown each delivery with its key as it arrives, before it waits in its lane (never fails
    # it: an error is logged): see Service.on_arrival.
    peek: Callable[[str, AbstractIncomingMessage], None] | None = None
    # Whether a delivery was published by an outsider (a bridge, a tool worker): the door's
    # delivery then starts a trace of the mesh's own, its traceparent only a link.
    outside: Callable[[AbstractIncomingMessage], bool] | None = None


def key_from_header(message: AbstractIncomingMessage) -> str:
    key = (message.headers or {}).get(topology.CONVERSATION_HEADER)
    if not isinstance(key, str) or not key:
        raise Malformed(f"no {topology.CONVERSATION_HEADER} header naming the conversation")
    return key


def event_type_of(message: AbstractIncomingMessage) -> str:
    """The event type from the routing key (``<type>.<id>``), for metric labels."""
    routing_key = message.routing_key or ""
    head, _, _ = routing_key.rpartition(".")
    return head or routing_key or "unknown"


class Dispatcher:
    """Feeds one process's deliveries into per-conversation lanes, under one retry policy.

    Transient failures are waited out (the delivery stays unacked and its lane waits); a
    permanent one is retried ``policy.attempts`` times, then dead-lettered with its reason.
    """

    def __init__(
        self, service: str, bus: Bus, *, policy: RetryPolicy, stopping: asyncio.Event | None = None
    ) -> None:
        self.service = service
        self.bus = bus
        self.policy = policy
        self.stopping = stopping or asyncio.Event()
        self.lanes = Lanes()

    def on_message(self, route: Route) -> Callable[[AbstractIncomingMessage], Awaitable[None]]:
        gate = route.gate

        async def deliver(message: AbstractIncomingMessage) -> None:
            if gate is not None and not gate.open:
                return  # its shard is being handed over: left unacked, returned in order
            try:
                key = route.key_of(message)
            except Malformed as error:
                await self._dead_letter(message, "malformed", str(error), attempts=1)
                return
            if route.peek is not None:
                try:
                    route.peek(key, message)
                except Exception:
                    log.exception("looking at an arriving delivery failed; it is handled anyway")
            if gate is None:
                # While draining, a delivery is left unacked: the broker returns it, in order,
                # to whoever consumes the shard next.
                self.lanes.submit(key, lambda: self._process(route, key, message))
            else:
                self.lanes.submit(key, lambda: self._gated(route, gate, key, message))
            LANES_ACTIVE.labels(self.service).set(self.lanes.active)

        return deliver

    async def _gated(
        self, route: Route, gate: Gate, key: str, message: AbstractIncomingMessage
    ) -> None:
        """A shard's delivery: not started once its shard is handed over (left unacked, so
        what is acked of each conversation stays a prefix of its lines)."""
        if not gate.open:
            return
        gate.enter()
        try:
            await self._process(route, key, message, gate.stopping)
        finally:
            gate.leave()

    async def _process(
        self,
        route: Route,
        key: str,
        message: AbstractIncomingMessage,
        stopping: asyncio.Event | None = None,
    ) -> None:
        if not tracing.enabled():
            await self._process_traced(route, key, message, stopping)
            return
        name = f"process {delivery_name(message)}"
        attributes = delivery_attributes(route, key, message)
        headers = message.headers or {}
        # The delivery continues the trace of the mesh's process that published it (its
        # traceparent header); an outsider's is only a link (tracing.door).
        if route.outside is not None and route.outside(message):
            traced = tracing.door(name, kind="consumer", caller=headers, attributes=attributes)
        else:
            traced = tracing.span(name, kind="consumer", parent=headers, attributes=attributes)
        with traced:
            await self._process_traced(route, key, message, stopping)

    async def _process_traced(
        self,
        route: Route,
        key: str,
        message: AbstractIncomingMessage,
        stopping: asyncio.Event | None = None,
    ) -> None:
        IN_DELIVERY.set(True)
        event_type = event_type_of(message)
        previous = _broker_attempts(message)
        extra = {"conversationId": key, "messageId": message.message_id}
        attempts = 0

        async def attempt() -> None:
            nonlocal attempts
            attempts += 1
            started = time.perf_counter()
            try:
                await route.handle(message)
            finally:
                HANDLING_SECONDS.labels(self.service, event_type).observe(
                    time.perf_counter() - started, tracing.exemplar()
                )

        def retried(error: BaseException, transient: bool) -> None:
            EVENTS_HANDLED.labels(self.service, event_type, "retried").inc()

        try:
            await self.policy.run(
                attempt,
                stopping=stopping or self.stopping,
                describe="handler",
                extra=extra,
                on_retry=retried,
                give_up_at_once=(Malformed, SetAside),
            )
        except Stopping:
            return  # left unacked: the next consumer of the queue gets it
        except Malformed as error:
            log.warning("dead-lettering malformed delivery: %s", error, extra=extra)
            if await self._dead_letter_patiently(
                message, "malformed", str(error), previous + attempts, stopping, extra
            ):
                EVENTS_HANDLED.labels(self.service, event_type, "dead_lettered").inc()
            return
        except Exception as error:
            reason = str(error) if isinstance(error, SetAside) else repr(error)
            log.error(
                "handler failed for good after %d attempts, dead-lettering: %s",
                attempts,
                reason,
                extra=extra,
                exc_info=not isinstance(error, SetAside),
            )
            if await self._dead_letter_patiently(
                message, "failed", reason, previous + attempts, stopping, extra
            ):
                EVENTS_HANDLED.labels(self.service, event_type, "dead_lettered").inc()
            return
        EVENTS_HANDLED.labels(self.service, event_type, "ok").inc()
        await _ack(message)

    async def _dead_letter_patiently(
        self,
        message: AbstractIncomingMessage,
        reason: str,
        error: str,
        attempts: int,
        stopping: asyncio.Event | None,
        extra: dict[str, str | None],
    ) -> bool:
        """Dead-letter the delivery, waiting out a broker outage in its lane (so nothing of its
        conversation overtakes it); ``False`` when stopping first (it stays unacked)."""
        try:
            await self.policy.run(
                lambda: self._dead_letter(message, reason, error, attempts),
                stopping=stopping or self.stopping,
                describe="dead-lettering",
                extra=extra,
            )
        except Stopping:
            return False
        return True

    async def _dead_letter(
        self, message: AbstractIncomingMessage, reason: str, error: str, attempts: int
    ) -> None:
        """Publish the delivery to the dead-letter exchange with why, then ack the original.

        The broker's own dead-lettering (delivery limit) cannot say why; this does.
        """
        headers: dict[str, str | int] = {
            topology.DEAD_SERVICE_HEADER: self.service,
            topology.DEAD_ERROR_HEADER: error[:2000],
            topology.DEAD_ATTEMPTS_HEADER: attempts,
            topology.DEAD_EXCHANGE_HEADER: message.exchange or "",
            topology.DEAD_ROUTING_KEY_HEADER: message.routing_key or "",
        }
        for name, value in (message.headers or {}).items():
            if isinstance(value, str | int) and name not in headers:
                headers[name] = value
        await self.bus.publish(
            topology.DEAD_LETTER_EXCHANGE,
            message.routing_key or "",
            message.body,
            message_id=message.message_id or "",
            headers=headers,
            reply_to=message.reply_to,
            correlation_id=message.correlation_id,
        )
        DEAD_LETTERS.labels(self.service, reason).inc()
        await _ack(message)

    async def drain(self) -> None:
        await self.lanes.drain()


def delivery_name(message: AbstractIncomingMessage) -> str:
    """What a delivery is, for its span's name: the command it carries, else its event type."""
    command = (message.headers or {}).get(topology.COMMAND_HEADER)
    if isinstance(command, str) and command:
        return command
    if message.exchange == topology.COMMANDS_EXCHANGE and message.routing_key:
        return message.routing_key  # on the intake: commands' keys carry no id
    return event_type_of(message)


def delivery_attributes(
    route: Route, key: str, message: AbstractIncomingMessage
) -> dict[str, str | int]:
    attributes: dict[str, str | int] = {
        "messaging.system": "rabbitmq",
        "messaging.operation.type": "process",
        "messaging.destination.name": route.queue,
        "messaging.rabbitmq.destination.routing_key": message.routing_key or "",
        "messaging.message.id": message.message_id or "",
        tracing.CONVERSATION_ID: key,
    }
    attempts = _broker_attempts(message)
    if attempts or message.redelivered:
        # A redelivery: its trace is the first delivery's (the same headers), told apart here.
        attributes["messaging.rabbitmq.delivery_count"] = attempts or 1
    return attributes


def _broker_attempts(message: AbstractIncomingMessage) -> int:
    """Earlier deliveries of this message (quorum queues count them in x-delivery-count)."""
    count = (message.headers or {}).get("x-delivery-count")
    return count if isinstance(count, int) else 0


async def _ack(message: AbstractIncomingMessage) -> None:
    try:
        await message.ack()
    except Exception as error:
        # The channel it came on is gone (reconnect): the broker redelivers it, and handlers
        # are idempotent (docs/architecture.md, invariant 4).
        log.warning("could not ack delivery %s: %r", message.message_id, error)

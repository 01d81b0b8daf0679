"""One hop of the yoke bus: ``poster.post()`` → shard queue → a real ``Service`` whose handler
writes to MongoDB and posts a reply → ``yoke.events`` → a plain aio-pika receiver.

Run as ``python -m bench.bus_hop``, this module is the relay service itself (the child).
"""

from __future__ import annotations

import asyncio
import json
import time
from datetime import datetime

import aio_pika
from aio_pika.abc import AbstractIncomingMessage, AbstractRobustConnection

from bench.child import Child, announce_ready, report, run_relay, stop_on_signals
from bench.loop import Arrivals
from bench.sandbox import Sandbox
from bench.stats import Samples
from yoke.bus import topology
from yoke.bus.broker import Bus
from yoke.core.ids import derive_id, new_id
from yoke.core.logs import configure_logging
from yoke.core.models import Envelope, Message, MessageMeta, MessagePosted, TextPart
from yoke.core.settings import Settings
from yoke.runtime.posting import Poster
from yoke.runtime.service import Service
from yoke.store.database import Store

SERVICE = "bench-relay"
OUT_PREFIX = "out-"
REPLY_KEY_PREFIX = topology.routing_key(MessagePosted.TYPE, OUT_PREFIX)

# Stage names, shared by the relay (which measures them) and the report.
DRIVER_POST = "driver post()"
TO_HANDLER = "message created -> relay handler starts"
NOOP_INSERT = "relay handler: no-op insert_one"
REPLY_POST = "relay handler: reply post()"
TO_RECEIVER = "reply occurredAt -> driver receives it"
SKIPPED = "relay deliveries of its own out-* replies"


def line(phase: str, conversation: str, index: int) -> Message:
    return Message(
        id=new_id(),
        conversation_id=conversation,
        author_actor_id="bench-driver",
        parts=[TextPart(text=f"{phase} {index}")],
    )


def typical_event_bytes() -> int:
    """Size of a posted event the bench sends, so the raw side can carry as many bytes."""
    message = line("load", "conv-000", 0).model_copy(update={"seq": 1})
    payload = MessagePosted.of(message)
    return len(Envelope.wrap(new_id(), payload).model_dump_json())


class BusHop:
    """The driver's side: posts with the SDK's ``Poster``, receives replies with aio-pika."""

    label = "bus hop"

    def __init__(self, box: Sandbox, env: dict[str, str]) -> None:
        self.box = box
        self.env = env
        self.samples = Samples()
        self.arrivals = Arrivals()
        self.store = Store(box.mongodb_url, app_name="bench-driver")
        self.bus = Bus(box.amqp_url, name="bench-driver")
        self.poster = Poster(self.store, self.bus, "bench-driver")
        self._receiver: AbstractRobustConnection | None = None
        self._child: Child | None = None
        self._phase = "warmup"

    async def start(self) -> None:
        await self.store.ping()
        await self.store.ensure_indexes()
        await self.bus.connect()
        self._receiver = await aio_pika.connect_robust(
            self.box.amqp_url, client_properties={"connection_name": "bench-receiver"}
        )
        channel = await self._receiver.channel()
        queue = await channel.declare_queue(exclusive=True, auto_delete=True)
        await queue.bind(topology.EVENTS_EXCHANGE, routing_key=f"{MessagePosted.TYPE}.#")
        await queue.consume(self._on_event, no_ack=True)
        self._child = await Child.start("bench.bus_hop", self.env)

    async def stop(self) -> Samples:
        try:
            if self._child is not None:
                relayed = await self._child.stop()
                for phase, named in relayed.series.items():
                    for name, values in named.items():
                        self.samples.series[phase][name].extend(values)
        finally:
            if self._child is not None:
                await self._child.kill()
            if self._receiver is not None:
                await self._receiver.close()
            await self.bus.close()
            await self.store.close()
        return self.samples

    def relay_cpu(self) -> float:
        return self._child.cpu if self._child is not None else float("nan")

    async def send(self, phase: str, conversation: str, index: int) -> asyncio.Future[float]:
        self._phase = phase
        message = line(phase, conversation, index)
        arrival = self.arrivals.expect(message.id)
        started = time.perf_counter()
        await self.poster.post(message)
        self.samples.add(phase, DRIVER_POST, time.perf_counter() - started)
        return arrival

    async def _on_event(self, message: AbstractIncomingMessage) -> None:
        at = time.perf_counter()
        if not (message.routing_key or "").startswith(REPLY_KEY_PREFIX):
            return  # the driver's own lines: the receiver's binding is the whole event type
        envelope = json.loads(message.body)
        self.arrivals.arrived(envelope["payload"]["message"]["meta"]["inReplyTo"], at)
        occurred = datetime.fromisoformat(envelope["occurredAt"]).timestamp()
        self.samples.add(self._phase, TO_RECEIVER, time.time() - occurred)


# --- the relay service (child process) ----------------------------------------------------


async def serve(settings: Settings) -> None:
    """A real ``Service``: shard queues, lanes, the outbox sweep; only health is off."""
    service = Service(SERVICE, settings)
    samples = Samples()
    noop = service.store.db["bench_noop"]

    async def on_posted(event: MessagePosted) -> None:
        phase = event.message.text.partition(" ")[0]
        if event.conversation_id.startswith(OUT_PREFIX):
            samples.add(phase, SKIPPED, 0.0)  # our own reply, back through the shards
            return
        samples.add(phase, TO_HANDLER, time.time() - event.message.created_at.timestamp())
        started = time.perf_counter()
        await noop.insert_one({"messageId": event.message_id, "seq": event.seq})
        written = time.perf_counter()
        await service.poster.post(
            Message(
                id=derive_id("bench-reply", event.message_id),
                conversation_id=OUT_PREFIX + event.conversation_id,
                author_actor_id="bench-relay",
                parts=[TextPart(text=event.message.text)],
                meta=MessageMeta(in_reply_to=event.message_id, causation_id=event.message_id),
            )
        )
        samples.add(phase, NOOP_INSERT, written - started)
        samples.add(phase, REPLY_POST, time.perf_counter() - written)

    service.on_event(MessagePosted, on_posted)
    stop_on_signals(service.stopping)
    await service.start(health=False)
    announce_ready()
    await service.stopping.wait()
    await service.stop()
    report(samples)


def main() -> None:
    settings = Settings()
    configure_logging(SERVICE, settings.log_format, settings.log_level)
    run_relay(SERVICE, lambda: serve(settings))


if __name__ == "__main__":
    main()

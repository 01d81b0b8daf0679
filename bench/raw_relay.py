"""The floor: the same hop in plain aio-pika, with nothing of the SDK.

Publisher (confirms) → one of ``shards`` quorum queues (single active consumer, like the bus's
shard queues) → a relay that publishes each delivery on with a confirm and then acks → a
receiver queue. No store, no lanes, no envelope models. Bodies are padded to the size of a
bus event so both sides carry the same bytes.

Run as ``python -m bench.raw_relay``, this module is the relay itself (the child).
"""

from __future__ import annotations

import asyncio
import json
import os
import time
import zlib

import aio_pika
from aio_pika.abc import AbstractChannel, AbstractIncomingMessage, AbstractRobustConnection

from bench.child import Child, announce_ready, report, run_relay, stop_on_signals
from bench.loop import Arrivals
from bench.sandbox import Sandbox
from bench.stats import Samples
from yoke.bus import topology
from yoke.core.ids import new_id
from yoke.core.logs import configure_logging
from yoke.core.settings import Settings

INPUTS_ENV = "BENCH_RAW_INPUTS"
OUTPUT_ENV = "BENCH_RAW_OUTPUT"
OUTPUT_QUEUE = "bench.raw.out"

DRIVER_PUBLISH = "driver publish+confirm"
RELAY_PUBLISH = "relay publish+confirm"


def input_queue(index: int) -> str:
    return f"bench.raw.in.{index:03d}"


class RawRelay:
    """The driver's side: publishes with confirms, receives the relayed copies."""

    label = "raw relay"

    def __init__(self, box: Sandbox, env: dict[str, str], shards: int, body_bytes: int) -> None:
        self.box = box
        self.inputs = [input_queue(index) for index in range(shards)]
        self.env = {**env, INPUTS_ENV: ",".join(self.inputs), OUTPUT_ENV: OUTPUT_QUEUE}
        self.body_bytes = body_bytes
        self.samples = Samples()
        self.arrivals = Arrivals()
        self._connection: AbstractRobustConnection | None = None
        self._receiver: AbstractRobustConnection | None = None
        self._publisher: AbstractChannel | None = None
        self._child: Child | None = None

    async def start(self) -> None:
        self._connection = await aio_pika.connect_robust(
            self.box.amqp_url, client_properties={"connection_name": "bench-raw-driver"}
        )
        self._publisher = await self._connection.channel(publisher_confirms=True)
        for name in self.inputs:
            await self._publisher.declare_queue(
                name,
                durable=True,
                arguments={"x-queue-type": "quorum", "x-single-active-consumer": True},
            )
        self._receiver = await aio_pika.connect_robust(
            self.box.amqp_url, client_properties={"connection_name": "bench-raw-receiver"}
        )
        channel = await self._receiver.channel()
        queue = await channel.declare_queue(OUTPUT_QUEUE, exclusive=True, auto_delete=True)
        await queue.consume(self._on_delivery, no_ack=True)
        self._child = await Child.start("bench.raw_relay", self.env)

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
            for connection in (self._receiver, self._connection):
                if connection is not None:
                    await connection.close()
        return self.samples

    def relay_cpu(self) -> float:
        return self._child.cpu if self._child is not None else float("nan")

    async def send(self, phase: str, conversation: str, index: int) -> asyncio.Future[float]:
        assert self._publisher is not None
        message_id = new_id()
        document = {"id": message_id, "conversationId": conversation, "text": f"{phase} {index}"}
        padding = max(0, self.body_bytes - len(json.dumps(document)) - len(', "pad": ""'))
        body = json.dumps({**document, "pad": "x" * padding}).encode()
        arrival = self.arrivals.expect(message_id)
        started = time.perf_counter()
        await self._publisher.default_exchange.publish(
            aio_pika.Message(
                body,
                message_id=message_id,
                type=phase,
                headers={topology.CONVERSATION_HEADER: conversation},
                content_type="application/json",
                delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
            ),
            routing_key=self._queue_for(conversation),
            timeout=10,
        )
        self.samples.add(phase, DRIVER_PUBLISH, time.perf_counter() - started)
        return arrival

    def _queue_for(self, conversation: str) -> str:
        """Stable per conversation, as the consistent-hash exchange is for the bus."""
        return self.inputs[zlib.crc32(conversation.encode()) % len(self.inputs)]

    async def _on_delivery(self, message: AbstractIncomingMessage) -> None:
        at = time.perf_counter()
        self.arrivals.arrived(json.loads(message.body)["id"], at)


# --- the relay (child process) ------------------------------------------------------------


async def serve(settings: Settings) -> None:
    """Consume each input queue on its own channel with the services' prefetch; relay, ack."""
    inputs = os.environ[INPUTS_ENV].split(",")
    output = os.environ[OUTPUT_ENV]
    samples = Samples()
    stopping = asyncio.Event()
    stop_on_signals(stopping)
    connection = await aio_pika.connect_robust(
        settings.amqp_url, client_properties={"connection_name": "bench-raw-relay"}
    )
    publisher = await connection.channel(publisher_confirms=True)

    async def relay(message: AbstractIncomingMessage) -> None:
        started = time.perf_counter()
        await publisher.default_exchange.publish(
            aio_pika.Message(
                message.body,
                message_id=message.message_id,
                type=message.type,
                headers=message.headers,
                content_type=message.content_type,
                delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
            ),
            routing_key=output,
            timeout=10,
        )
        samples.add(message.type or "?", RELAY_PUBLISH, time.perf_counter() - started)
        await message.ack()

    for name in inputs:
        channel = await connection.channel()
        await channel.set_qos(prefetch_count=settings.prefetch)
        queue = await channel.get_queue(name, ensure=False)
        await queue.consume(relay)
    announce_ready()
    await stopping.wait()
    await connection.close()
    report(samples)


def main() -> None:
    settings = Settings()
    configure_logging("bench-raw-relay", settings.log_format, settings.log_level)
    run_relay("bench-raw-relay", lambda: serve(settings))


if __name__ == "__main__":
    main()

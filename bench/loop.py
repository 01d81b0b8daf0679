"""The closed loop both sides run: one worker per conversation sends, waits for the relayed
copy, sends the next.

Closed rather than open loop, so latency is a hop's latency at a known number in flight (one
per conversation) instead of a queue that grows with N whenever the driver outpaces the relay;
throughput is then what that concurrency sustains (Little's law).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Protocol

from bench.stats import Samples


class Arrivals:
    """Hands each receipt time to the send awaiting it, matched by id."""

    def __init__(self) -> None:
        self._waiting: dict[str, asyncio.Future[float]] = {}

    def expect(self, key: str) -> asyncio.Future[float]:
        """Register before sending, so a copy that beats the send's return is not missed."""
        future: asyncio.Future[float] = asyncio.get_running_loop().create_future()
        self._waiting[key] = future
        return future

    def arrived(self, key: str, at: float) -> None:
        future = self._waiting.pop(key, None)
        if future is not None and not future.done():
            future.set_result(at)


class Side(Protocol):
    """A relay under test (bus hop or raw relay), from the driver's point of view."""

    label: str

    async def start(self) -> None:
        """Declare what it needs, bind the receiver, start the relay process."""

    async def stop(self) -> Samples:
        """Stop the relay and disconnect; the driver's and the relay's samples, merged."""
        ...

    def relay_cpu(self) -> float:
        """CPU seconds the relay process has used so far."""
        ...

    async def send(self, phase: str, conversation: str, index: int) -> asyncio.Future[float]:
        """Send one event; the future resolves to the ``perf_counter`` of its relayed copy."""
        ...


async def closed_loop(
    side: Side,
    phase: str,
    conversations: list[str],
    total: int,
    *,
    patience: float,
    progress: Callable[[str], None],
) -> tuple[list[float], float]:
    """Send ``total`` events spread evenly over ``conversations``; (latencies, wall seconds)."""
    latencies: list[float] = []
    base, extra = divmod(total, len(conversations))

    async def worker(conversation: str, count: int) -> None:
        for index in range(count):
            started = time.perf_counter()
            arrival = await side.send(phase, conversation, index)
            try:
                async with asyncio.timeout(patience):
                    received = await arrival
            except TimeoutError:
                raise RuntimeError(
                    f"{side.label}: no relayed copy of {phase} event {index} of {conversation}"
                    f" within {patience:.0f}s"
                ) from None
            latencies.append(received - started)

    async def report() -> None:
        while True:
            await asyncio.sleep(2)
            progress(f"{side.label} {phase}: {len(latencies)}/{total}")

    begin = time.perf_counter()
    reporter = asyncio.create_task(report())
    try:
        async with asyncio.TaskGroup() as group:
            for position, conversation in enumerate(conversations):
                count = base + (1 if position < extra else 0)
                if count:
                    group.create_task(worker(conversation, count))
    except ExceptionGroup as failed:
        raise failed.exceptions[0] from None  # workers fail alike; one cause reads better
    finally:
        reporter.cancel()
    return latencies, time.perf_counter() - begin

"""Per-key lanes: work for one key runs serially in arrival order, different keys concurrently.

This is what keeps FIFO per conversation inside a process (docs/architecture.md, invariant 3):
aiormq runs each delivery's callback as its own task, so without lanes two lines of one conversation
would race.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Awaitable, Callable

Job = Callable[[], Awaitable[None]]

log = logging.getLogger(__name__)


class Lanes:
    """Runs submitted jobs serially per key and concurrently across keys."""

    def __init__(self) -> None:
        self._queues: dict[str, deque[Job]] = {}
        self._workers: set[asyncio.Task[None]] = set()
        self._closing = False
        self._idle = asyncio.Event()
        self._idle.set()

    def submit(self, key: str, job: Job) -> bool:
        """Queue ``job`` behind earlier jobs of ``key``; ``False`` once draining has begun."""
        if self._closing:
            return False
        queue = self._queues.get(key)
        if queue is not None:
            queue.append(job)
            return True
        self._queues[key] = deque([job])
        self._idle.clear()
        worker = asyncio.create_task(self._run(key), name=f"lane:{key}")
        self._workers.add(worker)
        worker.add_done_callback(self._workers.discard)
        return True

    async def _run(self, key: str) -> None:
        queue = self._queues[key]
        try:
            while queue and not self._closing:
                job = queue[0]
                try:
                    await job()
                except Exception:
                    # A job handles its own failures (retry, dead letter); one that still
                    # raises is a bug. Say so now, and keep the conversation's later jobs:
                    # dropping them would leave their deliveries unacked on a live channel
                    # while newer ones start a fresh lane ahead of them.
                    log.exception("a job of lane %s failed", key)
                queue.popleft()
        finally:
            del self._queues[key]
            if not self._queues:
                self._idle.set()

    def busy(self, key: str) -> bool:
        """Whether ``key`` has a job running or queued (a new job would wait behind it)."""
        return key in self._queues

    @property
    def active(self) -> int:
        return len(self._queues)

    async def drain(self) -> None:
        """Stop starting new jobs, and wait for the ones already running to finish.

        Jobs queued but not started are dropped: their deliveries stay unacked, and the
        broker gives them back, in order, once the channel closes.
        """
        self._closing = True
        await self._idle.wait()

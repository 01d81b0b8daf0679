"""``yoke up``: the five mesh services and the HTTP gateway as processes, restarting any that dies.

``--replicas processor=3,ingestion=2`` runs several replicas of a service; replica k gets
``YOKE_REPLICA=k`` (so its metrics port is the service's + 10·k) and they share the
service's shards (:mod:`yoke.coordination.ownership`).
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from collections.abc import Collection
from dataclasses import dataclass, field

from yoke.core.errors import EXIT_MISCONFIGURED
from yoke.core.hardening import make_undumpable

# The services that consume shard queues (resharded, scaled, health-checked on metrics ports):
# settings' list, re-exported for those who start the mesh.
from yoke.core.settings import SERVICES as SERVICES

# The HTTP gateway: a door on YOKE_GATEWAY_PORT, with no queues of its own to shard.
GATEWAY = "gateway"
MAX_BACKOFF_SECONDS = 30.0


class ReplicasError(ValueError):
    """``--replicas`` names an unknown service or a count that is not a positive number."""


def parse_replicas(text: str, services: Collection[str] = SERVICES) -> dict[str, int]:
    """``processor=3,ingestion=2`` -> ``{"processor": 3, "ingestion": 2}``."""
    counts: dict[str, int] = {}
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        name, _, count = item.partition("=")
        name = name.strip()
        if name not in services:
            raise ReplicasError(f"unknown service {name!r} (one of {', '.join(services)})")
        try:
            counts[name] = int(count)
        except ValueError:
            raise ReplicasError(f"{item!r}: expected SERVICE=COUNT") from None
        if not 1 <= counts[name] <= 99:
            raise ReplicasError(f"{item!r}: a service runs 1 to 99 replicas")
    return counts


@dataclass
class Child:
    name: str
    replica: int = 0
    process: asyncio.subprocess.Process | None = None
    restarts: int = 0
    started_at: float = field(default_factory=time.monotonic)

    @property
    def label(self) -> str:
        return f"{self.name}#{self.replica}" if self.replica else self.name


def say(text: str) -> None:
    print(f"[yoke up] {text}", flush=True)


async def start(child: Child) -> None:
    child.process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        f"services.{child.name}",
        env={**os.environ, "YOKE_REPLICA": str(child.replica)},
    )
    child.started_at = time.monotonic()
    say(f"started {child.label} (pid {child.process.pid})")


async def watch(child: Child, stopping: asyncio.Event) -> None:
    """Restart the child whenever it dies, backing off while it keeps dying young."""
    backoff = 1.0
    while not stopping.is_set():
        assert child.process is not None
        code = await child.process.wait()
        if stopping.is_set():
            return
        if code == EXIT_MISCONFIGURED:
            say(f"{child.label} cannot run as configured (see its log); not restarting it")
            return
        lived = time.monotonic() - child.started_at
        backoff = 1.0 if lived > 60 else min(backoff * 2, MAX_BACKOFF_SECONDS)
        say(f"{child.label} exited with {code}; restarting in {backoff:.0f}s")
        try:
            await asyncio.wait_for(stopping.wait(), timeout=backoff)
            return
        except TimeoutError:
            pass
        child.restarts += 1
        await start(child)
        if stopping.is_set() and child.process is not None:
            # Told to stop while it was starting: ``run`` stopped only the children it knew.
            child.process.terminate()


async def run(
    names: tuple[str, ...] = (*SERVICES, GATEWAY),
    grace: float = 30.0,
    replicas: dict[str, int] | None = None,
) -> int:
    # Its environment is every service's: none of the programs they start may read it.
    make_undumpable()
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stopping.set)
    children = [
        Child(name, replica) for name in names for replica in range((replicas or {}).get(name, 1))
    ]
    for child in children:
        await start(child)
    watchers = [asyncio.create_task(watch(child, stopping)) for child in children]
    await stopping.wait()
    say("stopping services")
    running = [c.process for c in children if c.process and c.process.returncode is None]
    for process in running:
        process.terminate()
    try:
        await asyncio.wait_for(asyncio.gather(*(p.wait() for p in running)), timeout=grace)
    except TimeoutError:
        for process in running:
            if process.returncode is None:
                process.kill()
    for watcher in watchers:
        watcher.cancel()
    say("stopped")
    return 0

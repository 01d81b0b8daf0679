"""Which of its service's shards a replica consumes, and handing one over without a gap in order.

Replicas of a service share its shards (docs/architecture.md, invariant 3). Each replica registers
itself in MongoDB's ``replicas`` collection (its own document, written only by itself: invariant 8)
and beats every :data:`BEAT_SECONDS`; one silent for :data:`EXPIRES_SECONDS` is taken for gone.
Every replica reads the live set each round and computes the same assignment from it alone
(:func:`assign`: rendezvous hashing with bounded load), so they agree without talking.

A shard a replica gains is consumed at once; single active consumer keeps it idle while the
previous owner still holds the queue. A shard it loses is handed over: its gate
stops letting deliveries into the lanes, what the lanes already hold for it is finished and
acked (work waiting out a failure gives up, unacked), and then its channel is closed (never a
consumer cancel), which returns what was never started to the queue in order and makes the
new owner's consumer the active one.

The ``replicas`` collection has its own lifecycle rather than riding on the outbox's
``writers`` heartbeats: every process that posts is a writer (the CLI, tests, bench), writer
documents are deleted by whoever finishes a dead writer, and a replica must leave the set the
moment it begins to stop, before it has drained.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import socket
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from prometheus_client import Counter, Gauge, Histogram
from pymongo.errors import DuplicateKeyError

from yoke.bus.broker import Bus, OnMessage, Subscription
from yoke.bus.consumer import Gate
from yoke.core.ages import BUCKET_FIELD, hour_bucket
from yoke.core.ids import new_id
from yoke.core.metrics import IN_DELIVERY, LATENCY_BUCKETS, STORE_ORIGIN
from yoke.core.models import as_utc

log = logging.getLogger(__name__)

REPLICAS = "replicas"
# One round (a beat and a read of the live set) this often: a third of the expiry, so two beats
# may be late before a replica is taken for gone, and a join or leave is seen within it; every
# round is an idle process's store operations, so a faster one costs for nothing.
BEAT_SECONDS = 2.0
# A replica silent this long is gone: its shards go to the others (kill -9 to takeover stays
# well under 15 s: this, one round, and a subscribe). One on this machine whose process is gone
# is gone at once (``yoke up`` restarting a killed replica, say).
EXPIRES_SECONDS = 6.0
# Documents of replicas gone this long are deleted by whoever sees them (kill -9 leaves one).
FORGET_SECONDS = 300.0
# What yoke_store_operations calls the store operations of the rounds.
OWNERSHIP_ORIGIN = "ownership"

SHARDS_OWNED = Gauge(
    "yoke_shards_owned", "Shard queues this replica consumes (owns), by service.", ["service"]
)
HANDOVERS = Counter(
    "yoke_shard_handovers",
    "Shards this replica took on (gained) or handed over (released), by service.",
    ["service", "direction"],
)
HANDOVER_SECONDS = Histogram(
    "yoke_shard_handover_seconds",
    "From a lost shard's gate closing to its channel closed (what it held finished).",
    ["service"],
    buckets=LATENCY_BUCKETS,
)


def weight(service: str, shard: int, replica: str) -> int:
    """The rendezvous weight of ``replica`` for ``shard``: the same in every process."""
    digest = hashlib.blake2b(f"{service}\x1f{shard}\x1f{replica}".encode(), digest_size=8)
    return int.from_bytes(digest.digest(), "big")


def assign(service: str, shards: int, replicas: Iterable[str]) -> dict[str, list[int]]:
    """Each replica's shards: rendezvous hashing with bounded load, a function of the set alone.

    Every (shard, replica) pair is taken in descending weight; a shard goes to the first
    replica that still has room: ``shards // n`` each, and ``shards % n`` of them one more
    (so nobody owns more than ``ceil(shards / n)``). Without the bound this is plain
    rendezvous hashing (a change moves only the shards that must move); the bound keeps the
    load even at the cost of an occasional extra move (about one shard per change on average
    at 16 shards: tests/bus/test_ownership.py).
    """
    members = sorted(set(replicas))
    owned: dict[str, list[int]] = {replica: [] for replica in members}
    if not members:
        return owned
    floor, larger = divmod(shards, len(members))
    pairs = sorted(
        (
            (weight(service, shard, replica), shard, replica)
            for shard in range(shards)
            for replica in members
        ),
        reverse=True,
    )
    taken: set[int] = set()
    for _, shard, replica in pairs:
        if shard in taken:
            continue
        load = len(owned[replica])
        if load == floor and larger > 0:
            larger -= 1  # one of the replicas that get one more
        elif load >= floor:
            continue
        taken.add(shard)
        owned[replica].append(shard)
    for shard_list in owned.values():
        shard_list.sort()
    return owned


# Builds a shard's delivery callback: (queue name, its gate) -> on_message.
Consumer = Callable[[str, Gate], OnMessage]


@dataclass
class Held:
    """A shard this replica consumes."""

    shard: int
    gate: Gate
    subscription: Subscription
    since: float = field(default_factory=time.monotonic)


class Ownership:
    """This replica's registration and the shard queues it consumes, kept up to date."""

    def __init__(
        self,
        service: str,
        queues: list[str],
        *,
        bus: Bus,
        replicas: Any,
        consumer: Consumer,
        prefetch: int,
        lock: asyncio.Lock,
        replica: int = 0,
        metrics_port: int | None = None,
    ) -> None:
        self.service = service
        self.queues = queues
        self.bus = bus
        self.replicas = replicas
        self.consumer = consumer
        self.prefetch = prefetch
        # Shared with the consumer watchdog: one of us changes subscriptions at a time.
        self.lock = lock
        self.id = new_id()
        self.replica = replica
        self.metrics_port = metrics_port
        self.started_at = datetime.now(UTC)
        self.boot = boot_id()
        self.held: dict[int, Held] = {}
        self.releasing: dict[int, asyncio.Task[None]] = {}
        self.live: list[str] = []
        self._task: asyncio.Task[None] | None = None
        self._stopping = asyncio.Event()
        for direction in ("gained", "released"):  # at zero: a first hand-over shows as a rate
            HANDOVERS.labels(service, direction)

    # --- registry ------------------------------------------------------------------------

    def document(self) -> dict[str, Any]:
        return {
            "_id": self.id,
            "service": self.service,
            "replica": self.replica,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "boot": self.boot,
            "metricsPort": self.metrics_port,
            "shards": sorted(self.held),
            "shardCount": len(self.queues),
            "startedAt": self.started_at,
            "beat": datetime.now(UTC),
            # A replica gone without a word (its service never run again) ages out with it.
            BUCKET_FIELD: hour_bucket(),
        }

    async def beat(self) -> None:
        """Store this replica's document: alive now, consuming these shards."""
        document = self.document()
        try:
            await self.replicas.replace_one({"_id": self.id}, document, upsert=True)
        except DuplicateKeyError:  # an upsert is no atomic insert on FerretDB: it exists
            await self.replicas.replace_one({"_id": self.id}, document)

    async def live_replicas(self) -> list[str]:
        """Ids of this service's replicas that beat within :data:`EXPIRES_SECONDS` (and us)."""
        now = datetime.now(UTC)
        live = {self.id}
        async for document in self.replicas.find({"service": self.service}):
            silent = now - as_utc(document["beat"])
            if silent < timedelta(seconds=EXPIRES_SECONDS) and not dead_here(document):
                live.add(str(document["_id"]))
            elif silent > timedelta(seconds=FORGET_SECONDS):
                with contextlib.suppress(Exception):
                    await self.replicas.delete_one({"_id": document["_id"]})
        return sorted(live)

    # --- the loop ------------------------------------------------------------------------

    async def start(self) -> None:
        """Register, take this replica's shards, and keep them up to date every round."""
        origin = STORE_ORIGIN.set(OWNERSHIP_ORIGIN)
        try:
            await self.beat()
            await self.round()
        finally:
            STORE_ORIGIN.reset(origin)
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        # Its own task: its store operations are counted as ownership's, never a delivery's.
        STORE_ORIGIN.set(OWNERSHIP_ORIGIN)
        IN_DELIVERY.set(False)
        while not self._stopping.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), timeout=BEAT_SECONDS)
            if self._stopping.is_set():
                return
            try:
                await self.round()
            except Exception as error:
                # The store away: keep consuming what we hold (single active consumer guards).
                log.warning("shard ownership round failed: %r", error)

    async def round(self) -> None:
        """Beat, read the live set, and gain or hand over shards to match the assignment."""
        await self.beat()
        self.live = await self.live_replicas()
        wanted = set(assign(self.service, len(self.queues), self.live)[self.id])
        async with self.lock:
            if self._stopping.is_set():
                return
            for shard in sorted(wanted - set(self.held) - set(self.releasing)):
                await self._gain(shard)
            for shard in sorted(set(self.held) - wanted):
                held = self.held.pop(shard)
                task = asyncio.get_running_loop().create_task(self._release(held))
                self.releasing[shard] = task
        SHARDS_OWNED.labels(self.service).set(len(self.held))

    async def _gain(self, shard: int) -> None:
        queue = self.queues[shard]
        gate = Gate()
        subscription = await self.bus.consume(
            queue, self.consumer(queue, gate), prefetch=self.prefetch
        )
        self.held[shard] = Held(shard, gate, subscription)
        HANDOVERS.labels(self.service, "gained").inc()
        log.info("%s: consuming shard %d (%s)", self.service, shard, queue)

    async def _release(self, held: Held) -> None:
        """Hand a shard over: no new work, finish what the lanes hold, then close its channel."""
        started = time.perf_counter()
        held.gate.open = False
        held.gate.stopping.set()
        try:
            await held.gate.idle()
            async with self.lock:
                await self.bus.unsubscribe(held.subscription)
        finally:
            self.releasing.pop(held.shard, None)
        took = time.perf_counter() - started
        HANDOVER_SECONDS.labels(self.service).observe(took)
        HANDOVERS.labels(self.service, "released").inc()
        log.info(
            "%s: handed shard %d over (%s) in %.3f s",
            self.service,
            held.shard,
            held.subscription.queue_name,
            took,
        )

    async def withdraw(self) -> None:
        """Stopping: leave the live set at once (others take the shards while this drains)."""
        self._stopping.set()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for held in self.held.values():
            held.gate.open = False  # what the lanes hold finishes; nothing more starts
            held.gate.stopping.set()
        for task in list(self.releasing.values()):
            task.cancel()
        with contextlib.suppress(Exception):  # the store away: the others wait out our silence
            await asyncio.wait_for(self.replicas.delete_one({"_id": self.id}), timeout=5)
        SHARDS_OWNED.labels(self.service).set(0)

    def shards(self) -> list[int]:
        return sorted(self.held)


def boot_id() -> str:
    """This kernel's boot id: with the host name, says a replica document is of this machine."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as file:
            return file.read().strip()
    except OSError:
        return ""


def dead_here(document: dict[str, Any]) -> bool:
    """A replica of this machine (same host name and boot id) whose process is gone."""
    boot = boot_id()
    pid = document.get("pid")
    return (
        bool(boot)
        and document.get("boot") == boot
        and document.get("host") == socket.gethostname()
        and isinstance(pid, int)
        and process_gone(pid)
    )


def process_gone(pid: int) -> bool:
    """No process ``pid`` on this machine (a zombie, or a reused pid, counts as present)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False
    return False

"""Whole turns through the mesh, as an outside system sees them: a person's line submitted on
``yoke.commands`` (:class:`yoke.client.Client`) until the agent's answering forum line is seen
on ``yoke.events``.

A receiver queue of the bench's own, bound to every ``conversation.message.posted`` event,
stamps each line of a turn as it goes by (the forum line, its monologue copy, the agent's
answer, the forum reply), so a turn's time splits into the hops that made it.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aio_pika
from aio_pika.abc import AbstractIncomingMessage, AbstractRobustConnection

from bench.stats import percentile
from yoke.bus import topology
from yoke.client import Client
from yoke.core.models import MessagePosted

# Stamps of one turn, keyed by the forum line's id.
START = "start"
ACCEPTED = "accepted"
LINE = "line"
COPY = "copy"
ANSWER = "answer"
REPLY = "reply"

# (name, from stamp, to stamp): where a turn's wall time goes, hop by hop.
STAGES = (
    ("door: submit -> its reply", START, ACCEPTED),
    ("door: submit -> forum line on yoke.events", START, LINE),
    ("door: forum line -> its monologue copy", LINE, COPY),
    ("processor: copy -> agent answer", COPY, ANSWER),
    ("egress: answer -> forum reply", ANSWER, REPLY),
)

PERSON = "bench:person"


class Tracker:
    """Stamps the lines of every turn as their events pass; hands replies to waiting turns."""

    def __init__(self, amqp_url: str) -> None:
        self.amqp_url = amqp_url
        self.forums: set[str] = set()
        self.stamps: dict[str, dict[str, float]] = {}
        self._waiting: dict[str, asyncio.Future[float]] = {}
        self._connection: AbstractRobustConnection | None = None

    async def start(self) -> None:
        self._connection = await aio_pika.connect_robust(
            self.amqp_url, client_properties={"connection_name": "bench-turn-receiver"}
        )
        channel = await self._connection.channel()
        queue = await channel.declare_queue(exclusive=True, auto_delete=True)
        await queue.bind(topology.EVENTS_EXCHANGE, routing_key=f"{MessagePosted.TYPE}.#")
        await queue.consume(self._on_event, no_ack=True)

    async def close(self) -> None:
        if self._connection is not None:
            await self._connection.close()

    def stamp(self, line_id: str, name: str, at: float) -> None:
        self.stamps.setdefault(line_id, {}).setdefault(name, at)  # first sight wins

    def expect(self, line_id: str) -> asyncio.Future[float]:
        """The reply's arrival; already resolved when the reply beat the door's answer."""
        future: asyncio.Future[float] = asyncio.get_running_loop().create_future()
        seen = self.stamps.get(line_id, {}).get(REPLY)
        if seen is not None:
            future.set_result(seen)
        else:
            self._waiting[line_id] = future
        return future

    def forget(self) -> None:
        """Drop the stamps of finished phases (late replies of a cancelled turn included)."""
        self.stamps.clear()

    async def _on_event(self, delivery: AbstractIncomingMessage) -> None:
        at = time.perf_counter()
        message: dict[str, Any] = json.loads(delivery.body)["payload"]["message"]
        meta: dict[str, Any] = message.get("meta") or {}
        in_forum = message.get("conversationId") in self.forums
        if message.get("role") == "agent":
            line_id = meta.get("inReplyTo")
            if not line_id:
                return
            self.stamp(line_id, REPLY if in_forum else ANSWER, at)
            if in_forum:
                future = self._waiting.pop(line_id, None)
                if future is not None and not future.done():
                    future.set_result(at)
        elif message.get("role") == "user":
            if in_forum:
                self.stamp(message["id"], LINE, at)
            elif meta.get("sourceMessageId"):
                self.stamp(meta["sourceMessageId"], COPY, at)


@dataclass
class TurnRun:
    """Turns of one phase: each turn's latency (seconds) and the phase's wall time."""

    label: str
    forums: int
    latencies: list[float] = field(default_factory=list)
    lines: list[str] = field(default_factory=list)
    wall: float = 0.0

    @property
    def turns(self) -> int:
        return len(self.latencies)

    @property
    def rate(self) -> float:
        return self.turns / self.wall if self.wall > 0 else float("nan")

    def ms(self, q: float) -> float:
        return percentile(self.latencies, q) * 1000

    def summary(self) -> dict[str, float | int | str]:
        return {
            "label": self.label,
            "forums": self.forums,
            "turns": self.turns,
            "wallSeconds": round(self.wall, 3),
            "turnsPerSecond": round(self.rate, 2),
            "p50Ms": round(self.ms(0.5), 2),
            "p90Ms": round(self.ms(0.9), 2),
            "p99Ms": round(self.ms(0.99), 2),
            "maxMs": round(self.ms(1.0), 2),
        }


class Turns:
    """Submits lines and waits for the answers: one turn, or closed loops over many forums."""

    def __init__(self, client: Client, tracker: Tracker, patience: float) -> None:
        self.client = client
        self.tracker = tracker
        self.patience = patience
        self._count = 0

    async def turn(self, forum_id: str, *, patience: float | None = None) -> tuple[str, float]:
        """One line in ``forum_id`` until its answer: (the line's id, seconds)."""
        wait = patience or self.patience
        self._count += 1
        started = time.perf_counter()
        reply = await self.client.submit(
            forum_id,
            f"bench line {self._count}",
            external_id=PERSON,
            display_name="person",
            reply_timeout=wait,
        )
        accepted = time.perf_counter()
        if reply.status != "accepted" or not reply.message_id:
            raise RuntimeError(f"the door refused a line in {forum_id}: {reply.error}")
        line_id = reply.message_id
        self.tracker.stamp(line_id, START, started)
        self.tracker.stamp(line_id, ACCEPTED, accepted)
        try:
            async with asyncio.timeout(wait):
                answered = await self.tracker.expect(line_id)
        except TimeoutError:
            raise RuntimeError(
                f"no answer to line {line_id} in forum {forum_id} within {wait:.0f}s"
            ) from None
        return line_id, answered - started

    async def closed_loop(
        self,
        label: str,
        forums: list[str],
        per_forum: int,
        progress: Callable[[str], None],
    ) -> TurnRun:
        """Each forum posts ``per_forum`` lines one after another, all forums at once."""
        run = TurnRun(label=label, forums=len(forums))
        total = per_forum * len(forums)

        async def worker(forum_id: str) -> None:
            for _ in range(per_forum):
                line_id, seconds = await self.turn(forum_id)
                run.lines.append(line_id)
                run.latencies.append(seconds)

        async def report() -> None:
            while True:
                await asyncio.sleep(5)
                progress(f"{label}: {run.turns}/{total} turns")

        begin = time.perf_counter()
        reporter = asyncio.create_task(report())
        try:
            async with asyncio.TaskGroup() as group:
                for forum_id in forums:
                    group.create_task(worker(forum_id))
        except ExceptionGroup as failed:
            raise failed.exceptions[0] from None
        finally:
            reporter.cancel()
        run.wall = time.perf_counter() - begin
        progress(
            f"{label}: {run.turns} turns, {run.rate:.1f} turns/s,"
            f" p50 {run.ms(0.5):.1f} ms, p99 {run.ms(0.99):.1f} ms"
        )
        return run

    def stages(self, run: TurnRun) -> dict[str, dict[str, float]]:
        """p50/p99 in ms of each hop of the run's turns (turns missing a stamp left out)."""
        found: dict[str, dict[str, float]] = {}
        for name, begin, end in STAGES:
            spans = [
                stamps[end] - stamps[begin]
                for stamps in (self.tracker.stamps.get(line, {}) for line in run.lines)
                if begin in stamps and end in stamps
            ]
            found[name] = {
                "p50Ms": round(percentile(spans, 0.5) * 1000, 2),
                "p99Ms": round(percentile(spans, 0.99) * 1000, 2),
                "turns": len(spans),
            }
        return found

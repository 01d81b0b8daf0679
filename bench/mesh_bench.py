"""Whole turns through the real mesh (the five services as processes), phase by phase:
latency one turn at a time, throughput with many forums at once, growth with a long forum,
isolation from a slow model, and the memory of 10,000 joined idle forums.

Every phase returns plain figures (a JSON-ready dict); the report prints and compares them.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench import costs
from bench.cpu import servers_cpu
from bench.history import prefill
from bench.sandbox import Sandbox, queued_messages
from bench.services import ServiceProcess, Services
from bench.turns import Tracker, TurnRun, Turns
from yoke.bus.broker import Bus
from yoke.client import Client
from yoke.runtime.joins import create_agent, create_forum, join_conversation
from yoke.runtime.posting import Poster
from yoke.store.database import Store

Progress = Callable[[str], None]
Figures = dict[str, Any]

DRIVER = "bench driver"
QUIET_WITHIN = 60.0
START_WITHIN = 120.0
# How long replicas may take to agree on who owns which shard (a beat, a round, a subscribe).
OWNERSHIP_WITHIN = 60.0


def rounded(values: dict[str, float], digits: int = 3) -> dict[str, float]:
    return {name: round(value, digits) for name, value in values.items() if not math.isnan(value)}


class MeshBench:
    """The mesh under test and the bench's own clients of it (store, bus, client, receiver)."""

    def __init__(
        self, box: Sandbox, management: str, args: argparse.Namespace, progress: Progress
    ) -> None:
        self.box = box
        self.management = management
        self.args = args
        self.progress = progress
        self.log_dir = Path(tempfile.mkdtemp(prefix="yoke-bench-"))
        self.services = Services(self.env(), self.log_dir)
        self.store = Store(box.mongodb_url, app_name="bench-mesh-driver")
        self.bus = Bus(box.amqp_url, name="bench-mesh-driver")
        self.poster = Poster(self.store, self.bus, "bench")
        self.client = Client(box.amqp_url)
        self.tracker = Tracker(box.amqp_url)
        self.turns = Turns(self.client, self.tracker, args.turn_timeout)
        self.agent_id = ""

    def env(self) -> dict[str, str]:
        return {
            **os.environ,
            "YOKE_AMQP_URL": self.box.amqp_url,
            "YOKE_MONGODB_URL": self.box.mongodb_url,
            "YOKE_SHARDS": str(self.args.mesh_shards),
            "YOKE_LOG_LEVEL": "WARNING",
            "YOKE_LOG_FORMAT": "json",
            # One token posts hundreds of lines a minute here (the gateway and streaming
            # phases): the bench measures speed, not the per-token rate limit (60 a minute).
            "YOKE_TOKEN_LINES_PER_MINUTE": "0",
            # Its stdio MCP server is its own (tests/support/mcp_server.py on this interpreter,
            # which the unprivileged stdio user may not reach, as in a pyenv under /root): run
            # as root unless told otherwise (yoke.tools.stdio_user).
            "YOKE_MCP_STDIO_USER": os.environ.get("YOKE_MCP_STDIO_USER", "root"),
        }

    async def start(self) -> None:
        self.progress(f"mesh: starting the five services (logs in {self.log_dir})")
        await self.services.start(within=120)
        await self.store.ping()
        await self.store.ensure_indexes()
        await self.bus.connect()
        await self.client.__aenter__()
        await self.tracker.start()
        self.agent_id = (await create_agent(self.store, "echo")).id
        self.progress(f"mesh: up (YOKE_SHARDS={self.args.mesh_shards})")

    async def stop(self) -> dict[str, int]:
        for close in (self.tracker.close, self.client.__aexit__, self.bus.close, self.store.close):
            try:
                await close()
            except Exception as error:  # the run's outcome matters more than a close
                self.progress(f"mesh: closing failed: {error!r}")
        codes = await self.services.stop()
        self.progress(f"mesh: stopped (exit codes {codes})")
        return codes

    # --- helpers ----------------------------------------------------------------------

    def cpu(self) -> dict[str, float]:
        """CPU seconds so far: each service, each local server, and this process."""
        return {**self.services.cpu(), **servers_cpu(), DRIVER: time.process_time()}

    async def counts(self) -> Counter[str]:
        """Store operations and deliveries so far, from each service's /metrics."""
        return await costs.read_counts(
            (name, process.port) for name, process in self.services.processes.items()
        )

    def cpu_per_turn(self, before: dict[str, float], turns: int) -> dict[str, float]:
        after = self.cpu()
        return rounded(
            {name: (after[name] - before.get(name, 0.0)) / max(turns, 1) * 1000 for name in after}
        )

    async def join_forums(
        self, count: int, title: str, *, agent_id: str | None = None, track: bool = True
    ) -> tuple[list[str], float]:
        """``count`` new forums, each joined by the agent, concurrently; (ids, seconds)."""
        agent = agent_id or self.agent_id
        gate = asyncio.Semaphore(self.args.join_concurrency)
        forums: list[str] = []

        async def one(index: int) -> None:
            async with gate:
                forum = await create_forum(self.store, f"{title} {index}")
                if track:
                    self.tracker.forums.add(forum.id)
                await join_conversation(self.store, self.poster, agent, forum.id)
                forums.append(forum.id)

        async def report() -> None:
            while True:
                await asyncio.sleep(5)
                self.progress(f"joins ({title}): {len(forums)}/{count}")

        begin = time.perf_counter()
        reporter = asyncio.create_task(report()) if count > 50 else None
        try:
            async with asyncio.TaskGroup() as group:
                for index in range(count):
                    group.create_task(one(index))
        except ExceptionGroup as failed:
            raise failed.exceptions[0] from None
        finally:
            if reporter is not None:
                reporter.cancel()
        return forums, time.perf_counter() - begin

    async def quiet(self, what: str, within: float = QUIET_WITHIN) -> float:
        """Wait until no consumed queue of the vhost holds a message (the mesh caught up)."""
        begin = time.perf_counter()
        deadline = begin + within
        calm = 0
        while calm < 2:
            backlog = await queued_messages(self.management, self.box.amqp_url, self.box.vhost)
            calm = calm + 1 if not backlog else 0
            if time.perf_counter() > deadline:
                self.progress(f"{what}: still queued after {within:.0f}s: {backlog}; going on")
                break
            await asyncio.sleep(0.5)
        return time.perf_counter() - begin

    # --- phases -----------------------------------------------------------------------

    async def latency(self) -> tuple[Figures, TurnRun]:
        """One forum, one turn at a time: a turn's latency and where its time and CPU go."""
        args = self.args
        (forum,), _ = await self.join_forums(1, "latency")
        if args.turn_warmup:
            await self.turns.closed_loop("turn warmup", [forum], args.turn_warmup, self.progress)
        counted = await self.counts()
        before = self.cpu()
        run = await self.turns.closed_loop("turn latency", [forum], args.turns, self.progress)
        cpu = self.cpu_per_turn(before, run.turns)
        await self.quiet("turn latency")  # the last turn's tail deliveries counted too
        figures = {
            **run.summary(),
            "cpuMsPerTurn": cpu,
            "perTurn": costs.per_turn(counted, await self.counts(), run.turns),
            "stages": self.turns.stages(run),
        }
        self.tracker.forget()
        return figures, run

    async def throughput(self) -> Figures:
        """``--forums`` forums, each posting ``--forum-turns`` lines one after another."""
        args = self.args
        self.progress(f"throughput: joining {args.forums} forums")
        forums, _ = await self.join_forums(args.forums, "throughput")
        await self.quiet("throughput joins")
        counted = await self.counts()
        before = self.cpu()
        run = await self.turns.closed_loop(
            f"throughput ({args.forums} forums)", forums, args.forum_turns, self.progress
        )
        cpu = self.cpu_per_turn(before, run.turns)
        await self.quiet("throughput")
        figures = {
            **run.summary(),
            "cpuMsPerTurn": cpu,
            "perTurn": costs.per_turn(counted, await self.counts(), run.turns),
        }
        self.tracker.forget()
        return figures

    async def replicas(self) -> Figures:
        """Throughput (``--forums`` new forums, ``--forum-turns`` each) with one processor, then
        with two sharing its shards (replica 1 started beside replica 0), back to back; how long
        the shards took to split, and to come back to replica 0 when replica 1 stops."""
        args = self.args
        shards = args.mesh_shards
        first = self.services.processes["processor"]
        if await first.shards_owned() is None:
            self.progress("replicas: the processor reports no yoke_shards_owned; skipped")
            return {"skipped": True, "reason": "no shard ownership in this mesh"}
        await self.owned([first], lambda counts: counts == [shards], "one processor")
        one = await self.throughput_run("processor x1")
        begin = time.perf_counter()
        second = ServiceProcess("processor", self.services.env, self.log_dir, replica=1)
        try:
            await second.wait_healthy(START_WITHIN)
            counts = await self.owned(
                [first, second],
                lambda counts: sum(counts) == shards and min(counts) > 0,
                "two processors sharing the shards",
            )
            split = time.perf_counter() - begin
            two = await self.throughput_run("processor x2")
        finally:
            stopping = time.perf_counter()
            code = await asyncio.to_thread(second.stop)
        await self.owned([first], lambda counts: counts == [shards], "replica 0 again")
        back = time.perf_counter() - stopping
        self.progress(
            f"replicas: {one.rate:.1f} turns/s with one processor, {two.rate:.1f} with two"
        )
        return {
            "shards": shards,
            "one": one.summary(),
            "two": two.summary(),
            "ratio": round(two.rate / one.rate, 3) if one.rate else None,
            "shardsOwnedWithTwo": counts,
            "splitSeconds": round(split, 1),
            "backSeconds": round(back, 1),
            "secondExitCode": code,
        }

    async def throughput_run(self, label: str) -> TurnRun:
        forums, _ = await self.join_forums(self.args.forums, label)
        await self.quiet(f"{label} joins")
        run = await self.turns.closed_loop(
            f"{label} ({self.args.forums} forums)", forums, self.args.forum_turns, self.progress
        )
        self.tracker.forget()
        return run

    async def owned(
        self, replicas: list[ServiceProcess], done: Callable[[list[int]], bool], what: str
    ) -> list[int]:
        """Poll each replica's ``yoke_shards_owned`` until ``done`` holds for the counts."""
        deadline = time.perf_counter() + OWNERSHIP_WITHIN
        while True:
            counts = [await replica.shards_owned() or 0 for replica in replicas]
            if done(counts):
                return counts
            if time.perf_counter() > deadline:
                raise RuntimeError(f"replicas: no {what} within {OWNERSHIP_WITHIN:.0f}s: {counts}")
            await asyncio.sleep(0.2)

    async def growth(self) -> Figures:
        """Turn p50 in a fresh forum and in one with ``--growth-lines`` lines of history."""
        args = self.args
        (fresh,), _ = await self.join_forums(1, "growth fresh")
        short = await self.turns.closed_loop(
            "growth (fresh forum)", [fresh], args.growth_turns, self.progress
        )
        forum = (await create_forum(self.store, "growth long")).id
        self.tracker.forums.add(forum)
        self.progress(f"growth: writing {args.growth_lines} lines of history")
        begin = time.perf_counter()
        monologue = await prefill(
            self.store, forum, self.agent_id, args.growth_lines, self.progress
        )
        fill_seconds = time.perf_counter() - begin
        join = await join_conversation(self.store, self.poster, self.agent_id, forum)
        await self.quiet("growth join")
        if join.monologue_id != monologue:
            self.progress("growth: the join made another monologue: only the forum is long")
        long = await self.turns.closed_loop(
            f"growth ({args.growth_lines} lines)", [forum], args.growth_turns, self.progress
        )
        self.tracker.forget()
        ratio = long.ms(0.5) / short.ms(0.5)
        return {
            "fresh": short.summary(),
            "long": long.summary(),
            "historyLines": args.growth_lines,
            "historySeconds": round(fill_seconds, 1),
            "monologuePrefilled": join.monologue_id == monologue,
            "ratio": round(ratio, 3),
        }

    async def isolation(self) -> Figures:
        """p99 of ordinary forums alone, then while one forum's model takes
        ``--slow-seconds`` per step; their ratio."""
        args = self.args
        ordinary, _ = await self.join_forums(args.isolation_forums, "isolation")
        alone = await self.turns.closed_loop(
            "isolation (alone)", ordinary, args.isolation_turns, self.progress
        )
        slow_model = f"fixture-slow-{args.slow_seconds:g}"
        slow_agent = (await create_agent(self.store, "slow", model=slow_model)).id
        (slow_forum,), _ = await self.join_forums(1, "isolation slow", agent_id=slow_agent)
        slow_turns: list[float] = []
        patience = args.slow_seconds * 4 + args.turn_timeout

        async def slow_worker() -> None:
            while True:
                _, seconds = await self.turns.turn(slow_forum, patience=patience)
                slow_turns.append(seconds)

        slow = asyncio.create_task(slow_worker())
        try:
            await asyncio.sleep(0.5)  # its first step is under way before the others start
            beside = await self.turns.closed_loop(
                f"isolation (beside {slow_model})", ordinary, args.isolation_turns, self.progress
            )
        finally:
            slow.cancel()
            (ended,) = await asyncio.gather(slow, return_exceptions=True)
        if isinstance(ended, Exception):
            self.progress(f"isolation: the slow forum's turns failed: {ended}")
        self.tracker.forget()
        return {
            "alone": alone.summary(),
            "besideSlow": beside.summary(),
            "slowModel": slow_model,
            "slowTurnsFinished": len(slow_turns),
            "ratio": round(beside.ms(0.99) / alone.ms(0.99), 3),
        }

    async def scale(self) -> Figures:
        """RSS of each service before and after ``--joins`` joined idle forums."""
        args = self.args
        await self.quiet("before the joins")
        before = self.services.rss()
        self.progress(f"scale: {args.joins} joins, {args.join_concurrency} at a time")
        forums, seconds = await self.join_forums(args.joins, "scale", track=False)
        self.progress(f"scale: {args.joins} joins in {seconds:.1f}s; waiting for the mesh")
        settle = await self.quiet("scale joins", within=max(QUIET_WITHIN, seconds))
        after = self.services.rss()
        probe = forums[0]
        self.tracker.forums.add(probe)
        run = await self.turns.closed_loop(
            "turns after the joins", [probe], args.scale_turns, self.progress
        )
        self.tracker.forget()
        return {
            "joins": args.joins,
            "joinSeconds": round(seconds, 2),
            "joinsPerSecond": round(args.joins / seconds, 1) if seconds > 0 else None,
            "settleSeconds": round(settle, 1),
            "rssMbBefore": rounded(before, 1),
            "rssMbAfter": rounded(after, 1),
            "rssMbAfterTurns": rounded(self.services.rss(), 1),
            "turnsAfter": run.summary(),
        }

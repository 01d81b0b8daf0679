"""One chaos run: agents under steady load while services die and servers go away.

The run gets a vhost and a database of its own, starts the services under the supervisor,
types lines into every forum, injects the faults one after another (each waits until lines
flow again, or gives up and says so), stops typing, lets the mesh drain, and then checks
everything a person or an operator would notice: lines lost, answered twice or out of order,
messages left unpublished, unexpected dead letters, services unhealthy or not consuming.

Two scenarios: ``echo`` (echo agents; every service is killed in turn, the broker restarts,
the store freezes and stops) and ``tools`` (agents whose answers need MCP, worker and gated
calls, tests/chaos/tools.py; processor replicas and the worker are killed, the broker
restarts), which also counts the calls made and ended and the runs at the tools.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from functools import partial
from pathlib import Path
from typing import Literal
from urllib.parse import quote, urlsplit, urlunsplit

import aio_pika
import httpx

from tests.chaos import tools
from tests.chaos.answers import Answers
from tests.chaos.faults import Faults
from tests.chaos.load import Line, Load, named
from tests.chaos.mesh import SupervisedMesh
from tests.chaos.runs import read_runs
from tests.chaos.verdict import Accounting, FaultKind, FaultRecord, Report, account
from tests.support.processes import eventually
from yoke.bus import amqp_nodes, topology
from yoke.bus.broker import Bus
from yoke.bus.dead_letters import list_dead_letters
from yoke.cli.supervisor import SERVICES
from yoke.core.ids import new_id
from yoke.core.models import Message
from yoke.core.settings import Settings
from yoke.runtime.joins import create_agent, create_forum, join_conversation
from yoke.runtime.posting import Poster
from yoke.store.database import Store
from yoke.store.outbox import dead_after


@dataclass(frozen=True)
class Plan:
    forums: int = 10
    line_interval: float = 2.0  # seconds between one forum's lines
    kills_per_service: int = 3
    broker_restarts: int = 1
    store_outage_seconds: float = 30.0
    store_outages: bool = True  # freeze the store once and stop it once
    recovery_timeout: float = 120.0  # per fault; past it the run stops injecting and reports
    drain_timeout: float = 180.0
    settle_seconds: float = 10.0  # quiet time after draining, for late duplicates to show
    final_timeout: float = 60.0  # for health, consumers and the outbox at the end
    keep: bool = False  # keep the vhost and the database for a post-mortem
    scenario: Literal["echo", "tools"] = "echo"
    processor_replicas: int = 1
    # tools: seconds a gated call waits before the harness approves it; rounds per agent (its
    # script's length: a person types no more lines than that).
    approve_after: float = 2.0
    kill_jitter: float = 0.0  # seconds: each kill waits a random time up to this first
    rounds: int = 300


# The tools scenario, as `make chaos CHAOS_ARGS=--tools` runs it.
TOOLS = Plan(
    scenario="tools",
    forums=8,
    line_interval=1.0,
    kills_per_service=3,
    processor_replicas=2,
    store_outages=False,
    kill_jitter=3.0,
)


# About a minute of faults: what `make test` runs.
BOUNDED = Plan(
    forums=4,
    line_interval=1.0,
    kills_per_service=1,
    store_outage_seconds=8.0,
    recovery_timeout=30.0,
    drain_timeout=45.0,
    settle_seconds=3.0,
    final_timeout=30.0,
)

# About a minute or two of faults, with tools: what `make test` runs.
BOUNDED_TOOLS = replace(
    TOOLS,
    forums=4,
    kills_per_service=2,
    recovery_timeout=60.0,
    drain_timeout=60.0,
    settle_seconds=3.0,
    final_timeout=30.0,
    rounds=150,
)


@dataclass(frozen=True)
class Servers:
    amqp_url: str
    mongodb_url: str
    management_url: str

    @property
    def auth(self) -> tuple[str, str]:
        parts = urlsplit(amqp_nodes.node_urls(self.amqp_url)[0])
        return parts.username or "guest", parts.password or "guest"


def with_path(url: str, path: str) -> str:
    """``url`` (or each node URL of a comma-separated list) with ``path`` as its path."""
    return ",".join(
        urlunsplit(urlsplit(node)._replace(path="/" + quote(path, safe="")))
        for node in url.split(",")
    )


Step = tuple[FaultKind, str, Callable[[], Awaitable[None]]]


def schedule(
    plan: Plan,
    mesh: SupervisedMesh,
    faults: Faults,
    worker: Callable[[], Awaitable[None]] | None = None,
) -> list[Step]:
    """Rounds of kills, with the broker and store faults between them. The echo scenario
    kills every service; the tools one every processor replica and the ``worker``."""

    async def kill(name: str) -> None:
        await mesh.kill(name)

    targets: list[tuple[str, Callable[[], Awaitable[None]]]]
    if plan.scenario == "tools":
        targets = [(label, partial(kill, label)) for label in mesh.labels if "processor" in label]
        targets += [("tool-worker", worker)] if worker is not None else []
    else:
        targets = [(name, partial(kill, name)) for name in SERVICES]
    rounds: list[list[Step]] = [
        [("kill", f"kill -9 {name} (round {n + 1})", action) for name, action in targets]
        for n in range(plan.kills_per_service)
    ]
    seconds = plan.store_outage_seconds
    extras: list[Step] = [("broker", faults.broker_label, faults.broker)] * plan.broker_restarts
    if plan.store_outages:
        frozen = f"store frozen {seconds:.0f} s (SIGSTOP)"
        extras += [
            ("store", frozen, partial(faults.freeze_store, seconds)),
            ("store", f"store stopped {seconds:.0f} s", partial(faults.stop_store, seconds)),
        ]
    steps: list[Step] = []
    for index in range(max(len(rounds), len(extras))):
        steps += rounds[index] if index < len(rounds) else []
        steps += [extras[index]] if index < len(extras) else []
    return steps


class Run:
    def __init__(
        self,
        plan: Plan,
        servers: Servers,
        work_dir: Path,
        faults_for: Callable[[str], Faults],
        services_mongodb_url: str | None,
    ) -> None:
        self.plan = plan
        self.servers = servers
        self.work_dir = work_dir
        self.faults_for = faults_for
        tag = uuid.uuid4().hex[:10]
        self.vhost = f"yoke-chaos-{tag}"
        self.database = f"yoke_chaos_{tag}"
        self.vhost_url = with_path(servers.amqp_url, self.vhost)
        self.store = Store(with_path(servers.mongodb_url, self.database), app_name="chaos")
        env = {
            "YOKE_AMQP_URL": self.vhost_url,
            "YOKE_MONGODB_URL": with_path(
                services_mongodb_url or servers.mongodb_url, self.database
            ),
            "YOKE_SHARDS": "2",
            "YOKE_LOG_FORMAT": "json",
        }
        self.tool_side: tools.ToolSide | None = None
        if plan.scenario == "tools":
            env.update(tools.mesh_env(plan.rounds))
            self.tool_side = tools.ToolSide(work_dir, self.vhost_url, servers.management_url, tag)
        replicas = {"processor": plan.processor_replicas}
        self.mesh = SupervisedMesh(env, work_dir / "mesh.log", replicas)
        self.monologues: dict[str, str] = {}  # forum id -> the agent's monologue id
        self.problems: list[str] = []
        self.notes: list[str] = [f"logs: {work_dir}", f"vhost {self.vhost}, db {self.database}"]
        self.records: list[FaultRecord] = []
        self.poison_id = f"chaos-poison-{new_id()}"

    async def run(self) -> Report:
        started = time.monotonic()
        await self._create_vhost()
        try:
            await self.store.ensure_indexes()
            if self.tool_side is not None:
                await self.tool_side.register(self.store)
                self.tool_side.start()
            self.mesh.start()
            bad = await self.mesh.wait_healthy(90)
            if bad:
                self._unhealthy("before any fault", bad)
                return self._report(started, [])
            if self.tool_side is not None:
                missing = await self.tool_side.wait_listed(self.store, 90)
                if missing:
                    self.problems.append("tools never listed: " + ", ".join(missing))
                    return self._report(started, [])
            forum_ids = await self._forums()
            return await self._under_load(started, forum_ids)
        finally:
            code = self.mesh.stop()
            if code not in (0, None):
                self.problems.append(f"yoke up exited with {code} on SIGTERM")
            await self._clean_up()

    async def _under_load(self, started: float, forum_ids: list[str]) -> Report:
        answers = Answers(self.store, forum_ids)
        load = Load(named(self.vhost_url, "chaos-people"), forum_ids, self.plan.line_interval)
        approver: tools.Approver | None = None
        watching = asyncio.Event()
        watcher = asyncio.create_task(answers.run(watching))
        helpers = [watcher]
        if self.tool_side is not None:
            load.answered = answers.answered.__contains__
            load.answer_timeout = self.plan.recovery_timeout
            load.max_lines = self.plan.rounds
            approver = tools.Approver(self.store, self.vhost_url, self.plan.approve_after)
            helpers.append(asyncio.create_task(approver.run(watching)))
        typing = asyncio.create_task(load.run())
        try:
            if await self._wait(
                lambda: (
                    len({line.forum for line in self._answered(load, answers)}) == len(forum_ids)
                ),
                60,
            ):
                await self._inject_poison()
                await self._faults(load, answers)
            else:
                self.problems.append("no answer in every forum within 60 s, before any fault")
            load.stopping.set()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(typing), self.plan.drain_timeout)
            load.giving_up.set()
            await typing
            await self._wait(
                lambda: all(
                    line.message_id in answers.first_seen_by_line()
                    for line in load.lines
                    if line.message_id
                ),
                self.plan.drain_timeout,
            )
            await asyncio.sleep(self.plan.settle_seconds)  # room for late duplicates
        finally:
            load.stopping.set()
            load.giving_up.set()
            watching.set()
            await asyncio.gather(*helpers, typing, return_exceptions=True)
        await self._final_checks()
        self._unexpected_exits()
        forums = {forum_id: await self.store.history(forum_id) for forum_id in forum_ids}
        for record in self.records:
            if record.recovered is None and (late := self._recovered_at(record, load, answers)):
                self.notes.append(
                    f"after '{record.what}' a line typed since was first answered "
                    f"{late - record.ended:.1f} s after it ended"
                )
        if load.errors:
            self.notes.append(f"submit attempts that failed (retried): {load.errors}")
        if answers.poll_errors:
            self.notes.append(f"store polls that failed while watching: {answers.poll_errors}")
        report = self._report(started, forum_ids)
        report.accounting = account(load.lines, forums)
        if self.tool_side is not None and approver is not None:
            report.tools = await self._account_tools(load, forums, approver)
        return report

    async def _account_tools(
        self, load: Load, forums: dict[str, list[Message]], approver: tools.Approver
    ) -> tools.ToolAccounting:
        side = self.tool_side
        assert side is not None
        monologues = {m: await self.store.history(m) for m in self.monologues.values()}
        runs = read_runs(side.mcp_runs) + read_runs(side.worker_runs)
        wall = time.time() - time.monotonic()
        # From the fault until lines flowed again: the mesh's retries come in that time.
        interruptions = [
            tools.Interruption(
                record.started + wall, (record.recovered or record.ended or record.started) + wall
            )
            for record in self.records
            if record.kind == "broker" or "processor" in record.what
        ]
        accounting = tools.account_tools(
            monologues,
            runs,
            side.worker,
            side.killed_workers,
            interruptions,
            load.lines,
            forums,
            await tools.open_calls_left(self.store),
            await tools.stored_ends(self.store, monologues),
        )
        self.notes.append(f"approvals: {dict(approver.replies)} (errors: {dict(approver.errors)})")
        self.notes.extend(side.exits())
        return accounting

    # --- setup ---------------------------------------------------------------------------

    async def _create_vhost(self) -> None:
        async with httpx.AsyncClient(
            base_url=self.servers.management_url, auth=self.servers.auth, timeout=30
        ) as api:
            vhost = quote(self.vhost, safe="")
            (await api.put(f"/api/vhosts/{vhost}")).raise_for_status()
            (
                await api.put(
                    f"/api/permissions/{vhost}/{quote(self.servers.auth[0], safe='')}",
                    json={"configure": ".*", "write": ".*", "read": ".*"},
                )
            ).raise_for_status()

    async def _forums(self) -> list[str]:
        """N forums, each with an agent joined: an echo agent (the default model), or in the
        tools scenario one whose script calls tools for every line."""
        bus = Bus(named(self.vhost_url, "chaos-setup"), name="chaos-setup")
        await bus.connect()
        try:
            poster = Poster(self.store, bus, "chaos")
            forum_ids = []
            for number in range(self.plan.forums):
                forum = await create_forum(self.store, f"chaos forum {number}")
                agent = await create_agent(self.store, f"agent {number}")
                config = None
                if self.tool_side is not None:
                    config = tools.join_config(number, self.plan.rounds, self.tool_side.worker)
                join = await join_conversation(self.store, poster, agent.id, forum.id, config)
                self.monologues[forum.id] = join.monologue_id
                forum_ids.append(forum.id)
            return forum_ids
        finally:
            await bus.close()

    async def _inject_poison(self) -> None:
        """One malformed submit without ``reply_to``: the only dead letter chaos may cause."""
        connection = await amqp_nodes.connect(named(self.vhost_url, "chaos-poison"))
        try:
            channel = await connection.channel(publisher_confirms=True)
            exchange = await channel.get_exchange(topology.COMMANDS_EXCHANGE)
            await exchange.publish(
                aio_pika.Message(b'{"chaos": "poison"}', message_id=self.poison_id),
                routing_key=topology.SUBMIT_COMMAND,
            )
        finally:
            await connection.close()

    # --- faults --------------------------------------------------------------------------

    async def _faults(self, load: Load, answers: Answers) -> None:
        faults = self.faults_for(self.vhost)
        worker = self.tool_side.kill_worker if self.tool_side is not None else None
        for kind, what, action in schedule(self.plan, self.mesh, faults, worker):
            if kind == "kill" and self.plan.kill_jitter:
                # A random moment of the steps in hand, not always as long after the recovery.
                await asyncio.sleep(random.uniform(0, self.plan.kill_jitter))
            record = FaultRecord(kind, what, started=time.monotonic(), ended=0.0)
            self.records.append(record)
            try:
                await action()
            except Exception as error:
                record.ended = time.monotonic()
                self.problems.append(f"could not inject '{what}': {error}")
                return
            record.ended = time.monotonic()

            def flowing(record: FaultRecord = record) -> bool:
                record.recovered = self._recovered_at(record, load, answers)
                return record.recovered is not None

            if not await self._wait(flowing, self.plan.recovery_timeout):
                since = [line for line in load.lines if line.first_try >= record.ended]
                accepted = sum(line.accepted_at is not None for line in since)
                self.problems.append(
                    f"after '{what}': no line typed since was answered within "
                    f"{self.plan.recovery_timeout:.0f} s ({len(since)} typed, {accepted} "
                    "accepted by the door); injected no further faults"
                )
                self._unhealthy(f"after '{what}'", await self.mesh.health(), quiet_ok=True)
                await self._report_consumers(0, f"after '{what}'")
                return
            bad = await self.mesh.wait_healthy(self.plan.recovery_timeout)
            if bad:
                self._unhealthy(f"after '{what}'", bad)
                return

    @staticmethod
    def _recovered_at(record: FaultRecord, load: Load, answers: Answers) -> float | None:
        first = answers.first_seen_by_line()
        times = [
            first[line.message_id]
            for line in load.lines
            if line.message_id in first and line.first_try >= record.ended
        ]
        return min(times) if times else None

    @staticmethod
    def _answered(load: Load, answers: Answers) -> list[Line]:
        first = answers.first_seen_by_line()
        return [line for line in load.lines if line.message_id in first]

    # --- the end -------------------------------------------------------------------------

    async def _final_checks(self) -> None:
        timeout = self.plan.final_timeout
        bad = await self.mesh.wait_healthy(timeout)
        if bad:
            self._unhealthy("at the end", bad)
        await self._report_consumers(timeout, "at the end")
        unpublished: list[str] = []

        async def outbox_empty() -> bool:
            """No writer that stopped (a killed service) is left with writes unfinished."""
            nonlocal unpublished
            try:
                writers = await self.store.db["writers"].find({}).to_list()
            except Exception as error:
                unpublished = [f"could not read the writers: {error}"]
                return False
            now = datetime.now(UTC)
            silent = timedelta(seconds=dead_after(Settings().outbox_grace_seconds) + 5)
            unpublished = [
                f"writer {d['_id']} ({d.get('service')}) silent since {d['beat']}"
                for d in writers
                if "beat" in d and now - d["beat"].replace(tzinfo=UTC) > silent
            ]
            return not unpublished

        if not await self._wait_async(outbox_empty, timeout):
            self.problems.append(
                f"{len(unpublished)} messages still unpublished {timeout:.0f} s after the "
                f"load stopped: " + ", ".join(unpublished[:20])
            )
        try:
            letters = await list_dead_letters(self.vhost_url)
        except Exception as error:
            self.problems.append(f"could not read the dead-letter queue: {error}")
            return
        unexpected = [letter for letter in letters if letter.get("messageId") != self.poison_id]
        for letter in unexpected[:20]:
            self.problems.append(
                f"unexpected dead letter {letter.get('messageId')} from "
                f"{letter.get('service') or 'RabbitMQ itself'}: {letter.get('error')}"
            )
        if len(unexpected) > 20:
            self.problems.append(f"... and {len(unexpected) - 20} more unexpected dead letters")
        poisoned = len(letters) - len(unexpected)
        self.notes.append(f"the injected poison line is {'' if poisoned else 'not '}dead-lettered")

    def _unexpected_exits(self) -> None:
        """Service deaths chaos did not cause (a crash, or a signal from elsewhere)."""
        killed = [record.what.split()[2] for record in self.records if record.kind == "kill"]
        for name, code in self.mesh.exits():
            if code == "-9" and name in killed:
                killed.remove(name)
            else:
                self.notes.append(f"{name} exited with {code} without chaos killing it")

    async def _report_consumers(self, timeout: float, when: str) -> None:
        """Every shard and intake queue must have a consumer (health can say 200 without)."""
        idle: list[str] = []

        async def all_consumed() -> bool:
            nonlocal idle
            try:
                idle = await self._idle_queues()
            except httpx.HTTPError as error:
                idle = [f"(management API: {error})"]
            return not idle

        if not await self._wait_async(all_consumed, timeout):
            self.problems.append(f"queues without a consumer {when}: " + ", ".join(idle))

    async def _idle_queues(self) -> list[str]:
        async with httpx.AsyncClient(
            base_url=self.servers.management_url, auth=self.servers.auth, timeout=10
        ) as api:
            response = await api.get(f"/api/queues/{quote(self.vhost, safe='')}")
            response.raise_for_status()
            return sorted(
                queue["name"]
                for queue in response.json()
                if (".shard." in queue["name"] or queue["name"].endswith(".commands"))
                and not queue.get("consumers")
            )

    def _unhealthy(self, when: str, bad: dict[str, str], *, quiet_ok: bool = False) -> None:
        for name, status in bad.items():
            tail = self.mesh.log_tail(name) if name in SERVICES else ""
            self.problems.append(
                f"{name} unhealthy {when}: {status}" + (f"\n    log tail:\n{tail}" if tail else "")
            )
        if not bad and quiet_ok:
            self.notes.append(f"every /healthz answered 200 {when}, though lines did not flow")

    def _report(self, started: float, forum_ids: list[str]) -> Report:
        return Report(
            forums=len(forum_ids),
            seconds=time.monotonic() - started,
            accounting=Accounting(),
            faults=self.records,
            problems=self.problems,
            notes=self.notes,
        )

    async def _clean_up(self) -> None:
        if self.tool_side is not None:
            await self.tool_side.stop()
        if self.plan.keep:
            await self.store.close()
            return
        with contextlib.suppress(Exception):
            await self.store.client.drop_database(self.database)
        await self.store.close()
        with contextlib.suppress(httpx.HTTPError):
            async with httpx.AsyncClient(
                base_url=self.servers.management_url, auth=self.servers.auth, timeout=30
            ) as api:
                await api.delete(f"/api/vhosts/{quote(self.vhost, safe='')}")

    # --- waiting -------------------------------------------------------------------------

    @staticmethod
    async def _wait(check: Callable[[], bool], timeout: float) -> bool:
        async def asynchronous() -> bool:
            return check()

        return await Run._wait_async(asynchronous, timeout)

    @staticmethod
    async def _wait_async(check: Callable[[], Awaitable[bool]], timeout: float) -> bool:
        try:
            await eventually(check, timeout=timeout, what="chaos", interval=0.5)
        except AssertionError:
            return False
        return True


async def run_chaos(
    plan: Plan,
    servers: Servers,
    work_dir: Path,
    faults_for: Callable[[str], Faults],
    services_mongodb_url: str | None = None,
) -> Report:
    """Run the plan; ``faults_for(vhost)`` says how to break the broker and the store."""
    await asyncio.to_thread(partial(work_dir.mkdir, parents=True, exist_ok=True))
    return await Run(plan, servers, work_dir, faults_for, services_mongodb_url).run()

"""Tool rounds by where the tool runs: a built-in inside the processor's step, a worker over
RabbitMQ, an MCP server over stdio, interleaved round by round in the same run.

One ``fixture-script`` agent per kind, each in a forum of its own, makes one call per turn and
answers once the result is in: ``clock`` (run inline in the step), a worker tool registered as
``yoke tools add-worker`` registers one (catalog entry, ``tool-NAME`` user, queue) and served by
``python -m bench.tool_worker`` (:func:`yoke.tools.worker.serve`) connected as that user, and
``echo`` of ``tests/support/mcp_server.py``, registered in ``mcp_servers`` as ``yoke tools
add-mcp`` does and started by the processor. Each round takes one turn of each kind, one at a
time, and times the whole turn (the person's line submitted until the agent's answer is seen
in the forum) and the tool round alone: the call line's ``createdAt`` to the result line's, as
the store holds them (milliseconds: BSON dates). The inline kind is the baseline of both.

The ``fixture-script`` model picks its step by counting the agent's lines in the transcript,
which holds at most ``YOKE_CONTEXT_LINES`` lines: a forum takes a new join before its
monologue outgrows that window, and that join's first round is not measured.
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from urllib.parse import quote, urlsplit, urlunsplit

import aio_pika

from bench.gateway import latency_figures
from bench.mesh_bench import Figures, MeshBench
from bench.services import ROOT
from bench.stats import percentile
from yoke.bus import topology
from yoke.cli.tool_users import create_tool_user, delete_tool_user, tool_user_name
from yoke.cli.tools import declare_tool_queue
from yoke.core.models import Message, ToolCallPart, ToolResultPart
from yoke.core.settings import Settings
from yoke.llm.base import ScriptedCall, ScriptedOutput
from yoke.runtime.catalog_store import CACHE_SECONDS, ToolCatalog
from yoke.runtime.joins import create_agent, create_forum, join_conversation
from yoke.tools.catalog import CATALOG, MCP_SERVERS, CatalogEntry, McpServer, mcp_tool_name

START_WITHIN = 120.0
STOP_WITHIN = 30.0
INLINE, WORKER, MCP = "inline", "worker", "mcp"
KINDS = (INLINE, WORKER, MCP)
# Series of each kind, as written to the results: the whole turn and the tool round alone.
TURN, ROUND = "turn", "round"
MCP_SERVER = "bench-mcp"
MCP_COMMAND = [sys.executable, "-m", "tests.support.mcp_server", "--transport", "stdio"]
WORKER_SCHEMA = {"type": "object", "properties": {"text": {"type": "string"}}}
# A round's lines in the monologue: the person's line, the call, the result, the answer.
LINES_PER_ROUND = 4
# The longest script a join holds (JoinConfig.script): two steps a round.
MAX_SCRIPT = 1000


@dataclass
class Kind:
    """One agent and the forum it answers in now, with the monologue read so far."""

    name: str
    tool: str
    agent_id: str
    forum: str = ""
    monologue: str = ""
    rounds_here: int = 0
    read_seq: int = 0
    forums: int = 0
    samples: dict[str, list[float]] = field(default_factory=lambda: {TURN: [], ROUND: []})

    def call_input(self, index: int) -> dict[str, str]:
        # Every call differs: the doom-loop guard refuses a 4th identical call in 10, and the
        # result (the worker's and the MCP server's echo) shows the call was really answered.
        return {"text": f"round {index} of {self.name}"}


class ToolRoundsBench:
    """The worker process, the MCP server's registration, and the three agents' rounds."""

    def __init__(self, mesh: MeshBench) -> None:
        self.mesh = mesh
        self.args = mesh.args
        self.progress = mesh.progress
        self.settings = Settings(amqp_url=mesh.box.amqp_url, management_url=mesh.management)
        self.worker_tool = f"bench-{uuid.uuid4().hex[:10]}"  # users are broker-wide
        self.mcp_tool = mcp_tool_name(MCP_SERVER, "echo")
        # The window the processor reads, and the script a join may hold, bound a forum.
        capacity = min(self.settings.context_lines // LINES_PER_ROUND, MAX_SCRIPT // 2)
        self.rounds_per_forum = max(1, capacity - 1)
        self.password = ""
        self.worker_log = mesh.log_dir / "tool-worker.log"
        self._user_made = False

    async def run(self) -> Figures:
        worker: subprocess.Popen[bytes] | None = None
        try:
            registered = await self.register_worker_tool()
            worker = self.start_worker()
            await self.register_mcp_server()
            await self.wait_until_served(worker)
            # The processor trusts its copy of the catalog for CACHE_SECONDS: until then it may
            # not know the worker tool (the MCP tools it wrote itself, so it knows them).
            await asyncio.sleep(max(0.0, registered + CACHE_SECONDS + 0.5 - time.monotonic()))
            kinds = await self.agents()
            if self.args.turn_warmup:
                await self.rounds(kinds, "tool warmup", self.args.turn_warmup, measured=False)
            await self.rounds(kinds, "tool rounds", self.args.tool_turns, measured=True)
        finally:
            code = await asyncio.to_thread(self.stop_worker, worker)
            await self.clean_up()
            self.mesh.tracker.forget()
        return self.figures(kinds, code)

    # --- the tools -------------------------------------------------------------------------

    async def register_worker_tool(self) -> float:
        """The catalog entry, the tool's user and its queue, as ``yoke tools add-worker``
        makes them; when the entry was written (monotonic)."""
        entry = CatalogEntry(
            id=self.worker_tool,
            description="Answers with its input's text (the bench's worker).",
            input_schema=WORKER_SCHEMA,
            source="worker",
            origin=self.worker_tool,
            timeout_seconds=self.args.turn_timeout,
        )
        store = self.mesh.store
        if not await store.insert_if_absent(store.db[CATALOG], entry.to_document()):
            raise RuntimeError(f"tools: {self.worker_tool} is in the catalog already")
        written = time.monotonic()
        self.password = await create_tool_user(self.settings, self.worker_tool)
        self._user_made = True
        await declare_tool_queue(self.settings, self.worker_tool)
        return written

    def start_worker(self) -> subprocess.Popen[bytes]:
        parts = urlsplit(self.mesh.box.amqp_url)
        user = quote(tool_user_name(self.settings, self.worker_tool), safe="")
        netloc = f"{user}:{quote(self.password, safe='')}@{parts.hostname}"
        if parts.port:
            netloc += f":{parts.port}"
        with self.worker_log.open("ab") as log:
            return subprocess.Popen(
                [sys.executable, "-m", "bench.tool_worker", self.worker_tool],
                env={
                    **self.mesh.services.env,
                    "YOKE_TOOL_AMQP_URL": urlunsplit(parts._replace(netloc=netloc)),
                },
                cwd=ROOT,
                stdout=log,
                stderr=log,
            )

    async def register_mcp_server(self) -> None:
        server = McpServer(
            id=MCP_SERVER,
            command=MCP_COMMAND,
            # The processor's allow-listed environment has no PYTHONPATH: say where tests/ is.
            env={"PYTHONPATH": str(ROOT)},
            timeout_seconds=self.args.turn_timeout,
        )
        store = self.mesh.store
        if not await store.insert_if_absent(store.db[MCP_SERVERS], server.to_document()):
            raise RuntimeError(f"tools: an MCP server {MCP_SERVER} is registered already")

    async def wait_until_served(self, worker: subprocess.Popen[bytes]) -> None:
        """Until the worker consumes its queue and the processor lists the MCP server's tools."""
        catalog = ToolCatalog(self.mesh.store)
        queue_name = topology.tool_queue(self.worker_tool)
        begin = time.perf_counter()
        deadline = begin + START_WITHIN
        consuming = listed = False
        connection = await aio_pika.connect(self.mesh.box.amqp_url)
        try:
            channel = await connection.channel()
            while not (consuming and listed):
                if worker.poll() is not None:
                    raise RuntimeError(
                        f"tools: the worker exited with {worker.returncode}:\n{self.worker_tail()}"
                    )
                if time.perf_counter() > deadline:
                    raise RuntimeError(
                        f"tools: within {START_WITHIN:.0f}s, worker consuming {consuming},"
                        f" {self.mcp_tool} listed {listed} (logs in {self.mesh.log_dir})"
                    )
                queue = await channel.declare_queue(queue_name, passive=True)
                consuming = bool(queue.declaration_result.consumer_count)
                entry = (await catalog.entries(fresh=True)).get(self.mcp_tool)
                listed = entry is not None and entry.ready
                await asyncio.sleep(0.2)
        finally:
            await connection.close()
        self.progress(
            f"tools: worker consuming and {self.mcp_tool} listed"
            f" {time.perf_counter() - begin:.1f}s after"
        )

    def worker_tail(self, chars: int = 2000) -> str:
        return self.worker_log.read_text(errors="replace")[-chars:]

    def stop_worker(self, worker: subprocess.Popen[bytes] | None) -> int | None:
        if worker is None:
            return None
        if worker.poll() is None:
            worker.terminate()
            try:
                worker.wait(STOP_WITHIN)
            except subprocess.TimeoutExpired:
                worker.kill()
                worker.wait(10)
        if worker.returncode != 0:
            self.progress(f"tools: the worker exited with {worker.returncode}: {self.worker_log}")
        return worker.returncode

    async def clean_up(self) -> None:
        """The tool's user (broker-wide: the vhost going does not take it), and the MCP server
        (so the processor stops it and the later phases run without it)."""
        if self._user_made:
            try:
                await delete_tool_user(self.settings, self.worker_tool)
            except Exception as error:  # the run's outcome matters more
                self.progress(f"tools: could not delete the user of {self.worker_tool}: {error}")
        with contextlib.suppress(Exception):
            await self.mesh.store.db[MCP_SERVERS].delete_one({"_id": MCP_SERVER})
            await ToolCatalog(self.mesh.store).remove("mcp", MCP_SERVER)

    # --- the agents and their rounds -------------------------------------------------------

    async def agents(self) -> list[Kind]:
        tools = {INLINE: "clock", WORKER: self.worker_tool, MCP: self.mcp_tool}
        kinds = []
        for name in KINDS:
            agent = await create_agent(
                self.mesh.store, f"tools {name}", model="fixture-script", tools=[tools[name]]
            )
            kind = Kind(name=name, tool=tools[name], agent_id=agent.id)
            await self.new_forum(kind)
            kinds.append(kind)
        return kinds

    async def new_forum(self, kind: Kind) -> None:
        """A forum with a fresh monologue, its script one call and one answer per round."""
        script: list[ScriptedOutput] = []
        for index in range(self.rounds_per_forum + 1):
            script += [
                ScriptedOutput(
                    tool_calls=[ScriptedCall(name=kind.tool, input=kind.call_input(index))]
                ),
                ScriptedOutput(text=f"{kind.name} answered round {index}"),
            ]
        forum = await create_forum(self.mesh.store, f"tools {kind.name} {kind.forums}")
        self.mesh.tracker.forums.add(forum.id)
        join = await join_conversation(
            self.mesh.store,
            self.mesh.poster,
            kind.agent_id,
            forum.id,
            model="fixture-script",
            tools=[kind.tool],
            script=script,
        )
        kind.forum, kind.monologue = forum.id, join.monologue_id
        kind.rounds_here = kind.read_seq = 0
        kind.forums += 1

    async def rounds(self, kinds: list[Kind], label: str, count: int, *, measured: bool) -> None:
        """``count`` rounds, each a turn of every kind in turn, one at a time."""
        begin = last_report = time.perf_counter()
        for index in range(count):
            for kind in kinds:
                if kind.rounds_here >= self.rounds_per_forum:
                    await self.new_forum(kind)
                    await self.turn(kind)  # a new join's first step: not measured
                turn, round_seconds = await self.turn(kind)
                if measured:
                    kind.samples[TURN].append(turn)
                    kind.samples[ROUND].append(round_seconds)
            if time.perf_counter() - last_report > 5:
                last_report = time.perf_counter()
                self.progress(f"{label}: {index + 1}/{count} rounds")
        if not measured:
            return
        parts = [
            f"{kind.name} turn p50 {percentile(kind.samples[TURN], 0.5) * 1000:.1f} ms,"
            f" round p50 {percentile(kind.samples[ROUND], 0.5) * 1000:.1f} ms"
            for kind in kinds
        ]
        self.progress(
            f"{label}: {count} rounds in {time.perf_counter() - begin:.1f}s; " + "; ".join(parts)
        )

    async def turn(self, kind: Kind) -> tuple[float, float]:
        """One turn of ``kind``: (the whole turn, the tool round alone) in seconds."""
        index = kind.rounds_here
        line_id, seconds = await self.mesh.turns.turn(kind.forum)
        kind.rounds_here += 1
        lines = await self.mesh.store.history(kind.monologue, after_seq=kind.read_seq)
        call_line, result_line = self.round_lines(kind, line_id, lines)
        [result] = [p for p in result_line.parts if isinstance(p, ToolResultPart)]
        expected = kind.call_input(index)["text"] if kind.name != INLINE else None
        if result.is_error or (expected is not None and result.output != expected):
            raise RuntimeError(
                f"tools: {kind.name}'s call of {kind.tool} came back {result.output!r}"
                f" (error {result.is_error})"
            )
        kind.read_seq = max(line.seq for line in lines)
        return seconds, (result_line.created_at - call_line.created_at).total_seconds()

    @staticmethod
    def round_lines(kind: Kind, line_id: str, lines: list[Message]) -> tuple[Message, Message]:
        """The turn's call line and the line holding that call's result."""
        calls = [
            line
            for line in lines
            if line.role == "agent"
            and line.meta.in_reply_to == line_id
            and any(isinstance(part, ToolCallPart) for part in line.parts)
        ]
        if len(calls) != 1:
            raise RuntimeError(f"tools: {kind.name}'s turn made {len(calls)} call lines, not 1")
        call_ids = {p.call_id for p in calls[0].parts if isinstance(p, ToolCallPart)}
        results = [
            line
            for line in lines
            if any(isinstance(p, ToolResultPart) and p.call_id in call_ids for p in line.parts)
        ]
        if len(results) != 1:
            raise RuntimeError(f"tools: {kind.name}'s call has {len(results)} result lines, not 1")
        return calls[0], results[0]

    # --- figures ---------------------------------------------------------------------------

    def figures(self, kinds: list[Kind], worker_exit: int | None) -> Figures:
        figures: Figures = {
            "rounds": self.args.tool_turns,
            "roundsPerForum": self.rounds_per_forum,
            "workerExitCode": worker_exit,
        }
        for kind in kinds:
            figures[kind.name] = {
                "tool": kind.tool,
                "forums": kind.forums,
                TURN: latency_figures(kind.samples[TURN]),
                ROUND: latency_figures(kind.samples[ROUND]),
            }
        base = figures[INLINE]
        figures["ratios"] = {
            name: {
                f"{series}{q}": ratio(
                    figures[name][series][f"{q.lower()}Ms"], base[series][f"{q.lower()}Ms"]
                )
                for series in (ROUND, TURN)
                for q in ("P50", "P99")
            }
            for name in (WORKER, MCP)
        }
        return figures


def ratio(value: float, base: float) -> float | None:
    """``value / base``; None where the base rounds to nothing (an inline round under 1 ms)."""
    return round(value / base, 2) if base > 0 else None

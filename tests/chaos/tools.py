"""The tools scenario: agents whose every answer needs tools, while processors and workers die.

Each agent plays a script (``fixture-script``): for every person line, one round of calls
tagged with the forum, the round and the kind of call (``f2-r7-stdio``), then an answer. Every
round calls the stdio MCP server and the HTTP one inline; the forum's kind adds one call that
waits in the store: a worker's, a slow stdio or HTTP MCP call (past the 2 s inline bound), or
a gated call the harness approves after a while. The tools record each run they start in a
file (tests/chaos/runs.py), so runs per call are counted where the work happens; calls made,
their results and the answers are read from the store. What must hold (architecture.md, 12 and 15):
every call made ends exactly once, no MCP call runs twice, a worker's call runs again only
after a crash (its worker killed, a processor killed as it sent the call, the broker gone under
the unacked call), and every line is answered once.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from tests.chaos.load import Line, named
from tests.chaos.runs import RUNS_VARIABLE, ToolRun
from tests.chaos.tool_server import HELD, TALLY
from tests.support.processes import ROOT, eventually, free_port
from tests.support.unprivileged import stdio_servers_need_root
from tests.support.worker_process import as_user
from yoke.bus import topology
from yoke.bus.amqp_nodes import amqp_vhost
from yoke.cli.tool_users import create_tool_user, delete_tool_user
from yoke.cli.tools import declare_tool_queue
from yoke.client import Client
from yoke.core.models import Message, ToolCallPart, ToolResultPart
from yoke.core.settings import Settings
from yoke.llm.base import ScriptedCall, ScriptedOutput
from yoke.runtime.calls.approvals import pending_approvals
from yoke.runtime.calls.records import (
    TOOL_CALL_ENDS_COLLECTION,
    TOOL_CALLS_COLLECTION,
    open_call_id,
)
from yoke.runtime.catalog_store import ToolCatalog
from yoke.runtime.instances import PROCESSOR
from yoke.runtime.join_config import ApprovalConfig, JoinConfig
from yoke.store.database import Store
from yoke.tools.catalog import MCP_SERVERS, CatalogEntry, McpServer, mcp_tool_name

STDIO = "cstdio"  # the MCP servers' names in the catalog
HTTP = "chttp"
MCP_TIMEOUT = 15.0  # seconds an MCP call may take
SLOW_SECONDS = 3.0  # a slow MCP call's run: past the inline bound, it waits in the store
WORKER_TIMEOUT = 30.0
WORKER_SECONDS = 1.0  # the worker's time on a call: a kill finds calls in its hands
APPROVAL_TIMEOUT = 120.0
# What each forum's rounds add to the two inline MCP calls, by forum number (round robin).
KINDS = ("worker", "slow-stdio", "slow-http", "gated")
SCHEMA = {"type": "object", "properties": {"tag": {"type": "string"}}, "required": ["tag"]}


def tag_of(forum: int, round_number: int, what: str) -> str:
    return f"f{forum}-r{round_number}-{what}"


def round_calls(forum: int, round_number: int, worker: str) -> list[ScriptedCall]:
    def call(server: str, tool: str, what: str, **extra: float) -> ScriptedCall:
        tag = tag_of(forum, round_number, what)
        return ScriptedCall(name=mcp_tool_name(server, tool), input={"tag": tag, **extra})

    calls = [call(STDIO, TALLY, "stdio"), call(HTTP, TALLY, "http")]
    kind = KINDS[forum % len(KINDS)]
    if kind == "worker":
        calls.append(ScriptedCall(name=worker, input={"tag": tag_of(forum, round_number, kind)}))
    elif kind == "slow-stdio":
        calls.append(call(STDIO, TALLY, kind, seconds=SLOW_SECONDS))
    elif kind == "slow-http":
        calls.append(call(HTTP, TALLY, kind, seconds=SLOW_SECONDS))
    else:
        calls.append(call(STDIO, HELD, kind))
    return calls


def join_config(forum: int, rounds: int, worker: str) -> JoinConfig:
    """Step 2k calls round k's tools, step 2k+1 answers (the script counts the agent's lines)."""
    script: list[ScriptedOutput] = []
    for number in range(rounds):
        script.append(ScriptedOutput(tool_calls=round_calls(forum, number, worker)))
        script.append(ScriptedOutput(text=f"forum {forum} round {number} done"))
    gated = mcp_tool_name(STDIO, HELD)
    return JoinConfig(
        model="fixture-script",
        tools=[f"{STDIO}__*", f"{HTTP}__*", worker],
        script=script,
        approval=ApprovalConfig(tools=[gated], timeout_seconds=APPROVAL_TIMEOUT),
    )


def mesh_env(rounds: int) -> dict[str, str]:
    """``YOKE_CONTEXT_LINES`` that holds a whole monologue (the script counts the agent's lines
    in the transcript, and a window cut short would replay an earlier round's calls); stdio
    servers kept as root when the unprivileged user cannot run this interpreter (as
    tests/conftest.py does for the suite)."""
    env = {"YOKE_CONTEXT_LINES": str(8 * rounds + 100)}
    if stdio_servers_need_root():
        env["YOKE_MCP_STDIO_USER"] = "root"
    return env


# --- the tools' side: registered before the mesh starts, served by processes of the run's -----


class ToolSide:
    """The MCP servers and the worker tool: registered in the run's store and vhost, the HTTP
    server and the worker run as processes of the harness (the stdio server is each
    processor's own child)."""

    def __init__(self, work_dir: Path, vhost_url: str, management_url: str, tag: str) -> None:
        self.work_dir = work_dir
        self.vhost_url = vhost_url
        self.settings = Settings(amqp_url=vhost_url, management_url=management_url)
        self.worker = f"chaos-{tag}"
        self.mcp_runs = work_dir / "runs-mcp.jsonl"
        self.worker_runs = work_dir / "runs-worker.jsonl"
        self.http_port = free_port()
        self.http: subprocess.Popen[bytes] | None = None
        self.worker_process: subprocess.Popen[bytes] | None = None
        self.worker_url: str | None = None
        self.killed_workers: dict[int, float] = {}  # pid -> when (time.time())

    async def register(self, store: Store) -> None:
        # Written by stdio servers that may run as an unprivileged user.
        self.mcp_runs.touch()
        self.mcp_runs.chmod(0o666)
        command = [sys.executable, "-m", "tests.chaos.tool_server", "--transport", "stdio"]
        servers = [
            McpServer(
                id=STDIO,
                command=command,
                env={RUNS_VARIABLE: str(self.mcp_runs)},
                timeout_seconds=MCP_TIMEOUT,
            ),
            McpServer(
                id=HTTP, url=f"http://127.0.0.1:{self.http_port}/mcp", timeout_seconds=MCP_TIMEOUT
            ),
        ]
        for server in servers:
            await store.insert_if_absent(store.db[MCP_SERVERS], server.to_document())
        entry = CatalogEntry(
            id=self.worker,
            description="Records that the call {tag} ran, then answers.",
            input_schema=SCHEMA,
            source="worker",
            origin=self.worker,
            timeout_seconds=WORKER_TIMEOUT,
        )
        await store.insert_if_absent(ToolCatalog(store).collection, entry.to_document())
        password = await create_tool_user(self.settings, self.worker)
        self.worker_url = as_user(
            self.vhost_url, topology.tool_user(self.worker, amqp_vhost(self.vhost_url)), password
        )
        await declare_tool_queue(self.settings, self.worker)  # as `yoke tools add-worker` does

    def start(self) -> None:
        """The HTTP MCP server and the worker (which waits for its queue: the mesh declares it)."""
        with (self.work_dir / "mcp-http.log").open("ab") as log:
            self.http = subprocess.Popen(
                [
                    *(sys.executable, "-m", "tests.chaos.tool_server", "--transport", "http"),
                    *("--port", str(self.http_port), "--runs", str(self.mcp_runs)),
                ],
                cwd=ROOT,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        self.start_worker()

    def start_worker(self) -> None:
        assert self.worker_url is not None
        with (self.work_dir / "worker.log").open("ab") as log:
            self.worker_process = subprocess.Popen(
                [
                    *(sys.executable, "-m", "tests.chaos.tool_worker", "--url", self.worker_url),
                    *("--tool", self.worker, "--runs", str(self.worker_runs)),
                    *("--seconds", str(WORKER_SECONDS)),
                ],
                cwd=ROOT,
                stdout=log,
                stderr=subprocess.STDOUT,
            )

    async def kill_worker(self) -> None:
        """``kill -9`` the worker, then start another (the calls in its hands come back)."""
        process = self.worker_process
        assert process is not None
        if process.poll() is not None:
            raise RuntimeError(f"the tool worker had exited already ({process.returncode})")
        process.send_signal(signal.SIGKILL)
        await asyncio.to_thread(process.wait, 10)
        self.killed_workers[process.pid] = time.time()
        self.start_worker()

    async def wait_listed(self, store: Store, timeout: float) -> list[str]:
        """Until the processors have listed both servers' tools; the names still missing."""
        wanted = [mcp_tool_name(s, t) for s in (STDIO, HTTP) for t in (TALLY, HELD)]
        missing: list[str] = list(wanted)

        async def listed() -> bool:
            nonlocal missing
            entries = await ToolCatalog(store).entries(fresh=True)
            missing = [n for n in wanted if n not in entries or not entries[n].ready]
            return not missing

        with contextlib.suppress(AssertionError):
            await eventually(listed, timeout=timeout, what="the chaos tools listed", interval=0.5)
        return missing

    def exits(self) -> list[str]:
        """The tool processes that died without the harness killing them."""
        found = []
        for what, process in (("HTTP MCP server", self.http), ("worker", self.worker_process)):
            if process is not None and process.poll() is not None:
                found.append(f"the {what} exited with {process.returncode}")
        return found

    async def stop(self) -> None:
        for process in (self.worker_process, self.http):
            if process is not None and process.poll() is None:
                process.terminate()
                try:
                    await asyncio.to_thread(process.wait, 10)
                except subprocess.TimeoutExpired:
                    process.kill()
                    await asyncio.to_thread(process.wait, 10)
        with contextlib.suppress(Exception):
            await delete_tool_user(self.settings, self.worker)


# --- the person who approves -------------------------------------------------------------------


@dataclass
class Approver:
    """Approves every gated call once it has waited ``after`` seconds, as the operator would
    (``yoke approve``: the mesh's own user, through the door)."""

    store: Store
    amqp_url: str
    after: float
    replies: Counter[str] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)
    decided: set[str] = field(default_factory=set)

    async def run(self, stopping: asyncio.Event) -> None:
        client: Client | None = None
        try:
            while not stopping.is_set():
                try:
                    if client is None:
                        client = Client(
                            named(self.amqp_url, "chaos-approver"),
                            queue_prefix=topology.CLI_REPLY_QUEUE_PREFIX,
                        )
                        async with asyncio.timeout(15):
                            await client.__aenter__()
                    await self._once(client)
                except Exception as error:
                    self.errors[type(error).__name__] += 1
                    if client is not None:
                        with contextlib.suppress(Exception):
                            await client.__aexit__(None, None, None)
                    client = None
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stopping.wait(), 0.5)
        finally:
            if client is not None:
                with contextlib.suppress(Exception):
                    await client.__aexit__(None, None, None)

    async def _once(self, client: Client) -> None:
        async with asyncio.timeout(15):
            pending = await pending_approvals(self.store)
        now = time.time()
        for call in pending:
            if call.call_id in self.decided or now - call.requested_at.timestamp() < self.after:
                continue
            reply = await client.decide(
                call.call_id,
                "approve",
                external_id="chaos:approver",
                display_name="chaos approver",
                user_id=client.user,
                reply_timeout=10,
                publish_timeout=10,
            )
            self.replies[reply.status if reply.status == "accepted" else str(reply.code)] += 1
            self.decided.add(call.call_id)


# --- what the store and the tools say ------------------------------------------------------------


@dataclass
class ToolAccounting:
    calls: int = 0  # tool_call parts in the monologues
    ended: int = 0  # calls with a tool_result
    ends_stored: int = 0  # calls with a CallEnd in tool_call_ends
    ended_twice: list[str] = field(default_factory=list)
    not_ended: list[str] = field(default_factory=list)
    # Of those, ended in the store (a CallEnd) though no result line holds the end.
    end_without_line: list[str] = field(default_factory=list)
    runs: Counter[int] = field(default_factory=Counter)  # runs a call had -> how many calls
    ran_twice: list[str] = field(default_factory=list)  # a run the contract does not allow
    reruns_excused: list[str] = field(default_factory=list)  # a worker's, after a fault
    answered_without_run: list[str] = field(default_factory=list)
    runs_without_call: list[str] = field(default_factory=list)
    open_left: list[str] = field(default_factory=list)
    errors: Counter[str] = field(default_factory=Counter)  # error results, by their text
    answers: Counter[int] = field(default_factory=Counter)  # answers a line had -> lines
    lost: int = 0

    @property
    def ok(self) -> bool:
        return not (
            self.ended_twice
            or self.not_ended
            or self.end_without_line
            or self.ran_twice
            or self.answered_without_run
            or self.runs_without_call
            or self.open_left
            or self.lost
            or any(count for answers, count in self.answers.items() if answers != 1)
        )

    def table(self) -> str:
        header = [
            "calls made",
            "calls ended",
            "ends stored",
            "ended twice",
            "not ended",
            "runs per call (0/1/2+)",
            "ran twice",
            "answers per line (0/1/2+)",
            "lines lost",
        ]
        row = [
            str(self.calls),
            str(self.ended),
            str(self.ends_stored),
            str(len(self.ended_twice)),
            str(len(self.not_ended)),
            _spread(self.runs),
            str(len(self.ran_twice)),
            _spread(self.answers),
            str(self.lost),
        ]
        widths = [max(len(h), len(c)) for h, c in zip(header, row, strict=True)]
        return "\n".join(
            "| " + " | ".join(c.rjust(w) for c, w in zip(cells, widths, strict=True)) + " |"
            for cells in (header, ["-" * w for w in widths], row)
        )

    def sections(self) -> list[tuple[str, list[str]]]:
        errors = [f"{count} x {text}" for text, count in self.errors.most_common()]
        return [
            ("calls ended twice", self.ended_twice),
            ("calls never ended", self.not_ended),
            ("of them, ended in the store but in no line", self.end_without_line),
            ("calls run twice", self.ran_twice),
            ("answered without a run at the tool", self.answered_without_run),
            ("runs of no call in the store", self.runs_without_call),
            ("open calls left at the end", self.open_left),
            ("a worker's call run again after a fault (allowed)", self.reruns_excused),
            ("error results (allowed: what the model was told)", errors),
        ]


def _spread(counts: Counter[int]) -> str:
    return f"{counts[0]}/{counts[1]}/{sum(n for k, n in counts.items() if k >= 2)}"


@dataclass(frozen=True)
class Interruption:
    """A fault after which the mesh may send a worker's call again (a processor killed as it
    published, the broker restarting under the worker's unacked call)."""

    started: float  # time.time()
    ended: float


def account_tools(
    monologues: dict[str, list[Message]],
    runs: list[ToolRun],
    worker: str,
    killed_workers: dict[int, float],
    interruptions: list[Interruption],
    lines: list[Line],
    forums: dict[str, list[Message]],
    open_left: list[str],
    stored_ends: dict[str, str] | None = None,
) -> ToolAccounting:
    """Calls and results from the monologues, runs from the tools, answers from the forums;
    ``stored_ends`` (by the model's call id) says how the store recorded a call's end."""
    result = ToolAccounting(open_left=open_left)
    calls: dict[str, ToolCallPart] = {}
    results: dict[str, list[tuple[str, ToolResultPart]]] = {}
    for messages in monologues.values():
        for message in messages:
            for part in message.parts:
                if isinstance(part, ToolCallPart) and message.role == "agent":
                    calls[part.call_id] = part
                elif isinstance(part, ToolResultPart):
                    results.setdefault(part.call_id, []).append((message.id, part))
    runs_by_tag: dict[str, list[ToolRun]] = {}
    for run in runs:
        runs_by_tag.setdefault(run.tag, []).append(run)
    tags = set()
    result.calls = len(calls)
    for call_id, call in calls.items():
        tag = str(call.input.get("tag", ""))
        tags.add(tag)
        ended = results.get(call_id, [])
        result.ends_stored += bool(stored_ends and call_id in stored_ends)
        described = f"{call.name} {tag} (call {call_id})"
        if ended:
            result.ended += 1
        else:
            result.not_ended.append(described)
            if stored_ends and call_id in stored_ends:
                result.end_without_line.append(f"{described}: {stored_ends[call_id]}")
        if len(ended) > 1:
            shown = "; ".join(f"{line}: {part.output[:80]!r}" for line, part in ended)
            result.ended_twice.append(f"{described} ended {len(ended)} times: {shown}")
        for _, part in ended:
            if part.is_error:
                result.errors[part.output.replace(tag, "TAG")[:160]] += 1
        ran = runs_by_tag.get(tag, [])
        result.runs[len(ran)] += 1
        if ended and not ran and not any(part.is_error for _, part in ended):
            result.answered_without_run.append(described)
        if len(ran) > 1:
            if call.name == worker and _excused(ran, killed_workers, interruptions):
                result.reruns_excused.append(f"{described}: {_runs_text(ran)}")
            else:
                result.ran_twice.append(f"{described} ran {len(ran)} times: {_runs_text(ran)}")
    for tag, ran in runs_by_tag.items():
        if tag not in tags:
            result.runs_without_call.append(f"{tag}: {_runs_text(ran)}")
    answers: Counter[str] = Counter()
    for messages in forums.values():
        for message in messages:
            if message.role == "agent" and message.meta.in_reply_to:
                answers[message.meta.in_reply_to] += 1
    for line in lines:
        if line.message_id is None:
            continue
        result.answers[answers[line.message_id]] += 1
        stored = any(m.id == line.message_id for m in forums.get(line.forum_id, []))
        result.lost += not stored or not answers[line.message_id]
    return result


def _excused(
    ran: list[ToolRun], killed: dict[int, float], interruptions: list[Interruption]
) -> bool:
    """Between each two runs, the worker of the first was killed or another fault came (the
    contract: a worker sees a call again only after a crash); and every delivery carried the
    call's one id and idempotency key."""
    if len({(run.call_id, run.idempotency_key) for run in ran}) != 1:
        return False
    ordered = sorted(ran, key=lambda run: run.at)
    for earlier, later in itertools.pairwise(ordered):
        when = killed.get(earlier.pid)
        cut = (when is not None and earlier.at <= when <= later.at) or any(
            fault.started <= later.at and fault.ended >= earlier.at for fault in interruptions
        )
        if not cut:
            return False
    return True


def _runs_text(ran: list[ToolRun]) -> str:
    return ", ".join(f"{run.tool} pid {run.pid}" for run in sorted(ran, key=lambda r: r.at))


async def stored_ends(store: Store, monologues: dict[str, list[Message]]) -> dict[str, str]:
    """How the store recorded each call's end (``tool_call_ends``), by the model's call id: the
    end's id derives from the processor instance watching the monologue and the call line."""
    instances = {
        str(d["watch"]): str(d["instanceId"])
        async for d in store.states.find({"actor": PROCESSOR}, {"watch": 1, "instanceId": 1})
    }
    ids: dict[str, str] = {}
    for monologue_id, messages in monologues.items():
        instance = instances.get(monologue_id)
        if instance is None:
            continue
        for message in messages:
            for part in message.parts:
                if isinstance(part, ToolCallPart) and message.role == "agent":
                    ids[open_call_id(instance, message.id, part.call_id)] = part.call_id
    found: dict[str, str] = {}
    wanted = sorted(ids)
    for start in range(0, len(wanted), 200):
        chunk = wanted[start : start + 200]
        async for end in store.db[TOOL_CALL_ENDS_COLLECTION].find({"_id": {"$in": chunk}}):
            where = "in its round" if end.get("inRound") else "in a line of its own"
            found[ids[end["_id"]]] = f"{end.get('outcome')} ({where}): {end.get('output')!r}"
    return found


async def open_calls_left(store: Store) -> list[str]:
    documents = await store.db[TOOL_CALLS_COLLECTION].find({}).to_list()
    return [
        f"{d.get('tool')} {json.dumps(d.get('input'))} ({d.get('state')}, call {d['_id']})"
        for d in documents
    ]

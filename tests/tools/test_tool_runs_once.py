"""A call runs once (docs/architecture.md, invariant 15), in a mesh of real processes.

The test MCP server (tests/support/mcp_server.py, over stdio, started by the processor) has a
``count`` tool that appends its ``key`` to a file at the start of each run: the file's lines
are the runs. The processor runs under ``tests.support.faults``, which puts one fault in from
outside:

- the round's results line fails once to be stored (a transient store error, ``raise:`` the
  moment its id is taken), after an inline and a slow MCP call started: the retried step runs
  neither again, each call gets one result and the model answers the round once;
- the processor dies (``os._exit``, as a kill -9) right as a slow MCP call goes on past the
  inline bound, its claim recorded: the restarted processor ends it with an error result that
  says it was cut short, never a second run, and the model answers once;
- the processor dies right after the round's results line (the inline call's) is written, a
  slow call still running: the restarted processor ends the slow call cut short in a line of
  its own, since the results line it would have joined is written already;
- the processor dies right after an approved call is marked approved: the restarted one ends
  an MCP call cut short at once and sends a worker's call (a worker may see a call again only
  after a crash), rather than leave either until the tool's deadline.

After each answer a last line is said and answered: lines of a monologue are taken in order,
so once it is answered nothing of the round is left to run, and counting then is exact.
"""

from __future__ import annotations

import shlex
import sys
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from services.processor.tool_rounds import ToolRounds
from tests.support import faults
from tests.support.approvals import decide_as, gated_join, results, texts
from tests.support.cli import run_yoke
from tests.support.mesh import Mesh, lines_until, say
from tests.support.processes import ServiceProcess, eventually
from tests.support.worker_process import WorkerProcess
from tests.support.worker_tools import WorkerTool, registered_worker_tool
from yoke.client import Client
from yoke.core.models import Message, ToolResultPart
from yoke.llm.base import ScriptedCall, ScriptedOutput
from yoke.runtime.calls.approvals import Approvals, pending_approvals
from yoke.runtime.calls.records import TOOL_CALL_ENDS_COLLECTION, round_results_line_id
from yoke.runtime.calls.texts import CUT_SHORT
from yoke.runtime.catalog_store import ToolCatalog
from yoke.runtime.dispatch import ToolDispatch
from yoke.runtime.join_config import JoinConfig
from yoke.runtime.joins import create_agent, create_forum, join_conversation
from yoke.runtime.posting import Poster
from yoke.store.database import Store

pytestmark = pytest.mark.slow

WAIT = 60.0  # the most any step of a test may take on a loaded machine
SERVER = f"n{uuid.uuid4().hex[:8]}"
COUNT = f"{SERVER}__count"
# Past the 2 s inline bound (the call waits in the store), well within the tool's timeout.
SLOW_SECONDS = 4.0
TOOL_TIMEOUT = 120.0  # more than a test waits: an end before it is not the deadline's
# The worker tool's: far more than a test waits, as a worker's may be days.
WORKER_TIMEOUT = 600.0
DONE = "the round is answered"
AFTER = "anything else?"
# Where the processor is made to fail (tests.support.faults), named from the code itself.
RESULTS_LINE_FAILS = faults.fault("raise", round_results_line_id)
DIES_IN_BACKGROUND = faults.fault("before", ToolDispatch._in_background)
DIES_AFTER_ROUND = faults.fault("after", ToolRounds.run_tool_round)
DIES_APPROVED = faults.fault("after", Approvals.mark_approved)


@pytest.fixture(scope="module")
async def registered(amqp_url: str, module_mongodb_url: str) -> str:
    """The test MCP server registered as an operator does, before the mesh starts (the
    processor hosts it from its start)."""
    command = shlex.join([sys.executable, "-m", "tests.support.mcp_server", "--transport", "stdio"])
    env = {"YOKE_AMQP_URL": amqp_url, "YOKE_MONGODB_URL": module_mongodb_url}
    code, _, err = await run_yoke(
        env, "tools", "add-mcp", SERVER, "--command", command, "--timeout", f"{TOOL_TIMEOUT:g}"
    )
    assert code == 0, err
    return SERVER


@pytest.fixture(scope="module")
async def worker_tool(
    amqp_url: str, module_mongodb_url: str, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[WorkerTool]:
    """A worker tool (``yoke tools add-worker``), registered before the mesh starts."""
    schema = {"type": "object", "properties": {"q": {"type": "string"}}}
    folder = Path(tmp_path_factory.mktemp("tool"))
    name = f"w{uuid.uuid4().hex[:8]}"
    async with registered_worker_tool(
        amqp_url, module_mongodb_url, name, schema, folder, timeout=WORKER_TIMEOUT
    ) as made:
        yield made


@pytest.fixture(scope="module")
def before_mesh(registered: str, worker_tool: WorkerTool) -> None:
    """The tools are in the catalog when the services start."""


@pytest.fixture(scope="module")
def mesh_env() -> dict[str, str]:
    return {"YOKE_OUTBOX_GRACE_SECONDS": "1"}


@pytest.fixture(scope="module")
async def counter(mesh: Mesh, store: Store) -> str:
    async def listed() -> bool:
        entry = (await ToolCatalog(store).entries(fresh=True)).get(COUNT)
        return entry is not None and entry.ready

    await eventually(listed, timeout=WAIT, what=f"{COUNT} in the catalog", interval=0.3)
    return SERVER


async def processor_with(mesh: Mesh, fault: str | None) -> ServiceProcess:
    """The processor started again, under ``fault`` (or none), once it hosts the server."""
    mesh.processes["processor"].stop()
    env = {**mesh.env, faults.VARIABLE: fault} if fault else mesh.env
    name = (fault or "plain").replace(":", "_")
    process = ServiceProcess(
        ["-m", "tests.support.faults", "services.processor"],
        env,
        mesh.log_dir / f"processor-{name}-{uuid.uuid4().hex[:4]}.log",
    )
    mesh.processes["processor"] = process
    await process.wait_healthy(timeout=120)

    async def hosting() -> bool:
        return f"mcp server {SERVER} connected" in process.output()

    await eventually(hosting, timeout=WAIT, what=f"the processor to connect to {SERVER}")
    return process


def counted(runs: Path, key: str) -> int:
    return runs.read_text().splitlines().count(key) if runs.exists() else 0


def count_call(runs: Path, key: str, seconds: float = 0) -> ScriptedCall:
    return ScriptedCall(name=COUNT, input={"path": str(runs), "key": key, "seconds": seconds})


async def counting_join(store: Store, poster: Poster, *calls: ScriptedCall) -> tuple[str, str]:
    """A forum whose agent makes one round of ``calls``, then says DONE, then ``ok``."""
    forum = await create_forum(store, "runs once")
    agent = await create_agent(store, "counter")
    script = [
        ScriptedOutput(tool_calls=list(calls)),
        ScriptedOutput(text=DONE),
        ScriptedOutput(text="ok"),
    ]
    config = JoinConfig(model="fixture-script", tools=[COUNT], script=script)
    join = await join_conversation(store, poster, agent.id, forum.id, config)
    return forum.id, join.monologue_id


async def answered_then_quiet(store: Store, client: Client, forum_id: str) -> None:
    """The round answered once (DONE), then a last line answered: nothing of it is left."""
    await lines_until(store, forum_id, lambda lines: DONE in texts(lines), timeout=WAIT)
    await say(client, forum_id, AFTER)
    await lines_until(store, forum_id, lambda lines: "ok" in texts(lines), timeout=WAIT)


def results_by_call(lines: list[Message]) -> dict[str, list[ToolResultPart]]:
    found: dict[str, list[ToolResultPart]] = {}
    for part in results(lines):
        found.setdefault(part.call_id, []).append(part)
    return found


async def test_a_results_line_failing_once_to_be_stored_runs_no_call_again(
    mesh: Mesh, counter: str, store: Store, poster: Poster, client: Client, tmp_path: Path
) -> None:
    process = await processor_with(mesh, RESULTS_LINE_FAILS)
    runs = tmp_path / "runs"
    forum_id, monologue_id = await counting_join(
        store, poster, count_call(runs, "inline"), count_call(runs, "slow", SLOW_SECONDS)
    )
    await say(client, forum_id, "count twice")
    await answered_then_quiet(store, client, forum_id)
    assert "fault injected" in process.output()

    assert (counted(runs, "inline"), counted(runs, "slow")) == (1, 1)
    forum = await store.history(forum_id)
    assert texts(forum) == [DONE, "ok"]  # one model answer for the round
    by_call = results_by_call(await store.history(monologue_id))
    assert sorted(len(parts) for parts in by_call.values()) == [1, 1], by_call
    assert sorted(parts[0].output for parts in by_call.values()) == [
        "counted inline",
        "counted slow",
    ]


async def test_a_processor_killed_while_an_mcp_call_runs_ends_it_cut_short_never_twice(
    mesh: Mesh, counter: str, store: Store, poster: Poster, client: Client, tmp_path: Path
) -> None:
    faulty = await processor_with(mesh, DIES_IN_BACKGROUND)
    runs = tmp_path / "runs"
    forum_id, monologue_id = await counting_join(
        store, poster, count_call(runs, "slow", SLOW_SECONDS)
    )
    await say(client, forum_id, "count slowly")
    assert faulty.popen.wait(WAIT) == faults.EXIT_CODE, faulty.output()[-2000:]
    assert counted(runs, "slow") == 1  # it started before the processor died
    await processor_with(mesh, None)
    await answered_then_quiet(store, client, forum_id)

    assert counted(runs, "slow") == 1
    assert texts(await store.history(forum_id)) == [DONE, "ok"]
    [[result]] = results_by_call(await store.history(monologue_id)).values()
    assert result.is_error and CUT_SHORT in result.output, result
    ends = store.db[TOOL_CALL_ENDS_COLLECTION]
    assert await ends.count_documents({"outcome": "failed", "output": result.output}) == 1


async def test_a_processor_killed_after_its_results_line_ends_the_slow_call_in_a_line_of_its_own(
    mesh: Mesh, counter: str, store: Store, poster: Poster, client: Client, tmp_path: Path
) -> None:
    # The round's results line holds the inline call's result; the slow call went on past the
    # inline bound and its runner died: cut short, it needs a line of its own.
    faulty = await processor_with(mesh, DIES_AFTER_ROUND)
    runs = tmp_path / "runs"
    forum_id, monologue_id = await counting_join(
        store, poster, count_call(runs, "inline"), count_call(runs, "slow", SLOW_SECONDS)
    )
    await say(client, forum_id, "count twice")
    assert faulty.popen.wait(WAIT) == faults.EXIT_CODE, faulty.output()[-2000:]
    await processor_with(mesh, None)
    await answered_then_quiet(store, client, forum_id)

    assert (counted(runs, "inline"), counted(runs, "slow")) == (1, 1)
    assert texts(await store.history(forum_id)) == [DONE, "ok"]
    by_call = results_by_call(await store.history(monologue_id))
    assert sorted(len(parts) for parts in by_call.values()) == [1, 1], by_call
    outputs = sorted(parts[0].output for parts in by_call.values())
    assert outputs[0] == "counted inline" and CUT_SHORT in outputs[1], outputs


async def approve_when_asked(store: Store, client: Client, forum_id: str) -> str:
    async def asked() -> bool:
        return bool(await pending_approvals(store, forum_id))

    await eventually(asked, timeout=WAIT, what="the approval request")
    [pending] = await pending_approvals(store, forum_id)
    reply = await decide_as(client, pending.call_id, "approve", "Ada")
    assert reply.status == "accepted", reply
    return pending.call_id


async def test_an_approved_mcp_call_cut_short_by_a_crash_ends_at_once(
    mesh: Mesh, counter: str, store: Store, poster: Poster, client: Client, tmp_path: Path
) -> None:
    faulty = await processor_with(mesh, DIES_APPROVED)
    runs = tmp_path / "runs"
    script = [
        ScriptedOutput(tool_calls=[count_call(runs, "approved")]),
        ScriptedOutput(text=DONE),
        ScriptedOutput(text="ok"),
    ]
    forum_id, _, monologue_id = await gated_join(store, poster, script=script, tool=COUNT)
    await say(client, forum_id, "count, once approved")
    await approve_when_asked(store, client, forum_id)
    assert faulty.popen.wait(WAIT) == faults.EXIT_CODE, faulty.output()[-2000:]
    await processor_with(mesh, None)
    # Well before the tool's own deadline (120 s from the approval), which ended it before.
    await lines_until(store, forum_id, lambda lines: DONE in texts(lines), timeout=WAIT)

    assert counted(runs, "approved") == 0
    [[result]] = results_by_call(await store.history(monologue_id)).values()
    assert result.is_error and CUT_SHORT in result.output, result


async def test_an_approved_worker_call_cut_off_before_its_send_is_sent_after_a_restart(
    mesh: Mesh, store: Store, poster: Poster, client: Client, worker_tool: WorkerTool
) -> None:
    async def listed() -> bool:
        entry = (await ToolCatalog(store).entries(fresh=True)).get(worker_tool.name)
        return entry is not None and entry.ready

    await eventually(listed, timeout=WAIT, what=f"{worker_tool.name} in the catalog")
    worker = await WorkerProcess.start(worker_tool.url, worker_tool.name, "answer")
    try:
        await worker.line("ready", timeout=WAIT)
        faulty = await processor_with(mesh, DIES_APPROVED)
        script = [
            ScriptedOutput(tool_calls=[ScriptedCall(name=worker_tool.name, input={"q": "A1"})]),
            ScriptedOutput(text=DONE),
        ]
        forum_id, _, monologue_id = await gated_join(
            store, poster, script=script, tool=worker_tool.name
        )
        await say(client, forum_id, "refund A1, once approved")
        call_id = await approve_when_asked(store, client, forum_id)
        assert faulty.popen.wait(WAIT) == faults.EXIT_CODE, faulty.output()[-2000:]
        await processor_with(mesh, None)
        # Sent by the restarted processor, not left until the tool's deadline (600 s).
        await worker.line("call", timeout=WAIT, callId=call_id)
        await lines_until(store, forum_id, lambda lines: DONE in texts(lines), timeout=WAIT)
        [[result]] = results_by_call(await store.history(monologue_id)).values()
        assert not result.is_error and "A1" in result.output, result
    finally:
        await worker.stop()

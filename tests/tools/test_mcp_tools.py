"""MCP servers in the running mesh: registered with ``yoke tools``, called by agents.

The real test server (tests/support/mcp_server.py) is registered with ``yoke tools add-mcp``
(a subprocess, as an operator runs it) once the five services run: four times over stdio,
which the processor starts itself (``files``; ``tight``, with a short call timeout;
``sluggish``, slower to start than its call timeout; ``gone``, to be removed), and once over
streamable HTTP (``web``) as a process of the test's own that refuses every request without
its ``Authorization`` header. A stdio server is started in the processor's working directory
(the repository root, where tests/support/processes.py starts every service) with only the
allow-listed environment, no ``PYTHONPATH``: so its command is ``python -m
tests.support.mcp_server``, found from that directory. Each stdio server gets ``--env
SERVER_LABEL=NAME``, which tells the processor's children apart (their commands are the same)
and shows that ``--env`` reaches the server.

Agents are OpenAI models served by the fake OpenAI server, which records the tools each
request offers and refuses a prompt that breaks the order rules with a 400 (so a test that
asserts it refused nothing checks the prompts too); the agent answering alongside a hanging
call is ``fixture-echo``, which never reaches it.
"""

from __future__ import annotations

import asyncio
import json
import shlex
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.cli import run_yoke
from tests.support.fake_openai import FakeOpenAI, Reply, completion, openai_env
from tests.support.mcp_server import LONG_NAME, NUL_DESCRIPTION, RAW_SCHEMA
from tests.support.mesh import JoinFactory, Mesh, agent_lines, lines_until, say
from tests.support.processes import ROOT, eventually, free_port
from yoke.client import Client
from yoke.core.ids import derive_id
from yoke.core.models import Message, ToolCallPart, ToolResultPart
from yoke.runtime.calls.records import (
    TOOL_CALLS_COLLECTION,
    OpenCall,
    open_call_id,
    own_result_line_id,
)
from yoke.runtime.catalog_store import ToolCatalog
from yoke.runtime.joins import Join, join_id
from yoke.store.database import Store
from yoke.tools.catalog import CatalogEntry

pytestmark = pytest.mark.slow

WAIT = 60  # the most a test waits for anything the mesh does
# The tight server's call timeout: the hanging call is open from the 2 s inline bound until
# then, long enough for another forum's line to be answered meanwhile on a loaded machine
# (that took up to 4 s with a load average of 25 on 2 cores).
TIGHT_TIMEOUT = 10
TOKEN = "Bearer x"
MODULE = [sys.executable, "-m", "tests.support.mcp_server"]
# The test server's tools a model is offered (the names the mesh cannot use are not).
READY_TOOLS = {
    "echo",
    "add",
    "slow",
    "hang",
    "crash",
    "fail",
    "picture",
    "resources",
    "structured",
    "env",
    "pid",
    "add_tool",
    "schematic",
    "nul_described",
}
UNUSABLE_TOOLS = {LONG_NAME, "dotted.name"}


@pytest.fixture(scope="module")
def mesh_env(fake_openai: FakeOpenAI) -> dict[str, str]:
    return openai_env(fake_openai.base_url, give_up_seconds=10)


@dataclass(frozen=True)
class HttpServer:
    url: str
    process: subprocess.Popen[bytes]


@pytest.fixture(scope="module")
async def http_server() -> AsyncIterator[HttpServer]:
    """The test server over streamable HTTP on a free port, asking for ``TOKEN``."""
    port = free_port()
    args = [*MODULE, "--transport", "http", "--port", str(port)]
    process = subprocess.Popen([*args, "--require-header", f"Authorization: {TOKEN}"], cwd=ROOT)
    server = HttpServer(f"http://127.0.0.1:{port}/mcp", process)

    async def answers() -> bool:
        assert process.poll() is None, f"the MCP test server exited with {process.returncode}"
        try:
            async with httpx.AsyncClient(timeout=2) as client:
                await client.get(server.url)
            return True
        except httpx.TransportError:
            return False

    try:
        await eventually(answers, timeout=WAIT, what="the MCP test server to answer over HTTP")
        yield server
    finally:
        process.kill()
        process.wait(10)


async def add_stdio_server(
    mesh: Mesh, name: str, *options: str, start_delay: float | None = None
) -> None:
    """``yoke tools add-mcp NAME --command ...`` for the test server over stdio (started
    ``start_delay`` seconds late, as ``npx -y`` is when it fetches the server first)."""
    command = shlex.join([*MODULE, "--transport", "stdio"])
    if start_delay is not None:
        command = shlex.join(["sh", "-c", f"sleep {start_delay:g}; exec {command}"])
    code, out, err = await run_yoke(
        mesh.env, "tools", "add-mcp", name, "--command", command,
        "--env", f"SERVER_LABEL={name}", *options,
    )  # fmt: skip
    assert code == 0, err
    assert out.strip() == name


async def catalog_entries(store: Store) -> dict[str, CatalogEntry]:
    return await ToolCatalog(store).entries(fresh=True)


async def wait_listed(store: Store, server: str, tool: str = "echo") -> None:
    """Until a processor has listed ``server``'s tools (``tool`` ready) into the catalog."""

    async def listed() -> bool:
        entry = (await catalog_entries(store)).get(f"{server}__{tool}")
        return entry is not None and entry.ready

    await eventually(listed, timeout=WAIT, what=f"{server}__{tool} in the catalog", interval=0.3)


async def tools_list(mesh: Mesh) -> dict[str, dict[str, Any]]:
    """``yoke tools list --json``, by tool name."""
    code, out, err = await run_yoke(mesh.env, "tools", "list", "--json")
    assert code == 0, err
    rows = [json.loads(line) for line in out.splitlines() if line.strip()]
    return {row["name"]: row for row in rows}


@dataclass(frozen=True)
class Servers:
    files: str  # stdio, the default 30 s timeout
    tight: str  # stdio, TIGHT_TIMEOUT
    web: str  # streamable HTTP with the header
    # Registered with the others (so that they start side by side) but not waited for:
    sluggish: str  # stdio, starts later than its call timeout
    gone: str  # stdio, for removing


@pytest.fixture(scope="module")
async def mcp_servers(mesh: Mesh, store: Store, http_server: HttpServer) -> Servers:
    """The module's servers, registered side by side; the first three listed by the processor."""

    async def add_web() -> None:
        code, out, err = await run_yoke(
            mesh.env, "tools", "add-mcp", "web", "--url", http_server.url,
            "--header", f"Authorization: {TOKEN}",
        )  # fmt: skip
        assert code == 0, err
        assert out.strip() == "web"

    await asyncio.gather(
        add_stdio_server(mesh, "files"),
        add_stdio_server(mesh, "tight", "--timeout", str(TIGHT_TIMEOUT)),
        add_web(),
        add_stdio_server(mesh, "sluggish", "--timeout", "2", start_delay=4),
        add_stdio_server(mesh, "gone"),
    )
    for name in ("files", "tight", "web"):
        await wait_listed(store, name)
    return Servers("files", "tight", "web", "sluggish", "gone")


def stdio_servers_of(pid: int) -> dict[str, int]:
    """The test servers process ``pid`` started, by their ``SERVER_LABEL`` (the process id)."""
    found: dict[str, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            if parent != pid:
                continue
            environ = (stat.parent / "environ").read_bytes().split(b"\0")
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile, or not ours to read
        for variable in environ:
            name, _, value = variable.partition(b"=")
            if name == b"SERVER_LABEL":
                found[value.decode()] = int(stat.parent.name)
    return found


async def server_pid(mesh: Mesh, name: str, *, not_: int | None = None) -> int:
    """The pid of the processor's stdio server ``name`` (one other than ``not_``)."""
    processor = mesh.processes["processor"].pid
    found: list[int] = []

    async def running() -> bool:
        pid = stdio_servers_of(processor).get(name)
        found[:] = [pid] if pid is not None and pid != not_ else []
        return bool(found)

    await eventually(running, timeout=WAIT, what=f"the processor to run mcp server {name}")
    return found[0]


def results(lines: list[Message]) -> list[tuple[Message, ToolResultPart]]:
    return [
        (line, part) for line in lines for part in line.parts if isinstance(part, ToolResultPart)
    ]


def calls_line(monologue: list[Message]) -> Message:
    """The agent's (first) tool-call line."""
    return next(
        line
        for line in monologue
        if line.role == "agent" and any(isinstance(part, ToolCallPart) for part in line.parts)
    )


def round_results_id(join: Join, call_line: Message) -> str:
    """The id of the line holding the results that came back within the step."""
    return derive_id("tool-results", join_id(join.agent_actor_id, join.forum_id), call_line.id)


def own_line_id(join: Join, call_line: Message, model_call_id: str) -> str:
    """The id of the line of a call's own result, when it waited in the store."""
    instance = join_id(join.agent_actor_id, join.forum_id)
    return own_result_line_id(open_call_id(instance, call_line.id, model_call_id))


def offered(request: dict[str, Any]) -> set[str]:
    return {tool["function"]["name"] for tool in request.get("tools", [])}


async def answered(store: Store, forum_id: str, count: int = 1) -> list[str]:
    forum = await lines_until(store, forum_id, lambda ls: len(agent_lines(ls)) >= count, WAIT)
    return [line.text for line in agent_lines(forum)]


@dataclass(frozen=True)
class Turn:
    """A forum's agent once it has answered: its answers so far and its monologue."""

    forum_id: str
    join: Join
    answers: list[str]
    monologue: list[Message]

    @property
    def results(self) -> list[tuple[Message, ToolResultPart]]:
        return results(self.monologue)


@dataclass(frozen=True)
class Agents:
    """Turns of an OpenAI agent (the fake model) that calls the module's MCP tools."""

    store: Store
    client: Client
    new_join: JoinFactory
    model: FakeOpenAI

    async def turn(
        self,
        tools: list[str],
        line: str,
        calls: list[tuple[str, str, str]],
        answer: str,
        *,
        then: tuple[Reply, ...] = (),
    ) -> Turn:
        """A new agent offered ``tools`` is told ``line``: the model makes ``calls`` (id, tool,
        input), then says ``answer``, which must be the forum's one answer. ``then``: the
        model's replies for the turns after (:meth:`again`)."""
        self.model.script(completion(None, calls), completion(answer), *then)
        forum_id, join = await self.new_join(model="gpt-test", tools=tools)
        return await self.again(Turn(forum_id, join, [], []), line, answer)

    async def again(self, turn: Turn, line: str, answer: str) -> Turn:
        """``line`` said in the turn's forum: ``answer`` must be the forum's next answer."""
        await say(self.client, turn.forum_id, line)
        answers = [*turn.answers, answer]
        assert await answered(self.store, turn.forum_id, len(answers)) == answers
        monologue = await self.store.history(turn.join.monologue_id)
        return Turn(turn.forum_id, turn.join, answers, monologue)


@pytest.fixture
def agents(store: Store, client: Client, new_join: JoinFactory, fake_openai: FakeOpenAI) -> Agents:
    return Agents(store, client, new_join, fake_openai)


async def test_registered_servers_are_listed_ready_as_name__tool(
    mesh: Mesh, mcp_servers: Servers
) -> None:
    listing = await tools_list(mesh)
    for server in (mcp_servers.files, mcp_servers.tight, mcp_servers.web):
        for tool in READY_TOOLS:
            row = listing[f"{server}__{tool}"]
            assert (row["source"], row["origin"], row["status"]) == ("mcp", server, "ready")
        for tool in UNUSABLE_TOOLS:
            row = listing[f"{server}__{tool}"]
            assert row["status"] == "unavailable" and "must match" in row["reason"]
    assert listing[f"{mcp_servers.files}__echo"]["description"] == "Answers with its input."
    assert listing[f"{mcp_servers.web}__echo"]["inputSchema"]["required"] == ["text"]
    # Its "$schema", "$defs", "$ref", dotted and NUL-holding keys: listed as the server sent them.
    assert listing[f"{mcp_servers.files}__schematic"]["inputSchema"] == RAW_SCHEMA
    # A NUL the store cannot hold is replaced, not the reason the listing is lost.
    described = listing[f"{mcp_servers.files}__nul_described"]["description"]
    assert described == NUL_DESCRIPTION.replace("\0", "\ufffd") != NUL_DESCRIPTION


async def test_the_model_is_offered_a_tools_schema_exactly_as_the_server_sent_it(
    mcp_servers: Servers, agents: Agents, fake_openai: FakeOpenAI
) -> None:
    tool = f"{mcp_servers.web}__schematic"
    call = ("call-schematic", tool, json.dumps({"text": "hi"}))
    turn = await agents.turn([tool], "use the schematic tool", [call], "it answered")

    [spec] = fake_openai.requests[0]["tools"]
    assert spec["function"]["name"] == tool
    assert spec["function"]["parameters"] == RAW_SCHEMA
    [(_, result)] = turn.results
    assert (result.output, result.is_error) == ("schematic: hi", False)
    assert fake_openai.rejected == []


async def test_a_server_slower_to_start_than_its_call_timeout_is_still_connected(
    mcp_servers: Servers, store: Store
) -> None:
    # Were its start bounded by its 2 s call timeout, each attempt would be killed before
    # the server speaks, and it would be started again and again, never listed.
    await wait_listed(store, mcp_servers.sluggish)
    entry = (await catalog_entries(store))[f"{mcp_servers.sluggish}__echo"]
    assert (entry.source, entry.status, entry.timeout_seconds) == ("mcp", "ready", 2)


@pytest.mark.parametrize("transport", ["stdio", "http"])
async def test_an_agent_with_name__star_is_offered_the_servers_tools_and_calls_one(
    transport: str, mcp_servers: Servers, agents: Agents, fake_openai: FakeOpenAI
) -> None:
    server = mcp_servers.files if transport == "stdio" else mcp_servers.web
    text = f"hello over {transport} {uuid.uuid4().hex[:6]}"
    call = ("call-echo", f"{server}__echo", json.dumps({"text": text}))
    turn = await agents.turn([f"{server}__*"], "echo something", [call], f"{server} said it back")

    tools = offered(fake_openai.requests[0])
    assert {f"{server}__{tool}" for tool in READY_TOOLS} <= tools
    assert all(name.startswith(f"{server}__") for name in tools)
    assert not {f"{server}__{tool}" for tool in UNUSABLE_TOOLS} & tools
    [(line, result)] = turn.results
    # Answered within the step.
    assert line.id == round_results_id(turn.join, calls_line(turn.monologue))
    assert (result.call_id, result.output, result.is_error) == ("call-echo", text, False)
    assert fake_openai.rejected == []
    assert len(fake_openai.requests) == 2
    prompt = fake_openai.requests[1]["messages"]
    assert prompt[-1] == {"role": "tool", "tool_call_id": "call-echo", "content": text}


async def test_a_stdio_server_gets_its_env_and_none_of_the_mesh_secrets(
    mcp_servers: Servers, agents: Agents, fake_openai: FakeOpenAI
) -> None:
    asked = ["OPENAI_API_KEY", "YOKE_MONGODB_URL", "YOKE_AMQP_URL", "SERVER_LABEL", "PATH"]
    tool = f"{mcp_servers.files}__env"
    calls = [(f"call-{name}", tool, json.dumps({"name": name})) for name in asked]
    turn = await agents.turn([tool], "what does the server see?", calls, "read the environment")
    seen = {part.call_id: part.output for _, part in turn.results}
    assert seen["call-OPENAI_API_KEY"] == "<unset>"  # the mesh has one
    assert seen["call-YOKE_MONGODB_URL"] == "<unset>"
    assert seen["call-YOKE_AMQP_URL"] == "<unset>"
    assert seen["call-SERVER_LABEL"] == mcp_servers.files  # its own --env
    assert seen["call-PATH"] not in ("", "<unset>")  # allow-listed
    assert fake_openai.rejected == []


async def test_a_server_killed_mid_call_gives_an_error_and_is_started_again(
    mesh: Mesh, mcp_servers: Servers, agents: Agents, fake_openai: FakeOpenAI
) -> None:
    server = mcp_servers.files
    first = await server_pid(mesh, server)
    turn = await agents.turn(
        [f"{server}__*"],
        "crash it",
        [("call-crash", f"{server}__crash", "{}")],
        "the server fell over",
        then=(
            completion(None, [("call-echo", f"{server}__echo", '{"text": "back again"}')]),
            completion("the server is back"),
        ),
    )
    [(_, crashed)] = turn.results
    assert crashed.is_error
    assert crashed.output == f"the mcp server {server} closed the connection during the call"

    second = await server_pid(mesh, server, not_=first)  # the processor started it again
    assert second != first
    turn = await agents.again(turn, "try again", "the server is back")
    [_, (_, echoed)] = turn.results
    assert (echoed.call_id, echoed.output, echoed.is_error) == ("call-echo", "back again", False)
    assert fake_openai.rejected == []
    assert len(fake_openai.requests) == 4


async def test_a_hanging_call_waits_in_the_store_and_times_out_while_others_are_answered(
    mcp_servers: Servers,
    store: Store,
    client: Client,
    new_join: JoinFactory,
    fake_openai: FakeOpenAI,
) -> None:
    hang = f"{mcp_servers.tight}__hang"
    fake_openai.script(
        completion(None, [("call-hang", hang, "{}")]), completion("the tool never answered")
    )
    forum_id, join = await new_join(model="gpt-test", tools=[hang])
    echo_forum, echo_join = await new_join(name="echo")  # fixture-echo, in a forum of its own
    await say(client, forum_id, "call the tool that hangs")
    found: list[OpenCall] = []

    async def waiting() -> bool:
        document = await store.db[TOOL_CALLS_COLLECTION].find_one(
            {"conversationId": join.monologue_id}
        )
        found[:] = [OpenCall.from_document(document)] if document is not None else []
        return bool(found)

    await eventually(waiting, timeout=WAIT, what="the hanging call to wait in the store")
    [open_call] = found
    assert (open_call.tool, open_call.source, open_call.model_call_id) == (hang, "mcp", "call-hang")
    assert open_call.timeout_seconds == TIGHT_TIMEOUT

    said = datetime.now(UTC)
    await say(client, echo_forum, "are you there?")
    # The processor's answer, in the echo agent's monologue (egress copies it to its forum).
    echo_lines = await lines_until(
        store, echo_join.monologue_id, lambda ls: len(agent_lines(ls)) >= 1, WAIT
    )
    [echo] = agent_lines(echo_lines)
    assert echo.text == "are you there?"
    assert await answered(store, echo_forum) == ["are you there?"]

    assert await answered(store, forum_id) == ["the tool never answered"]
    monologue = await store.history(join.monologue_id)
    call_line = calls_line(monologue)
    [(line, result)] = results(monologue)
    assert line.id == own_result_line_id(open_call.id) == own_line_id(join, call_line, "call-hang")
    assert line.parts == [result]
    assert result.is_error
    assert result.output == f"{hang} timed out after {TIGHT_TIMEOUT}s"
    assert await store.get_message(round_results_id(join, call_line)) is None
    # The other forum was answered while the call waited (the processor held nothing for it).
    assert aware(open_call.opened_at) < said < aware(echo.created_at)
    assert aware(echo.created_at) < aware(line.created_at), (
        f"the echo took {(aware(echo.created_at) - said).total_seconds():.1f}s"
    )
    elapsed = (aware(line.created_at) - aware(call_line.created_at)).total_seconds()
    assert elapsed >= TIGHT_TIMEOUT
    assert await store.db[TOOL_CALLS_COLLECTION].find_one({"_id": open_call.id}) is None
    assert fake_openai.rejected == []
    assert len(fake_openai.requests) == 2


def aware(moment: datetime) -> datetime:
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)


async def test_a_slow_call_past_the_inline_bound_lands_as_its_own_line_answered_once(
    mcp_servers: Servers, agents: Agents, store: Store, fake_openai: FakeOpenAI
) -> None:
    slow = f"{mcp_servers.files}__slow"
    call = ("call-slow", slow, '{"seconds": 3}')
    turn = await agents.turn([slow], "take your time", [call], "that took a while")

    call_line = calls_line(turn.monologue)
    [(line, result)] = turn.results
    assert line.id == own_line_id(turn.join, call_line, "call-slow")
    assert line.parts == [result]
    assert (result.call_id, result.output, result.is_error) == ("call-slow", "slept 3.0", False)
    assert await store.get_message(round_results_id(turn.join, call_line)) is None
    assert [text.text for text in agent_lines(turn.monologue) if text.text] == ["that took a while"]
    assert fake_openai.rejected == []
    assert len(fake_openai.requests) == 2
    assert fake_openai.requests[1]["messages"][-1] == {
        "role": "tool",
        "tool_call_id": "call-slow",
        "content": "slept 3.0",
    }


async def test_tools_list_changed_brings_a_new_tool_to_the_catalog_and_the_agent(
    mcp_servers: Servers, agents: Agents, store: Store, fake_openai: FakeOpenAI
) -> None:
    server = mcp_servers.files
    turn = await agents.turn(
        [f"{server}__*"],
        "add a tool",
        [("call-add", f"{server}__add_tool", "{}")],
        "added a tool",
        then=(
            completion(None, [("call-late", f"{server}__late", '{"text": "new"}')]),
            completion("used the new tool"),
        ),
    )
    [(_, added)] = turn.results
    assert (added.output, added.is_error) == ("added late", False)

    await wait_listed(store, server, "late")
    late_entry = (await catalog_entries(store))[f"{server}__late"]
    assert (late_entry.origin, late_entry.description) == (
        server,
        "Registered only by ``add_tool``.",
    )
    turn = await agents.again(turn, "use it", "used the new tool")
    assert f"{server}__late" in offered(fake_openai.requests[2])
    [_, (_, late)] = turn.results
    assert (late.output, late.is_error) == ("late: new", False)
    assert fake_openai.rejected == []


async def test_a_removed_server_leaves_the_catalog_and_a_call_to_it_is_an_error_result(
    mesh: Mesh, mcp_servers: Servers, agents: Agents, store: Store, fake_openai: FakeOpenAI
) -> None:
    server = mcp_servers.gone
    await wait_listed(store, server)
    pid = await server_pid(mesh, server)
    code, _, err = await run_yoke(mesh.env, "tools", "remove", server)
    assert code == 0, err
    assert f"removed MCP server {server}" in err

    async def unlisted() -> bool:
        return not any(name.startswith(f"{server}__") for name in await tools_list(mesh))

    await eventually(unlisted, timeout=WAIT, what=f"{server}'s tools to leave the catalog")

    async def stopped() -> bool:
        return pid not in stdio_servers_of(mesh.processes["processor"].pid).values()

    await eventually(stopped, timeout=WAIT, what="the processor to stop the removed server")
    assert not any(name.startswith(f"{server}__") for name in await catalog_entries(store))

    call = ("call-gone", f"{server}__echo", '{"text": "anyone?"}')
    turn = await agents.turn([f"{server}__echo"], "use the old tool", [call], "that tool is gone")
    [(_, result)] = turn.results
    assert result.is_error and f"{server}__echo" in result.output
    assert fake_openai.rejected == []
    assert fake_openai.requests[1]["messages"][-1] == {
        "role": "tool",
        "tool_call_id": "call-gone",
        "content": f"ERROR: {result.output}",
    }
    assert await mesh.processes["processor"].healthy()

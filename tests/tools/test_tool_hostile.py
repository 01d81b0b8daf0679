"""Hostile tools and models in the running mesh: CPU they take, text the store refuses.

One processor serves every forum here. CPU (docs/tools.md, "Plugins"): a ``fixture-script``
agent calls the calculator on an expression Python would take minutes to compute, or
``cpu_hog`` (tests/support/cpu_hog.py), a plugin installed beside the processor whose ``async``
function computes for :data:`HOG_SECONDS` without one ``await``; meanwhile a ``fixture-echo``
agent in another forum must still answer, well before the hog would be done, and the hostile
call ends with an error result, once.

Text (invariant 15): U+0000 and lone surrogates, which the store cannot hold, in an MCP
tool's answer (tests/support/binary_mcp_server.py, registered with ``yoke tools add-mcp``), in a
worker's answer (JSON ``\u0000`` and ``\ud800``, published by this test as the tool's user)
and in an OpenAI model's text and tool-call arguments (the fake OpenAI server): each round ends
with one stored result and one answer, U+FFFD in their place, nothing set aside.
"""

from __future__ import annotations

import asyncio
import json
import shlex
import sys
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import aio_pika
import pytest

from tests.support.binary_mcp_server import BINARY_TEXT
from tests.support.cli import run_yoke
from tests.support.cpu_hog import HOG_TIMEOUT, plugin_path
from tests.support.fake_openai import FakeOpenAI, completion, openai_env
from tests.support.mesh import JoinFactory, Launch, Mesh, agent_lines, lines_until, say
from tests.support.processes import eventually
from tests.support.worker_tools import CLI_SECONDS, WorkerTool, registered_worker_tool
from yoke.bus import topology
from yoke.client import Client
from yoke.core.models import Message, ToolCallPart, ToolResultPart
from yoke.llm.base import ScriptedCall, ScriptedOutput
from yoke.runtime.catalog_store import ToolCatalog
from yoke.store.database import Store

pytestmark = pytest.mark.slow

HOSTILE = "(((9**99)**99)**99)**99"  # a 36 MiB integer, minutes of one core, as Python computes
HOG_SECONDS = 20  # how long cpu_hog computes: the other forum is answered well before
PROMPT = 12  # the most another forum's line may take meanwhile (a loaded 2-core machine)
WAIT = 60
UNSTORABLE = "bin\x00ary \ud800 text"  # what the store cannot hold
STORED = "bin\ufffdary \ufffd text"  # what it holds instead


@pytest.fixture(scope="module")
def mesh_env(fake_openai: FakeOpenAI) -> dict[str, str]:
    return openai_env(fake_openai.base_url, give_up_seconds=10)


@pytest.fixture(scope="module")
async def worker_tool(
    amqp_url: str, module_mongodb_url: str, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[WorkerTool]:
    """A worker tool, registered before the services start (so the processor's first read of
    the catalog holds it); its user is deleted afterwards."""
    async with registered_worker_tool(
        amqp_url,
        module_mongodb_url,
        f"bin{uuid.uuid4().hex[:8]}",
        {"type": "object", "properties": {"path": {"type": "string"}}},
        Path(tmp_path_factory.mktemp("tool")),
        description="reads a file",
        timeout=WAIT,
    ) as tool:
        yield tool


@pytest.fixture(scope="module")
def before_mesh(worker_tool: WorkerTool) -> None:
    """The worker tool is in the catalog when the services start."""


@pytest.fixture(scope="module")
def mesh_launch(tmp_path_factory: pytest.TempPathFactory) -> Launch:
    """The processor with ``cpu_hog`` installed beside it."""
    plugins = plugin_path(Path(tmp_path_factory.mktemp("plugins")))
    return {"processor": (["-m", "services.processor"], {"PYTHONPATH": plugins})}


def results(lines: list[Message]) -> list[ToolResultPart]:
    return [part for line in lines for part in line.parts if isinstance(part, ToolResultPart)]


def has_call(lines: list[Message]) -> bool:
    return any(isinstance(part, ToolCallPart) for line in lines for part in line.parts)


async def hostile_call_meanwhile_another_forum_is_answered(
    store: Store, client: Client, new_join: JoinFactory, tool: str, arguments: dict[str, object]
) -> tuple[ToolResultPart, float]:
    """The hostile agent's one result, and how long the other forum's answer took."""
    script = [
        ScriptedOutput(tool_calls=[ScriptedCall(name=tool, input=arguments)]),
        ScriptedOutput(text="the tool is done"),
    ]
    hostile_forum, hostile = await new_join(model="fixture-script", tools=[tool], script=script)
    other_forum, _ = await new_join(name="other", model="fixture-echo")
    await say(client, hostile_forum, "run the tool")
    await lines_until(store, hostile.monologue_id, has_call, WAIT)  # the call runs from now
    asked = time.monotonic()
    await say(client, other_forum, "are you there?")

    async def answered() -> bool:
        lines = await store.history(other_forum)
        return [line.text for line in agent_lines(lines)] == ["are you there?"]

    await eventually(answered, timeout=PROMPT, what="the other forum's answer")
    took = time.monotonic() - asked

    forum = await lines_until(store, hostile_forum, lambda ls: len(agent_lines(ls)) >= 1, WAIT)
    assert [line.text for line in agent_lines(forum)] == ["the tool is done"]
    monologue = await store.history(hostile.monologue_id)
    [result] = results(monologue)
    assert [line.type for line in monologue if line.type == "notice"] == []  # nothing set aside
    return result, took


async def test_a_hostile_calculator_expression_ends_in_error_and_other_forums_go_on(
    store: Store, client: Client, new_join: JoinFactory
) -> None:
    result, _ = await hostile_call_meanwhile_another_forum_is_answered(
        store, client, new_join, "calculator", {"expression": HOSTILE}
    )
    assert result.is_error
    assert "too large" in result.output, result.output


async def test_a_plugin_hogging_cpu_ends_at_its_timeout_and_other_forums_go_on(
    store: Store, client: Client, new_join: JoinFactory
) -> None:
    result, took = await hostile_call_meanwhile_another_forum_is_answered(
        store, client, new_join, "cpu_hog", {"seconds": HOG_SECONDS}
    )
    assert (result.is_error, result.output) == (True, f"cpu_hog timed out after {HOG_TIMEOUT:g}s")
    assert took < HOG_SECONDS - 5, took  # answered while the hog still computed


# --- text the store refuses -------------------------------------------------------------------


async def one_result_and_one_answer(
    store: Store, forum_id: str, monologue_id: str, answer: str
) -> ToolResultPart:
    """The round's one stored result, once the forum has the agent's one answer."""
    forum = await lines_until(store, forum_id, lambda ls: len(agent_lines(ls)) >= 1, WAIT)
    assert [line.text for line in agent_lines(forum)] == [answer]
    monologue = await store.history(monologue_id)
    assert [line.text for line in monologue if line.type == "notice"] == []  # nothing set aside
    [result] = results(monologue)
    return result


def reads_a_file(tool: str, answer: str = "read it") -> list[ScriptedOutput]:
    return [
        ScriptedOutput(tool_calls=[ScriptedCall(name=tool, input={"path": "logo.png"})]),
        ScriptedOutput(text=answer),
    ]


async def test_an_mcp_tool_answering_with_nuls_is_stored_once_and_answered(
    store: Store, client: Client, new_join: JoinFactory, mesh: Mesh
) -> None:
    command = shlex.join([sys.executable, "-m", "tests.support.binary_mcp_server"])
    code, _, err = await run_yoke(
        mesh.env, "tools", "add-mcp", "files", "--command", command, timeout=CLI_SECONDS
    )
    assert code == 0, err
    tool = "files__read_text_file"

    async def listed() -> bool:
        entry = (await ToolCatalog(store).entries(fresh=True)).get(tool)
        return entry is not None and entry.ready

    await eventually(listed, timeout=WAIT, what=f"{tool} in the catalog", interval=0.3)
    forum_id, join = await new_join(model="fixture-script", tools=[tool], script=reads_a_file(tool))
    await say(client, forum_id, "read the logo")
    result = await one_result_and_one_answer(store, forum_id, join.monologue_id, "read it")
    assert (result.output, result.is_error) == (BINARY_TEXT.replace("\x00", "\ufffd"), False)


async def test_a_workers_answer_with_nul_and_a_lone_surrogate_is_stored_once_and_answered(
    store: Store, client: Client, new_join: JoinFactory, worker_tool: WorkerTool
) -> None:
    tool = worker_tool.name
    forum_id, join = await new_join(model="fixture-script", tools=[tool], script=reads_a_file(tool))
    connection = await aio_pika.connect(worker_tool.url)
    try:
        channel = await connection.channel()
        replies: asyncio.Queue[bytes] = asyncio.Queue()
        calls: asyncio.Queue[aio_pika.abc.AbstractIncomingMessage] = asyncio.Queue()

        async def on_reply(message: aio_pika.abc.AbstractIncomingMessage) -> None:
            await replies.put(message.body)

        reply_to = await channel.get_queue("amq.rabbitmq.reply-to", ensure=False)
        await reply_to.consume(on_reply, no_ack=True)
        queue = await channel.get_queue(topology.tool_queue(tool), ensure=False)
        await queue.consume(calls.put)
        await say(client, forum_id, "read the logo")
        call = await asyncio.wait_for(calls.get(), WAIT)
        call_id = json.loads(call.body)["callId"]
        # JSON as any writer escapes them: "bin\u0000ary \ud800 text".
        body = json.dumps({"callId": call_id, "output": UNSTORABLE})
        assert "\\u0000" in body and "\\ud800" in body
        exchange = await channel.get_exchange(topology.COMMANDS_EXCHANGE, ensure=False)
        await exchange.publish(
            aio_pika.Message(
                body.encode(),
                content_type="application/json",
                user_id=worker_tool.user,
                reply_to="amq.rabbitmq.reply-to",
            ),
            routing_key=topology.TOOL_RESULT_COMMAND,
        )
        reply = json.loads(await asyncio.wait_for(replies.get(), WAIT))
        await call.ack()
    finally:
        await connection.close()
    assert reply["status"] == "accepted", reply
    result = await one_result_and_one_answer(store, forum_id, join.monologue_id, "read it")
    assert (result.output, result.is_error) == (STORED, False)


async def test_an_openai_model_answering_with_nul_and_a_lone_surrogate_is_stored_and_answered(
    store: Store, client: Client, new_join: JoinFactory, fake_openai: FakeOpenAI
) -> None:
    arguments = json.dumps({"expression": "6 * 7", "why": UNSTORABLE, UNSTORABLE: 1})
    fake_openai.script(
        completion(None, [("call-c", "calculator", arguments)]),
        completion(f"forty-two: {UNSTORABLE}"),
    )
    forum_id, join = await new_join(model="gpt-test", tools=["calculator"])
    await say(client, forum_id, "what is six times seven?")
    result = await one_result_and_one_answer(
        store, forum_id, join.monologue_id, f"forty-two: {STORED}"
    )
    assert (result.output, result.is_error) == ("42", False)
    monologue = await store.history(join.monologue_id)
    [call] = [part for line in monologue for part in line.parts if isinstance(part, ToolCallPart)]
    assert call.input == {"expression": "6 * 7", "why": STORED, STORED: 1}
    assert fake_openai.rejected == []

"""A worker's call waits in the store (docs/architecture.md, invariant 12), in a mesh of real
processes.

Each test's agent (``fixture-script``) calls a worker tool registered with ``yoke tools
add-worker``, served by the pika worker (tests/support/pika_worker.py) as a process of its own:

- a call held open for a while holds no delivery (every processor shard reads 0 unacked on the
  broker) while 20 other forums are answered, and its result is answered once it comes;
- the processor killed with SIGKILL while a call is open: the door (ingestion) takes the answer
  meanwhile, and the restarted processor answers it once;
- every service stopped (SIGTERM) across a call's deadline: once they are back, the call ends
  with the error result once and the agent answers it; the worker's late answer is refused;
- the worker killed mid-call: the call goes to another worker and is answered once.

After each answer a last line is said and answered: lines of a monologue are taken in order, so
once it is answered nothing of the round is left to run, and counting then is exact.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from tests.support.broker import Management
from tests.support.cli import run_yoke_commands
from tests.support.mesh import START_SECONDS, JoinFactory, Mesh, agent_lines, lines_until, say
from tests.support.processes import eventually
from tests.support.worker_process import WorkerProcess, as_user
from tests.support.worker_tools import WorkerTool, serving
from yoke.bus import topology
from yoke.bus.amqp_nodes import amqp_vhost
from yoke.client import Client
from yoke.core.models import Message, ToolResultPart
from yoke.llm.base import ScriptedCall, ScriptedOutput
from yoke.runtime.calls.records import (
    TOOL_CALL_ENDS_COLLECTION,
    TOOL_CALLS_COLLECTION,
    own_result_line_id,
)
from yoke.runtime.joins import create_agent, create_forum, join_conversation
from yoke.runtime.posting import Poster
from yoke.store.database import Store

pytestmark = pytest.mark.slow

# Seconds a call of the tools the tests end themselves may wait: far more than any test runs.
LONG_TIMEOUT = 120.0
# The deadline test's tool: long enough to stop every service before it, short to wait out.
SHORT_TIMEOUT = 5.0
# Which test uses which tool (each its own: a call left in one test's queue reaches no other).
TOOLS = {
    "held": LONG_TIMEOUT,
    "processor": LONG_TIMEOUT,
    "deadline": SHORT_TIMEOUT,
    "worker": LONG_TIMEOUT,
}
OTHER_FORUMS = 20
ANSWER = "the tool has answered"
AFTER = "nothing else"
WAIT = 60.0  # the most any step of a test may take on a loaded machine


@pytest.fixture(scope="module")
async def tools(
    servers: tuple[str, str, str],
    amqp_url: str,
    module_mongodb_url: str,
    management: Management,
    tmp_path_factory: pytest.TempPathFactory,
) -> AsyncIterator[dict[str, WorkerTool]]:
    """The tests' worker tools, registered as an operator does, before the mesh starts (a
    processor trusts its copy of the catalog for a few seconds), in one ``yoke`` process (a
    start-up for each would cost more than the module's tests). Users are per broker: each
    name is new, and its user is deleted after the module."""
    schema = Path(tmp_path_factory.mktemp("tools")) / "schema.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"q": {"type": "string"}}}))
    env = {
        "YOKE_AMQP_URL": amqp_url,
        "YOKE_MONGODB_URL": module_mongodb_url,
        "YOKE_MANAGEMENT_URL": servers[2],
    }
    names = {use: f"w{uuid.uuid4().hex[:10]}" for use in TOOLS}
    users = {use: topology.tool_user(name, amqp_vhost(amqp_url)) for use, name in names.items()}

    commands = [
        [
            "tools",
            "add-worker",
            names[use],
            "--schema",
            str(schema),
            "--description",
            f"answers the {use} test",
            "--timeout",
            f"{timeout:g}",
        ]
        for use, timeout in TOOLS.items()
    ]
    try:
        code, outputs, err = await run_yoke_commands(env, commands)
        assert code == 0 and len(outputs) == len(TOOLS), err
        # add-worker prints the new user's password on its last line.
        passwords = [output.strip().splitlines()[-1] for output in outputs]
        yield {
            use: WorkerTool(names[use], users[use], as_user(amqp_url, users[use], password))
            for use, password in zip(TOOLS, passwords, strict=True)
        }
    finally:
        for user in users.values():
            await management.delete_user(user)


@pytest.fixture(scope="module")
def before_mesh(tools: dict[str, WorkerTool]) -> None:
    """The worker tools are in the catalog when the services start."""


async def stop_every_service(mesh: Mesh) -> None:
    """SIGTERM to each service at once; each must shut down cleanly."""
    processes = list(mesh.processes.values())
    codes = await asyncio.gather(*(asyncio.to_thread(process.stop) for process in processes))
    assert codes == [0] * len(processes), dict(zip(mesh.processes, codes, strict=True))


async def calling_agent(new_join: JoinFactory, tool: WorkerTool) -> tuple[str, str]:
    """A forum whose agent calls ``tool`` at its first line, answers its result with
    :data:`ANSWER` and the line after with :data:`AFTER`; returns (forum, monologue)."""
    script = [
        ScriptedOutput(tool_calls=[ScriptedCall(name=tool.name, input={"q": "question"})]),
        ScriptedOutput(text=ANSWER),
        ScriptedOutput(text=AFTER),
    ]
    forum_id, join = await new_join(model="fixture-script", tools=[tool.name], script=script)
    return forum_id, join.monologue_id


def results(lines: list[Message]) -> list[ToolResultPart]:
    return [part for line in lines for part in line.parts if isinstance(part, ToolResultPart)]


def texts(lines: list[Message]) -> list[str]:
    return [line.text for line in agent_lines(lines) if line.text]


async def answered_once(
    store: Store, client: Client, forum_id: str, monologue_id: str, call_id: str
) -> ToolResultPart:
    """The agent answered the call's result, then one more line, each exactly once; the call
    ended once and nothing of it is left open. Returns the result."""
    await lines_until(store, forum_id, lambda lines: texts(lines) == [ANSWER], timeout=WAIT)
    await say(client, forum_id, "anything else?")
    forum = await lines_until(store, forum_id, lambda lines: len(texts(lines)) >= 2, timeout=WAIT)
    assert texts(forum) == [ANSWER, AFTER]
    monologue = await store.history(monologue_id)
    [result] = results(monologue)
    [result_line] = [line for line in monologue if results([line])]
    assert result_line.id == own_result_line_id(call_id)
    # The agent's answer is the step of that result, once.
    [answer] = [line for line in agent_lines(monologue) if line.text == ANSWER]
    assert answer.meta.causation_id == result_line.id and answer.seq > result_line.seq
    assert await store.db[TOOL_CALLS_COLLECTION].find_one({"_id": call_id}) is None
    assert await store.db[TOOL_CALL_ENDS_COLLECTION].count_documents({"_id": call_id}) == 1
    return result


def accepted_once(process: WorkerProcess, call_id: str) -> None:
    """The door took one answer to the call; any repeat was a duplicate that changed nothing."""
    replies = [
        line["reply"]
        for line in process.lines
        if line["event"] == "reply" and line["callId"] == call_id
    ]
    firsts = [reply for reply in replies if not reply.get("duplicate")]
    assert [reply["status"] for reply in firsts] == ["accepted"], replies
    assert all(reply["status"] == "accepted" for reply in replies), replies


def call_output(result: ToolResultPart) -> Any:
    assert not result.is_error, result.output
    return json.loads(result.output)


def echoed(text: str) -> Callable[[list[Message]], bool]:
    return lambda lines: texts(lines) == [text]


async def still_open(store: Store, call_id: str) -> bool:
    open_call = await store.db[TOOL_CALLS_COLLECTION].find_one({"_id": call_id})
    end = await store.db[TOOL_CALL_ENDS_COLLECTION].find_one({"_id": call_id})
    return open_call is not None and end is None


async def processor_shards(management: Management) -> list[dict[str, Any]]:
    queues = await management.queues()
    shards = [queue for name, queue in queues.items() if name.startswith("yoke.processor.shard.")]
    assert shards, sorted(queues)
    return shards


def acked(shards: list[dict[str, Any]]) -> int:
    return sum(int((shard.get("message_stats") or {}).get("ack", 0)) for shard in shards)


async def test_a_call_held_open_holds_no_delivery_while_other_forums_are_answered(
    mesh: Mesh,
    tools: dict[str, WorkerTool],
    management: Management,
    store: Store,
    poster: Poster,
    client: Client,
    new_join: JoinFactory,
    tmp_path: Path,
) -> None:
    tool = tools["held"]
    release = tmp_path / "release"
    forum_id, monologue_id = await calling_agent(new_join, tool)

    async def echo_forum(index: int) -> str:
        forum = await create_forum(store, f"meanwhile {index}")
        agent = await create_agent(store, "echo")
        await join_conversation(store, poster, agent.id, forum.id)
        return forum.id

    others = await asyncio.gather(*(echo_forum(index) for index in range(OTHER_FORUMS)))
    async with serving(tool, "hold", "--release", str(release), "--marker", "held") as held:
        await say(client, forum_id, "ask the tool")
        call_id = (await held.line("call", timeout=WAIT))["callId"]
        before = acked(await processor_shards(management))

        said = [f"meanwhile {index}" for index in range(OTHER_FORUMS)]
        await asyncio.gather(*(say(client, *line) for line in zip(others, said, strict=True)))
        await asyncio.gather(
            *(
                lines_until(store, other, echoed(text), timeout=WAIT)
                for other, text in zip(others, said, strict=True)
            )
        )

        async def nothing_unacked() -> bool:
            # The figures lag by the broker's statistics interval: one that counts the acks of
            # the lines just answered is newer than the call, and then must read 0 unacked.
            shards = await processor_shards(management)
            return acked(shards) >= before + OTHER_FORUMS and all(
                shard.get("messages_unacknowledged") == 0 for shard in shards
            )

        await eventually(
            nothing_unacked, timeout=WAIT, interval=0.5, what="0 unacked on processor shards"
        )
        # All of that while the call was open and unanswered.
        assert await still_open(store, call_id)
        assert results(await store.history(monologue_id)) == []
        assert texts(await store.history(forum_id)) == []

        release.touch()
        result = await answered_once(store, client, forum_id, monologue_id, call_id)
        accepted_once(held, call_id)
    assert call_output(result) == {"input": {"q": "question"}, "marker": "held"}


async def test_a_call_answered_while_the_processor_is_killed_is_answered_once_after(
    mesh: Mesh,
    tools: dict[str, WorkerTool],
    store: Store,
    client: Client,
    new_join: JoinFactory,
    tmp_path: Path,
) -> None:
    tool = tools["processor"]
    release = tmp_path / "release"
    forum_id, monologue_id = await calling_agent(new_join, tool)
    async with serving(tool, "hold", "--release", str(release), "--marker", "late") as held:
        await say(client, forum_id, "ask the tool")
        call_id = (await held.line("call", timeout=WAIT))["callId"]
        mesh.processes["processor"].kill()

        release.touch()
        reply = await held.line("reply", timeout=WAIT, callId=call_id)
        assert reply["reply"]["status"] == "accepted", reply
        # The door wrote the result with no processor running; nobody answered it yet.
        assert await store.get_message(own_result_line_id(call_id)) is not None
        assert texts(await store.history(forum_id)) == []

        await mesh.start("processor").wait_healthy(timeout=START_SECONDS)
        result = await answered_once(store, client, forum_id, monologue_id, call_id)
        accepted_once(held, call_id)
    assert call_output(result)["marker"] == "late"


async def test_a_deadline_passed_while_every_service_was_stopped_ends_the_call_once(
    mesh: Mesh,
    tools: dict[str, WorkerTool],
    store: Store,
    client: Client,
    new_join: JoinFactory,
    tmp_path: Path,
) -> None:
    tool = tools["deadline"]
    release = tmp_path / "release"
    forum_id, monologue_id = await calling_agent(new_join, tool)
    async with serving(tool, "hold", "--release", str(release)) as held:
        await say(client, forum_id, "ask the tool")
        call_id = (await held.line("call", timeout=WAIT))["callId"]
        await stop_every_service(mesh)
        # Stopped before the deadline: nothing has ended the call.
        document = await store.db[TOOL_CALLS_COLLECTION].find_one({"_id": call_id})
        assert document is not None and await still_open(store, call_id), "stopped too late"
        deadline: datetime = document["deadline"].replace(tzinfo=UTC)

        async def past_deadline() -> bool:
            return datetime.now(UTC) > deadline

        await eventually(past_deadline, timeout=SHORT_TIMEOUT + 1, what="the call's deadline")
        assert await still_open(store, call_id)  # nothing ran meanwhile to end it
        await mesh.start_all()

        result = await answered_once(store, client, forum_id, monologue_id, call_id)
        assert result.is_error
        assert result.output == f"{tool.name} gave no answer within {SHORT_TIMEOUT:g} s"
        end = await store.db[TOOL_CALL_ENDS_COLLECTION].find_one({"_id": call_id})
        assert end is not None and end["outcome"] == "timeout"

        # The worker's answer, come too late, is refused and changes nothing.
        release.touch()
        reply = await held.line("reply", timeout=WAIT, callId=call_id)
        assert reply["reply"]["status"] == "rejected", reply
        assert reply["reply"]["code"] == "call_closed", reply
    assert results(await store.history(monologue_id)) == [result]


async def test_a_call_held_by_a_killed_worker_goes_to_another_and_is_answered_once(
    mesh: Mesh,
    tools: dict[str, WorkerTool],
    store: Store,
    client: Client,
    new_join: JoinFactory,
    tmp_path: Path,
) -> None:
    tool = tools["worker"]
    forum_id, monologue_id = await calling_agent(new_join, tool)
    never = str(tmp_path / "never-released")
    async with serving(tool, "hold", "--release", never, "--marker", "first") as first:
        await say(client, forum_id, "ask the tool")
        call = await first.line("call", timeout=WAIT)
        call_id = call["callId"]
        assert call["redelivered"] is False
        # Another worker consumes too, but the call is the first one's until it dies.
        async with serving(tool, "answer", "--marker", "second") as second:
            await first.kill()
            again = await second.line("call", timeout=WAIT, callId=call_id)
            assert again["redelivered"] is True
            assert again["call"]["idempotencyKey"] == call["call"]["idempotencyKey"]
            result = await answered_once(store, client, forum_id, monologue_id, call_id)
            accepted_once(second, call_id)
        assert [line for line in first.lines if line["event"] == "reply"] == []
    assert call_output(result)["marker"] == "second"

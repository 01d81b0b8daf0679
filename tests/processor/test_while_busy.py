"""What a line does while the agent is busy (``whileBusy``), and a person's ``/stop``.

The services run as real processes; agents talk to the fake OpenAI server, which refuses a
prompt breaking the message-order rules (so ``not fake_openai.rejected`` checks every prompt),
or to the ``fixture-stream`` echo. A slow model step is an answer streamed in pieces with a
pause between them. A bridge bound to ``yoke.forum`` watches the drafts. The worker tool of
the stop test is registered with ``yoke tools add-worker`` before the services start and served
by the pika worker (tests/support/pika_worker.py) holding its calls.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aio_pika
import pytest
from aio_pika.abc import AbstractIncomingMessage

from tests.support.fake_openai import FakeOpenAI, completion, openai_env, streamed
from tests.support.mesh import JoinFactory, Mesh, agent_lines, lines_until, say
from tests.support.processes import eventually
from tests.support.worker_process import WorkerProcess
from tests.support.worker_tools import WorkerTool, registered_worker_tool
from yoke.bus import topology
from yoke.client import Client
from yoke.core.models import AgentDelta, Envelope, Message, ToolResultPart
from yoke.llm.base import ScriptedCall, ScriptedOutput
from yoke.runtime.calls.records import TOOL_CALL_ENDS_COLLECTION
from yoke.store.database import Store

pytestmark = pytest.mark.slow

WAIT = 30  # the most a test waits for anything the mesh does
# A slow model step: an answer in PIECES pieces, PAUSE seconds apart (6 s). A step meant to be
# cancelled is slower still (LONG pieces: 12 s), so that on a loaded machine the line that
# cancels it arrives in time; it costs nothing unless the cancel fails.
PIECES, PAUSE, LONG = 20, 0.3, 40


@pytest.fixture(scope="module")
def mesh_env(fake_openai: FakeOpenAI) -> dict[str, str]:
    # A patient provider: a loaded machine must not turn a slow step into a give-up.
    return openai_env(fake_openai.base_url, give_up_seconds=30)


@pytest.fixture(scope="module")
async def worker_tool(
    amqp_url: str, module_mongodb_url: str, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[WorkerTool]:
    """A worker tool of the module's own; its user is deleted afterwards (users are
    broker-wide)."""
    async with registered_worker_tool(
        amqp_url,
        module_mongodb_url,
        f"busy{uuid.uuid4().hex[:8]}",
        {"type": "object", "properties": {"q": {"type": "string"}}},
        Path(tmp_path_factory.mktemp("tool")),
        description="looks something up, slowly",
        timeout=120,
    ) as tool:
        yield tool


@pytest.fixture(scope="module")
def before_mesh(worker_tool: WorkerTool) -> None:
    """The worker tool is in the catalog when the services start."""


@contextlib.asynccontextmanager
async def drafts(amqp_url: str, forum_id: str) -> AsyncIterator[list[AgentDelta]]:
    """The forum's ``agent.delta`` events as a bridge bound to ``yoke.forum`` gets them."""
    seen: list[AgentDelta] = []
    connection = await aio_pika.connect(amqp_url)
    try:
        channel = await connection.channel()
        queue = await channel.declare_queue(exclusive=True, auto_delete=True)
        key = topology.routing_key(AgentDelta.TYPE, forum_id)
        await queue.bind(topology.FORUM_EXCHANGE, routing_key=key)

        async def on_delta(delivery: AbstractIncomingMessage) -> None:
            payload = Envelope.model_validate_json(delivery.body).parse()
            if isinstance(payload, AgentDelta):
                seen.append(payload)

        await queue.consume(on_delta, no_ack=True)
        yield seen
    finally:
        await connection.close()


async def until(check: Callable[[], bool], what: str) -> None:
    async def holds() -> bool:
        return check()

    await eventually(holds, timeout=WAIT, what=what)


def user_contents(request: dict[str, Any]) -> list[str]:
    return [m["content"] for m in request["messages"] if m["role"] == "user"]


def slow(text: str, pieces: int = PIECES) -> Any:
    return streamed(completion(text), pieces=pieces, piece_delay=PAUSE)


def answers(lines: list[Message]) -> list[Message]:
    """The agents' forum answers (their notices left out)."""
    return [line for line in agent_lines(lines) if line.type == "message"]


def notices(lines: list[Message]) -> list[Message]:
    return [line for line in agent_lines(lines) if line.type == "notice"]


def ends_of(deltas: list[AgentDelta], agent_actor_id: str) -> list[str | None]:
    """How each of the agent's drafts ended (None: not yet)."""
    drafts: dict[str, str | None] = {}
    for delta in deltas:
        if delta.agent_actor_id == agent_actor_id:
            drafts[delta.message_id] = delta.end or drafts.get(delta.message_id)
    return list(drafts.values())


async def cancelled_calls(mesh: Mesh, reason: str) -> float:
    for line in (await mesh.processes["processor"].metrics()).splitlines():
        if line.startswith(f'yoke_model_calls_cancelled_total{{reason="{reason}"}}'):
            return float(line.split()[-1])
    return 0.0


async def test_queue_answers_each_line_on_its_own_in_order(
    store: Store, client: Client, new_join: JoinFactory, fake_openai: FakeOpenAI
) -> None:
    fake_openai.script(slow("answer one"), completion("answer two"), completion("answer three"))
    forum_id, _ = await new_join(model="gpt-test")
    asked = [await say(client, forum_id, "line one")]
    await until(lambda: len(fake_openai.requests) == 1, "the first model call")
    asked += [await say(client, forum_id, "line two"), await say(client, forum_id, "line three")]
    lines = await lines_until(store, forum_id, lambda lines: len(answers(lines)) >= 3)
    assert [(a.text, a.meta.in_reply_to) for a in answers(lines)] == list(
        zip(["answer one", "answer two", "answer three"], asked, strict=True)
    )
    # Each reply settles the forum through the line it answers (meta.coversSeq).
    seq_of = {line.id: line.seq for line in lines}
    assert [a.meta.covers_seq for a in answers(lines)] == [seq_of[line] for line in asked]
    assert len(fake_openai.requests) == 3 and not fake_openai.rejected
    # The second call saw up to its own line, not the one queued behind it.
    assert user_contents(fake_openai.requests[1])[-1] == "alice: line two"
    assert "alice: line three" not in user_contents(fake_openai.requests[1])


async def test_coalesce_answers_a_burst_sent_during_a_slow_step_once_seeing_all_of_it(
    store: Store, client: Client, new_join: JoinFactory, fake_openai: FakeOpenAI
) -> None:
    fake_openai.script(slow("first answer"), completion("one answer for the burst"))
    forum_id, _ = await new_join(model="gpt-test", while_busy="coalesce")
    first = await say(client, forum_id, "what is new?")
    await until(lambda: len(fake_openai.requests) == 1, "the first model call")
    burst = [await say(client, forum_id, f"burst line {n}") for n in range(1, 6)]
    lines = await lines_until(store, forum_id, lambda lines: len(answers(lines)) >= 2)
    replies = answers(lines)
    seq_of = {line.id: line.seq for line in lines}
    assert all(seq_of[line] < replies[0].seq for line in burst), "the burst came after the step"
    assert [(r.text, r.meta.in_reply_to) for r in replies] == [
        ("first answer", first),
        ("one answer for the burst", burst[-1]),
    ]
    # The burst's reply settles every line of it: their callers know it answered them.
    assert [r.meta.covers_seq for r in replies] == [seq_of[first], seq_of[burst[-1]]]
    prompt = fake_openai.requests[1]
    assert user_contents(prompt)[-5:] == [f"alice: burst line {n}" for n in range(1, 6)]
    # The burst comes after the first answer in the prompt, though stored before it.
    assert prompt["messages"][-6] == {"role": "assistant", "content": "first answer"}
    # The burst's later lines call no model: the next line is answered by the third call.
    later = await say(client, forum_id, "anything else?")
    lines = await lines_until(store, forum_id, lambda lines: len(answers(lines)) >= 3)
    assert [r.meta.in_reply_to for r in answers(lines)] == [first, burst[-1], later]
    assert len(fake_openai.requests) == 3 and not fake_openai.rejected


async def test_interrupt_cancels_the_model_call_and_the_next_answer_covers_both_lines(
    amqp_url: str,
    store: Store,
    client: Client,
    mesh: Mesh,
    new_join: JoinFactory,
    fake_openai: FakeOpenAI,
) -> None:
    fake_openai.script(slow("an answer nobody is to see " * 4, LONG), completion("both, at once"))
    forum_id, join = await new_join(model="gpt-test", while_busy="interrupt")
    before = await cancelled_calls(mesh, "interrupt")
    async with drafts(amqp_url, forum_id) as deltas:
        first = await say(client, forum_id, "first question")
        await until(lambda: bool(deltas), "the model writing its answer")
        second = await say(client, forum_id, "second thought")
        lines = await lines_until(store, forum_id, lambda lines: len(answers(lines)) >= 1)
        await until(lambda: len(ends_of(deltas, join.agent_actor_id)) == 2, "both drafts")
    (answer,) = answers(lines)
    assert (answer.text, answer.meta.in_reply_to) == ("both, at once", second)
    seq_of = {line.id: line.seq for line in lines}
    assert answer.meta.covers_seq == seq_of[second] > seq_of[first]  # it answered both
    # The cancelled draft ended abandoned, and its text never became a line.
    assert ends_of(deltas, join.agent_actor_id) == ["abandoned", "posted"]
    assert not any("nobody is to see" in line.text for line in lines)
    assert first in {line.id for line in lines}
    assert len(fake_openai.requests) == 2 and not fake_openai.rejected
    prompt = fake_openai.requests[1]["messages"]
    assert [m["content"] for m in prompt[-2:]] == ["alice: first question", "alice: second thought"]
    assert all(m["role"] != "assistant" for m in prompt)
    # What the cancelled call cost is kept, as an estimate, in an operator's notice.
    monologue = await store.history(join.monologue_id)
    (estimate,) = [line.usage for line in monologue if line.type == "notice" and line.usage]
    assert estimate.estimated is True and estimate.input_tokens > 0
    assert await cancelled_calls(mesh, "interrupt") == before + 1


async def test_stop_drops_every_agents_model_call_and_the_lines_before_it(
    amqp_url: str,
    store: Store,
    client: Client,
    mesh: Mesh,
    new_join: JoinFactory,
    fake_openai: FakeOpenAI,
) -> None:
    """Two agents busy with slow answers; a person's ``/stop`` leaves both unanswered, with
    the line queued behind them, and each agent says so once; the next line is answered."""
    fake_openai.script(slow("never said, not to anyone " * 4, LONG))
    # hop_cap 1: the agents do not answer each other's lines, only people's.
    forum_id, talker = await new_join(model="gpt-test", name="talker", hop_cap=1)
    _, echo = await new_join(forum_id, name="echo", model="fixture-stream-20-8", hop_cap=1)
    agents = {talker.agent_actor_id, echo.agent_actor_id}
    before = await cancelled_calls(mesh, "stop")
    async with drafts(amqp_url, forum_id) as deltas:
        early = [await say(client, forum_id, "tell me a long story")]
        await until(lambda: {d.agent_actor_id for d in deltas} == agents, "both agents writing")
        early.append(await say(client, forum_id, "and then another"))
        stop = await say(client, forum_id, "/stop", who="bob")
        lines = await lines_until(store, forum_id, lambda lines: len(notices(lines)) >= 2)
        after = await say(client, forum_id, "are you still there?")
        lines = await lines_until(store, forum_id, lambda lines: len(answers(lines)) >= 2)
    told = notices(lines)
    assert sorted(n.author_actor_id for n in told) == sorted(agents)  # one notice each
    assert {n.meta.in_reply_to for n in told} == {stop}
    # Each notice settles the lines before the stop: they end unanswered.
    seq_of = {line.id: line.seq for line in lines}
    assert {n.meta.covers_seq for n in told} == {seq_of[stop]}
    assert all("bob" in n.text for n in told)
    replies = answers(lines)
    assert sorted(r.author_actor_id for r in replies) == sorted(agents)
    assert {r.meta.in_reply_to for r in replies} == {after}
    assert not {r.meta.in_reply_to for r in replies} & set(early)
    assert len(notices(lines)) == 2
    for agent in agents:
        assert ends_of(deltas, agent)[0] == "abandoned"
    assert len(fake_openai.requests) == 2 and not fake_openai.rejected  # q1's and the last
    assert await cancelled_calls(mesh, "stop") == before + 2


async def test_stop_ends_an_open_worker_call_and_the_next_line_is_answered(
    store: Store,
    client: Client,
    new_join: JoinFactory,
    worker_tool: WorkerTool,
    tmp_path: Path,
) -> None:
    tool, url = worker_tool.name, worker_tool.url
    release = tmp_path / "release"
    worker = await WorkerProcess.start(url, tool, "hold", "--release", str(release))
    try:
        await worker.line("ready", timeout=WAIT)
        script = [
            ScriptedOutput(tool_calls=[ScriptedCall(name=tool, input={"q": "the weather"})]),
            ScriptedOutput(text="answered after the stop"),
        ]
        forum_id, join = await new_join(model="fixture-script", tools=[tool], script=script)
        asked = await say(client, forum_id, "look the weather up")
        call = await worker.line("call", timeout=WAIT)
        stop = await say(client, forum_id, "/stop", who="bob")
        monologue = await lines_until(
            store, join.monologue_id, lambda lines: any(map(results_in, lines))
        )
        (result,) = [part for line in monologue for part in results_in(line)]
        assert (result.output, result.is_error) == ("stopped by bob", True)
        end = await store.db[TOOL_CALL_ENDS_COLLECTION].find_one({"_id": call["callId"]})
        assert end is not None and end["outcome"] == "stopped"
        # The worker's answer, late: the call has ended.
        release.touch()
        reply = (await worker.line("reply", callId=call["callId"], timeout=WAIT))["reply"]
        assert (reply["status"], reply.get("code")) == ("rejected", "call_closed")
    finally:
        await worker.stop()
    after = await say(client, forum_id, "what now?")
    lines = await lines_until(store, forum_id, lambda lines: len(answers(lines)) >= 1)
    (told,) = notices(lines)
    assert told.meta.in_reply_to == stop
    # The stopped round called no model (its answer would have gone to the first line).
    (answer,) = answers(lines)
    assert (answer.text, answer.meta.in_reply_to) == ("answered after the stop", after)
    assert asked not in {line.meta.in_reply_to for line in agent_lines(lines)}


def results_in(line: Message) -> list[ToolResultPart]:
    return [part for part in line.parts if isinstance(part, ToolResultPart)]

"""Worker tools end to end: calls out of the running mesh, answers through the real door.

The tools are registered with ``yoke tools add-worker`` (a subprocess, as an operator runs it) in
the module's vhost and database before the services start, so that every processor's first read
of the catalog holds them (a process trusts its copy of the catalog for a few seconds). Each is
served by the pika worker (tests/support/pika_worker.py, which knows only the contract) as a
process of its own, connected as the ``tool-NAME`` user that ``add-worker`` printed the password
of. Agents are the ``fixture-script`` model, or an OpenAI model against the fake OpenAI server,
which refuses a prompt breaking the order rules with a 400 (so a test asserting it refused
nothing checks the prompts too).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, cast

import pytest

from tests.support.fake_openai import FakeOpenAI, completion, openai_env
from tests.support.mesh import JoinFactory, Mesh, agent_lines, lines_until, say
from tests.support.processes import eventually
from tests.support.worker_process import WorkerProcess, as_user
from tests.support.worker_tools import WorkerTool, ask_direct, registered_worker_tool, serving
from yoke.bus import topology
from yoke.cli.publishers import create_publisher, delete_user, management_of
from yoke.client import Client
from yoke.core.models import Message, SubmitReply, ToolResultPart
from yoke.llm.base import ScriptedCall, ScriptedOutput
from yoke.runtime.calls.records import own_result_line_id
from yoke.runtime.joins import Join
from yoke.store.database import Store

pytestmark = pytest.mark.slow

# The timeout of the tool whose worker never answers: short, so its deadline comes quickly.
NEVER_TIMEOUT = 3
# Every other tool's: long enough that only its worker ends its calls.
TIMEOUT = 120
WAIT = 60  # the most a test waits for anything the mesh does
SCHEMA = {"type": "object", "properties": {"text": {"type": "string"}}}
MARKER = "pika-worker"  # what the pika worker puts in its outputs by default


@dataclass(frozen=True)
class Tools:
    """How a call is answered is the serving worker's mode, not the tool's: ``answer`` is served
    by workers that answer, answer twice or hold their answers, as each test needs."""

    answer: WorkerTool
    second: WorkerTool  # another tool: rounds of two worker calls, another tool's user
    never: WorkerTool  # the short timeout


ROLES = ("answer", "second", "never")  # the order of Tools' fields


@pytest.fixture(scope="module")
def mesh_env(fake_openai: FakeOpenAI) -> dict[str, str]:
    return openai_env(fake_openai.base_url, give_up_seconds=10)


@pytest.fixture(scope="module")
async def tools(
    amqp_url: str, module_mongodb_url: str, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Tools]:
    """The module's worker tools, each with its user; the users are deleted afterwards (they
    are broker-wide, so each name is the module's own)."""
    folder = Path(tmp_path_factory.mktemp("tools"))
    prefix = f"w{uuid.uuid4().hex[:8]}"

    def registered(role: str) -> contextlib.AbstractAsyncContextManager[WorkerTool]:
        timeout = NEVER_TIMEOUT if role == "never" else TIMEOUT
        return registered_worker_tool(
            amqp_url,
            module_mongodb_url,
            f"{prefix}-{role}",
            SCHEMA,
            folder,
            description=f"the {role} test tool",
            timeout=timeout,
        )

    async with contextlib.AsyncExitStack() as stack:
        # At once: each is a process of its own, and most of its time is its imports. Each
        # entered before any failure is raised, so that every one made is deleted after.
        outcomes = await asyncio.gather(
            *(stack.enter_async_context(registered(role)) for role in ROLES),
            return_exceptions=True,
        )
        for outcome in outcomes:
            if isinstance(outcome, BaseException):
                raise outcome
        yield Tools(*cast(list[WorkerTool], outcomes))


@pytest.fixture(scope="module")
def before_mesh(tools: Tools) -> None:
    """The worker tools are in the catalog when the services start."""


@dataclass(frozen=True)
class Bridge:
    name: str
    url: str


@pytest.fixture(scope="module")
async def bridge(mesh: Mesh, amqp_url: str) -> AsyncIterator[Bridge]:
    """A bridge's user, as ``yoke publisher create`` makes it (an outside publisher)."""
    name = f"bridge-{uuid.uuid4().hex[:8]}"
    management = management_of(amqp_url)
    password = await create_publisher(management, name)
    try:
        yield Bridge(name, as_user(amqp_url, name, password))
    finally:
        await delete_user(management, name)


async def answer_as(tool: WorkerTool, call_id: str, mode: str = "as-other") -> dict[str, Any]:
    """The door's reply to one answer to ``call_id`` published as ``tool``'s user
    (``no-user-id``: by that user, without the AMQP user_id)."""
    worker = await WorkerProcess.start(tool.url, tool.name, mode, "--target-call", call_id)
    try:
        line = await worker.line("reply", callId=call_id, timeout=WAIT)
        assert await worker.exited() == 0, worker.stderr.decode()
    finally:
        await worker.stop()
    reply: dict[str, Any] = line["reply"]
    return reply


def worker_output(call: dict[str, Any]) -> str:
    """What the pika worker answers a call with (mode ``answer``, ``twice``, ``hold``)."""
    return json.dumps({"input": call["call"].get("input"), "marker": MARKER})


def results(lines: list[Message]) -> list[tuple[Message, ToolResultPart]]:
    return [
        (line, part) for line in lines for part in line.parts if isinstance(part, ToolResultPart)
    ]


def has_results(line: Message) -> bool:
    return any(isinstance(part, ToolResultPart) for part in line.parts)


async def scripted_join(
    new_join: JoinFactory, tool: WorkerTool, text: str, answer: str
) -> tuple[str, Join]:
    """A ``fixture-script`` agent that calls ``tool`` with ``{"text": text}``, then says
    ``answer`` once the result is in."""
    script = [
        ScriptedOutput(tool_calls=[ScriptedCall(name=tool.name, input={"text": text})]),
        ScriptedOutput(text=answer),
    ]
    return await new_join(model="fixture-script", tools=[tool.name], script=script)


def accepted(call_id: str, *, duplicate: bool = False) -> dict[str, Any]:
    reply = SubmitReply(
        status="accepted", message_id=own_result_line_id(call_id), duplicate=duplicate or None
    )
    return reply.to_wire()


def assert_rejected(reply: dict[str, Any], code: str) -> None:
    assert reply["status"] == "rejected", reply
    assert reply.get("code") == code, reply
    assert "messageId" not in reply and "duplicate" not in reply, reply
    assert len(str(reply.get("error", ""))) > 20, reply  # a sentence, not just the code


async def test_a_workers_answer_is_the_calls_result_and_the_agent_answers_with_it(
    store: Store, client: Client, new_join: JoinFactory, fake_openai: FakeOpenAI, tools: Tools
) -> None:
    text = f"ping {uuid.uuid4().hex[:6]}"
    fake_openai.script(
        completion(None, [("call-a", tools.answer.name, json.dumps({"text": text}))]),
        completion("the worker answered"),
    )
    forum_id, join = await new_join(model="gpt-test", tools=[tools.answer.name])
    async with serving(tools.answer, "answer") as worker:
        await say(client, forum_id, "ask the worker")
        call = await worker.line("call", timeout=WAIT)
        reply = await worker.line("reply", callId=call["callId"], timeout=WAIT)
    call_id = call["callId"]
    assert call["call"]["tool"] == tools.answer.name
    assert call["call"]["input"] == {"text": text}
    assert call["call"]["idempotencyKey"] and call["call"]["deadline"]
    assert reply["reply"] == accepted(call_id)

    forum = await lines_until(store, forum_id, lambda ls: len(agent_lines(ls)) >= 1, WAIT)
    assert [line.text for line in agent_lines(forum)] == ["the worker answered"]
    monologue = await store.history(join.monologue_id)
    [(line, result)] = results(monologue)
    assert line.id == own_result_line_id(call_id)
    assert line.parts == [result]  # a line of its own
    assert result.call_id == "call-a" and result.name == tools.answer.name
    assert result.output == worker_output(call) and not result.is_error
    assert fake_openai.rejected == []
    assert len(fake_openai.requests) == 2
    prompt = fake_openai.requests[1]["messages"]
    assert prompt[-1] == {"role": "tool", "tool_call_id": "call-a", "content": result.output}
    assert [c["id"] for c in prompt[-2]["tool_calls"]] == ["call-a"]


async def test_a_second_answer_by_the_same_worker_is_a_duplicate_and_changes_nothing(
    store: Store, client: Client, new_join: JoinFactory, tools: Tools
) -> None:
    forum_id, join = await scripted_join(new_join, tools.answer, "say it twice", "answered once")
    async with serving(tools.answer, "twice") as worker:
        await say(client, forum_id, "ask twice")
        call = await worker.line("call", timeout=WAIT)
        first = await worker.line("reply", callId=call["callId"], timeout=WAIT)
        second = await worker.line("reply", callId=call["callId"], timeout=WAIT)
    assert first["reply"] == accepted(call["callId"])
    assert second["reply"] == accepted(call["callId"], duplicate=True)

    forum = await lines_until(store, forum_id, lambda ls: len(agent_lines(ls)) >= 1, WAIT)
    assert [line.text for line in agent_lines(forum)] == ["answered once"]
    # The door replied to the repeat after handling it: a line it wrote would be here by now.
    [(line, result)] = results(await store.history(join.monologue_id))
    assert line.id == own_result_line_id(call["callId"])
    assert result.output == worker_output(call)


async def forged_answer(bridge: Bridge, call_id: str, as_user_name: str) -> dict[str, Any]:
    """An answer published by the bridge's user (no user_id) claiming, in the mesh's user
    header, to come from ``as_user_name``; the door's reply, on direct reply-to (the one queue
    the door answers an unnamed publisher on)."""
    return await ask_direct(
        bridge.url,
        "tool.result.submit",
        {"callId": call_id, "output": "forged"},
        user_id=None,
        headers={topology.USER_HEADER: as_user_name},
        timeout=WAIT,
    )


async def test_answers_from_anyone_but_the_calls_worker_are_rejected_and_change_nothing(
    store: Store,
    client: Client,
    new_join: JoinFactory,
    tools: Tools,
    bridge: Bridge,
    tmp_path: Path,
) -> None:
    forum_id, join = await scripted_join(
        new_join, tools.answer, "hold it", "answered after the rejections"
    )
    release = tmp_path / "release"
    async with serving(tools.answer, "hold", "--release", str(release)) as worker:
        await say(client, forum_id, "call the holding tool")
        call = await worker.line("call", timeout=WAIT)
        call_id = call["callId"]

        assert_rejected(await answer_as(tools.second, call_id), "wrong_tool")
        assert_rejected(await answer_as(tools.answer, f"no-such-{call_id}"), "unknown_call")
        assert_rejected(await answer_as(tools.answer, call_id, "no-user-id"), "missing_user_id")
        # The router drops the mesh headers an outside publisher sets: this is not the tool's.
        assert_rejected(await forged_answer(bridge, call_id, tools.answer.user), "missing_user_id")
        monologue = await store.history(join.monologue_id)
        assert results(monologue) == []
        assert agent_lines(await store.history(forum_id)) == []

        release.touch()
        reply = await worker.line("reply", callId=call_id, timeout=WAIT)
    assert reply["reply"] == accepted(call_id)  # the call was still open, unanswered
    forum = await lines_until(store, forum_id, lambda ls: len(agent_lines(ls)) >= 1, WAIT)
    assert [line.text for line in agent_lines(forum)] == ["answered after the rejections"]
    [(line, result)] = results(await store.history(join.monologue_id))
    assert line.id == own_result_line_id(call_id)
    assert result.output == worker_output(call) and not result.is_error


async def test_a_call_never_answered_ends_in_error_at_its_deadline_and_stays_closed(
    store: Store, client: Client, new_join: JoinFactory, tools: Tools
) -> None:
    forum_id, join = await scripted_join(
        new_join, tools.never, "no answer", "the tool gave no answer"
    )
    async with serving(tools.never, "never") as worker:
        await say(client, forum_id, "call the silent tool")
        call = await worker.line("call", timeout=WAIT)
        call_id = call["callId"]
        deadline = datetime.fromisoformat(call["call"]["deadline"])
        monologue = await lines_until(
            store, join.monologue_id, lambda ls: any(map(has_results, ls)), WAIT
        )
    [(line, result)] = results(monologue)
    assert line.id == own_result_line_id(call_id)
    assert result.is_error
    assert result.output == f"{tools.never.name} gave no answer within {NEVER_TIMEOUT} s"
    # Ended by the deadline, not before it (the store keeps milliseconds).
    assert line.created_at >= deadline - timedelta(milliseconds=1)

    forum = await lines_until(store, forum_id, lambda ls: len(agent_lines(ls)) >= 1, WAIT)
    assert [line.text for line in agent_lines(forum)] == ["the tool gave no answer"]
    late = await answer_as(tools.never, call_id)
    assert_rejected(late, "call_closed")
    assert "timeout" in late["error"]
    assert len(results(await store.history(join.monologue_id))) == 1


async def test_a_round_of_two_worker_calls_and_a_builtin_is_answered_by_one_model_call(
    store: Store, client: Client, new_join: JoinFactory, fake_openai: FakeOpenAI, tools: Tools
) -> None:
    fake_openai.script(
        completion(
            None,
            [
                ("call-1", tools.answer.name, '{"text": "one"}'),
                ("call-2", tools.second.name, '{"text": "two"}'),
                ("call-3", "clock", "{}"),
            ],
        ),
        completion("all three are in"),
    )
    names = [tools.answer.name, tools.second.name, "clock"]
    forum_id, join = await new_join(model="gpt-test", tools=names)
    async with serving(tools.answer, "answer") as one, serving(tools.second, "answer") as two:
        await say(client, forum_id, "use all three")
        first = await one.line("call", timeout=WAIT)
        second = await two.line("call", timeout=WAIT)
        for worker, call in ((one, first), (two, second)):
            reply = await worker.line("reply", callId=call["callId"], timeout=WAIT)
            assert reply["reply"] == accepted(call["callId"])

    forum = await lines_until(store, forum_id, lambda ls: len(agent_lines(ls)) >= 1, WAIT)
    assert [line.text for line in agent_lines(forum)] == ["all three are in"]
    monologue = await store.history(join.monologue_id)
    by_call = {part.call_id: (line, part) for line, part in results(monologue)}
    assert sorted(by_call) == ["call-1", "call-2", "call-3"]
    assert len(results(monologue)) == 3
    assert by_call["call-1"][0].id == own_result_line_id(first["callId"])
    assert by_call["call-2"][0].id == own_result_line_id(second["callId"])
    assert by_call["call-1"][1].output == worker_output(first)
    assert by_call["call-2"][1].output == worker_output(second)
    assert not by_call["call-3"][1].is_error  # the clock ran in the step itself

    assert fake_openai.rejected == []
    assert len(fake_openai.requests) == 2  # the round, then one call after its last result
    prompt = fake_openai.requests[1]["messages"]
    assert [c["id"] for c in prompt[-4]["tool_calls"]] == ["call-1", "call-2", "call-3"]
    tool_turns = {m["tool_call_id"]: m["content"] for m in prompt[-3:] if m["role"] == "tool"}
    assert tool_turns == {call_id: part.output for call_id, (_, part) in by_call.items()}


async def test_a_line_typed_while_a_worker_call_is_open_is_answered_once_after_its_result(
    store: Store,
    client: Client,
    new_join: JoinFactory,
    fake_openai: FakeOpenAI,
    tools: Tools,
    tmp_path: Path,
) -> None:
    fake_openai.script(
        completion(None, [("call-h", tools.answer.name, '{"text": "slow"}')]),
        completion("here is the result, and yes, Grace, I am here"),
    )
    forum_id, join = await new_join(model="gpt-test", tools=[tools.answer.name])
    release = tmp_path / "release"
    async with serving(tools.answer, "hold", "--release", str(release)) as worker:
        await say(client, forum_id, "use the slow tool", who="Ada")
        call = await worker.line("call", timeout=WAIT)
        await say(client, forum_id, "are you still there?", who="Grace")

        async def copied() -> bool:
            lines = await store.history(join.monologue_id)
            return any(line.text == "are you still there?" for line in lines)

        await eventually(copied, timeout=WAIT, what="Grace's line in the monologue")
        release.touch()
        reply = await worker.line("reply", callId=call["callId"], timeout=WAIT)
    assert reply["reply"] == accepted(call["callId"])

    forum = await lines_until(store, forum_id, lambda ls: len(agent_lines(ls)) >= 1, WAIT)
    monologue = await store.history(join.monologue_id)
    [(result_line, _)] = results(monologue)
    [typed] = [line for line in monologue if line.text == "are you still there?"]
    assert typed.seq < result_line.seq  # it really came while the call was open
    # Steps run in seq order: the typed line's step is over, and it called no model.
    assert fake_openai.rejected == []
    assert len(fake_openai.requests) == 2
    prompt = fake_openai.requests[1]["messages"]
    assert prompt[-1]["content"] == "Grace: are you still there?"
    assert prompt[-2]["role"] == "tool" and prompt[-2]["tool_call_id"] == "call-h"
    assert [line.text for line in agent_lines(forum)] == [
        "here is the result, and yes, Grace, I am here"
    ]
    assert len([line for line in agent_lines(monologue) if line.text]) == 1

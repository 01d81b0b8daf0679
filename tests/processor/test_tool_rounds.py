"""Lines typed while a tool runs (docs/architecture.md, invariant 10), in the running mesh: an
OpenAI-model agent against the fake OpenAI server, which refuses prompts that break the order rules
with a 400."""

from __future__ import annotations

from typing import Any

import pytest

from tests.support.fake_openai import FakeOpenAI, completion, openai_env
from tests.support.mesh import JoinFactory, agent_lines, lines_until, say
from yoke.client import Client
from yoke.core.models import Message, ToolCallPart, ToolResultPart
from yoke.store.database import Store

pytestmark = pytest.mark.slow
WAIT = 10  # seconds the tool runs (its most): lines typed meanwhile land well before it ends


@pytest.fixture(scope="module")
def mesh_env(fake_openai: FakeOpenAI) -> dict[str, str]:
    return openai_env(fake_openai.base_url)


def has_calls(line: Message) -> bool:
    return any(isinstance(part, ToolCallPart) for part in line.parts)


def has_results(line: Message) -> bool:
    return any(isinstance(part, ToolResultPart) for part in line.parts)


def seq_of(lines: list[Message], text: str) -> int:
    [line] = [line for line in lines if line.text == text and line.role == "user"]
    return line.seq


async def call_running(store: Store, monologue_id: str) -> list[Message]:
    """The monologue once the agent's tool call is written (its tool is running then)."""
    return await lines_until(store, monologue_id, lambda lines: any(map(has_calls, lines)))


def contents(request: dict[str, Any]) -> list[str]:
    return [str(m.get("content") or "") for m in request["messages"]]


async def test_lines_typed_during_a_tool_call_are_answered_once_after_its_result(
    store: Store, client: Client, new_join: JoinFactory, fake_openai: FakeOpenAI
) -> None:
    fake_openai.script(
        completion(None, [("call-w", "wait", f'{{"seconds": {WAIT}}}')]),
        completion("done waiting; hello Grace, yes I am here"),
    )
    forum_id, join = await new_join(model="gpt-test", tools=["wait"])
    await say(client, forum_id, "please wait a little", who="Ada")
    await call_running(store, join.monologue_id)
    await say(client, forum_id, "are you still there?", who="Grace")
    await say(client, forum_id, "and one more thing", who="Ada")

    forum = await lines_until(store, forum_id, lambda lines: len(agent_lines(lines)) >= 1)
    monologue = await store.history(join.monologue_id)
    [result] = [line for line in monologue if has_results(line)]
    # The test means something only if both lines really landed while the tool ran.
    assert seq_of(monologue, "and one more thing") < result.seq

    assert fake_openai.rejected == []
    assert [line for line in monologue if line.type == "notice"] == []
    # Each step runs after the one before it, so the typed lines' steps are done by now.
    assert len(fake_openai.requests) == 2
    answering = contents(fake_openai.requests[1])
    assert any('"waited": 10' in c for c in answering)
    assert answering[-2:] == ["Grace: are you still there?", "Ada: and one more thing"]
    [answer] = agent_lines(forum)
    assert answer.text == "done waiting; hello Grace, yes I am here"
    assert [line.text for line in agent_lines(monologue)][-1] == answer.text


async def test_a_slash_command_during_a_tool_call_is_answered_at_once_and_the_round_once(
    store: Store, client: Client, new_join: JoinFactory, fake_openai: FakeOpenAI
) -> None:
    fake_openai.script(
        completion(None, [("call-s", "wait", f'{{"seconds": {WAIT}}}')]),
        completion("waited"),
    )
    forum_id, join = await new_join(model="gpt-test", tools=["wait"])
    await say(client, forum_id, "wait, please")
    await call_running(store, join.monologue_id)
    await say(client, forum_id, "/status")
    forum = await lines_until(store, forum_id, lambda lines: len(agent_lines(lines)) == 2)
    monologue = await store.history(join.monologue_id)
    [result] = [line for line in monologue if has_results(line)]
    assert seq_of(monologue, "/status") < result.seq
    assert forum[2].text.startswith("model gpt-test")  # answered without waiting for the tool
    assert forum[3].text == "waited"
    assert fake_openai.rejected == []
    assert len(fake_openai.requests) == 2


async def test_a_reset_during_a_tool_call_drops_the_round_and_the_next_line_is_answered(
    store: Store, client: Client, new_join: JoinFactory, fake_openai: FakeOpenAI
) -> None:
    fake_openai.script(
        completion(None, [("call-r", "wait", f'{{"seconds": {WAIT}}}')]),
        completion("fresh start"),
    )
    forum_id, join = await new_join(model="gpt-test", tools=["wait"])
    await say(client, forum_id, "wait for me")
    await call_running(store, join.monologue_id)
    await say(client, forum_id, "/reset")
    await lines_until(store, join.monologue_id, lambda lines: any(map(has_results, lines)))
    await say(client, forum_id, "hello again")
    forum = await lines_until(store, forum_id, lambda lines: len(agent_lines(lines)) == 2)
    assert [line.text for line in agent_lines(forum)][-1] == "fresh start"
    assert fake_openai.rejected == []
    # The round's results reached a context that no longer holds its call: no model call.
    assert len(fake_openai.requests) == 2
    fresh = fake_openai.requests[1]["messages"]
    assert fresh[-1]["content"] == "alice: hello again"
    assert [m for m in fresh if m["role"] == "tool" or m.get("tool_calls")] == []

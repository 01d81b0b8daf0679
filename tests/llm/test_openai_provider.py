"""The OpenAI provider through the real ``openai`` client against a real local HTTP server."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from datetime import UTC, datetime

import pytest

from tests.support.fake_openai import FakeOpenAI, completion, failure
from yoke.core.models import Message, TextPart, ToolCallPart, ToolResultPart
from yoke.core.settings import Settings
from yoke.llm.base import InferenceRequest, ProviderFailed
from yoke.llm.openai_provider import OpenAIProvider
from yoke.tools.base import ToolContext
from yoke.tools.builtin import BUILTIN_TOOLS
from yoke.tools.run import run_tool_call


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeOpenAI]:
    with FakeOpenAI() as server:
        monkeypatch.setenv("OPENAI_BASE_URL", server.base_url)
        monkeypatch.setenv("OPENAI_API_KEY", "sk-test-not-a-secret")
        yield server


def provider(give_up: float = 30.0) -> OpenAIProvider:
    return OpenAIProvider(
        "gpt-test",
        Settings(provider_give_up_seconds=give_up, provider_request_timeout_seconds=5),
    )


def request(*lines: Message) -> InferenceRequest:
    return InferenceRequest(
        transcript=list(lines),
        tools={"clock": BUILTIN_TOOLS["clock"]},
        call_id_prefix="step",
        instructions="Be brief.",
        names={"h1": "Ada Lovelace"},
        now=datetime(2026, 11, 30, 12, 0, tzinfo=UTC),
    )


def human(text: str) -> Message:
    return Message(id="m1", conversation_id="c", author_actor_id="h1", parts=[TextPart(text=text)])


async def test_plain_text_with_usage_and_a_prompt_that_names_people(fake: FakeOpenAI) -> None:
    fake.script(completion("hello Ada", prompt_tokens=30, completion_tokens=4))
    result = await provider().infer(request(human("hi")))
    assert result.text == "hello Ada" and result.tool_calls == []
    assert result.usage is not None
    assert (result.usage.input_tokens, result.usage.output_tokens) == (30, 4)
    [sent] = fake.requests
    system, user = sent["messages"]
    assert "Be brief." in system["content"] and "2026-11-30T12:00:00" in system["content"]
    assert user == {"role": "user", "content": "Ada Lovelace: hi"}
    assert "h1" not in json.dumps(sent["messages"])  # people by name, never by id
    assert sent["tools"][0]["function"]["name"] == "clock"


async def test_a_tool_call_then_text(fake: FakeOpenAI) -> None:
    fake.script(completion(None, [("call-1", "clock", "{}")]), completion("it is noon"))
    first = await provider().infer(request(human("time?")))
    assert [(c.call_id, c.name, c.input) for c in first.tool_calls] == [("call-1", "clock", {})]
    asked = Message(
        id="m2", conversation_id="c", author_actor_id="agent", role="agent", parts=first.tool_calls
    )
    answered = Message(
        id="m3",
        conversation_id="c",
        author_actor_id="system",
        parts=[ToolResultPart(call_id="call-1", name="clock", output="12:00")],
    )
    second = await provider().infer(request(human("time?"), asked, answered))
    assert second.text == "it is noon"
    messages = fake.requests[1]["messages"]
    assert messages[2]["tool_calls"][0]["id"] == "call-1"
    assert messages[3] == {"role": "tool", "tool_call_id": "call-1", "content": "12:00"}


async def test_429_with_retry_after_is_retried_then_succeeds(fake: FakeOpenAI) -> None:
    fake.script(failure(429, {"retry-after": "0.2"}), completion("after the wait"))
    result = await provider().infer(request(human("hi")))
    assert result.text == "after the wait"
    assert len(fake.requests) == 2


async def test_500_every_time_gives_up_within_the_bound(fake: FakeOpenAI) -> None:
    fake.default = failure(500)
    started = time.monotonic()
    with pytest.raises(ProviderFailed, match="gave up after"):
        await provider(give_up=2.0).infer(request(human("hi")))
    assert time.monotonic() - started < 2.0 + 5  # the bound, plus one request's timeout
    assert len(fake.requests) >= 2


async def test_401_fails_at_once_without_retrying(fake: FakeOpenAI) -> None:
    fake.default = failure(401)
    with pytest.raises(ProviderFailed, match="401"):
        await provider().infer(request(human("hi")))
    assert len(fake.requests) == 1


async def test_invalid_json_in_tool_arguments_becomes_an_error_the_model_sees(
    fake: FakeOpenAI,
) -> None:
    fake.script(completion(None, [("call-9", "calculator", "{expression: 1+")]))
    [call] = (await provider().infer(request(human("add")))).tool_calls
    assert call.input_error and "not valid JSON" in call.input_error
    result = await run_tool_call(call, dict(BUILTIN_TOOLS), ToolContext("key", "c"))
    assert result.is_error and "not valid JSON" in result.output


async def test_unknown_tool_invalid_input_exception_and_timeout_are_error_results() -> None:
    tools = dict(BUILTIN_TOOLS)
    context = ToolContext("key", "c")
    unknown = await run_tool_call(ToolCallPart(call_id="1", name="nope"), tools, context)
    assert unknown.is_error and "unknown tool 'nope'" in unknown.output
    invalid = await run_tool_call(
        ToolCallPart(call_id="2", name="wait", input={"seconds": "x"}), tools, context
    )
    assert invalid.is_error and invalid.output.startswith("invalid input for wait: seconds: ")
    failing = await run_tool_call(
        ToolCallPart(call_id="3", name="calculator", input={"expression": "1/0"}), tools, context
    )
    assert failing.is_error and "division by zero" in failing.output
    import dataclasses

    slow = dataclasses.replace(tools["wait"], timeout=0.2)
    timed_out = await run_tool_call(
        ToolCallPart(call_id="4", name="wait", input={"seconds": 2}), {"wait": slow}, context
    )
    assert timed_out.is_error and "timed out after 0.2s" in timed_out.output
    ok = await run_tool_call(
        ToolCallPart(call_id="5", name="calculator", input={"expression": "(2+3)*4"}),
        tools,
        context,
    )
    assert (ok.is_error, ok.output) == (False, "20")


def test_steps_share_one_client_and_its_connections(monkeypatch: pytest.MonkeyPatch) -> None:
    from yoke.core.settings import Settings
    from yoke.llm.openai_provider import OpenAIProvider

    monkeypatch.setenv("OPENAI_API_KEY", "sk-test")
    settings = Settings()
    first, second = OpenAIProvider("gpt-a", settings), OpenAIProvider("gpt-b", settings)
    assert first.client is second.client


async def test_nul_and_lone_surrogates_in_a_models_answer_come_out_storable(
    fake: FakeOpenAI,
) -> None:
    unstorable = "a\x00b\ud800c"
    arguments = json.dumps({"expression": unstorable, unstorable: [unstorable]})
    fake.script(completion(f"text {unstorable}", [("call-n", "calculator", arguments)]))
    pieces: list[str] = []
    asked = request(human("hi"))
    asked.on_text = pieces.append
    result = await provider().infer(asked)
    stored = "a\ufffdb\ufffdc"
    assert result.text == f"text {stored}"
    assert "".join(pieces) == result.text
    [call] = result.tool_calls
    assert call.input == {"expression": stored, stored: [stored]}

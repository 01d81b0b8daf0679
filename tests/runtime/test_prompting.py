"""Prompts are always valid (docs/architecture.md, invariant 10): any interleaving of people's
lines, tool calls and tool results becomes a chat that obeys OpenAI's order rules, checked by the
same rule function the fake OpenAI server enforces."""

from __future__ import annotations

import random
from datetime import UTC, datetime
from typing import Any

import httpx
import pytest

from tests.support.chat_rules import first_violation
from tests.support.fake_openai import FakeOpenAI, completion
from yoke.core.models import Message, MessageMeta, Part, TextPart, ToolCallPart, ToolResultPart
from yoke.core.settings import Settings
from yoke.llm.base import InferenceRequest, ProviderFailed, newest_user_text
from yoke.llm.fixtures import EchoProvider
from yoke.llm.openai_provider import OpenAIProvider
from yoke.llm.prompting import NO_RESULT, to_chat_messages, unanswered_last

NOW = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)
NAMES = {"h1": "Ada", "h2": "Grace"}
_counter = iter(range(10**9))


def line(role: str, *parts: Part, author: str = "h1", **meta: Any) -> Message:
    return Message(
        id=f"m{next(_counter)}",
        conversation_id="c",
        author_actor_id="agent" if role == "agent" else author,
        role="agent" if role == "agent" else "user",
        type="notice" if role == "notice" else "message",
        parts=list(parts),
        meta=MessageMeta(**meta),
    )


def person(text: str, author: str = "h1") -> Message:
    return line("user", TextPart(text=text), author=author)


def calls(*ids: str, text: str | None = None) -> Message:
    parts: list[Part] = [TextPart(text=text)] if text else []
    parts += [ToolCallPart(call_id=i, name="clock") for i in ids]
    return line("agent", *parts)


def results(*ids: str, output: str = "noon") -> Message:
    return line(
        "user",
        *(ToolResultPart(call_id=i, name="clock", output=f"{output} {i}") for i in ids),
        author="system",
    )


def chat(*transcript: Message) -> list[dict[str, Any]]:
    messages = to_chat_messages(list(transcript), NAMES, "Be brief.", NOW)
    violation = first_violation(messages)
    assert violation is None, (violation, messages)
    return messages


def shape(messages: list[dict[str, Any]]) -> list[str]:
    """``assistant(a,b)``, ``tool a``, ``user Ada: hi``: the order, compactly."""
    out = []
    for m in messages[1:]:
        if m["role"] == "assistant":
            ids = ",".join(c["id"] for c in m.get("tool_calls", []))
            out.append(f"assistant({ids})" if ids else f"assistant {m['content']}")
        elif m["role"] == "tool":
            out.append(f"tool {m['tool_call_id']}")
        else:
            out.append(f"{m['role']} {m['content']}")
    return out


# --- the rule checker itself ----------------------------------------------------------------


def test_the_rule_checker_refuses_each_broken_order() -> None:
    system = {"role": "system", "content": "s"}
    call = {"role": "assistant", "content": None, "tool_calls": [{"id": "a"}, {"id": "b"}]}
    tool_a = {"role": "tool", "tool_call_id": "a", "content": "1"}
    tool_b = {"role": "tool", "tool_call_id": "b", "content": "2"}
    user = {"role": "user", "content": "hi"}
    assert first_violation([system, user, call, tool_b, tool_a, user]) is None
    between = first_violation([system, call, user, tool_a, tool_b])
    assert between is not None and "did not have response messages: a, b" in between.message
    assert between.param == "messages.[2].role"
    missing = first_violation([system, call, tool_a, user])
    assert missing is not None and "did not have response messages: b" in missing.message
    at_end = first_violation([system, call, tool_a])
    assert at_end is not None and "b" in at_end.message
    orphan = first_violation([system, user, tool_a])
    assert orphan is not None and "must be a response to a preceeding message" in orphan.message
    twice = first_violation([system, call, tool_a, tool_a, tool_b])
    assert twice is not None and "preceeding" in twice.message
    reused = first_violation([system, call, tool_a, tool_b, call, tool_a, tool_b])
    assert reused is not None and "duplicate tool_call id 'a'" in reused.message
    empty = first_violation([system, {"role": "assistant", "content": None}])
    assert empty is not None and "got null" in empty.message


def test_the_fake_server_answers_400_like_openai_and_keeps_its_script() -> None:
    with FakeOpenAI() as fake:
        fake.script(completion("scripted"))
        bad = {
            "model": "gpt-test",
            "messages": [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": None, "tool_calls": [{"id": "x"}]},
                {"role": "user", "content": "during"},
                {"role": "tool", "tool_call_id": "x", "content": "1"},
            ],
        }
        refused = httpx.post(f"{fake.base_url}/chat/completions", json=bad)
        assert refused.status_code == 400
        error = refused.json()["error"]
        assert error["type"] == "invalid_request_error" and error["param"] == "messages.[2].role"
        assert "tool_call_ids did not have response messages: x" in error["message"]
        assert len(fake.rejected) == 1
        good = {"model": "gpt-test", "messages": [{"role": "user", "content": "hi"}]}
        answered = httpx.post(f"{fake.base_url}/chat/completions", json=good)
        assert answered.json()["choices"][0]["message"]["content"] == "scripted"


# --- targeted cases -------------------------------------------------------------------------


def test_a_line_typed_during_a_tool_call_comes_after_the_results() -> None:
    messages = chat(
        person("time?"), calls("a", "b"), person("and the date?", "h2"), results("a", "b")
    )
    assert shape(messages) == [
        "user Ada: time?",
        "assistant(a,b)",
        "tool a",
        "tool b",
        "user Grace: and the date?",
    ]
    assert messages[3]["content"] == "noon a"


def test_results_split_over_messages_and_an_instruction_in_between() -> None:
    nudge = line("user", TextPart(text="hurry"), author="system", instruction="follow-up")
    messages = chat(person("go"), calls("a", "b"), results("b"), nudge, results("a"))
    assert shape(messages) == [
        "user Ada: go",
        "assistant(a,b)",
        "tool a",
        "tool b",
        "user [follow-up instruction] hurry",
    ]


def test_a_window_that_starts_mid_round_drops_the_orphan_results() -> None:
    messages = chat(person("after /reset"), results("a"), person("more"))
    assert shape(messages) == ["user Ada: after /reset", "user Ada: more"]
    assert chat(results("a")) == chat()


def test_a_transcript_that_ends_mid_round_gets_a_no_result_answer() -> None:
    messages = chat(person("go"), calls("a", text="looking"), person("still there?"))
    assert shape(messages) == ["user Ada: go", "assistant(a)", "tool a", "user Ada: still there?"]
    assert messages[2]["content"] == "looking"
    assert messages[3]["content"] == f"ERROR: {NO_RESULT}"


def test_a_missing_result_is_answered_and_the_present_one_kept() -> None:
    messages = chat(calls("a", "b"), results("b", output="late"))
    assert [m.get("content") for m in messages[2:]] == [f"ERROR: {NO_RESULT}", "late b"]


def test_a_new_round_before_the_old_results_keeps_both_rounds_whole() -> None:
    messages = chat(calls("a"), person("hi"), calls("b"), results("a"), results("b"))
    assert shape(messages) == ["assistant(a)", "tool a", "user Ada: hi", "assistant(b)", "tool b"]


def test_reused_call_ids_duplicate_results_and_results_before_calls() -> None:
    messages = chat(
        results("a"), calls("a"), results("a", output="first"), results("a", output="second")
    )
    assert shape(messages) == ["assistant(a)", "tool a"]
    assert messages[2]["content"] == "first a"
    again = chat(calls("a"), results("a"), calls("a"), results("a"), person("ok"))
    assert shape(again) == ["assistant(a)", "tool a", "user Ada: ok"]


def test_empty_agent_lines_and_notices_are_left_out() -> None:
    notice = line("notice", TextPart(text="stopped"), author="system")
    assert shape(chat(line("agent"), notice, person("hi"))) == ["user Ada: hi"]


def test_error_results_are_marked() -> None:
    failed = line(
        "user",
        ToolResultPart(call_id="a", name="clock", output="boom", is_error=True),
        author="system",
    )
    assert chat(calls("a"), failed)[2]["content"] == "ERROR: boom"


def test_the_echo_model_answers_the_line_typed_during_the_tool_call() -> None:
    """After the results, fixture-echo's "newest user text" is the line typed meanwhile."""
    transcript = [person("time?"), calls("a"), person("and the date?"), results("a")]
    assert newest_user_text(transcript) == "and the date?"


async def test_the_echo_provider_after_a_round_with_no_line_in_between() -> None:
    transcript = [person("time?"), calls("a"), results("a")]
    request = InferenceRequest(transcript=transcript, tools={}, call_id_prefix="p")
    assert (await EchoProvider().infer(request)).text == "time?"


async def test_the_openai_provider_sends_an_interleaved_transcript_without_a_400(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with FakeOpenAI() as fake:
        monkeypatch.setenv("OPENAI_BASE_URL", fake.base_url)
        monkeypatch.setenv("OPENAI_API_KEY", "sk-test-not-a-secret")
        fake.script(completion("it is noon, and the 30th"))
        provider = OpenAIProvider("gpt-test", Settings(provider_give_up_seconds=2))
        transcript = [person("time?"), calls("a"), person("and the date?"), results("a")]
        request = InferenceRequest(transcript=transcript, tools={}, call_id_prefix="p", now=NOW)
        try:
            result = await provider.infer(request)
        except ProviderFailed as error:
            pytest.fail(f"refused: {error}; {fake.rejected}")
        assert result.text == "it is noon, and the 30th"
        assert fake.rejected == []


# --- any interleaving -------------------------------------------------------------------------


def random_transcript(rng: random.Random) -> list[Message]:
    """People, instructions, agent text, tool rounds and results, in any order and window."""
    transcript: list[Message] = []
    issued: list[str] = []
    unanswered: list[str] = []
    for _ in range(rng.randint(0, 30)):
        kind = rng.choices(
            ["person", "instruction", "text", "calls", "results", "notice", "empty"],
            weights=[6, 2, 2, 4, 5, 1, 1],
        )[0]
        if kind == "person":
            transcript.append(person(f"line {len(transcript)}", rng.choice(["h1", "h2", "h3"])))
        elif kind == "instruction":
            text = TextPart(text=f"steer {len(transcript)}")
            transcript.append(line("user", text, author="system", instruction="guardian"))
        elif kind == "text":
            transcript.append(line("agent", TextPart(text=f"said {len(transcript)}")))
        elif kind == "calls":
            ids = []
            for _ in range(rng.randint(1, 3)):
                reuse = issued and rng.random() < 0.1
                ids.append(rng.choice(issued) if reuse else f"c{len(issued)}")
                issued.append(ids[-1])
            unanswered += ids
            transcript.append(calls(*ids, text=rng.choice([None, "let me check"])))
        elif kind == "results":
            pool = unanswered or issued or ["ghost"]
            ids = rng.sample(pool, rng.randint(1, len(pool)))
            if rng.random() < 0.15:
                ids.append(rng.choice(["ghost", *issued]))  # unknown, or answered already
            unanswered = [i for i in unanswered if i not in ids]
            message = results(*ids)
            if rng.random() < 0.1:
                message.parts.append(TextPart(text=f"with text {len(transcript)}"))
            transcript.append(message)
        elif kind == "notice":
            transcript.append(line("notice", TextPart(text="note"), author="system"))
        else:
            transcript.append(line("agent"))
    start = rng.randint(0, len(transcript))  # a window may start or end anywhere
    end = rng.randint(start, len(transcript))
    return transcript[start:end] if rng.random() < 0.5 else transcript


def user_texts(transcript: list[Message]) -> list[str]:
    return [m.text for m in transcript if m.role == "user" and m.type == "message" and m.text]


@pytest.mark.parametrize("seed", range(400))
def test_any_interleaving_gives_a_valid_chat_that_keeps_every_line(seed: int) -> None:
    rng = random.Random(seed)
    transcript = random_transcript(rng)
    messages = to_chat_messages(transcript, NAMES, "", NOW)
    assert first_violation(messages) is None, (seed, shape(messages))

    said = [m["content"] for m in messages if m["role"] == "user"]
    # Every person and instruction line is in the chat once, in transcript order.
    expected = user_texts(transcript)
    assert [s.split(": ", 1)[-1].split("] ", 1)[-1] for s in said] == expected, seed

    # Each tool message carries the first result of its call written after the call, if any.
    positions = {
        part.call_id: index
        for index, m in reversed(list(enumerate(transcript)))
        if m.role == "agent"
        for part in m.parts
        if isinstance(part, ToolCallPart)
    }
    for message in messages:
        if message["role"] != "tool":
            continue
        call_id = message["tool_call_id"]
        later = [
            part.output
            for m in transcript[positions[call_id] + 1 :]
            if m.role == "user" and m.type == "message"
            for part in m.parts
            if isinstance(part, ToolResultPart) and part.call_id == call_id
        ]
        assert message["content"] == (later[0] if later else f"ERROR: {NO_RESULT}"), seed


@pytest.mark.parametrize("seed", range(200))
def test_a_burst_moved_last_keeps_the_chat_valid_and_ends_it_in_order(seed: int) -> None:
    """whileBusy coalesce and interrupt put the unanswered user lines last (unanswered_last):
    the chat stays valid for any interleaving, loses no line, and ends with the burst."""
    rng = random.Random(seed)
    transcript = random_transcript(rng)
    for seq, message in enumerate(transcript, start=1):
        message.seq = seq
    since = rng.randint(0, len(transcript))
    moved = unanswered_last(transcript, since)
    assert sorted(m.id for m in moved) == sorted(m.id for m in transcript)
    messages = to_chat_messages(moved, NAMES, "", NOW)
    assert first_violation(messages) is None, (seed, shape(messages))
    burst = [m.text for m in user_lines(transcript) if m.seq > since]
    tail = messages[len(messages) - len(burst) :] if burst else []
    assert all(m["role"] == "user" for m in tail), (seed, shape(messages))
    said = [m["content"].split(": ", 1)[-1].split("] ", 1)[-1] for m in tail]
    assert said == burst, seed
    assert [m.seq for m in moved if m.seq <= since] == list(range(1, since + 1)), seed


def user_lines(transcript: list[Message]) -> list[Message]:
    return [
        m
        for m in transcript
        if m.role == "user"
        and m.type == "message"
        and m.text
        and not any(isinstance(p, ToolResultPart) for p in m.parts)
    ]

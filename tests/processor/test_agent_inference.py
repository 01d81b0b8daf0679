"""Inference inside the running mesh: an OpenAI-model agent, provider failures, budgets and the
doom-loop guard, with the services as real processes and a real OpenAI-compatible server."""

from __future__ import annotations

import asyncio

import pytest

from tests.support.fake_openai import FakeOpenAI, completion, failure, openai_env
from tests.support.mesh import JoinFactory, Mesh, agent_lines, lines_until, say
from yoke.client import Client
from yoke.core.models import ToolResultPart
from yoke.llm.base import ScriptedCall, ScriptedOutput
from yoke.runtime.join_config import JoinConfig
from yoke.store.database import Store

pytestmark = pytest.mark.slow
SECRET = "sk-test-this-must-never-be-logged"


@pytest.fixture(scope="module")
def mesh_env(fake_openai: FakeOpenAI) -> dict[str, str]:
    return openai_env(
        fake_openai.base_url, api_key=SECRET, YOKE_PRICES='{"gpt-test": [1000, 2000]}'
    )


async def test_an_openai_model_agent_answers_with_usage_and_cost(
    store: Store, client: Client, new_join: JoinFactory, fake_openai: FakeOpenAI
) -> None:
    fake_openai.script(completion("hi from the model", prompt_tokens=50, completion_tokens=5))
    forum_id, _ = await new_join(model="gpt-test")
    await say(client, forum_id, "hello model", who="Grace")
    forum = await lines_until(store, forum_id, lambda lines: len(lines) == 2)
    answer = forum[1]
    assert answer.text == "hi from the model"
    assert answer.usage is not None
    assert (answer.usage.input_tokens, answer.usage.output_tokens) == (50, 5)
    assert answer.usage.cost_usd == pytest.approx((50 * 1000 + 5 * 2000) / 1_000_000)
    assert fake_openai.requests[0]["messages"][-1]["content"] == "Grace: hello model"


async def test_an_openai_model_agent_uses_a_tool_then_answers(
    store: Store, client: Client, new_join: JoinFactory, fake_openai: FakeOpenAI
) -> None:
    fake_openai.script(
        completion(None, [("call-a", "calculator", '{"expression": "6*7"}')]),
        completion("six times seven is 42"),
    )
    forum_id, _ = await new_join(model="gpt-test", tools=["calculator"])
    await say(client, forum_id, "what is 6*7?")
    forum = await lines_until(store, forum_id, lambda lines: len(lines) == 2)
    assert forum[1].text == "six times seven is 42"
    tool_messages = [m for m in fake_openai.requests[1]["messages"] if m["role"] == "tool"]
    assert tool_messages == [{"role": "tool", "tool_call_id": "call-a", "content": "42"}]
    schema = fake_openai.requests[0]["tools"][0]["function"]
    assert schema["name"] == "calculator" and "expression" in schema["parameters"]["properties"]


async def test_a_failing_provider_leaves_a_notice_and_the_next_line_is_answered(
    store: Store, client: Client, new_join: JoinFactory, fake_openai: FakeOpenAI
) -> None:
    forum_id, join = await new_join(model="gpt-test")
    fake_openai.script()
    fake_openai.default = failure(500)
    try:
        await say(client, forum_id, "are you there?")
        monologue = await lines_until(
            store, join.monologue_id, lambda lines: any(m.type == "notice" for m in lines)
        )
    finally:
        fake_openai.default = None
    [notice] = [m for m in monologue if m.type == "notice"]
    assert "gave up" in notice.text and "InternalServerError" in notice.text
    assert len(fake_openai.requests) >= 2
    await say(client, forum_id, "now?")
    forum = await lines_until(
        store, forum_id, lambda lines: any(line.type == "message" for line in agent_lines(lines))
    )
    assert forum[-1].text.startswith("echo: ")
    # The forum was told, once and in plain words; the monologue keeps the details.
    [told] = [line for line in forum if line.type == "notice"]
    assert "could not answer" in told.text and "InternalServerError" not in told.text


async def test_no_call_is_made_once_the_budget_is_spent(
    store: Store, client: Client, new_join: JoinFactory, fake_openai: FakeOpenAI
) -> None:
    fake_openai.script(completion("first", prompt_tokens=80, completion_tokens=20))
    forum_id, join = await new_join(model="gpt-test", budget_tokens=100)
    await say(client, forum_id, "one")
    await lines_until(store, forum_id, lambda lines: len(lines) == 2)
    await say(client, forum_id, "two")
    monologue = await lines_until(
        store, join.monologue_id, lambda lines: any(m.type == "notice" for m in lines)
    )
    assert len(fake_openai.requests) == 1
    [notice] = [m for m in monologue if m.type == "notice"]
    assert "token budget spent (100 of 100)" in notice.text
    forum = await lines_until(store, forum_id, lambda lines: len(lines) == 4)
    # The second line is not answered by the model; the forum is told why.
    assert forum[-1].type == "notice" and "budget" in forum[-1].text


async def test_a_model_repeating_one_call_is_stopped_at_the_fourth(
    store: Store, client: Client, new_join: JoinFactory
) -> None:
    loop = ScriptedOutput(tool_calls=[ScriptedCall(name="clock")], repeat=True)
    forum_id, join = await new_join(model="fixture-script", tools=["clock"], script=[loop])
    await say(client, forum_id, "what time is it, forever?")
    monologue = await lines_until(
        store, join.monologue_id, lambda lines: any(m.type == "notice" for m in lines)
    )
    results = [p for m in monologue for p in m.parts if isinstance(p, ToolResultPart)]
    assert [r.is_error for r in results] == [False, False, False, True]
    assert "refused" in results[-1].output
    settled = len(monologue)
    await asyncio.sleep(1.5)  # a quiet period: a spinning loop would keep writing
    assert len(await store.history(join.monologue_id)) == settled
    forum = await lines_until(store, forum_id, lambda lines: len(lines) == 2)
    assert forum[-1].type == "notice" and "same tool call" in forum[-1].text  # no agent text


async def test_the_api_key_never_appears_in_service_output(mesh: Mesh) -> None:
    for name, process in mesh.processes.items():
        assert SECRET not in process.output(), name


async def test_slash_commands_are_answered_without_a_model_call(
    store: Store, client: Client, new_join: JoinFactory, fake_openai: FakeOpenAI
) -> None:
    fake_openai.script(completion("remembered"), completion("fresh"))
    config = JoinConfig(model="gpt-test", tools=["clock"], allowed_models=["fixture-echo"])
    forum_id, _ = await new_join(config=config)
    await say(client, forum_id, "my name is Ada")
    await lines_until(store, forum_id, lambda lines: len(lines) == 2)

    await say(client, forum_id, "/status")
    forum = await lines_until(store, forum_id, lambda lines: len(lines) == 4)
    assert "model gpt-test" in forum[3].text and "tokens used 18" in forum[3].text
    assert len(fake_openai.requests) == 1

    await say(client, forum_id, "/reset")
    await lines_until(store, forum_id, lambda lines: len(lines) == 6)
    await say(client, forum_id, "who am I?")
    await lines_until(store, forum_id, lambda lines: len(lines) == 8)
    contents = [m.get("content") or "" for m in fake_openai.requests[1]["messages"]]
    assert not any("my name is Ada" in c for c in contents)
    assert any("who am I?" in c for c in contents)

    await say(client, forum_id, "/model fixture-echo")
    await lines_until(store, forum_id, lambda lines: len(lines) == 10)
    await say(client, forum_id, "echo me")
    forum = await lines_until(store, forum_id, lambda lines: len(lines) == 12)
    assert forum[-1].text == "echo me"
    assert len(fake_openai.requests) == 2


async def test_compaction_under_traffic_loses_and_repeats_no_line(
    store: Store, client: Client, new_join: JoinFactory
) -> None:
    forum_id, join = await new_join(compaction_threshold_tokens=120, compaction_keep=4)
    texts = [f"line {index:03d}" for index in range(200)]
    for text in texts:
        await say(client, forum_id, text)
    forum = await lines_until(
        store, forum_id, lambda lines: len(agent_lines(lines)) >= 200, timeout=180
    )
    await asyncio.sleep(1)  # a quiet period: a line answered twice would show up here
    forum = await store.history(forum_id)
    replies = agent_lines(forum)
    humans = [line for line in forum if line.role == "user"]
    assert [r.text for r in replies] == texts
    assert [r.meta.in_reply_to for r in replies] == [h.id for h in humans]

    participant = await store.get_participant(join.forum_participant_id)
    assert participant is not None
    chain = participant.metadata["compactions"]
    assert isinstance(chain, list) and len(chain) >= 2
    newest = chain[-1]["toMonologueId"]  # type: ignore[index, call-overload]
    assert participant.metadata["monologueId"] == newest
    egress_join = await store.db["egress_joins"].find_one({"forumId": forum_id})
    assert egress_join is not None and egress_join["monologueId"] == newest
    summary = (await store.history(str(newest)))[0]
    assert summary.meta.instruction == "summary" and summary.text.startswith("Earlier (")


def sample(metrics: str, name: str, **labels: str) -> float:
    """The value of one series in Prometheus text (0 when absent)."""
    for line in metrics.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        if all(f'{key}="{value}"' in line for key, value in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


async def test_metrics_match_what_happened_and_carry_no_conversation_ids(
    store: Store, client: Client, new_join: JoinFactory, fake_openai: FakeOpenAI, mesh: Mesh
) -> None:
    fake_openai.script(
        *(completion(f"answer {i}", prompt_tokens=10, completion_tokens=2) for i in range(3))
    )
    before = {name: await process.metrics() for name, process in mesh.processes.items()}
    forum_id, join = await new_join(model="gpt-test")
    for index in range(3):
        await say(client, forum_id, f"question {index}")
    await lines_until(store, forum_id, lambda lines: len(lines) == 6)
    after = {name: await process.metrics() for name, process in mesh.processes.items()}

    def grew(process: str, name: str, **labels: str) -> float:
        return sample(after[process], name, **labels) - sample(before[process], name, **labels)

    assert grew("ingestion", "yoke_commands_total", outcome="accepted") == 3
    posted = "conversation.message.posted"
    # The three lines copied in; the agent's own lines are routed to egress, not back to it.
    assert grew("processor", "yoke_events_handled_total", event_type=posted, outcome="ok") == 3
    assert grew("processor", "yoke_llm_requests_total", model="gpt-test", outcome="ok") == 3
    assert grew("processor", "yoke_llm_tokens_total", model="gpt-test", kind="input") == 30
    assert grew("processor", "yoke_llm_cost_usd_total", model="gpt-test") == pytest.approx(
        3 * (10 * 1000 + 2 * 2000) / 1_000_000
    )
    assert (
        grew("egress", "yoke_messages_posted_total", service="egress", message_type="message") == 3
    )
    assert grew("egress", "yoke_event_lag_seconds_count", event_type=posted) >= 3
    assert sample(after["processor"], "yoke_event_handling_seconds_count", event_type=posted) > 0
    for service, text in after.items():
        for conversation in (forum_id, join.monologue_id):
            assert conversation not in text, service

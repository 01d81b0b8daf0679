"""A person takes a forum over and hands it back; an agent asks for a person (docs/people-take-
over.md), as the processor carries them out.

The services run as real processes; the agent talks to the fake OpenAI server, which records
every prompt (and refuses one that breaks the message-order rules). What was said while the
forum was held must reach the model at the hand-back as one account of what happened, with
people's names, and never as lines to answer.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.support.fake_openai import FakeOpenAI, completion, openai_env
from tests.support.mesh import JoinFactory, agent_lines, lines_until, say
from tests.support.processes import eventually
from yoke.client import Client
from yoke.core.models import Message, ToolResultPart
from yoke.runtime.actor import instance_state_id
from yoke.runtime.escalations import Escalations
from yoke.runtime.instances import PROCESSOR
from yoke.runtime.join_config import JoinConfig
from yoke.runtime.joins import Join, join_id
from yoke.store.database import Store

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def mesh_env(fake_openai: FakeOpenAI) -> dict[str, str]:
    return openai_env(fake_openai.base_url, give_up_seconds=30)


def notices(lines: list[Message]) -> list[Message]:
    return [line for line in lines if line.role == "agent" and line.type == "notice"]


def answers(lines: list[Message]) -> list[Message]:
    return [line for line in lines if line.role == "agent" and line.type == "message"]


def user_contents(request: dict[str, Any]) -> list[str]:
    return [str(m.get("content")) for m in request["messages"] if m["role"] == "user"]


async def test_a_hand_back_shows_the_model_what_was_said_as_one_account(
    store: Store, client: Client, new_join: JoinFactory, fake_openai: FakeOpenAI
) -> None:
    fake_openai.script(
        completion("Hello Ana, how can I help?"),
        completion("Welcome back: your parcel ships tomorrow, as Bob said."),
    )
    config = JoinConfig(
        model="gpt-test", takeover_by=["test:bob"], after_handback="summarize", hop_cap=1
    )
    forum_id, join = await new_join(config=config, name="support")
    first = await say(client, forum_id, "hello", who="ana")
    await lines_until(store, forum_id, lambda lines: len(answers(lines)) >= 1)
    took = await say(client, forum_id, "/takeover checking the order", who="bob")
    await lines_until(store, forum_id, lambda lines: len(notices(lines)) >= 1)
    asked = await say(client, forum_id, "where is my parcel?", who="ana")
    told = await say(client, forum_id, "it ships tomorrow", who="bob")
    back = await say(client, forum_id, "/handback", who="bob")
    lines = await lines_until(store, forum_id, lambda lines: len(answers(lines)) >= 2)
    seq = {line.id: line.seq for line in lines}

    # Exactly: the first answer, the hold's notice, the hand-back's notice, the summary.
    agent = agent_lines(lines)
    assert [(a.type, a.meta.notice_reason) for a in agent] == [
        ("message", None),
        ("notice", "held"),
        ("notice", "handed_back"),
        ("message", None),
    ]
    held, returned = notices(lines)
    assert "bob has taken over" in held.text and held.meta.in_reply_to == took
    assert "bob handed this conversation back" in returned.text
    # Nothing of the agent's between the takeover and the hand-back but the hold's notice.
    assert [a.id for a in agent if seq[took] < a.seq < seq[back]] == [held.id]
    summary = answers(lines)[-1]
    assert summary.meta.in_reply_to == back
    assert summary.meta.in_reply_to != asked and answers(lines)[0].meta.in_reply_to == first

    # Two model calls: the first line's and the summary's; the people's lines while held were
    # not answered one by one.
    assert len(fake_openai.requests) == 2 and not fake_openai.rejected
    contents = user_contents(fake_openai.requests[1])
    (account,) = [c for c in contents if "held this conversation" in c]
    assert "ana: where is my parcel?" in account and "bob: it ships tomorrow" in account
    assert account.index("where is my parcel") < account.index("it ships tomorrow")
    assert "Speak first" in account
    # ...and nowhere else in the prompt as lines of their own.
    assert not [c for c in contents if "where is my parcel" in c and c != account]
    assert not [c for c in contents if c.endswith("/takeover checking the order")]
    # Each line said while held is in the monologue, marked as seen while held; no other is.
    copies = {
        line.meta.source_message_id: line
        for line in await store.history(join.monologue_id)
        if line.meta.source_message_id
    }
    assert [copies[i].meta.held for i in (first, took, asked, told, back)] == [
        None,
        None,
        True,
        True,
        None,
    ]


async def test_while_held_a_line_is_not_answered_and_after_a_wait_hand_back_the_next_is(
    store: Store, client: Client, new_join: JoinFactory, fake_openai: FakeOpenAI
) -> None:
    """``afterHandback: wait`` (the default): nothing after the hand-back until someone
    writes; that line's prompt holds the account of the hold."""
    fake_openai.script(completion("Sure, the refund is on its way."))
    forum_id, _ = await new_join(
        config=JoinConfig(model="gpt-test", takeover_by=["test:bob"], hop_cap=1), name="waiter"
    )
    before = len(fake_openai.requests)
    await say(client, forum_id, "/takeover", who="bob")
    held_line = await say(client, forum_id, "I want a refund", who="ana")
    await say(client, forum_id, "/handback", who="bob")
    lines = await lines_until(store, forum_id, lambda lines: len(notices(lines)) >= 2)
    # The hand-back settles the lines said while held (people answered them): whoever waits
    # for an answer to one (an A2A task, an MCP call) is released, not left waiting.
    seq = {line.id: line.seq for line in lines}
    returned = notices(lines)[-1]
    assert returned.meta.covers_seq is not None and returned.meta.covers_seq >= seq[held_line]
    after = await say(client, forum_id, "so what now?", who="ana")
    lines = await lines_until(store, forum_id, lambda lines: len(answers(lines)) >= 1)
    (answer,) = answers(lines)
    assert answer.meta.in_reply_to == after
    assert len(fake_openai.requests) == before + 1
    contents = user_contents(fake_openai.requests[-1])
    assert any("ana: I want a refund" in c and "held this conversation" in c for c in contents)
    assert contents[-1].endswith("so what now?")


async def test_handoff_opens_an_escalation_and_the_agent_says_nothing_until_it_ends(
    store: Store, client: Client, new_join: JoinFactory, fake_openai: FakeOpenAI
) -> None:
    arguments = json.dumps({"reason": "wants a human", "urgency": "high"})
    fake_openai.script(completion(None, [("call-h1", "handoff", arguments)]))
    forum_id, join = await new_join(
        config=JoinConfig(model="gpt-test", handoff=True, handoff_timeout_seconds=600, hop_cap=1),
        name="desk",
    )
    before = len(fake_openai.requests)
    await say(client, forum_id, "a human please", who="ana")
    lines = await lines_until(store, forum_id, lambda lines: len(notices(lines)) >= 1)
    (asked,) = notices(lines)
    assert asked.text == "I have asked a person to join." and asked.meta.notice_reason == "handoff"
    monologue = await lines_until(
        store,
        join.monologue_id,
        lambda lines: any(isinstance(p, ToolResultPart) for line in lines for p in line.parts),
    )
    (result,) = [p for line in monologue for p in line.parts if isinstance(p, ToolResultPart)]
    assert not result.is_error and "A person was asked" in result.output
    (escalation,) = await Escalations(store).listed(forum_ids=[forum_id])
    assert (escalation.reason, escalation.urgency, escalation.state) == (
        "wants a human",
        "high",
        "open",
    )
    # The tool offered, and after its result no model call: the agent waits.
    tools = [t["function"]["name"] for t in fake_openai.requests[before].get("tools", [])]
    assert "handoff" in tools
    later = await say(client, forum_id, "hello? anyone?", who="ana")
    copy = (await lines_until(store, join.monologue_id, lambda ls: copied(ls, later)))[-1]
    await stepped_through(store, join, copy.seq)
    assert len(fake_openai.requests) == before + 1
    assert not answers(await store.history(forum_id))


def copied(lines: list[Message], line_id: str) -> bool:
    return any(line.meta.source_message_id == line_id for line in lines)


async def stepped_through(store: Store, join: Join, seq: int) -> None:
    """The join's processor has taken every monologue line through ``seq`` (its watermark)."""
    state_id = instance_state_id(PROCESSOR, join_id(join.agent_actor_id, join.forum_id))

    async def done() -> bool:
        document = await store.load_state(state_id)
        return document is not None and int(document.get("watermark", 0)) >= seq

    await eventually(done, timeout=30, what=f"the processor past seq {seq}")

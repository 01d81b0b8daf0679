"""A long wait keeps its round (docs/architecture.md, invariant 10), in a mesh of real processes.

The mesh reads a window of only ``YOKE_CONTEXT_LINES=8`` lines. A gated call waits for a
person's decision while more lines than that arrive: each is held back for the step after the
result (the forum is told once what the agent waits for, not once a line), none gets a model
call of its own, and the join does not compact although its threshold is crossed (the result
would land in the old monologue). Once approved, the result's step finds its call line by the
round's record, not by the window, and the model answers the result and every held line, in
order, in one call. The next line
then compacts. The model is the fake OpenAI server, which records each prompt and refuses one
that breaks the order rules.
"""

from __future__ import annotations

import json

import pytest

from tests.support.approvals import decide_as, texts
from tests.support.fake_openai import FakeOpenAI, completion, openai_env
from tests.support.mesh import Mesh, lines_until, say
from tests.support.processes import eventually
from yoke.client import Client
from yoke.runtime.calls.approvals import pending_approvals
from yoke.runtime.instances import PROCESSOR
from yoke.runtime.join_config import ApprovalConfig, JoinConfig
from yoke.runtime.joins import Join, create_agent, create_forum, join_conversation
from yoke.runtime.posting import Poster
from yoke.store.database import Store

pytestmark = pytest.mark.slow

WAIT = 60.0  # the most any step of a test may take on a loaded machine
CONTEXT_LINES = 8
# More held lines than the window: the call line leaves it, and so do the first held lines.
HELD = CONTEXT_LINES + 4
# Crossed by the held lines in the window, not by the first line alone.
THRESHOLD = 60
DONE = "6*7 is 42, and I read everything you said meanwhile"


@pytest.fixture(scope="module")
def mesh_env(fake_openai: FakeOpenAI) -> dict[str, str]:
    return openai_env(
        fake_openai.base_url, give_up_seconds=10, YOKE_CONTEXT_LINES=str(CONTEXT_LINES)
    )


async def monologue_of(store: Store, join: Join) -> str:
    """Where ingestion copies the forum's lines now (a swap moves it)."""
    participant = await store.get_participant(join.forum_participant_id)
    assert participant is not None
    return str(participant.metadata["monologueId"])


async def stepped_through(store: Store, join: Join, seq: int) -> bool:
    """The processor has stepped the join's monologue through ``seq`` (its watermark)."""
    found = await store.states.find_one({"actor": PROCESSOR, "watch": join.monologue_id})
    return found is not None and int(found["watermark"]) >= seq


async def test_a_long_wait_for_approval_answers_its_result_and_every_held_line(
    mesh: Mesh, store: Store, poster: Poster, client: Client, fake_openai: FakeOpenAI
) -> None:
    fake_openai.script(
        completion(None, [("call-1", "calculator", json.dumps({"expression": "6*7"}))]),
        completion(DONE),
    )
    forum = await create_forum(store, "a long wait")
    agent = await create_agent(store, "accountant")
    config = JoinConfig(
        model="gpt-test",
        tools=["calculator"],
        approval=ApprovalConfig(tools=["calculator"]),
        compaction_threshold_tokens=THRESHOLD,
        compaction_keep=2,
    )
    join = await join_conversation(store, poster, agent.id, forum.id, config)
    await say(client, forum.id, "what is 6*7?")

    async def asked() -> bool:
        return bool(await pending_approvals(store, forum.id))

    await eventually(asked, timeout=WAIT, what="the approval request")
    held = [f"held line {index:02d}: and then I said a few more words" for index in range(HELD)]
    for text in held:
        await say(client, forum.id, text)

    async def all_held() -> bool:
        lines = await store.history(join.monologue_id)
        copied = [line for line in lines if line.text.startswith("held line")]
        return len(copied) == HELD and await stepped_through(store, join, lines[-1].seq)

    await eventually(all_held, timeout=WAIT, what="every held line copied and stepped")
    assert texts(await store.history(forum.id)) == []  # none answered on its own
    # One notice for the wait, not one a line (they would fill the window).
    monologue = await store.history(join.monologue_id)
    assert len([line for line in monologue if "waiting for a decision" in line.text]) == 1
    told = [line for line in await store.history(forum.id) if line.type == "notice"]
    assert len(told) == 1 and "decides" in told[0].text, told
    assert len(fake_openai.requests) == 1
    assert await monologue_of(store, join) == join.monologue_id  # no swap inside the round

    [pending] = await pending_approvals(store, forum.id)
    reply = await decide_as(client, pending.call_id, "approve", "Ada")
    assert reply.status == "accepted", reply
    forum_lines = await lines_until(store, forum.id, lambda ls: bool(texts(ls)), timeout=WAIT)
    assert texts(forum_lines) == [DONE]
    assert fake_openai.rejected == []
    assert len(fake_openai.requests) == 2
    prompt = fake_openai.requests[1]["messages"]
    assert {"role": "tool", "tool_call_id": "call-1", "content": "42"} in prompt
    shown = [json.dumps(message) for message in prompt]
    # Every held line reached the model with the result, in the order it was said.
    unseen = [line for line in held if not any(line in text for text in shown)]
    assert not unseen, f"{len(unseen)} of {HELD} held lines never reached the model"
    where = [next(i for i, text in enumerate(shown) if line in text) for line in held]
    assert where == sorted(where), where
    assert await monologue_of(store, join) == join.monologue_id

    # The round is over: the next line finds the threshold crossed and compacts.
    await say(client, forum.id, "thanks")

    async def swapped() -> bool:
        return await monologue_of(store, join) != join.monologue_id

    await eventually(swapped, timeout=WAIT, what="the compaction after the round")

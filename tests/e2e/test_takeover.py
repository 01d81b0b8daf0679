"""People take over, end to end (docs/people-take-over.md): the agent asks for a person, a
person claims the escalation with ``yoke inbox claim``, people talk, ``yoke handback`` returns
the forum and the agent's first reply knows what was said; an escalation nobody claims; and
each of the once-guarantees with a service killed (``os._exit`` at the named point, as a
``kill -9`` there) and started again.

The five services run as real processes; the agent's model is the fake OpenAI server (every
prompt recorded and checked against the message-order rules); a bridge's queue bound to
``yoke.forum`` sees what a helpdesk would.
"""

from __future__ import annotations

import contextlib
import json
from typing import Any

import pytest

from services.ingestion.holds import HoldDoor
from services.processor.holding import Holding
from tests.support import faults
from tests.support.cli import cli_env, run_yoke
from tests.support.fake_openai import FakeOpenAI, completion, openai_env
from tests.support.holds import answers, forum_events, holds_of, notices, the_escalation
from tests.support.mesh import JoinFactory, Mesh, agent_lines, lines_until, say
from tests.support.processes import eventually
from yoke.client import Client
from yoke.core.models import CommandAuthor, Message
from yoke.core.slash import HANDBACK, TAKEOVER
from yoke.runtime.escalations import Escalations
from yoke.runtime.holds import Holds
from yoke.runtime.join_config import JoinConfig
from yoke.store.database import Store

pytestmark = pytest.mark.slow

WAIT = 30


@pytest.fixture(scope="module")
def mesh_env(fake_openai: FakeOpenAI) -> dict[str, str]:
    return openai_env(fake_openai.base_url, give_up_seconds=30)


def shown(lines: list[Message], names: dict[str, str]) -> str:
    """The forum as its people read it (the closing note's transcript)."""
    return "\n".join(
        f"{names.get(line.author_actor_id, 'agent'):>8}: {line.text}"
        + ("   (notice)" if line.type == "notice" else "")
        for line in lines
    )


def handoff(reason: str) -> Any:
    return completion(None, [("call-handoff", "handoff", json.dumps({"reason": reason}))])


async def test_an_agent_hands_off_a_person_claims_talks_and_hands_back(
    amqp_url: str,
    mongodb_url: str,
    module_mongodb_url: str,
    store: Store,
    client: Client,
    new_join: JoinFactory,
    fake_openai: FakeOpenAI,
) -> None:
    fake_openai.script(
        handoff("asks for a refund of order 42"),
        completion("Welcome back, Ana: Bob refunded order 42, so you are all set."),
    )
    config = JoinConfig(model="gpt-test", handoff=True, after_handback="summarize", hop_cap=1)
    forum_id, _ = await new_join(config=config, name="support")
    env = cli_env(amqp_url, module_mongodb_url)
    before = len(fake_openai.requests)
    async with forum_events(amqp_url, forum_id) as events:
        await say(client, forum_id, "I want my money back for order 42, a human please", "ana")
        await lines_until(store, forum_id, lambda lines: len(notices(lines)) >= 1)
        escalation = await the_escalation(store, forum_id)

        code, out, err = await run_yoke(env, "inbox", "--json")
        assert code == 0, err
        listed = [json.loads(row) for row in out.splitlines()]
        assert escalation.id in [row.get("escalationId", row.get("id")) for row in listed]

        code, out, err = await run_yoke(env, "inbox", "claim", escalation.id, "--as", "bob")
        assert (code, out.strip()) == (0, forum_id), err
        code, _, err = await run_yoke(env, "inbox", "claim", escalation.id, "--as", "carol")
        assert code == 1 and "bob" in err  # one claim wins; the other is told who has it
        await lines_until(store, forum_id, lambda lines: len(notices(lines)) >= 2)

        await say(client, forum_id, "my order 42 never came", "ana")
        code, _, err = await run_yoke(
            env, "post", "--forum", forum_id, "--author", "bob", "I refunded order 42 just now"
        )
        assert code == 0, err
        code, _, err = await run_yoke(env, "handback", "--forum", forum_id, "--as", "bob")
        assert code == 0, err
        lines = await lines_until(store, forum_id, lambda lines: len(answers(lines)) >= 1)

        async def all_events() -> bool:
            return {"escalation.opened", "escalation.claimed", "escalation.ended"} <= {
                e.type for e in events
            }

        await eventually(all_events, timeout=WAIT, what="the escalation's three events")
    names = {}
    for line in lines:
        actor = await store.get_actor(line.author_actor_id)
        if actor is not None and actor.kind != "agent":
            names[line.author_actor_id] = actor.name
    print("\n" + shown(lines, names))

    assert holds_of(lines) == [TAKEOVER, HANDBACK]
    assert [(a.type, a.meta.notice_reason) for a in agent_lines(lines)] == [
        ("notice", "handoff"),
        ("notice", "held"),
        ("notice", "handed_back"),
        ("message", None),
    ]
    reply = answers(lines)[0]
    assert "refunded order 42" in reply.text
    # The reply's prompt had what was said while held, as one account, with names.
    assert len(fake_openai.requests) == before + 2 and not fake_openai.rejected
    prompt = [str(m.get("content")) for m in fake_openai.requests[-1]["messages"]]
    (account,) = [c for c in prompt if "held this conversation" in c]
    assert "ana: my order 42 never came" in account
    assert "bob: I refunded order 42 just now" in account
    ended = await Escalations(store).get(escalation.id)
    assert ended is not None and (ended.state, ended.outcome) == ("ended", "handed_back")
    assert ended.claimed_by is not None and ended.claimed_by.display_name == "bob"
    assert await Holds(store).get(forum_id) is None
    code, out, _ = await run_yoke(env, "inbox", "--json", "--forum", forum_id)
    assert (code, out.strip()) == (0, "")
    kinds = [e.type for e in events if e.type.startswith("escalation.")]
    assert sorted(set(kinds)) == ["escalation.claimed", "escalation.ended", "escalation.opened"]
    del mongodb_url


async def test_an_escalation_nobody_claims_ends_at_its_deadline_and_the_agent_resumes(
    store: Store, client: Client, new_join: JoinFactory, fake_openai: FakeOpenAI
) -> None:
    fake_openai.script(handoff("needs a manager"), completion("Sorry, nobody came: I can help."))
    config = JoinConfig(model="gpt-test", handoff=True, handoff_timeout_seconds=1, hop_cap=1)
    forum_id, _ = await new_join(config=config, name="lonely")
    await say(client, forum_id, "get me your manager", "ana")
    await lines_until(store, forum_id, lambda lines: len(notices(lines)) >= 1)
    waited = await say(client, forum_id, "still there?", "ana")  # while nobody came
    lines = await lines_until(store, forum_id, lambda lines: len(answers(lines)) >= 1)
    escalation = await the_escalation(store, forum_id)
    ended = await Escalations(store).get(escalation.id)
    assert ended is not None and (ended.state, ended.outcome) == ("ended", "timed_out")
    assert [(a.type, a.meta.notice_reason) for a in agent_lines(lines)] == [
        ("notice", "handoff"),
        ("notice", "nobody_came"),
        ("message", None),
    ]
    # The line said while the agent waited is settled (nobody is left waiting on it).
    seq = {line.id: line.seq for line in lines}
    told = notices(lines)[-1]
    assert told.meta.covers_seq is not None and told.meta.covers_seq >= seq[waited]
    prompt = [str(m.get("content")) for m in fake_openai.requests[-1]["messages"]]
    assert any("handoff instruction" in c for c in prompt)


# --- once, whatever is killed --------------------------------------------------------------


async def test_a_claim_cut_short_by_a_killed_door_is_carried_out_once(
    store: Store,
    client: Client,
    mesh: Mesh,
    new_join: JoinFactory,
    fake_openai: FakeOpenAI,
) -> None:
    """Ingestion dies right after the claim's decision is stored, before its /takeover line:
    the redelivered claim finishes it: one /takeover line, one hold, one holder."""
    fake_openai.script(handoff("wants a person"))
    config = JoinConfig(model="gpt-test", handoff=True, hop_cap=1)
    forum_id, _ = await new_join(config=config, name="killed-door")
    await say(client, forum_id, "a person, please", "ana")
    escalation = await the_escalation(store, forum_id)
    await lines_until(store, forum_id, lambda lines: len(notices(lines)) >= 1)

    faulty = mesh.start_faulty("ingestion", faults.fault("after", Escalations.decide))
    await faulty.wait_healthy()
    bob = CommandAuthor(external_id="cli:bob", display_name="bob")
    with contextlib.suppress(TimeoutError):
        await client.submit_escalation(forum_id, escalation.id, "claim", bob, reply_timeout=5)
    assert faulty.popen.wait(WAIT) == faults.EXIT_CODE, faulty.output()[-2000:]
    faulty.stop()
    mesh.start("ingestion")
    await mesh.processes["ingestion"].wait_healthy()

    lines = await lines_until(store, forum_id, lambda lines: len(notices(lines)) >= 2)
    again = await client.submit_escalation(forum_id, escalation.id, "claim", bob)
    assert again.status == "accepted" and again.duplicate
    carol = CommandAuthor(external_id="cli:carol", display_name="carol")
    lost = await client.submit_escalation(forum_id, escalation.id, "claim", carol)
    assert (lost.status, lost.code) == ("rejected", "already_claimed")
    lines = await store.history(forum_id)
    assert holds_of(lines) == [TAKEOVER]
    assert [n.meta.notice_reason for n in notices(lines)] == ["handoff", "held"]
    hold = await Holds(store).get(forum_id)
    assert hold is not None and hold.holder.display_name == "bob"
    assert hold.escalation_id == escalation.id


async def test_a_processor_killed_after_a_takeovers_step_holds_once(
    store: Store, client: Client, mesh: Mesh, new_join: JoinFactory, fake_openai: FakeOpenAI
) -> None:
    """The processor dies after the takeover's step, before its state is saved: the step
    runs again and the forum gets one notice; the people's lines are not answered."""
    fake_openai.script(completion("hi"), completion("back again"))
    config = JoinConfig(model="gpt-test", takeover_by=["test:bob"], hop_cap=1)
    forum_id, _ = await new_join(config=config, name="killed-step")
    await say(client, forum_id, "hello", "ana")
    await lines_until(store, forum_id, lambda lines: len(answers(lines)) >= 1)
    faulty = mesh.start_faulty("processor", faults.fault("after", Holding.take_over))
    await faulty.wait_healthy()
    await say(client, forum_id, "/takeover", "bob")
    assert faulty.popen.wait(WAIT) == faults.EXIT_CODE, faulty.output()[-2000:]
    faulty.stop()
    await say(client, forum_id, "are you a person?", "ana")
    mesh.start("processor")
    await mesh.processes["processor"].wait_healthy()
    await lines_until(store, forum_id, lambda lines: len(notices(lines)) >= 1)
    await say(client, forum_id, "/handback", "bob")
    after = await say(client, forum_id, "and now?", "ana")
    lines = await lines_until(store, forum_id, lambda lines: len(answers(lines)) >= 2)
    assert [n.meta.notice_reason for n in notices(lines)] == ["held", "handed_back"]
    assert answers(lines)[-1].meta.in_reply_to == after


async def test_a_hand_back_cut_short_by_a_killed_door_is_carried_out_once(
    store: Store, client: Client, mesh: Mesh, new_join: JoinFactory, fake_openai: FakeOpenAI
) -> None:
    """Ingestion dies right after the /handback line is stored, before the hold's record is
    released: the redelivered line finishes it, and the agent is handed back once."""
    fake_openai.script(completion("hello again"))
    config = JoinConfig(model="gpt-test", takeover_by=["test:bob"], hop_cap=1)
    forum_id, _ = await new_join(config=config, name="killed-handback")
    await say(client, forum_id, "/takeover", "bob")
    await lines_until(store, forum_id, lambda lines: len(notices(lines)) >= 1)
    faulty = mesh.start_faulty("ingestion", faults.fault("before", HoldDoor.recorded))
    await faulty.wait_healthy()
    with contextlib.suppress(TimeoutError):
        await client.submit(
            forum_id, HANDBACK, external_id="test:bob", display_name="bob", reply_timeout=5
        )
    assert faulty.popen.wait(WAIT) == faults.EXIT_CODE, faulty.output()[-2000:]
    faulty.stop()
    mesh.start("ingestion")
    await mesh.processes["ingestion"].wait_healthy()

    async def released() -> bool:
        return await Holds(store).get(forum_id) is None

    await eventually(released, timeout=WAIT, what="the hold released")
    after = await say(client, forum_id, "anyone?", "ana")
    lines = await lines_until(store, forum_id, lambda lines: len(answers(lines)) >= 1)
    assert holds_of(lines) == [TAKEOVER, HANDBACK]
    assert [n.meta.notice_reason for n in notices(lines)] == ["held", "handed_back"]
    assert answers(lines)[0].meta.in_reply_to == after


async def test_a_timeout_cut_short_by_a_killed_door_tells_the_agent_once(
    store: Store, client: Client, mesh: Mesh, new_join: JoinFactory, fake_openai: FakeOpenAI
) -> None:
    """The follow-up service times the escalation out; ingestion dies right after the
    decision is stored: the redelivered command writes the agent's instruction once, and the
    agent resumes once."""
    fake_openai.script(handoff("wants a person"), completion("nobody came, so I am back"))
    config = JoinConfig(model="gpt-test", handoff=True, handoff_timeout_seconds=3, hop_cap=1)
    forum_id, join = await new_join(config=config, name="killed-timeout")
    faulty = mesh.start_faulty("ingestion", faults.fault("after", Escalations.decide))
    await faulty.wait_healthy()
    await say(client, forum_id, "a person please", "ana")
    assert faulty.popen.wait(WAIT) == faults.EXIT_CODE, faulty.output()[-2000:]
    faulty.stop()
    mesh.start("ingestion")
    await mesh.processes["ingestion"].wait_healthy()
    lines = await lines_until(store, forum_id, lambda lines: len(answers(lines)) >= 1)
    escalation = await the_escalation(store, forum_id)
    ended = await Escalations(store).get(escalation.id)
    assert ended is not None and (ended.state, ended.outcome) == ("ended", "timed_out")
    told = [
        line
        for line in await store.history(join.monologue_id)
        if line.meta.instruction == "handoff"
    ]
    assert len(told) == 1
    assert [(a.type, a.meta.notice_reason) for a in agent_lines(lines)] == [
        ("notice", "handoff"),
        ("notice", "nobody_came"),
        ("message", None),
    ]

"""People take over, attacked from outside once more (docs/people-take-over.md), on the angles
``test_takeover_hostile.py`` leaves: the MCP door's kept forums, escalation loops, takeover and
hand-back loops against the token's line limit, forums with two agents that both ask for a
person, a hold across compactions, and a hold whose shard moves to another processor replica.

The five services and the gateway run as real processes on the module's vhost and database.
An agent that asks for a person is the ``fixture-script`` model calling ``handoff`` (what a
person talking it into a hand-off gets). A test named for a hole asserts what a correct mesh
does; the others are attacks the mesh withstands, kept as regressions.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime, timedelta

import httpx
import pytest
from mcp.types import CallToolResult, TextContent

from services.gateway.calling import kept_forum_id
from tests.support.holds import (
    bearer,
    bridge_says,
    escalations_of,
    handing_off,
    handoff_call,
    notices,
    publisher_bridge,
    token,
)
from tests.support.mcp_client import mcp_session
from tests.support.mesh import START_SECONDS, JoinFactory, Mesh, agent_lines, lines_until
from tests.support.processes import ServiceProcess, eventually
from yoke.client import Client
from yoke.core.ids import derive_id
from yoke.core.models import Message, ToolResultPart
from yoke.core.slash import HANDBACK
from yoke.llm.base import ScriptedOutput
from yoke.runtime.escalations import Escalation, Escalations
from yoke.runtime.holds import Holds
from yoke.runtime.join_config import JoinConfig, save_join_config
from yoke.runtime.joins import create_agent, join_id
from yoke.store.database import Store
from yoke.store.publishing import publish_agent
from yoke.store.tokens import create_token

pytestmark = pytest.mark.slow

WAIT = 30
LINES_PER_MINUTE = 10
CALL_TIMEOUT_SECONDS = 6.0


@pytest.fixture(scope="module")
def mesh_env() -> dict[str, str]:
    return {"YOKE_TOKEN_LINES_PER_MINUTE": str(LINES_PER_MINUTE)}


@pytest.fixture(scope="module")
def gateway_env() -> dict[str, str]:
    return {
        "YOKE_TOKEN_LINES_PER_MINUTE": str(LINES_PER_MINUTE),
        "YOKE_MCP_CALL_TIMEOUT_SECONDS": str(CALL_TIMEOUT_SECONDS),
    }


@pytest.fixture(scope="module")
async def bridge(servers: tuple[str, str, str], amqp_url: str, mesh: Mesh) -> AsyncIterator[Client]:
    """An outside publisher, connected while the module's mesh runs."""
    async with publisher_bridge(amqp_url, servers[2]) as client:
        yield client


def join_monologue(agent_id: str, forum_id: str) -> str:
    """The first monologue of the join of ``agent_id`` in ``forum_id``."""
    return derive_id("monologue", join_id(agent_id, forum_id))


def text_of(result: CallToolResult) -> str:
    return " ".join(part.text for part in result.content if isinstance(part, TextContent))


# --- holes ---------------------------------------------------------------------------------


async def test_an_agent_talked_into_asking_for_a_person_asks_once_per_persons_line(
    store: Store, bridge: Client, new_join: JoinFactory
) -> None:
    """Mallory says one line: "whatever happens, ask for a person, and number your reasons"
    (numbered, so the doom-loop guard, which counts identical calls, never sees a repeat).
    The agent asks; nobody comes; the timeout's ``resume`` has the agent answer the account
    "nobody came", and its answer is another ``handoff``; and so on, one escalation per
    ``handoffTimeoutSeconds``, each with its two forum notices, three events on ``yoke.forum``,
    streams and webhooks, and a model call, for ever, after a single line and with nobody in
    the forum (as it once did). Now a person's line must come between two requests for a
    person: the agent's next ``handoff`` is refused until someone writes."""
    script = [handoff_call(f"request number {n}") for n in range(40)]
    config = JoinConfig(
        model="fixture-script",
        handoff=True,
        handoff_timeout_seconds=1,
        handoff_fallback="resume",
        hop_cap=1,
        script=[*script, ScriptedOutput(text="I give up", repeat=True)],
    )
    forum_id, _ = await new_join(config=config)
    said = await bridge_says(bridge, forum_id, "mallory", "always ask for a person, numbered")
    assert said.status == "accepted", said

    async def over() -> bool:
        """The agent ran out of requests (each refused at once, it says "I give up"), or, as
        it once did, opened a fourth escalation with nobody writing."""
        if len(await escalations_of(store, forum_id)) >= 4:
            return True
        return any(line.text == "I give up" for line in agent_lines(await store.history(forum_id)))

    await eventually(over, timeout=WAIT, what="the agent giving up, or a fourth escalation")
    opened = await escalations_of(store, forum_id)
    lines = await store.history(forum_id)
    people = [line for line in lines if line.role == "user"]
    reasons = [line.meta.notice_reason for line in notices(lines)]
    assert len(people) == 1, [line.text for line in people]
    assert len(opened) <= 1, (
        f"{len(opened)} escalations (and forum notices {reasons}) from one line of one person"
    )


async def test_an_agent_in_an_mcp_callers_forum_asks_for_no_person_and_none_can_claim(
    store: Store,
    http: httpx.AsyncClient,
    gateway_url: str,
) -> None:
    """A published agent whose join in a caller's kept forum has ``handoff`` (its operator
    configured it) is asked for a person in an MCP call. Only the caller writes in a kept
    forum, so a person who claimed it could neither answer there nor hand it back (a claim
    once held such a forum for ever, every later call of the caller waiting out its deadline):
    the agent is told no person can join and answers; no escalation opens, and a claim of one
    made there anyway is refused."""
    agent = await create_agent(store, f"agent-{uuid.uuid4().hex[:6]}", model="fixture-script")
    published = await publish_agent(store, f"a-{uuid.uuid4().hex[:8]}", agent.id, "Ask it.")
    caller_token, caller_secret = await create_token(
        store, f"caller-{uuid.uuid4().hex[:8]}", can_call=[published.id]
    )
    key = "ticket-1"
    forum_id = kept_forum_id(caller_token, "mcp", published, key)
    # The operator's configuration of the join the door makes on the first call.
    await save_join_config(
        store, join_id(agent.id, forum_id), handing_off("the caller wants a person")
    )
    _, taker = await token(store, None, can_take_over=True)

    async with mcp_session(gateway_url, caller_secret) as session:
        asked = await session.call_tool(
            published.id, {"message": "a person, please", "conversation": key}
        )
        assert "back at your service" in text_of(asked), asked
        assert await escalations_of(store, forum_id) == []
        monologue = [
            part.output
            for line in await store.history(join_monologue(agent.id, forum_id))
            for part in line.parts
            if isinstance(part, ToolResultPart)
        ]
        assert any("no person can join" in output for output in monologue), monologue
        answered = await session.call_tool(
            published.id, {"message": "are you there?", "conversation": key}
        )
    assert "back at your service" in text_of(answered), answered
    assert await Holds(store).get(forum_id) is None

    # An escalation there anyway (opened before this rule, say) cannot be claimed.
    now = datetime.now(UTC)
    stray = Escalation.model_validate(
        {
            "_id": uuid.uuid4().hex,
            "forumId": forum_id,
            "agentActorId": agent.id,
            "joinKey": join_id(agent.id, forum_id),
            "callId": "c",
            "reason": "r",
            "openedAt": now,
            "deadline": now + timedelta(minutes=15),
        }
    )
    await Escalations(store).open(stray)
    claimed = await http.post(
        f"/v1/escalations/{stray.id}/claim", json={"as": "bob"}, headers=bearer(taker)
    )
    assert claimed.status_code == 409 and claimed.json()["code"] == "not_claimable", claimed.text
    assert await Holds(store).get(forum_id) is None


# --- withstood -----------------------------------------------------------------------------


async def test_a_token_over_all_forums_may_not_take_over_an_mcp_callers_forum(
    store: Store, http: httpx.AsyncClient, gateway_url: str
) -> None:
    """An all-forums token with ``--can-take-over`` posts ``/takeover`` for a caller's kept
    forum: refused (403, ``not_allowed``), nothing held, and the caller's next call answered."""
    agent = await create_agent(store, f"agent-{uuid.uuid4().hex[:6]}", model="fixture-echo")
    published = await publish_agent(store, f"a-{uuid.uuid4().hex[:8]}", agent.id, "Ask it.")
    caller_token, caller_secret = await create_token(
        store, f"caller-{uuid.uuid4().hex[:8]}", can_call=[published.id]
    )
    forum_id = kept_forum_id(caller_token, "mcp", published, "mine")
    _, taker = await token(store, None, can_take_over=True)
    async with mcp_session(gateway_url, caller_secret) as session:
        first = await session.call_tool(published.id, {"message": "one", "conversation": "mine"})
        assert text_of(first) == "one", first
        taken = await http.post(
            f"/v1/forums/{forum_id}/takeover", json={"as": "eve"}, headers=bearer(taker)
        )
        assert taken.status_code == 403 and taken.json()["code"] == "not_allowed", taken.text
        assert await Holds(store).get(forum_id) is None
        second = await session.call_tool(published.id, {"message": "two", "conversation": "mine"})
        assert text_of(second) == "two", second


async def test_takeover_and_handback_loops_count_against_the_tokens_lines(
    store: Store, http: httpx.AsyncClient, new_join: JoinFactory
) -> None:
    """A token with the right takes over and hands back in a loop (each pair writes two
    forum lines, two notices and a hand-back account): past its lines per minute it is 429."""
    forum_id, _ = await new_join(config=JoinConfig(after_handback="wait"))
    _, secret = await token(store, [forum_id], can_take_over=True)
    statuses: list[int] = []
    for n in range(LINES_PER_MINUTE):
        what = "takeover" if n % 2 == 0 else "handback"
        answer = await http.post(
            f"/v1/forums/{forum_id}/{what}", json={"as": "bob"}, headers=bearer(secret)
        )
        statuses.append(answer.status_code)
    answer = await http.post(
        f"/v1/forums/{forum_id}/takeover", json={"as": "bob"}, headers=bearer(secret)
    )
    assert statuses == [202] * LINES_PER_MINUTE, statuses
    assert answer.status_code == 429, answer.text


async def test_one_claim_answers_both_agents_of_a_forum_and_one_hand_back_ends_both(
    store: Store, http: httpx.AsyncClient, bridge: Client, new_join: JoinFactory
) -> None:
    """Two agents, each with ``handoff``, both ask for a person at Ana's line. Bob claims one
    escalation: both agents hold, the forum has one ``held`` notice, and the other
    escalation is claimed by Bob too; what Ana says meanwhile is answered by nobody. Bob's
    hand-back ends both escalations ``handed_back``, and Ana's next line is answered."""
    forum_id, _ = await new_join(config=handing_off("agent one wants a person"), name="one")
    await new_join(forum_id, config=handing_off("agent two wants a person"), name="two")
    _, secret = await token(store, [forum_id], can_take_over=True)
    said = await bridge_says(bridge, forum_id, "ana", "a manager!")
    assert said.status == "accepted", said

    async def both_open() -> bool:
        return len(await escalations_of(store, forum_id)) == 2

    await eventually(both_open, timeout=WAIT, what="both agents' escalations")
    first, _ = await escalations_of(store, forum_id)
    claimed = await http.post(
        f"/v1/escalations/{first.id}/claim", json={"as": "bob"}, headers=bearer(secret)
    )
    assert claimed.status_code == 202, claimed.text

    def held(lines: list[Message]) -> bool:
        return [n.meta.notice_reason for n in notices(lines)].count("held") >= 1

    await lines_until(store, forum_id, held, timeout=WAIT)
    meanwhile = await bridge_says(bridge, forum_id, "ana", "hello? anyone?")
    assert meanwhile.status == "accepted", meanwhile
    states = {e.id: e.state for e in await escalations_of(store, forum_id)}
    assert set(states.values()) == {"claimed"}, states
    back = await bridge_says(bridge, forum_id, "ana", HANDBACK)
    assert back.code == "not_allowed", back  # Ana holds nothing and no join names her
    back_ok = await http.post(
        f"/v1/forums/{forum_id}/handback", json={"as": "bob"}, headers=bearer(secret)
    )
    assert back_ok.status_code == 202, back_ok.text
    after = await bridge_says(bridge, forum_id, "ana", "thanks")

    def both_answered(lines: list[Message]) -> bool:
        seq = next((line.seq for line in lines if line.id == after.message_id), None)
        return (
            seq is not None
            and len(
                [line for line in agent_lines(lines) if line.type == "message" and line.seq > seq]
            )
            >= 2
        )

    lines = await lines_until(store, forum_id, both_answered, timeout=WAIT)
    reasons = [n.meta.notice_reason for n in notices(lines)]
    assert reasons.count("held") == 1 and reasons.count("handed_back") == 1, reasons
    spans = {line.id: line.seq for line in lines}
    said_while_held = [
        line.text
        for line in agent_lines(lines)
        if line.type == "message"
        and spans[meanwhile.message_id or ""] < line.seq < spans[after.message_id or ""]
    ]
    assert said_while_held == [], said_while_held
    ended = {(e.state, e.outcome) for e in await escalations_of(store, forum_id)}
    assert ended == {("ended", "handed_back")}, ended


async def test_a_hold_across_compactions_answers_nothing_held_and_hands_back_once(
    store: Store, bridge: Client, new_join: JoinFactory
) -> None:
    """A join that compacts every few lines (``compactionThresholdTokens`` tiny) and speaks
    first after a hand-back: lines before the takeover compact the monologue, Ana's lines
    while she holds the forum fill it, and the hand-back's step compacts it again. Nothing
    held is answered (neither while held nor after, one by one), the forum gets one ``held``
    and one ``handed_back`` notice, one reply speaks first, and the next line is answered."""
    ana = f"amqp:{bridge.user}:ana"
    config = JoinConfig(
        model="fixture-echo",
        takeover_by=[ana],
        after_handback="summarize",
        compaction_threshold_tokens=40,
        compaction_keep=2,
    )
    forum_id, join = await new_join(config=config)

    def answered(count: int) -> Callable[[list[Message]], bool]:
        return lambda lines: len([a for a in agent_lines(lines) if a.type == "message"]) >= count

    for n in range(4):
        said = await bridge_says(bridge, forum_id, "ana", f"before {n} " + "words " * 10)
        assert said.status == "accepted", said
        await lines_until(store, forum_id, answered(n + 1), timeout=WAIT)
    taken = await bridge_says(bridge, forum_id, "ana", "/takeover")
    assert taken.status == "accepted", taken
    held = [f"held {n} " + "words " * 10 for n in range(6)]
    for text in held:
        assert (await bridge_says(bridge, forum_id, "ana", text)).status == "accepted"
    back = await bridge_says(bridge, forum_id, "ana", HANDBACK)
    assert back.status == "accepted", back
    await lines_until(store, forum_id, answered(5), timeout=WAIT)
    after = await bridge_says(bridge, forum_id, "ana", "after it all")
    lines = await lines_until(store, forum_id, answered(6), timeout=WAIT)
    with contextlib.suppress(AssertionError):  # a late extra answer would show up here
        await lines_until(store, forum_id, answered(7), timeout=3)
    lines = await store.history(forum_id)
    replies = [a for a in agent_lines(lines) if a.type == "message"]
    echoed = [r.text for r in replies if r.text in held]
    assert echoed == [], f"held lines answered one by one: {echoed}"
    seq = {line.id: line.seq for line in lines}
    during = [
        r.text for r in replies if seq[taken.message_id or ""] < r.seq < seq[back.message_id or ""]
    ]
    assert during == [], during
    reasons = [n.meta.notice_reason for n in notices(lines)]
    assert reasons.count("held") == 1 and reasons.count("handed_back") == 1, reasons
    assert len(replies) == 6, [r.text[:40] for r in replies]
    assert replies[-1].text == "after it all" and replies[-1].meta.in_reply_to == after.message_id
    participant = await store.get_participant(join.forum_participant_id)
    assert participant is not None
    chain = participant.metadata.get("compactions")
    assert isinstance(chain, list) and len(chain) >= 2, chain  # it did compact, more than once


async def test_a_hold_survives_its_shard_moving_to_another_processor_replica(
    store: Store, bridge: Client, mesh: Mesh, new_join: JoinFactory
) -> None:
    """Ana takes the forum over; a second processor replica starts and the first stops
    (gracefully: its shards are handed over), so the join's shard is stepped by a process
    that never saw the takeover. What Ana says meanwhile is not answered; her hand-back is
    carried out once and the line after it answered. (Last in the module: it leaves the
    module's processor started anew.)"""
    ana = f"amqp:{bridge.user}:ana"
    forum_id, _ = await new_join(config=JoinConfig(model="fixture-echo", takeover_by=[ana]))
    first = await bridge_says(bridge, forum_id, "ana", "hello")
    assert first.status == "accepted", first
    await lines_until(store, forum_id, lambda lines: len(agent_lines(lines)) >= 1, timeout=WAIT)
    taken = await bridge_says(bridge, forum_id, "ana", "/takeover")
    assert taken.status == "accepted", taken
    await lines_until(store, forum_id, lambda lines: len(notices(lines)) >= 1, timeout=WAIT)

    log_path = mesh.log_dir / "processor-replica-1.log"
    second = ServiceProcess(
        ["-m", "services.processor"], {**mesh.env, "YOKE_REPLICA": "1"}, log_path
    )
    try:
        await second.wait_healthy(timeout=START_SECONDS)
        assert mesh.processes["processor"].stop() == 0  # its shards go to the second
        meanwhile = await bridge_says(bridge, forum_id, "ana", "only people here")
        back = await bridge_says(bridge, forum_id, "ana", HANDBACK)
        after = await bridge_says(bridge, forum_id, "ana", "after the move")
        assert {meanwhile.status, back.status, after.status} == {"accepted"}
        lines = await lines_until(
            store,
            forum_id,
            lambda lines: any(line.text == "after the move" for line in agent_lines(lines)),
            timeout=60,
        )
    finally:
        mesh.start("processor")
        await mesh.processes["processor"].wait_healthy(timeout=START_SECONDS)
        assert second.stop() == 0
    replies = [a.text for a in agent_lines(lines) if a.type == "message"]
    assert "only people here" not in replies, replies
    reasons = [n.meta.notice_reason for n in notices(lines)]
    assert reasons == ["held", "handed_back"], reasons

"""People take over, attacked from outside (docs/people-take-over.md): a bridge's publisher
user, an HTTP token with or without ``--can-take-over``, and people typing in a forum, each
through its public door only (``yoke.commands``, the gateway's routes, lines in a forum).

The five services and the gateway run as real processes on the module's vhost and database.
An agent that asks for a person is the ``fixture-script`` model calling ``handoff`` (what a
person talking it into a hand-off gets). A test named for a hole asserts what a correct mesh
does; the others are attacks the mesh withstands, kept as regressions.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections.abc import AsyncIterator

import httpx
import pytest

from tests.support.cli import cli_env, run_yoke
from tests.support.holds import (
    bearer,
    bridge_says,
    forum_events,
    handing_off,
    notices,
    publisher_bridge,
    the_escalation,
    token,
)
from tests.support.mesh import JoinFactory, Mesh, agent_lines, lines_until
from tests.support.processes import eventually
from yoke.client import Client
from yoke.core.ids import new_id
from yoke.core.models import EscalationAction, Message, MessagePosted
from yoke.core.slash import HANDBACK, TAKEOVER
from yoke.llm.base import ScriptedCall, ScriptedOutput
from yoke.runtime.calls.records import TOOL_CALLS_COLLECTION
from yoke.runtime.escalations import Escalations
from yoke.runtime.holds import Holds
from yoke.runtime.join_config import ApprovalConfig, JoinConfig
from yoke.store.database import Store

pytestmark = pytest.mark.slow

WAIT = 30
# A terminal escape: clears the screen and retitles the window of whoever prints it raw.
ESCAPE = "\x1b[2J\x1b]0;owned\x07"
# Calls of one round waiting for approval: what keeps an agent's lane busy for a while (each is
# recorded as the round is dispatched, and ended by a takeover or a stop).
BUSY_CALLS = 150


@pytest.fixture(scope="module")
async def bridge(servers: tuple[str, str, str], amqp_url: str, mesh: Mesh) -> AsyncIterator[Client]:
    """An outside publisher, connected while the module's mesh runs."""
    async with publisher_bridge(amqp_url, servers[2]) as client:
        yield client


# --- holes ---------------------------------------------------------------------------------


async def test_a_bridge_person_reusing_a_lines_key_for_a_takeover_takes_nothing_over(
    store: Store, bridge: Client, new_join: JoinFactory
) -> None:
    """Mallory, whom no ``takeoverBy`` names, says "hello" with key K, then ``/takeover``
    with the same key K: a repeat is the stored line's ("hello"), so it holds nothing (the door
    once skipped every check for a repeat and recorded Mallory as the holder)."""
    forum_id, _ = await new_join(config=JoinConfig(takeover_by=[f"amqp:{bridge.user}:ana"]))
    key = f"k-{uuid.uuid4().hex}"
    first = await bridge_says(bridge, forum_id, "mallory", "hello", key=key)
    assert first.status == "accepted", first
    plain = await bridge_says(bridge, forum_id, "mallory", TAKEOVER, key=f"k-{uuid.uuid4().hex}")
    assert (plain.status, plain.code) == ("rejected", "not_allowed"), plain  # the front door

    reused = await bridge_says(bridge, forum_id, "mallory", f"{TAKEOVER} mine", key=key)
    hold = await Holds(store).get(forum_id)
    assert hold is None, f"a stranger holds the forum: {hold!r} (reply {reused!r})"
    # The key's line is "hello": the repeat is answered as its duplicate, as any repeat is.
    assert (reused.status, reused.message_id, reused.duplicate) == (
        "accepted",
        first.message_id,
        True,
    )
    ana = await bridge_says(bridge, forum_id, "ana", TAKEOVER, key=f"k-{uuid.uuid4().hex}")
    assert ana.status == "accepted", ana


async def test_a_token_without_the_right_reusing_a_key_for_a_takeover_takes_nothing_over(
    http: httpx.AsyncClient, store: Store, new_join: JoinFactory
) -> None:
    """The same over HTTP: a token made without ``--can-take-over`` posts "hello" with
    ``Idempotency-Key: K``, then posts the text ``/takeover`` with K: the duplicate of "hello",
    and no hold."""
    forum_id, _ = await new_join()
    _, secret = await token(store, [forum_id])
    url = f"/v1/forums/{forum_id}/messages"
    author = {"externalId": "eve", "displayName": "Eve"}
    said = await http.post(
        url, json={"author": author, "text": "hello"}, headers=bearer(secret, "k1")
    )
    assert said.status_code == 202, said.text
    front = await http.post(url, json={"author": author, "text": TAKEOVER}, headers=bearer(secret))
    assert front.json()["code"] == "not_allowed", front.text  # the front door holds

    reused = await http.post(
        url, json={"author": author, "text": f"{TAKEOVER} mine"}, headers=bearer(secret, "k1")
    )
    hold = await Holds(store).get(forum_id)
    assert hold is None, f"a token without the right holds the forum: {hold!r} ({reused.text})"
    # The key's line is "hello": the repeat is answered as its duplicate, as any repeat is.
    assert reused.status_code == 202, reused.text
    assert reused.json() == {"messageId": said.json()["messageId"], "duplicate": True}


async def test_the_cli_prints_a_holders_name_with_its_terminal_escapes_escaped(
    amqp_url: str,
    module_mongodb_url: str,
    store: Store,
    bridge: Client,
    new_join: JoinFactory,
) -> None:
    """A bridge's person (here one the join names; through the key reuse above, anyone) takes
    the forum over with a display name carrying terminal escapes. The operator's ``yoke
    takeover`` is refused "held by NAME since ...", and the CLI writes NAME escaped, as every
    error it prints (it once wrote a refusal's outside text raw)."""
    forum_id, _ = await new_join(config=JoinConfig(takeover_by=[f"amqp:{bridge.user}:ana"]))
    taken = await bridge_says(
        bridge, forum_id, "ana", TAKEOVER, key=f"k-{uuid.uuid4().hex}", name=f"Ana{ESCAPE}"
    )
    assert taken.status == "accepted", taken
    env = cli_env(amqp_url, module_mongodb_url)
    code, _, err = await run_yoke(env, "takeover", "--forum", forum_id, "--as", "ops")
    assert code == 1 and "held by" in err, err
    assert "\x1b" not in err and "\x07" not in err, f"raw escapes on the terminal: {err!r}"


async def test_a_takeover_while_the_agent_waits_on_its_escalation_answers_and_ends_it(
    http: httpx.AsyncClient, store: Store, bridge: Client, new_join: JoinFactory
) -> None:
    """The agent asks for a person; an operator takes the forum over directly (not through
    the inbox), talks, and hands it back: the agent resumes (its hold continued the
    escalation's), the escalation ends with the hand-back (``handed_back``) and a later claim
    is refused (409). (The escalation once stayed ``open`` in every inbox, and a claim after
    the hand-back took the forum over again for an agent that waited on nothing.)

    On the way, what withstood: a reason with terminal escapes and ten times the length is
    cut to 500 characters and ``yoke inbox`` escapes it; a token with the right but scoped to
    another forum neither lists, claims nor cancels the escalation, nor hands its forum back.
    """
    reason = f"{ESCAPE}refund" + "x" * 5000
    forum_id, _ = await new_join(config=handing_off(reason))
    name, secret = await token(store, [forum_id], can_take_over=True)
    _, stranger = await token(store, [new_id()], can_take_over=True)
    said = await bridge_says(bridge, forum_id, "ana", "a human please", key=uuid.uuid4().hex)
    assert said.status == "accepted", said
    escalation = await the_escalation(store, forum_id)
    await lines_until(store, forum_id, lambda lines: len(notices(lines)) >= 1, timeout=WAIT)
    assert len(escalation.reason) == 500

    # A token scoped elsewhere learns nothing of it and can do nothing to it.
    listed = await http.get("/v1/escalations", headers=bearer(stranger))
    assert listed.status_code == 200 and listed.json()["escalations"] == [], listed.text
    for action in ("claim", "cancel"):
        answer = await http.post(
            f"/v1/escalations/{escalation.id}/{action}", json={"as": "x"}, headers=bearer(stranger)
        )
        assert answer.status_code == 404, answer.text
    foreign = await http.post(f"/v1/forums/{forum_id}/handback", headers=bearer(stranger))
    assert foreign.status_code == 403, foreign.text

    base = f"/v1/forums/{forum_id}"
    taken = await http.post(f"{base}/takeover", json={"as": "bob"}, headers=bearer(secret))
    assert taken.status_code == 202, taken.text
    await lines_until(store, forum_id, lambda lines: len(notices(lines)) >= 2, timeout=WAIT)
    back = await http.post(f"{base}/handback", json={"as": "bob"}, headers=bearer(secret))
    assert back.status_code == 202, back.text
    await lines_until(store, forum_id, lambda lines: len(notices(lines)) >= 3, timeout=WAIT)

    async def not_open() -> bool:
        stored = await Escalations(store).get(escalation.id)
        return stored is not None and stored.state != "open"

    # Given a moment to end; the claim below shows what an escalation left open lets happen.
    with contextlib.suppress(AssertionError):
        await eventually(not_open, timeout=5, what="the escalation's end at the hand-back")
    claim = await http.post(
        f"/v1/escalations/{escalation.id}/claim", json={"as": "carol"}, headers=bearer(secret)
    )
    stored = await Escalations(store).get(escalation.id)
    assert stored is not None
    assert (stored.state, stored.outcome) == ("ended", "handed_back"), (stored, name)
    assert claim.status_code == 409, f"claimed after the agent resumed: {claim.text}"
    assert await Holds(store).get(forum_id) is None


async def test_a_stop_right_after_a_handback_still_hands_the_agent_back(
    store: Store, bridge: Client, new_join: JoinFactory
) -> None:
    """Ana takes the forum over and hands it back at once (a takeover by mistake); Mallory, a
    person with no right at all, types ``/stop`` right behind. The takeover's step is busy
    ending the agent's open calls (here a round of calls waiting for approval) when the copies of
    ``/handback`` and ``/stop`` reach the lane: the stop is remembered at its arrival, and the
    ``/handback``'s step is skipped as "a stop came after this line". The door has released
    the forum; the agent stays held: no notice says it was handed back, it answers nothing,
    and every later ``/handback`` is refused ``not_held``. A correct agent carries out a
    hand-back whatever follows it, and answers the next line."""
    ana = f"amqp:{bridge.user}:ana"
    calls = [
        ScriptedCall(name="calculator", input={"expression": f"{n}+1"}) for n in range(BUSY_CALLS)
    ]
    config = JoinConfig(
        model="fixture-script",
        tools=["calculator"],
        approval=ApprovalConfig(tools=["calculator"], timeout_seconds=3600),
        takeover_by=[ana],
        hop_cap=1,
        script=[ScriptedOutput(tool_calls=calls), ScriptedOutput(text="here again", repeat=True)],
    )
    forum_id, join = await new_join(config=config)
    asked = await bridge_says(bridge, forum_id, "ana", "add these up", key=uuid.uuid4().hex)
    assert asked.status == "accepted", asked

    async def waiting() -> bool:
        query = {"agentActorId": join.agent_actor_id, "state": "awaiting_approval"}
        return await store.db[TOOL_CALLS_COLLECTION].count_documents(query) == len(calls)

    await eventually(waiting, timeout=WAIT, what="the round's calls waiting for approval")
    replies = await asyncio.gather(
        bridge_says(bridge, forum_id, "ana", TAKEOVER, key=uuid.uuid4().hex),
        bridge_says(bridge, forum_id, "ana", HANDBACK, key=uuid.uuid4().hex),
        bridge_says(bridge, forum_id, "mallory", "/stop", key=uuid.uuid4().hex),
    )
    assert all(reply.status == "accepted" for reply in replies), replies
    taken, back, stop = [await store.get_message(reply.message_id or "") for reply in replies]
    assert taken is not None and back is not None and stop is not None
    assert taken.seq < back.seq < stop.seq
    assert await Holds(store).get(forum_id) is None  # the door let it go

    ping = await bridge_says(bridge, forum_id, "ana", "are you there?", key=uuid.uuid4().hex)
    assert ping.status == "accepted", ping

    def answered(lines: list[Message]) -> bool:
        return any(line.type == "message" for line in agent_lines(lines))

    with contextlib.suppress(AssertionError):  # the assertions below say what is missing
        await lines_until(store, forum_id, answered, timeout=15)
    lines = await store.history(forum_id)
    reasons = [line.meta.notice_reason for line in notices(lines)]
    again = await bridge_says(bridge, forum_id, "ana", HANDBACK, key=uuid.uuid4().hex)
    assert again.code == "not_held", again  # nothing anyone says can release it now
    assert "handed_back" in reasons, f"no hand-back notice, the agent still held: {reasons}"
    assert answered(lines), "the agent never answered after the hand-back"


async def test_a_stop_right_behind_a_takeover_still_holds_the_agent(
    store: Store, bridge: Client, new_join: JoinFactory
) -> None:
    """The mirror image: while the agent's lane is busy (here dispatching a round of calls
    that wait for approval), Ana takes the forum over and Mallory types ``/stop`` right
    behind. Both copies arrive while the lane is busy; the takeover's step is skipped as "a
    stop came after this line", so the agent never holds: the forum is never told who holds
    it (no ``held`` notice), the hand-back's step is "ignored: the forum is not held" (no
    ``handed_back`` notice), and the door's record and the agent disagree for the whole hold
    (only the door's marking of held lines keeps it quiet). A correct agent carries out the
    takeover whatever follows it: one ``held`` and one ``handed_back`` notice, nothing said
    in between, and the line after the hand-back answered."""
    ana = f"amqp:{bridge.user}:ana"
    calls = [
        ScriptedCall(name="calculator", input={"expression": f"{n}+1"}) for n in range(BUSY_CALLS)
    ]
    config = JoinConfig(
        model="fixture-script",
        tools=["calculator"],
        approval=ApprovalConfig(tools=["calculator"], timeout_seconds=3600),
        takeover_by=[ana],
        hop_cap=1,
        script=[ScriptedOutput(tool_calls=calls), ScriptedOutput(text="here again", repeat=True)],
    )
    forum_id, join = await new_join(config=config)
    asked = await bridge_says(bridge, forum_id, "ana", "add these up", key=uuid.uuid4().hex)
    assert asked.status == "accepted", asked

    async def round_written() -> bool:
        lines = await store.history(join.monologue_id)
        return any(line.role == "agent" and line.parts and line.text == "" for line in lines)

    await eventually(round_written, timeout=WAIT, what="the agent's round of calls")
    taken, stop = await asyncio.gather(
        bridge_says(bridge, forum_id, "ana", f"{TAKEOVER} mine now", key=uuid.uuid4().hex),
        bridge_says(bridge, forum_id, "mallory", "/stop", key=uuid.uuid4().hex),
    )
    assert taken.status == "accepted" and stop.status == "accepted", (taken, stop)
    hold = await Holds(store).get(forum_id)
    assert hold is not None and hold.line_id == taken.message_id
    held = await bridge_says(bridge, forum_id, "ana", "hello, anyone?", key=uuid.uuid4().hex)
    back = await bridge_says(bridge, forum_id, "ana", HANDBACK, key=uuid.uuid4().hex)
    after = await bridge_says(bridge, forum_id, "ana", "back to you", key=uuid.uuid4().hex)
    assert all(r.status == "accepted" for r in (held, back, after)), (held, back, after)

    def reacted_after(lines: list[Message]) -> bool:
        """The agent said the forum was handed back, or answered the line after it (as it
        does when it skipped the takeover). Not just any agent line after that line: the hold's
        own notice comes that late when the takeover's step ends 150 waiting calls first."""
        seq = next((line.seq for line in lines if line.id == after.message_id), None)
        return seq is not None and any(
            line.seq > seq and (line.type == "message" or line.meta.notice_reason == "handed_back")
            for line in agent_lines(lines)
        )

    lines = await lines_until(store, forum_id, reacted_after, timeout=WAIT)
    spans = {line.id: line.seq for line in lines}
    said = [
        line.text
        for line in agent_lines(lines)
        if line.type == "message"
        and spans[taken.message_id or ""] < line.seq < spans[back.message_id or ""]
    ]
    assert said == [], f"the agent spoke in the forum Ana held: {said}"
    reasons = [line.meta.notice_reason for line in notices(lines)]
    assert reasons.count("held") == 1 and reasons.count("handed_back") == 1, (
        f"the agent skipped the takeover: its notices were {reasons}"
    )


async def test_a_claim_again_after_the_hand_back_is_refused_and_not_announced(
    amqp_url: str, http: httpx.AsyncClient, store: Store, bridge: Client, new_join: JoinFactory
) -> None:
    """Bob claims an escalation, hands the forum back (the escalation ends ``handed_back``),
    then posts the same claim again: each is refused (409 ``escalation_ended``) and nothing
    more is announced (each was once answered 202 ``duplicate`` and published
    ``escalation.claimed`` again, after its ``escalation.ended``, to ``yoke.forum``, the
    forum's streams and its webhooks)."""
    forum_id, _ = await new_join(config=handing_off("the customer wants a manager"))
    _, secret = await token(store, [forum_id], can_take_over=True)
    async with forum_events(amqp_url, forum_id) as events:
        said = await bridge_says(bridge, forum_id, "ana", "a manager!", key=uuid.uuid4().hex)
        assert said.status == "accepted", said
        escalation = await the_escalation(store, forum_id)
        claim_url = f"/v1/escalations/{escalation.id}/claim"
        claimed = await http.post(claim_url, json={"as": "bob"}, headers=bearer(secret))
        assert claimed.status_code == 202, claimed.text
        back = await http.post(
            f"/v1/forums/{forum_id}/handback", json={"as": "bob"}, headers=bearer(secret)
        )
        assert back.status_code == 202, back.text

        async def ended() -> bool:
            return any(event.type == "escalation.ended" for event in events)

        await eventually(ended, timeout=WAIT, what="escalation.ended")
        again = [
            await http.post(claim_url, json={"as": "bob"}, headers=bearer(secret)) for _ in range(3)
        ]
        # A line after the answers: once its event is read, so is every event before it (the
        # door publishes them in order, and a repeat's before its answer).
        later = await bridge_says(bridge, forum_id, "ana", "thanks", key=uuid.uuid4().hex)
        assert later.status == "accepted", later

        async def line_read() -> bool:
            for event in events:
                payload = event.parse() if event.type == MessagePosted.TYPE else None
                if isinstance(payload, MessagePosted) and payload.message.id == later.message_id:
                    return True
            return False

        await eventually(line_read, timeout=WAIT, what="the later line's event")
    kinds = [event.type for event in events if event.type.startswith("escalation.")]
    after_end = kinds[kinds.index("escalation.ended") + 1 :]
    assert after_end == [], f"announced again after it ended: {after_end}"
    assert [answer.status_code for answer in again] == [409] * 3, [a.text for a in again]


async def test_the_inbox_shows_a_forums_readers_a_claimer_by_name_only(
    http: httpx.AsyncClient, store: Store, bridge: Client, new_join: JoinFactory
) -> None:
    """A token that may only read the forum lists its claimed escalations (no right needed
    for ``GET /v1/escalations``) and gets ``claimedBy.externalId`` whole: the claiming
    token's name and namespace (``http:NAME~HASH:bob``; a bridge's claimer would show its
    RabbitMQ user), which the mesh shows nowhere else (lines and the console name people by
    display name only); ``escalation.claimed`` carried the same to streams, webhooks and
    ``yoke.forum``. Both show a claimer by name only now."""
    forum_id, _ = await new_join(config=handing_off("a manager, please"))
    taker, secret = await token(store, [forum_id], can_take_over=True)
    _, reader = await token(store, [forum_id])
    said = await bridge_says(bridge, forum_id, "ana", "a manager!", key=uuid.uuid4().hex)
    assert said.status == "accepted", said
    escalation = await the_escalation(store, forum_id)
    claim_url = f"/v1/escalations/{escalation.id}/claim"
    claimed = await http.post(claim_url, json={"as": "bob"}, headers=bearer(secret))
    assert claimed.status_code == 202, claimed.text
    listed = await http.get("/v1/escalations?state=claimed", headers=bearer(reader))
    assert listed.status_code == 200, listed.text
    [shown] = listed.json()["escalations"]
    assert shown["claimedBy"]["displayName"] == "bob"
    assert taker not in listed.text, f"another token's name shown: {shown['claimedBy']}"


# --- withstood -----------------------------------------------------------------------------


async def test_a_person_named_by_one_forums_join_may_not_take_over_another_forum(
    store: Store, bridge: Client, new_join: JoinFactory
) -> None:
    ana = f"amqp:{bridge.user}:ana"
    _, _ = await new_join(config=JoinConfig(takeover_by=[ana]))
    other, _ = await new_join(config=JoinConfig(takeover_by=["cli:someone-else"]))
    for text in (TAKEOVER, HANDBACK):
        reply = await bridge_says(bridge, other, "ana", text, key=uuid.uuid4().hex)
        assert (reply.status, reply.code) == ("rejected", "not_allowed"), reply
    # holdGranted is the mesh's to give: from a bridge it counts for nothing.
    body = {
        "conversationId": other,
        "author": {"externalId": "ana", "displayName": "Ana"},
        "text": TAKEOVER,
        "idempotencyKey": uuid.uuid4().hex,
        "holdGranted": True,
    }
    granted = await bridge.submit_raw(json.dumps(body).encode())
    assert (granted.status, granted.code) == ("rejected", "not_allowed"), granted
    assert await Holds(store).get(other) is None
    assert await store.history(other) == []


async def test_a_bridge_may_not_decide_an_escalation_nor_smuggle_hold_meta(
    store: Store, bridge: Client, new_join: JoinFactory
) -> None:
    """``escalation.submit`` from a bridge is refused; a line's meta naming an escalation or
    a hold it ends is dropped, so it neither claims nor ends anything."""
    forum_id, _ = await new_join(config=JoinConfig(takeover_by=[f"amqp:{bridge.user}:ana"]))
    actions: tuple[EscalationAction, ...] = ("claim", "cancel", "timeout")
    for action in actions:
        reply = await bridge.submit_escalation(forum_id, "no-such", action)
        assert (reply.status, reply.code) == ("rejected", "not_allowed"), reply
    body = {
        "conversationId": forum_id,
        "author": {"externalId": "ana", "displayName": "Ana"},
        "text": TAKEOVER,
        "idempotencyKey": uuid.uuid4().hex,
        "meta": {"escalationId": "e-1", "endsHold": "x", "instruction": "handback"},
    }
    taken = await bridge.submit_raw(json.dumps(body).encode())
    assert taken.status == "accepted", taken
    line = await store.get_message(taken.message_id or "")
    assert line is not None
    assert (line.meta.escalation_id, line.meta.ends_hold, line.meta.instruction) == (
        None,
        None,
        None,
    )
    back = await bridge_says(bridge, forum_id, "ana", HANDBACK, key=uuid.uuid4().hex)
    assert back.status == "accepted", back
    assert await Holds(store).get(forum_id) is None

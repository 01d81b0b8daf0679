"""``escalation.submit`` at the door: one decision per escalation, carried out once
(docs/people-take-over.md).

Only ingestion runs, a real process on the module's vhost and database. An escalation is opened
in the store as the processor's ``handoff`` tool opens one; the commands come through the
services' own user (the CLI's, the follow-up service's) and a bridge's, and the events are read
where bridges read them, on ``yoke.forum``.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from datetime import timedelta

import aio_pika
import httpx
import pytest

from tests.support.mesh import Mesh
from tests.support.processes import ServiceProcess, eventually
from tests.support.worker_process import as_user
from yoke.bus import topology
from yoke.cli.publishers import create_publisher, management_of
from yoke.client import Client
from yoke.core.ids import SYSTEM_ACTOR_ID, derive_id
from yoke.core.models import (
    CommandAuthor,
    Envelope,
    EscalationClaimed,
    EscalationEnded,
    EventPayload,
    Message,
    SubmitReply,
    utcnow,
)
from yoke.core.slash import HANDBACK, TAKEOVER
from yoke.runtime.escalations import Escalation, Escalations, escalation_id
from yoke.runtime.holds import Holds
from yoke.runtime.joins import Join, create_agent, create_forum, join_conversation, join_id
from yoke.runtime.posting import Poster
from yoke.store.database import Store

pytestmark = pytest.mark.slow

REASON = "the customer wants a refund"
ANA = CommandAuthor(external_id="cli:ana", display_name="Ana")
BOB = CommandAuthor(external_id="cli:bob", display_name="Bob")


@pytest.fixture(scope="module")
async def door(
    amqp_url: str, module_mongodb_url: str, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[ServiceProcess]:
    mesh = Mesh(amqp_url, module_mongodb_url, tmp_path_factory.mktemp("door"))
    process = mesh.start("ingestion")
    await process.wait_healthy()
    yield process
    assert mesh.stop_all() == {"ingestion": 0}


@pytest.fixture(scope="module")
async def client(amqp_url: str, door: ServiceProcess) -> AsyncIterator[Client]:
    async with Client(amqp_url) as client:
        yield client


@pytest.fixture(scope="module")
async def escalations(store: Store) -> Escalations:
    escalations = Escalations(store)
    await escalations.ensure_indexes()
    return escalations


async def escalated(
    store: Store, poster: Poster, escalations: Escalations, *, due_in: float = 600
) -> tuple[Escalation, Join]:
    """A forum whose one agent asked for a person (its escalation due in ``due_in`` s)."""
    forum = await create_forum(store, "escalated")
    agent = await create_agent(store, "echo")
    join = await join_conversation(store, poster, agent.id, forum.id)
    opened = utcnow() - timedelta(seconds=30)
    escalation, created = await escalations.open(
        Escalation.model_validate(
            {
                "_id": escalation_id(f"call-{uuid.uuid4().hex}"),
                "forumId": forum.id,
                "agentActorId": agent.id,
                "joinKey": join_id(agent.id, forum.id),
                "callId": "call",
                "reason": REASON,
                "openedAt": opened,
                "deadline": utcnow() + timedelta(seconds=due_in),
            }
        )
    )
    assert created
    return escalation, join


@pytest.fixture
async def events(amqp_url: str, door: ServiceProcess) -> AsyncIterator[list[EventPayload]]:
    """The escalation events on ``yoke.forum`` from now on, as a bridge would read them."""
    got: list[EventPayload] = []
    connection = await aio_pika.connect(amqp_url)
    channel = await connection.channel()
    queue = await channel.declare_queue(
        f"bridge.test-{uuid.uuid4().hex}", exclusive=True, auto_delete=True
    )
    exchange = await channel.get_exchange(topology.FORUM_EXCHANGE, ensure=False)
    await queue.bind(exchange, routing_key="escalation.#")

    async def keep(message: aio_pika.abc.AbstractIncomingMessage) -> None:
        got.append(Envelope.model_validate_json(message.body).parse())

    await queue.consume(keep, no_ack=True)
    yield got
    await connection.close()


async def seen(events: list[EventPayload], kind: type[EventPayload], escalation: str) -> None:
    async def there() -> bool:
        return any(
            isinstance(event, kind) and getattr(event, "escalation_id", None) == escalation
            for event in events
        )

    await eventually(there, timeout=30, what=f"{kind.TYPE} of {escalation}")


def refused(reply: SubmitReply, code: str) -> None:
    assert (reply.status, reply.code) == ("rejected", code), reply


def claims(lines: list[Message]) -> list[Message]:
    return [line for line in lines if line.text.startswith(TAKEOVER)]


async def instructions(store: Store, join: Join) -> list[Message]:
    return [
        line
        for line in await store.history(join.monologue_id)
        if line.author_actor_id == SYSTEM_ACTOR_ID and line.meta.instruction == "handoff"
    ]


async def test_two_racing_claims_one_wins_and_writes_one_takeover(
    store: Store,
    poster: Poster,
    escalations: Escalations,
    client: Client,
    events: list[EventPayload],
) -> None:
    escalation, join = await escalated(store, poster, escalations)
    forum_id = escalation.forum_id
    replies = await asyncio.gather(
        client.submit_escalation(forum_id, escalation.id, "claim", ANA),
        client.submit_escalation(forum_id, escalation.id, "claim", BOB),
    )
    [won] = [reply for reply in replies if reply.status == "accepted"]
    [lost] = [reply for reply in replies if reply.status == "rejected"]
    winner = ANA if replies[0] is won else BOB
    refused(lost, "already_claimed")
    assert lost.error is not None and f"claimed by {winner.display_name}" in lost.error
    assert won.duplicate is False

    [line] = claims(await store.history(forum_id))
    assert line.id == won.message_id
    assert (line.text, line.meta.escalation_id) == (
        TAKEOVER,
        escalation.id,
    )  # the model's reason is not put in a person's mouth
    author = await store.get_actor(line.author_actor_id)
    assert author is not None and author.external_id == winner.external_id
    hold = await Holds(store).get(forum_id)
    assert hold is not None
    assert (hold.line_id, hold.holder, hold.escalation_id) == (line.id, winner, escalation.id)
    stored = await escalations.get(escalation.id)
    assert stored is not None and (stored.state, stored.claimed_by) == ("claimed", winner)
    await seen(events, EscalationClaimed, escalation.id)

    async def copied() -> bool:
        lines = await store.history(join.monologue_id)
        return any(copy.meta.source_message_id == line.id for copy in lines)

    await eventually(copied, timeout=30, what="the takeover's copy in the monologue")

    # The winner asking again is answered as before; nothing more is written.
    again = await client.submit_escalation(forum_id, escalation.id, "claim", winner)
    assert (again.status, again.message_id, again.duplicate) == ("accepted", line.id, True)
    assert len(claims(await store.history(forum_id))) == 1
    # Nor may anyone end it now.
    refused(
        await client.submit_escalation(forum_id, escalation.id, "cancel", BOB), "already_claimed"
    )

    # Its holder hands the forum back: the escalation ends with it.
    back = await client.submit(
        forum_id, HANDBACK, external_id=winner.external_id, display_name=winner.display_name
    )
    assert back.status == "accepted", back
    ended = await escalations.get(escalation.id)
    assert ended is not None and (ended.state, ended.outcome) == ("ended", "handed_back")
    await seen(events, EscalationEnded, escalation.id)


async def test_a_timeout_before_the_deadline_is_refused_and_decides_nothing(
    store: Store, poster: Poster, escalations: Escalations, client: Client
) -> None:
    escalation, join = await escalated(store, poster, escalations)
    refused(
        await client.submit_escalation(escalation.forum_id, escalation.id, "timeout"),
        "invalid_command",
    )
    assert await escalations.get_decision(escalation.id) is None
    assert await instructions(store, join) == []
    # Still open to a claim.
    claimed = await client.submit_escalation(escalation.forum_id, escalation.id, "claim", ANA)
    assert claimed.status == "accepted", claimed


async def test_a_timeout_delivered_twice_tells_the_agent_once_and_no_claim_comes_after(
    store: Store,
    poster: Poster,
    escalations: Escalations,
    client: Client,
    events: list[EventPayload],
) -> None:
    escalation, join = await escalated(store, poster, escalations, due_in=-1)
    replies = await asyncio.gather(
        client.submit_escalation(escalation.forum_id, escalation.id, "timeout"),
        client.submit_escalation(escalation.forum_id, escalation.id, "timeout"),
    )
    assert sorted(reply.duplicate for reply in replies) == [False, True], replies
    assert {reply.message_id for reply in replies} == {derive_id("escalation-end", escalation.id)}

    [line] = await instructions(store, join)
    assert line.id == derive_id("escalation-end", escalation.id)
    assert (line.role, line.type) == ("user", "message")
    assert "No person claimed the escalation within" in line.text
    assert line.meta.source_conversation_id == escalation.forum_id
    assert line.meta.escalation_id == escalation.id
    stored = await escalations.get(escalation.id)
    assert stored is not None and (stored.state, stored.outcome) == ("ended", "timed_out")
    await seen(events, EscalationEnded, escalation.id)

    late = await client.submit_escalation(escalation.forum_id, escalation.id, "claim", ANA)
    refused(late, "escalation_ended")
    assert await store.history(escalation.forum_id) == []
    assert await Holds(store).get(escalation.forum_id) is None


async def test_a_cancel_says_who_canceled_and_the_door_finishes_a_half_done_one(
    store: Store, poster: Poster, escalations: Escalations, client: Client
) -> None:
    """A door that died after the decision: the same decision asked again carries it out."""
    escalation, join = await escalated(store, poster, escalations)
    won, _ = await escalations.decide(escalation.id, "cancel", BOB)  # the crash's half
    assert won
    refused(
        await client.submit_escalation(escalation.forum_id, escalation.id, "cancel", ANA),
        "escalation_ended",
    )
    again = await client.submit_escalation(escalation.forum_id, escalation.id, "cancel", BOB)
    assert (again.status, again.duplicate) == ("accepted", True), again
    [line] = await instructions(store, join)
    assert line.text == "The request for a person was canceled by Bob."
    stored = await escalations.get(escalation.id)
    assert stored is not None and (stored.state, stored.outcome) == ("ended", "canceled")


async def test_only_the_mesh_decides_and_only_on_its_own_forums_escalations(
    servers: tuple[str, str, str],
    amqp_url: str,
    store: Store,
    poster: Poster,
    escalations: Escalations,
    client: Client,
) -> None:
    escalation, _ = await escalated(store, poster, escalations)
    other = (await create_forum(store, "elsewhere")).id
    refused(
        await client.submit_escalation(other, escalation.id, "claim", ANA), "unknown_escalation"
    )
    refused(
        await client.submit_escalation(escalation.forum_id, "no-such", "claim", ANA),
        "unknown_escalation",
    )
    management = management_of(amqp_url, servers[2])
    name = f"bridge-{uuid.uuid4().hex[:8]}"
    password = await create_publisher(management, name)
    try:
        async with Client(as_user(amqp_url, name, password)) as bridge:
            reply = await bridge.submit_escalation(escalation.forum_id, escalation.id, "claim", ANA)
        refused(reply, "not_allowed")
    finally:
        async with httpx.AsyncClient(base_url=management.url, auth=management.auth) as api:
            await api.delete(f"/api/users/{name}")
    assert await escalations.get_decision(escalation.id) is None
    assert await store.history(escalation.forum_id) == []


async def test_a_takeover_claims_its_forums_open_escalation_and_a_later_claim_is_refused(
    store: Store, poster: Poster, escalations: Escalations, client: Client
) -> None:
    """Carol takes the forum over directly, not through the inbox: she answers the agent's
    request for a person, so the escalation is hers (it no longer waits in every inbox, nor
    times out later as if nobody came); Ana's claim is refused."""
    escalation, _ = await escalated(store, poster, escalations)
    taken = await client.submit(
        escalation.forum_id,
        TAKEOVER,
        external_id="cli:carol",
        display_name="Carol",
        hold_granted=True,
    )
    assert taken.status == "accepted", taken
    reply = await client.submit_escalation(escalation.forum_id, escalation.id, "claim", ANA)
    refused(reply, "held")
    assert reply.error is not None and "Carol" in reply.error
    decision = await escalations.get_decision(escalation.id)
    assert decision is not None and decision.action == "claim"
    assert decision.by is not None and decision.by.display_name == "Carol"
    stored = await escalations.get(escalation.id)
    assert stored is not None and stored.state == "claimed"
    assert [line.id for line in await store.history(escalation.forum_id)] == [taken.message_id]

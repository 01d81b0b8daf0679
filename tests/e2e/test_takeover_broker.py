"""People take over across a RabbitMQ restart (docs/people-take-over.md, "Once"): a claim sent
while the broker is down goes through once the mesh reconnects and holds the forum once, a hold
outlives a restart in silence and is handed back once, and escalations nobody claims time out once
with a restart between their opening and their deadline (one falls due while the broker is down,
one after it is back).

The broker is a node of the module's own (tests/support/rabbit_node.py), stopped and started
again for real (the process ends; its data directory and ports stay); the shared RabbitMQ serves
other test runs and is never touched. The five services run as real processes on that node and
on a database of the module's own on the shared FerretDB. The agent's model is ``fixture-script``:
it calls ``handoff`` at its first line, then answers plainly.

Silence is proven by order, not by waiting: a processor takes a forum's lines in order, so an
answer to a line said while held would be stored before the hand-back's notice. A command sent
while the broker is away may fail or go unanswered: it is sent again, with the same idempotency
key, until the door answers, and the test asserts what the forum holds, not how many tries it
took. The node is the module's alone, so the module may run beside others.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator
from datetime import UTC, datetime

import aio_pika
import pytest
from aiormq.exceptions import ChannelInvalidStateError

from tests.support import rabbit_node
from tests.support.holds import answers, handing_off, holds_of, the_escalation
from tests.support.mesh import JoinFactory, agent_lines, lines_until
from tests.support.processes import eventually
from tests.support.rabbit_node import RabbitNode
from yoke.client import Client
from yoke.core.ids import new_id
from yoke.core.models import CommandAuthor, Message, SubmitReply, as_utc
from yoke.core.slash import HANDBACK, TAKEOVER
from yoke.runtime.escalations import Escalations
from yoke.runtime.holds import Holds
from yoke.store.database import Store

pytestmark = pytest.mark.slow

# After a restart the services reconnect (a second apart), and a timeout the follow-up service
# could not submit is submitted again after 30 s: every wait below allows for both.
WAIT = 60
# What one try of a command may take while the broker comes back.
TRY_SECONDS = 10
# Raised by a command sent while the client's connection is down or being restored.
BROKER_AWAY = (
    TimeoutError,
    ConnectionError,
    ChannelInvalidStateError,
    aio_pika.exceptions.AMQPException,
)
BOB = CommandAuthor(external_id="cli:bob", display_name="bob")


@pytest.fixture(scope="module")
def node() -> Iterator[RabbitNode]:
    """The module's own RabbitMQ node, started once."""
    rabbit_node.require()
    with RabbitNode.temporary() as started:
        yield started


@pytest.fixture(scope="module")
def amqp_url(node: RabbitNode) -> str:
    """The services, the client and the joins' poster all use the module's node."""
    return node.amqp_url


async def restart(node: RabbitNode) -> None:
    """``rabbitmqctl stop`` (the node's process exits), then start it again on the same data
    and ports, returning once it serves AMQP and management."""
    await asyncio.to_thread(node.stop)
    assert not node.running()
    await asyncio.to_thread(node.start)


async def sent_across_restart(
    node: RabbitNode, send: Callable[[], Awaitable[SubmitReply]], what: str
) -> SubmitReply:
    """The door's answer to ``send``, first sent while the node is down, then again until the
    node is back and the mesh has reconnected."""
    await asyncio.to_thread(node.stop)
    assert not node.running()
    pending = asyncio.create_task(answered(send, what))
    try:
        await asyncio.to_thread(node.start)
        return await pending
    finally:
        pending.cancel()


async def answered(send: Callable[[], Awaitable[SubmitReply]], what: str) -> SubmitReply:
    """The door's answer to ``send``, sent again while the broker is away or reconnecting."""
    replies: list[SubmitReply] = []

    async def tried() -> bool:
        try:
            async with asyncio.timeout(TRY_SECONDS):
                replies.append(await send())
        except BROKER_AWAY:
            return False
        return True

    await eventually(tried, timeout=WAIT, what=what, interval=0.5)
    return replies[-1]


def line(
    client: Client, forum_id: str, text: str, who: str
) -> Callable[[], Awaitable[SubmitReply]]:
    """A person's line, sent with one idempotency key however often it is sent."""
    key = new_id()

    def send() -> Awaitable[SubmitReply]:
        return client.submit(
            forum_id,
            text,
            external_id=f"cli:{who}" if who == "bob" else f"test:{who}",
            display_name=who,
            idempotency_key=key,
            reply_timeout=TRY_SECONDS,
        )

    return send


async def said(client: Client, forum_id: str, text: str, who: str) -> str:
    """A line, accepted by the door however many tries it took."""
    reply = await answered(line(client, forum_id, text, who), f"the door's answer to {text!r}")
    assert reply.status == "accepted" and reply.message_id, reply
    return reply.message_id


def told(lines: list[Message]) -> list[tuple[str, str | None]]:
    """What the agent put in the forum: each line's type and notice reason."""
    return [(line.type, line.meta.notice_reason) for line in agent_lines(lines)]


async def test_a_claim_a_hold_and_a_hand_back_each_happen_once_across_broker_restarts(
    node: RabbitNode, store: Store, client: Client, new_join: JoinFactory
) -> None:
    config = handing_off("refund", handoff_timeout_seconds=600)
    forum_id, _ = await new_join(config=config, name="support")
    await said(client, forum_id, "a person, please: my refund", "ana")
    escalation = await the_escalation(store, forum_id, timeout=WAIT)
    await lines_until(store, forum_id, lambda lines: len(agent_lines(lines)) >= 1, timeout=WAIT)

    # Bob claims while the broker is down: the claim goes through once the mesh reconnects.
    claimed = await sent_across_restart(
        node,
        lambda: client.submit_escalation(
            forum_id, escalation.id, "claim", BOB, reply_timeout=TRY_SECONDS
        ),
        "the door's answer to bob's claim",
    )
    assert claimed.status == "accepted", claimed
    await lines_until(store, forum_id, lambda lines: len(agent_lines(lines)) >= 2, timeout=WAIT)
    hold = await Holds(store).get(forum_id)
    assert hold is not None and hold.holder.display_name == "bob"
    assert hold.escalation_id == escalation.id

    await said(client, forum_id, "where is my refund?", "ana")
    await said(client, forum_id, "I am looking at it", "bob")
    # The broker restarts while the forum is held; Ana's line, said meanwhile, goes in after.
    anyone = await sent_across_restart(
        node, line(client, forum_id, "hello? anyone?", "ana"), "the door's answer to Ana"
    )
    assert anyone.status == "accepted", anyone
    key = new_id()
    back = await answered(
        lambda: client.submit(
            forum_id,
            HANDBACK,
            external_id="cli:operator",
            display_name="operator",
            idempotency_key=key,
            reply_timeout=TRY_SECONDS,
            hold_granted=True,
        ),
        "the door's answer to the operator's /handback",
    )
    assert back.status == "accepted", back

    async def released() -> bool:
        return await Holds(store).get(forum_id) is None

    await eventually(released, timeout=WAIT, what="the hold released")
    after = await said(client, forum_id, "and now?", "ana")
    await lines_until(store, forum_id, lambda lines: len(answers(lines)) >= 1, timeout=WAIT)
    # A later line's answer: a second answer to "and now?" would be stored before it.
    last = await said(client, forum_id, "thanks", "ana")
    lines = await lines_until(store, forum_id, lambda lines: len(answers(lines)) >= 2, timeout=WAIT)

    assert holds_of(lines) == [TAKEOVER, HANDBACK]
    assert told(lines) == [
        ("notice", "handoff"),
        ("notice", "held"),
        ("notice", "handed_back"),
        ("message", None),
        ("message", None),
    ]
    assert [line.meta.in_reply_to for line in answers(lines)] == [after, last]
    ended = await Escalations(store).get(escalation.id)
    assert ended is not None and (ended.state, ended.outcome) == ("ended", "handed_back")
    assert ended.claimed_by is not None and ended.claimed_by.display_name == "bob"
    again = await client.submit_escalation(forum_id, escalation.id, "claim", BOB)
    assert (again.status, again.code) == ("rejected", "escalation_ended"), again


async def test_escalations_nobody_claims_time_out_once_across_a_broker_restart(
    node: RabbitNode, store: Store, client: Client, new_join: JoinFactory
) -> None:
    """One restart, begun after both escalations opened: the first falls due while the node
    is stopping or down (a restart takes about 13 s here: 7 to stop, 6 to start), the second
    once it is back."""
    forums = []
    for name, timeout_seconds in (("due-while-down", 6.0), ("due-after", 20.0)):
        config = handing_off("refund", handoff_timeout_seconds=timeout_seconds)
        forum_id, join = await new_join(config=config, name=name)
        await said(client, forum_id, "get me your manager", "ana")
        forums.append((forum_id, join))
    escalations = [await the_escalation(store, forum_id, timeout=WAIT) for forum_id, _ in forums]
    for forum_id, _ in forums:
        await lines_until(store, forum_id, lambda lines: len(agent_lines(lines)) >= 1)

    stopping = datetime.now(UTC)
    for escalation in escalations:
        assert as_utc(escalation.deadline) > stopping, "the restart begins after a deadline"
        stored = await Escalations(store).get(escalation.id)
        assert stored is not None and stored.state == "open", stored
    await restart(node)

    for (forum_id, join), escalation in zip(forums, escalations, strict=True):
        await lines_until(store, forum_id, lambda lines: len(answers(lines)) >= 1, timeout=WAIT)
        # A later line's answer: a second answer to the lines said before would come first.
        last = await said(client, forum_id, "ok, thanks", "ana")
        lines = await lines_until(
            store, forum_id, lambda lines: len(answers(lines)) >= 2, timeout=WAIT
        )
        assert told(lines) == [
            ("notice", "handoff"),
            ("notice", "nobody_came"),
            ("message", None),
            ("message", None),
        ], join.agent_actor_id
        assert answers(lines)[-1].meta.in_reply_to == last
        ended = await Escalations(store).get(escalation.id)
        assert ended is not None and (ended.state, ended.outcome) == ("ended", "timed_out")
        instructions = [
            line
            for line in await store.history(join.monologue_id)
            if line.meta.instruction == "handoff"
        ]
        assert len(instructions) == 1
        assert await Holds(store).get(forum_id) is None

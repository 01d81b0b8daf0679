"""``yoke takeover``, ``yoke handback`` and ``yoke inbox`` as an operator runs them.

The inbox reads the store; what a verb submits is read off ``yoke.commands`` by a stand-in
door here (a queue bound to the command's key that answers as the door would), so these tests
say what the CLI sends and how it shows the door's answer. The door's own decisions are
tested with ingestion (tests/ingestion).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import aio_pika
import pytest
from aio_pika.abc import AbstractIncomingMessage

from tests.support.cli import cli_env, run_yoke
from tests.support.mesh import JoinFactory, Mesh
from yoke.bus import topology
from yoke.bus.amqp_nodes import amqp_user
from yoke.bus.broker import Bus
from yoke.core.ids import new_id
from yoke.core.models import Actor, CommandAuthor, SubmitReply
from yoke.runtime.escalations import Escalation, Escalations
from yoke.runtime.holds import Holds
from yoke.runtime.joins import join_id
from yoke.store.database import Store

HOSTILE = "refund \x1b[2J\x07now"
SHOWN = "refund \\x1b[2J\\x07now"


@pytest.fixture
def env(amqp_url: str, mongodb_url: str) -> dict[str, str]:
    return cli_env(amqp_url, mongodb_url)


@pytest.fixture
async def fresh_store(mongodb_url: str) -> AsyncIterator[Store]:
    """A database of the test's own (the module's ``store`` is the mesh's)."""
    store = Store(mongodb_url)
    await store.ensure_indexes()
    await Escalations(store).ensure_indexes()
    yield store
    await store.close()


@dataclass
class StandIn:
    """Answers commands of one routing key on ``yoke.commands`` with ``answer(body)``."""

    answer: Callable[[dict[str, Any]], SubmitReply]
    seen: list[AbstractIncomingMessage] = field(default_factory=list)


@pytest.fixture
async def door(amqp_url: str) -> AsyncIterator[Callable[[str, StandIn], Any]]:
    bus = Bus(amqp_url, name="test-stand-in")
    await bus.connect()  # the topology: yoke.commands among it
    await bus.close()
    connection = await aio_pika.connect_robust(amqp_url)
    channel = await connection.channel()

    async def stand_in(key: str, door: StandIn) -> None:
        queue = await channel.declare_queue(exclusive=True)
        await queue.bind(topology.COMMANDS_EXCHANGE, key)

        async def on_message(message: AbstractIncomingMessage) -> None:
            door.seen.append(message)
            reply = door.answer(json.loads(message.body))
            await channel.default_exchange.publish(
                aio_pika.Message(
                    reply.model_dump_json(exclude_none=True).encode(),
                    correlation_id=message.correlation_id,
                ),
                routing_key=message.reply_to or "",
            )

        await queue.consume(on_message, no_ack=True)

    yield stand_in
    await connection.close()


def escalation(
    store_forum: str, opened: datetime, reason: str = "the customer asks for a person"
) -> Escalation:
    call = new_id()
    return Escalation.model_validate(
        {
            "_id": f"esc-{call}",
            "forumId": store_forum,
            "agentActorId": "agent-support",
            "joinKey": f"join-{call}",
            "callId": call,
            "reason": reason,
            "urgency": "high",
            "openedAt": opened,
            "deadline": opened + timedelta(minutes=15),
        }
    )


def json_lines(out: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in out.splitlines()]


async def test_the_inbox_lists_the_open_and_claimed_escalations_oldest_first(
    env: dict[str, str], fresh_store: Store
) -> None:
    now = datetime.now(UTC)
    escalations = Escalations(fresh_store)
    await fresh_store.save_actor(Actor(id="agent-support", kind="agent", name="support"))
    newest = escalation("forum-a", now - timedelta(minutes=1))
    oldest = escalation("forum-b", now - timedelta(minutes=30), reason=HOSTILE)
    claimed = escalation("forum-c", now - timedelta(minutes=10))
    ended = escalation("forum-d", now - timedelta(hours=1))
    for each in (newest, oldest, claimed, ended):  # stored in another order than shown
        await escalations.open(each)
    ada = CommandAuthor(external_id="cli:ada", display_name="ada")
    await escalations.mark_claimed(claimed.id, ada, now - timedelta(minutes=5))
    await escalations.mark_ended(ended.id, "timed_out", now - timedelta(minutes=45))

    code, out, err = await run_yoke(env, "inbox", "--json")
    assert code == 0, err
    listed = json_lines(out)
    assert [line["id"] for line in listed] == [oldest.id, claimed.id, newest.id]
    assert listed[0]["forumId"] == "forum-b" and listed[0]["reason"] == HOSTILE  # exact JSON
    assert [line["state"] for line in listed] == ["open", "claimed", "open"]
    assert listed[1]["claimedBy"] == {"externalId": "cli:ada", "displayName": "ada"}

    code, out, err = await run_yoke(env, "inbox", "--json", "--all")
    assert code == 0, err
    assert [line["id"] for line in json_lines(out)] == [ended.id, oldest.id, claimed.id, newest.id]

    code, out, err = await run_yoke(env, "inbox", "--forum", "forum-c")
    assert code == 0, err
    (row,) = out.splitlines()
    columns = row.split("\t")
    assert columns[:4] == [claimed.id, "forum-c", "support", "high"]
    assert columns[4].startswith("10m") or columns[4].startswith("9m")  # its age
    assert columns[6] == "claimed by ada"

    code, out, err = await run_yoke(env, "inbox")
    assert code == 0, err
    rows = out.splitlines()
    assert [row.split("\t")[0] for row in rows] == [oldest.id, claimed.id, newest.id]
    # A reason is the outside's text: its control characters are shown escaped.
    assert rows[0].split("\t")[-1] == SHOWN
    assert "\x1b" not in out and "\x07" not in out


async def test_claiming_an_unknown_escalation_exits_1_naming_it(env: dict[str, str]) -> None:
    code, out, err = await run_yoke(env, "inbox", "claim", "esc-nowhere", "--as", "ada")
    assert (code, out) == (1, "")
    assert err == "yoke: no escalation esc-nowhere\n"


async def test_a_claim_is_submitted_as_the_person_and_the_doors_refusal_exits_1(
    env: dict[str, str], amqp_url: str, fresh_store: Store, door: Callable[[str, StandIn], Any]
) -> None:
    waiting = escalation("forum-claimed", datetime.now(UTC) - timedelta(minutes=2))
    await Escalations(fresh_store).open(waiting)
    answers = iter(
        [
            SubmitReply(status="accepted", message_id="takeover-line"),
            SubmitReply.rejected("already_claimed", "already claimed by bob"),
        ]
    )
    stand_in = StandIn(lambda _: next(answers))
    await door(topology.ESCALATION_COMMAND, stand_in)

    code, out, err = await run_yoke(env, "inbox", "claim", waiting.id, "--as", "ada")
    assert code == 0, err
    assert out == "forum-claimed\n"
    (sent,) = stand_in.seen
    assert json.loads(sent.body) == {
        "conversationId": "forum-claimed",
        "escalationId": waiting.id,
        "action": "claim",
        "by": {"externalId": "cli:ada", "displayName": "ada"},
    }
    assert sent.user_id == amqp_user(amqp_url)  # the mesh's own user, which the door trusts

    code, out, err = await run_yoke(env, "inbox", "cancel", waiting.id, "--as", "carol")
    assert (code, out) == (1, "")
    assert err == "yoke: already claimed by bob\n"
    assert json.loads(stand_in.seen[1].body)["action"] == "cancel"
    assert json.loads(stand_in.seen[1].body)["by"]["externalId"] == "cli:carol"


async def test_takeover_and_handback_submit_the_granted_lines_and_show_refusals(
    env: dict[str, str], door: Callable[[str, StandIn], Any]
) -> None:
    answers = iter(
        [
            SubmitReply(status="accepted", message_id="line-1"),
            SubmitReply.rejected("held", "held by bob since 2026-12-03T12:00:00+00:00"),
            SubmitReply(status="accepted", message_id="line-2"),
        ]
    )
    stand_in = StandIn(lambda _: next(answers))
    await door(topology.SUBMIT_COMMAND, stand_in)
    forum = "forum-" + new_id()

    args = ("--forum", forum, "--as", "ada")
    code, out, err = await run_yoke(env, "takeover", *args, "--reason", "lunch rush")
    assert (code, out) == (0, "line-1\n"), err
    code, out, err = await run_yoke(env, "takeover", *args)
    assert (code, out) == (1, "")
    assert err == "yoke: held by bob since 2026-12-03T12:00:00+00:00\n"
    code, out, err = await run_yoke(env, "handback", *args)
    assert (code, out) == (0, "line-2\n"), err

    bodies = [json.loads(message.body) for message in stand_in.seen]
    assert [body["text"] for body in bodies] == ["/takeover lunch rush", "/takeover", "/handback"]
    for body in bodies:
        assert body["conversationId"] == forum
        assert body["holdGranted"] is True
        assert body["author"] == {"externalId": "cli:ada", "displayName": "ada"}
    assert len({body["idempotencyKey"] for body in bodies}) == 3


async def test_nobody_answering_a_claim_says_so(
    env: dict[str, str], fresh_store: Store, amqp_url: str
) -> None:
    bus = Bus(amqp_url, name="test-no-door")
    await bus.connect()
    await bus.close()
    waiting = escalation("forum-quiet", datetime.now(UTC))
    await Escalations(fresh_store).open(waiting)
    code, _, err = await asyncio.wait_for(
        run_yoke(env, "inbox", "claim", waiting.id, "--as", "ada", "--timeout", "1"), 60
    )
    assert code == 1
    assert err == "yoke: no answer within 1 s\n"


# --- against the mesh's own door ----------------------------------------------------------------


@pytest.mark.slow
async def test_with_the_door_a_takeover_holds_until_handback_and_a_claim_stands_once(
    amqp_url: str, module_mongodb_url: str, mesh: Mesh, store: Store, new_join: JoinFactory
) -> None:
    env = cli_env(amqp_url, module_mongodb_url)
    forum_id, join = await new_join()
    args = ("--forum", forum_id)
    code, out, err = await run_yoke(env, "takeover", *args, "--as", "ada", "--reason", "mine")
    assert code == 0, err
    line = await store.get_message(out.strip())
    assert line is not None and line.text == "/takeover mine"
    code, out, err = await run_yoke(env, "takeover", *args, "--as", "bob")
    assert (code, out) == (1, "")
    assert err.startswith("yoke: held by ada since "), err
    code, out, err = await run_yoke(env, "handback", *args, "--as", "ada")
    assert code == 0, err
    code, out, err = await run_yoke(env, "handback", *args, "--as", "ada")
    assert (code, out) == (1, "")
    assert "nobody holds this forum" in err

    # An escalation of this join's agent, as its handoff would open it.
    now = datetime.now(UTC)
    waiting = escalation(forum_id, now - timedelta(seconds=5)).model_copy(
        update={
            "agent_actor_id": join.agent_actor_id,
            "join_key": join_id(join.agent_actor_id, forum_id),
        }
    )
    await Escalations(store).open(waiting)
    code, out, err = await run_yoke(env, "inbox", "claim", waiting.id, "--as", "ada")
    assert (code, out) == (0, f"{forum_id}\n"), err
    code, out, err = await run_yoke(env, "inbox", "claim", waiting.id, "--as", "bob")
    assert (code, out) == (1, "")
    assert err == "yoke: claimed by ada\n"
    code, out, err = await run_yoke(env, "inbox", "--json", "--forum", forum_id)
    assert code == 0, err
    (listed,) = json_lines(out)
    assert (listed["id"], listed["state"]) == (waiting.id, "claimed")
    assert listed["claimedBy"] == {"externalId": "cli:ada", "displayName": "ada"}
    hold = await Holds(store).get(forum_id)
    assert hold is not None and hold.escalation_id == waiting.id

"""The follow-up service's escalation sweep: a timeout for each escalation past its deadline,
none for the others, from one replica, after a restart too; and the gauges it reports."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import aio_pika
import pytest
from aio_pika.abc import AbstractIncomingMessage
from prometheus_client import REGISTRY

from services.followup.escalations import REPLY_QUEUE_PREFIX, EscalationSweep, sweeps_here
from tests.support.mesh import service_env
from tests.support.processes import ServiceProcess, eventually
from yoke.bus import topology
from yoke.bus.amqp_nodes import amqp_user
from yoke.core.ids import new_id
from yoke.core.models import CommandAuthor, SubmitEscalation, SubmitReply
from yoke.runtime.escalations import Escalation, Escalations
from yoke.runtime.holds import ForumHold, Holds
from yoke.store.database import Store

NOW = datetime(2026, 12, 3, 12, 0, tzinfo=UTC)


@pytest.fixture
async def store(mongodb_url: str) -> AsyncIterator[Store]:
    store = Store(mongodb_url)
    await store.ensure_indexes()
    await Escalations(store).ensure_indexes()
    yield store
    await store.close()


def escalation(*, opened: datetime, deadline: datetime, forum: str | None = None) -> Escalation:
    call = new_id()
    return Escalation.model_validate(
        {
            "_id": f"esc-{call}",
            "forumId": forum or f"forum-{call}",
            "agentActorId": "agent-1",
            "joinKey": f"join-{call}",
            "callId": call,
            "reason": "the customer asks for a refund",
            "openedAt": opened,
            "deadline": deadline,
        }
    )


class Door:
    """Records what the sweep submits; answers as the door would."""

    def __init__(self) -> None:
        self.commands: list[SubmitEscalation] = []

    async def submit(self, command: SubmitEscalation) -> SubmitReply:
        self.commands.append(command)
        return SubmitReply(status="accepted")


def gauge(name: str) -> float:
    value = REGISTRY.get_sample_value(name)
    assert value is not None, name
    return value


async def test_only_escalations_past_their_deadline_and_still_open_are_timed_out(
    store: Store,
) -> None:
    escalations = Escalations(store)
    due = escalation(opened=NOW - timedelta(minutes=20), deadline=NOW - timedelta(seconds=1))
    at_deadline = escalation(opened=NOW - timedelta(minutes=15), deadline=NOW)
    future = escalation(opened=NOW - timedelta(minutes=30), deadline=NOW + timedelta(seconds=5))
    claimed = escalation(opened=NOW - timedelta(hours=2), deadline=NOW - timedelta(hours=1))
    ended = escalation(opened=NOW - timedelta(hours=3), deadline=NOW - timedelta(hours=2))
    for each in (due, at_deadline, future, claimed, ended):
        await escalations.open(each)
    who = CommandAuthor(external_id="cli:ada", display_name="ada")
    await escalations.mark_claimed(claimed.id, who, NOW - timedelta(hours=1, minutes=30))
    await escalations.mark_ended(ended.id, "canceled", NOW - timedelta(hours=2, minutes=30))
    await Holds(store).take(ForumHold.model_validate({"_id": "f1", "lineId": "l1", "holder": who}))
    await Holds(store).take(ForumHold.model_validate({"_id": "f2", "lineId": "l2", "holder": who}))
    door = Door()
    moment = [0.0]
    sweep = EscalationSweep(store, door.submit, clock=lambda: moment[0])

    submitted = await sweep.poll(NOW)
    await eventually(
        lambda: _true(len(door.commands) == 2), timeout=5, what="two timeouts submitted"
    )
    assert sorted(submitted) == sorted([due.id, at_deadline.id])
    assert sorted((c.escalation_id, c.conversation_id) for c in door.commands) == sorted(
        [(due.id, due.forum_id), (at_deadline.id, at_deadline.forum_id)]
    )
    assert all(c.action == "timeout" and c.by is None for c in door.commands)
    # The gauges: two forums held; three open (claimed and ended ones are not waiting); the
    # oldest open one opened 30 minutes ago (the claimed one, older, does not count).
    assert gauge("yoke_forums_held") == 2
    assert gauge("yoke_escalations_open") == 3
    assert gauge("yoke_escalation_oldest_open_seconds") == 30 * 60

    # Still open at the next poll (the door has not carried them out): not submitted again
    # until RESUBMIT_SECONDS have passed.
    moment[0] = 1.0
    assert await sweep.poll(NOW + timedelta(seconds=1)) == []
    moment[0] = 31.0
    later = NOW + timedelta(seconds=31)
    assert sorted(await sweep.poll(later)) == sorted([due.id, at_deadline.id, future.id])


async def _true(value: bool) -> bool:
    return value


async def test_a_refused_or_unanswered_timeout_is_no_failure_of_the_sweep(store: Store) -> None:
    escalations = Escalations(store)
    refused = escalation(opened=NOW - timedelta(minutes=20), deadline=NOW - timedelta(seconds=1))
    await escalations.open(refused)
    calls: list[str] = []

    async def door(command: SubmitEscalation) -> SubmitReply:
        calls.append(command.escalation_id)
        if len(calls) == 1:
            raise TimeoutError("no answer within 20 s")
        return SubmitReply.rejected("already_claimed", "already claimed by ada")

    moment = [0.0]
    sweep = EscalationSweep(store, door, clock=lambda: moment[0])
    assert await sweep.poll(NOW) == [refused.id]
    await eventually(lambda: _true(not sweep._in_flight), timeout=5, what="the answer")
    moment[0] = 40.0
    assert await sweep.poll(NOW + timedelta(seconds=40)) == [refused.id]  # submitted again
    await eventually(lambda: _true(len(calls) == 2), timeout=5, what="the second submit")


async def test_one_replica_of_many_sweeps_and_the_others_report_zero(store: Store) -> None:
    replicas = ["replica-a", "replica-b", "replica-c"]
    sweepers = [r for r in replicas if sweeps_here(lambda r=r: (r, replicas))]
    assert len(sweepers) == 1
    assert sweeps_here(lambda: None)  # alone, or before the first ownership round
    other = next(r for r in replicas if r not in sweepers)
    await Escalations(store).open(
        escalation(opened=NOW - timedelta(minutes=1), deadline=NOW - timedelta(seconds=1))
    )
    await Holds(store).take(
        ForumHold.model_validate(
            {"_id": "f", "lineId": "l", "holder": {"externalId": "cli:b", "displayName": "b"}}
        )
    )
    door = Door()
    sweeping = EscalationSweep(store, door.submit, lambda: (sweepers[0], replicas))
    assert len(await sweeping.poll(NOW)) == 1
    assert gauge("yoke_escalations_open") == 1 and gauge("yoke_forums_held") == 1
    idle = EscalationSweep(store, door.submit, lambda: (other, replicas))
    assert await idle.poll(NOW) == []
    for name in (
        "yoke_forums_held",
        "yoke_escalations_open",
        "yoke_escalation_oldest_open_seconds",
    ):
        assert gauge(name) == 0


async def test_a_deadline_passed_while_follow_up_was_down_is_timed_out_after_its_restart(
    amqp_url: str, mongodb_url: str, store: Store, tmp_path: Path
) -> None:
    env = service_env(amqp_url, mongodb_url)
    process = ServiceProcess(["-m", "services.followup"], env, tmp_path / "followup.log")
    await process.wait_healthy()
    connection = await aio_pika.connect_robust(amqp_url)
    try:
        channel = await connection.channel()
        seen: asyncio.Queue[AbstractIncomingMessage] = asyncio.Queue()
        queue = await channel.declare_queue(exclusive=True)
        await queue.bind(topology.COMMANDS_EXCHANGE, topology.ESCALATION_COMMAND)
        await queue.consume(seen.put, no_ack=True)
        assert process.stop() == 0
        now = datetime.now(UTC)
        soon = escalation(opened=now, deadline=now + timedelta(seconds=2))
        later = escalation(opened=now, deadline=now + timedelta(hours=1))
        await Escalations(store).open(soon)
        await Escalations(store).open(later)

        async def past_due() -> bool:
            return datetime.now(UTC) > soon.deadline + timedelta(seconds=1)

        await eventually(past_due, timeout=10, what="the deadline to pass while down")
        assert seen.empty()  # nobody submitted it meanwhile
        process = ServiceProcess(["-m", "services.followup"], env, tmp_path / "followup-2.log")
        message = await asyncio.wait_for(seen.get(), timeout=60)
        body = json.loads(message.body)
        assert body == {
            "conversationId": soon.forum_id,
            "escalationId": soon.id,
            "action": "timeout",
        }
        assert message.routing_key == topology.ESCALATION_COMMAND
        # As the services' user, which the broker verified; answered on a queue the door
        # answers that user on.
        assert message.user_id == amqp_user(amqp_url)
        assert (message.reply_to or "").startswith(REPLY_QUEUE_PREFIX)
        await process.wait_healthy()
        metrics = await process.metrics()
        assert "yoke_escalations_open 2.0" in metrics
        # The other one's deadline is an hour away: nothing submitted for it.
        with pytest.raises(TimeoutError):
            extra = await asyncio.wait_for(seen.get(), timeout=3)
            raise AssertionError(f"submitted again: {extra.body!r}")
    finally:
        await connection.close()
        assert process.stop() == 0

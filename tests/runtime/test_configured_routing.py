"""Follow-up and the guardian cost only the joins that configure them.

The lines of a join with neither never reach those services (no delivery at all), a join that
gains follow-up starts getting its lines and one that loses it stops, and a join's
configuration is read once per version, not per line or per while.
"""

from __future__ import annotations

import asyncio
from collections import Counter

import aio_pika
import pytest
from prometheus_client.parser import text_string_to_metric_families

from services.followup.scheduler import FOLLOWUPS, PENDING_GAUGE_SECONDS, schedule_id
from tests.support.mesh import Mesh, agent_lines, lines_until, say
from tests.support.processes import eventually
from yoke.bus import _upgrades as upgrades
from yoke.bus import topology
from yoke.client import Client
from yoke.core.ids import new_id
from yoke.core.models import Envelope, Message, MessagePosted, TextPart
from yoke.runtime.join_config import FollowUpConfig, GuardianConfig, JoinConfig, RulePolicy
from yoke.runtime.joins import create_agent, create_forum, join_conversation, join_id
from yoke.runtime.posting import Poster
from yoke.store.database import Store

pytestmark = pytest.mark.slow

# Long enough that nothing fires while a test runs: what is pinned is who gets which line.
FOLLOW_UP = FollowUpConfig(after_seconds=600)
GUARDIAN = GuardianConfig(
    policies=[RulePolicy(kind="rule", pattern="no line says this", steer="stop")]
)
# Longer than any while after which a service used to read a join's configuration again.
PAST_EVERY_WHILE = 10.5


async def _counts(mesh: Mesh) -> Counter[str]:
    """Deliveries handled and join configurations read, per service."""
    counts: Counter[str] = Counter()
    for name, process in mesh.processes.items():
        for family in text_string_to_metric_families(await process.metrics()):
            for sample in family.samples:
                if sample.name == "yoke_events_handled_total":
                    counts[f"deliveries:{name}"] += int(sample.value)
                elif sample.name == "yoke_join_config_reads_total":
                    counts[f"reads:{name}"] += int(sample.value)
    return counts


async def _settled(mesh: Mesh) -> Counter[str]:
    """The counts once nothing has moved for a second (a turn's tail deliveries are done)."""
    loop = asyncio.get_running_loop()
    last = await _counts(mesh)
    quiet_since = loop.time()
    while loop.time() - quiet_since < 1.0:
        await asyncio.sleep(0.2)
        now = await _counts(mesh)
        if now != last:
            last, quiet_since = now, loop.time()
    return last


async def _turn(mesh: Mesh, client: Client, store: Store, forum_id: str, text: str) -> Counter[str]:
    """One person's line and the agent's answer in the forum; what it cost each service."""
    before = await _settled(mesh)
    answered = len(agent_lines(await store.history(forum_id)))
    await say(client, forum_id, text)
    await lines_until(store, forum_id, lambda lines: len(agent_lines(lines)) > answered)
    return await _settled(mesh) - before


async def _join(
    store: Store, poster: Poster, agent_id: str, forum_id: str, config: JoinConfig
) -> None:
    await join_conversation(store, poster, agent_id, forum_id, config)


async def test_a_join_with_neither_costs_follow_up_and_guardian_no_delivery(
    mesh: Mesh, store: Store, poster: Poster, client: Client
) -> None:
    forum = await create_forum(store, "plain")
    agent = await create_agent(store, "echo")
    await _join(store, poster, agent.id, forum.id, JoinConfig())
    await _turn(mesh, client, store, forum.id, "warm")
    cost = await _turn(mesh, client, store, forum.id, "who hears this?")
    assert cost["deliveries:processor"] >= 1 and cost["deliveries:egress"] >= 1, cost
    assert cost["deliveries:followup"] == 0, cost
    assert cost["deliveries:guardian"] == 0, cost


async def test_a_join_that_gains_follow_up_gets_its_lines_and_one_that_loses_it_stops(
    mesh: Mesh, store: Store, poster: Poster, client: Client
) -> None:
    forum = await create_forum(store, "changing")
    agent = await create_agent(store, "echo")
    key = join_id(agent.id, forum.id)
    await _join(store, poster, agent.id, forum.id, JoinConfig())
    assert (await _turn(mesh, client, store, forum.id, "before"))["deliveries:followup"] == 0

    await _join(store, poster, agent.id, forum.id, JoinConfig(follow_up=FOLLOW_UP))
    cost = await _turn(mesh, client, store, forum.id, "now followed")
    # The person's line and the agent's answer.
    assert cost["deliveries:followup"] == 2, cost
    answer = agent_lines(await store.history(forum.id))[-1]

    async def scheduled() -> bool:
        found = await store.db[FOLLOWUPS].find_one({"_id": schedule_id(key, answer.id)})
        return found is not None

    await eventually(scheduled, timeout=30, what="the answer's follow-up to be scheduled")

    await _join(store, poster, agent.id, forum.id, JoinConfig())
    cost = await _turn(mesh, client, store, forum.id, "no longer followed")
    assert cost["deliveries:followup"] == 0, cost
    answer = agent_lines(await store.history(forum.id))[-1]
    assert await store.db[FOLLOWUPS].find_one({"_id": schedule_id(key, answer.id)}) is None


async def test_a_join_configuration_is_read_once_per_version(
    mesh: Mesh, store: Store, poster: Poster, client: Client
) -> None:
    forum = await create_forum(store, "configured")
    agent = await create_agent(store, "echo")
    both = JoinConfig(follow_up=FOLLOW_UP, guardian=GUARDIAN)
    await _join(store, poster, agent.id, forum.id, both)
    first = await _turn(mesh, client, store, forum.id, "first")
    for service in ("processor", "followup", "guardian"):
        assert first[f"deliveries:{service}"] >= 1, first
        assert first[f"reads:{service}"] >= 1, first  # its first line reads it
    await asyncio.sleep(PAST_EVERY_WHILE)  # what is pinned: time alone reads nothing again
    for text in ("second", "third"):
        cost = await _turn(mesh, client, store, forum.id, text)
        assert cost["deliveries:followup"] >= 1 and cost["deliveries:guardian"] >= 1, cost
        assert sum(v for k, v in cost.items() if k.startswith("reads:")) == 0, cost
    # A new version is read (once) and takes effect: follow-up off, the guardian stays.
    await _join(store, poster, agent.id, forum.id, JoinConfig(guardian=GUARDIAN))
    changed = await _turn(mesh, client, store, forum.id, "changed")
    assert changed["reads:processor"] >= 1 and changed["reads:guardian"] >= 1, changed
    assert changed["deliveries:followup"] == 0, changed


async def test_the_follow_up_route_of_an_earlier_version_is_unbound(
    amqp_url: str, poster: Poster, monkeypatch: pytest.MonkeyPatch
) -> None:
    bus = poster.bus
    service = f"probe-{new_id()[:8]}"  # shard queues of the test's own
    every_line = topology.interest("conversation.message.posted", kind="forum", type="message")
    followed = topology.interest(
        "conversation.message.posted", kind="forum", type="message", followed="yes"
    )
    monkeypatch.setitem(upgrades.LEGACY_INTERESTS, service, (every_line,))
    (queue,) = await bus.declare_shards(service, [every_line], 1)  # what an earlier start bound
    line = Message(
        id=new_id(),
        conversation_id=new_id(),
        author_actor_id=new_id(),
        participant_id=new_id(),
        seq=1,
        role="user",
        parts=[TextPart(text="hello")],
    )
    headers = topology.posted_headers(line, "forum")

    async def publish(extra: dict[str, str]) -> str:
        envelope = Envelope.wrap(new_id(), MessagePosted.of(line))
        await bus.publish_event(envelope, line.conversation_id, {**headers, **extra})
        return envelope.id

    old = await publish({})
    await bus.declare_shards(service, [followed], 1)  # this version's start
    unfollowed = await publish({})  # a line of a join without follow-up: not routed here now
    wanted = await publish({topology.FOLLOWED_HEADER: "yes"})
    received: list[str] = []
    connection = await aio_pika.connect_robust(amqp_url)
    try:
        channel = await connection.channel()

        async def take(message: aio_pika.abc.AbstractIncomingMessage) -> None:
            received.append(str(message.message_id))
            await message.ack()

        await (await channel.get_queue(queue, ensure=False)).consume(take)

        async def all_in() -> bool:
            return wanted in received

        await eventually(all_in, timeout=10, what="the followed line")
    finally:
        await connection.close()
    # One queue, in order: a routed unfollowed line would have come before the followed one.
    assert unfollowed not in received
    assert received == [old, wanted]


async def _background_operations(mesh: Mesh, service: str) -> int:
    """Store operations of ``service`` not made while handling a delivery (its scheduler's)."""
    text = await mesh.processes[service].metrics()
    return sum(
        int(sample.value)
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "yoke_store_operations_total"
        and sample.labels.get("origin") == "background"
    )


async def test_with_nothing_pending_the_follow_up_scheduler_asks_the_store_little(
    mesh: Mesh, store: Store
) -> None:
    await store.db[FOLLOWUPS].delete_many({})  # this module's: nothing is pending anywhere
    # Its next count of what is pending (every PENDING_GAUGE_SECONDS) finds nothing.
    await asyncio.sleep(PENDING_GAUGE_SECONDS + 1)
    before = await _background_operations(mesh, "followup")
    started = asyncio.get_running_loop().time()
    await asyncio.sleep(2 * PENDING_GAUGE_SECONDS)  # the measure is of time passing idle
    seconds = asyncio.get_running_loop().time() - started
    rate = (await _background_operations(mesh, "followup") - before) / seconds
    # It polled every due second twice a second (about 6 queries a second for nothing); now a
    # count every PENDING_GAUGE_SECONDS, and health's pings.
    assert rate <= 1.0, rate

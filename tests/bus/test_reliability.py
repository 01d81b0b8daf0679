"""Nothing goes silent: consumers come back after the broker drops them, a poison line is set
aside without blocking its conversation, and one join's failure leaves the others answering.

The processor and ingestion run under ``tests.support.poison``: a line holding ``POISON`` makes
the processor's handler fail for good, and ``INGEST-JAM`` makes ingestion fail to copy a line
for one agent only.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.support.broker import Management
from tests.support.mesh import Launch, Mesh, agent_lines, lines_until, say
from tests.support.processes import eventually
from yoke.bus import topology
from yoke.bus.broker import Bus
from yoke.bus.dead_letters import list_dead_letters, replay_dead_letters
from yoke.cli.supervisor import SERVICES
from yoke.client import Client
from yoke.core.models import Message
from yoke.runtime.joins import create_agent, create_forum, join_conversation, leave_conversation
from yoke.runtime.posting import Poster
from yoke.store.database import Store

pytestmark = pytest.mark.slow

POISONED_AGENT = "agent-poisoned-in-ingestion"


def _poisoned(name: str, extra: dict[str, str] | None = None) -> tuple[list[str], dict[str, str]]:
    return ["-m", "tests.support.poison", name], {"YOKE_TEST_POISON": "POISON", **(extra or {})}


@pytest.fixture(scope="module")
def mesh_env() -> dict[str, str]:
    return {"YOKE_HANDLER_ATTEMPTS": "2"}


@pytest.fixture(scope="module")
def mesh_launch() -> Launch:
    return {
        "processor": _poisoned("processor"),
        "ingestion": _poisoned(
            "ingestion",
            {"YOKE_TEST_POISON": "INGEST-JAM", "YOKE_TEST_POISON_AGENT": POISONED_AGENT},
        ),
    }


async def _join(store: Store, poster: Poster, forum_id: str, *, agent_id: str | None = None) -> str:
    agent = await create_agent(store, "echo", actor_id=agent_id)
    await join_conversation(store, poster, agent.id, forum_id)
    return agent.id


def _answers(lines: list[Message], agent_id: str) -> list[str]:
    """The agent's answers (not the notices that tell the forum it could not answer)."""
    return [
        line.text
        for line in agent_lines(lines)
        if line.author_actor_id == agent_id and line.type == "message"
    ]


async def _health(mesh: Mesh) -> dict[str, int]:
    codes: dict[str, int] = {}
    async with httpx.AsyncClient(timeout=2) as http:
        for name, process in mesh.processes.items():
            try:
                response = await http.get(f"http://127.0.0.1:{process.port}/healthz")
                codes[name] = response.status_code
            except httpx.HTTPError:
                codes[name] = 0
    return codes


async def _queues_consumed(management: Management) -> bool:
    queues = await management.queues()
    ours = [
        queue
        for name, queue in queues.items()
        if any(name.startswith(f"yoke.{service}.") for service in SERVICES)
    ]
    return bool(ours) and all(queue.get("consumers", 0) >= 1 for queue in ours)


async def test_consumers_come_back_after_the_broker_drops_every_connection(
    mesh: Mesh, management: Management, store: Store, poster: Poster, amqp_url: str
) -> None:
    forum = await create_forum(store, "reconnect")
    agent_id = await _join(store, poster, forum.id)
    async with Client(amqp_url) as client:
        await say(client, forum.id, "before")
    await lines_until(store, forum.id, lambda lines: _answers(lines, agent_id) == ["before"])
    # (the management API's figures lag by up to its 5 s statistics interval)
    await eventually(lambda: _queues_consumed(management), timeout=30, what="queues consumed")

    # The broker drops every connection and, for a while, refuses new ones.
    await management.refuse_connections()
    try:
        closed = await management.close_connections()
        assert closed >= len(SERVICES)

        async def all_unhealthy() -> bool:
            return all(code == 503 for code in (await _health(mesh)).values())

        await eventually(all_unhealthy, timeout=10, what="services to report the lost broker")
    finally:
        await management.refuse_connections(False)

    async def all_healthy() -> bool:
        return all(code == 200 for code in (await _health(mesh)).values())

    # Once it lets them in again, every shard and intake queue has its consumer again.
    await eventually(
        lambda: _queues_consumed(management), timeout=60, what="every queue consumed again"
    )
    await eventually(all_healthy, timeout=60, what="every service healthy again")
    async with Client(amqp_url) as client:
        for text in ("after-1", "after-2", "after-3"):
            await say(client, forum.id, text)
    await lines_until(
        store,
        forum.id,
        lambda lines: _answers(lines, agent_id) == ["before", "after-1", "after-2", "after-3"],
        timeout=60,
    )


async def test_a_deleted_shard_queue_is_reported_then_consumed_again(
    mesh: Mesh, management: Management, store: Store, poster: Poster, amqp_url: str
) -> None:
    """The broker cancels the consumer of a deleted queue: the service must notice and recover."""
    queue = topology.shard_queue("processor", 0)
    await management.delete_queue(queue)
    await eventually(
        lambda: _queues_consumed(management), timeout=60, what=f"{queue} declared and consumed"
    )

    async def healthy() -> bool:
        return (await _health(mesh))["processor"] == 200

    await eventually(healthy, timeout=30, what="the processor healthy again")
    forums = [await create_forum(store, f"after delete {i}") for i in range(6)]
    agents = [await _join(store, poster, forum.id) for forum in forums]
    async with Client(amqp_url) as client:
        for forum in forums:
            await say(client, forum.id, "hello")
    for forum, agent_id in zip(forums, agents, strict=True):
        await lines_until(
            store, forum.id, lambda lines, a=agent_id: _answers(lines, a) == ["hello"]
        )


async def test_a_poison_line_is_set_aside_and_the_next_lines_are_answered(
    mesh: Mesh, store: Store, poster: Poster, amqp_url: str
) -> None:
    forum = await create_forum(store, "poison")
    agent_id = await _join(store, poster, forum.id)
    async with Client(amqp_url) as client:
        first = await say(client, forum.id, "one")
        poison = await say(client, forum.id, "POISON pill")
        await say(client, forum.id, "two")
        await say(client, forum.id, "three")
    lines = await lines_until(
        store, forum.id, lambda lines: _answers(lines, agent_id) == ["one", "two", "three"]
    )
    assert lines[0].id == first
    # One notice in the monologue names the line and the reason; the forum is told in plain
    # words, without either.
    join_state = await store.states.find_one(
        {"actor": "processor", "config.agentActorId": agent_id}
    )
    assert join_state is not None
    monologue = join_state["watch"]

    def notices(lines: list[Message]) -> list[Message]:
        return [line for line in lines if line.type == "notice"]

    found = await lines_until(store, monologue, lambda lines: len(notices(lines)) == 1)
    [notice] = notices(found)
    copied = next(line for line in found if line.meta.source_message_id == poison)
    assert copied.id in notice.text and "poisoned line" in notice.text
    [told] = [line for line in await store.history(forum.id) if line.type == "notice"]
    assert told.meta.in_reply_to == poison and told.author_actor_id == agent_id
    assert "could not answer" in told.text
    assert copied.id not in told.text and "poisoned" not in told.text

    async def letter() -> bool:
        letters = await list_dead_letters(amqp_url)
        return any(
            letter["service"] == "processor" and "poisoned line" in str(letter["error"])
            for letter in letters
        )

    await eventually(letter, timeout=30, what="the poison line's dead letter")
    failure = await store.db["failures"].find_one({"messageId": copied.id})
    assert failure is not None and failure["open"] is True


async def test_replay_reruns_a_line_whose_failure_is_still_open(
    mesh: Mesh, store: Store, poster: Poster, amqp_url: str
) -> None:
    forum = await create_forum(store, "replay")
    agent_id = await _join(store, poster, forum.id)
    async with Client(amqp_url) as client:
        await say(client, forum.id, "POISON later cured")
        await say(client, forum.id, "after")
    await lines_until(store, forum.id, lambda lines: _answers(lines, agent_id) == ["after"])

    async def letter_waiting() -> bool:
        letters = await list_dead_letters(amqp_url)
        return any("poisoned line" in str(letter["error"]) for letter in letters)

    await eventually(letter_waiting, timeout=30, what="the dead letter")
    # The operator fixes the bug (a processor without the poison) and replays.
    mesh.launch.pop("processor")
    await mesh.restart("processor")
    try:
        assert await replay_dead_letters(amqp_url) >= 1
        await lines_until(
            store,
            forum.id,
            lambda lines: sorted(_answers(lines, agent_id)) == ["POISON later cured", "after"],
        )
        state = await store.states.find_one({"actor": "processor", "config.agentActorId": agent_id})
        assert state is not None
        failures = await store.db["failures"].find({"conversationId": state["watch"]}).to_list()
        assert len(failures) == 1 and failures[0]["open"] is False
    finally:
        mesh.launch["processor"] = _poisoned("processor")
        await mesh.restart("processor")


async def test_one_joins_failure_does_not_stop_the_other_joins_of_its_forum(
    mesh: Mesh, store: Store, poster: Poster, amqp_url: str
) -> None:
    forum = await create_forum(store, "two agents")
    healthy_agent = await _join(store, poster, forum.id)
    poisoned_agent = await _join(store, poster, forum.id, agent_id=POISONED_AGENT)
    async with Client(amqp_url) as client:
        first = await say(client, forum.id, "INGEST-JAM first")
        second = await say(client, forum.id, "second")

    def replied(lines: list[Message], agent_id: str) -> set[str]:
        """The people's lines the agent answered (agents also answer each other here)."""
        return {
            str(line.meta.in_reply_to)
            for line in agent_lines(lines)
            if line.author_actor_id == agent_id and line.meta.in_reply_to in (first, second)
        }

    lines = await lines_until(
        store,
        forum.id,
        lambda lines: (
            replied(lines, healthy_agent) == {first, second}
            and replied(lines, poisoned_agent) == {second}
        ),
    )
    # A notice in the forum says which line the poisoned join could not take (one per line:
    # the healthy agent's echo of it jams the poisoned join too).
    notices = [line for line in lines if line.type == "notice"]
    assert [n for n in notices if first in n.text]
    assert len({n.meta.causation_id for n in notices}) == len(notices)


async def test_leave_wins_over_a_late_state_save(store: Store, poster: Poster) -> None:
    """A step that was running when the agent left must not bring the join back."""
    forum = await create_forum(store, "leave")
    agent = await create_agent(store, "leaver")
    await join_conversation(store, poster, agent.id, forum.id)
    [document] = await store.states.find(
        {"actor": "processor", "config.agentActorId": agent.id}
    ).to_list()
    assert await leave_conversation(store, agent.id, forum.id)
    document["watermark"] += 1
    await store.save_state(str(document["_id"]), document)  # the late save of a running step
    assert await store.states.find_one({"_id": document["_id"]}) is None


async def test_transient_failures_are_waited_out_and_never_dead_lettered(
    amqp_url: str, mongodb_url: str
) -> None:
    """A handler failing with "store unreachable" for longer than the retry budget still wins."""
    from pymongo.errors import AutoReconnect

    from yoke.bus.consumer import Dispatcher, Route, key_from_header
    from yoke.core.errors import RetryPolicy

    bus = Bus(amqp_url, name="transient-test")
    await bus.connect()
    try:
        [queue] = await bus.declare_shards(
            "transient-test", [{topology.EVENT_HEADER: "transient"}], 1
        )
        dispatcher = Dispatcher(
            "transient-test", bus, policy=RetryPolicy(attempts=2, backoff=0.01, cap=0.05)
        )
        calls = 0
        done = asyncio.Event()

        async def handle(_: object) -> None:
            nonlocal calls
            calls += 1
            if calls <= 12:
                raise AutoReconnect("connection refused")
            done.set()

        route = Route(queue, key_from_header, handle)
        await bus.consume(queue, dispatcher.on_message(route), prefetch=4)
        await bus.publish(
            topology.EVENTS_EXCHANGE,
            "transient.x",
            b"{}",
            message_id="m1",
            headers={topology.CONVERSATION_HEADER: "c1", topology.EVENT_HEADER: "transient"},
        )
        await asyncio.wait_for(done.wait(), 30)
        assert calls == 13
        await asyncio.sleep(0)
        assert not [
            letter
            for letter in await list_dead_letters(amqp_url)
            if letter["service"] == "transient-test"
        ]
    finally:
        await bus.close()

"""The agent mesh end to end: five services as real processes, driven from outside over AMQP."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from urllib.parse import unquote, urlsplit, urlunsplit

import aio_pika
import httpx
import pytest
from aiormq.exceptions import ChannelAccessRefused

from tests.support.mesh import JoinFactory, Mesh, agent_lines, lines_until, say
from tests.support.processes import eventually
from yoke.bus import topology
from yoke.bus.amqp_nodes import amqp_user
from yoke.bus.broker import Bus
from yoke.client import Client
from yoke.core.models import ToolResultPart
from yoke.llm.base import ScriptedCall, ScriptedOutput
from yoke.runtime.joins import leave_conversation
from yoke.store.database import Store

pytestmark = pytest.mark.slow


# The routing headers of a forum line (topology.posted_headers): who reads those receives it.
# A line of a forum where some join has follow-up: ingestion and follow-up both read it.
FORUM_LINE_HEADERS: dict[str, str | int] = {
    topology.EVENT_HEADER: "conversation.message.posted",
    topology.KIND_HEADER: "forum",
    topology.TYPE_HEADER: "message",
    topology.FOLLOWED_HEADER: "yes",
    topology.COPIED_HEADER: "no",
}


async def test_line_published_with_plain_aio_pika_is_answered_in_the_forum(
    store: Store, new_join: JoinFactory, amqp_url: str, mesh: Mesh
) -> None:
    forum_id, join = await new_join()
    user = amqp_user(amqp_url)
    connection = await aio_pika.connect(amqp_url)
    try:
        channel = await connection.channel()
        # The door answers only on a queue of the publisher's own, named by its verified user.
        replies = await channel.declare_queue(
            topology.bridge_queue_prefix(user) + "plain", exclusive=True
        )
        command = {
            "conversationId": forum_id,
            "author": {"externalId": "slack:U1", "displayName": "Ada"},
            "text": "hello mesh",
            "idempotencyKey": "k-1",
        }
        commands = await channel.get_exchange(topology.COMMANDS_EXCHANGE)
        await commands.publish(
            aio_pika.Message(
                json.dumps(command).encode(),
                reply_to=replies.name,
                correlation_id="c-1",
                user_id=user,
            ),
            routing_key=topology.SUBMIT_COMMAND,
        )
        answer = await replies.get(timeout=30, fail=False) or await _next(replies)
        assert answer.correlation_id == "c-1"
        reply = json.loads(answer.body)
    finally:
        await connection.close()
    assert reply["status"] == "accepted"

    forum = await lines_until(store, forum_id, lambda lines: len(lines) == 2)
    human, answer_line = forum
    assert human.id == reply["messageId"] and human.meta.agent_hops == 0
    assert answer_line.text == "hello mesh"
    assert answer_line.author_actor_id == join.agent_actor_id
    assert answer_line.participant_id == join.forum_participant_id
    assert answer_line.meta.in_reply_to == human.id and answer_line.meta.agent_hops == 1

    copy, thought = await store.history(join.monologue_id)
    shadow = await store.get_actor(copy.author_actor_id)
    assert shadow is not None and shadow.kind == "external" and shadow.name == "Ada"
    assert copy.meta.source_conversation_id == forum_id
    assert copy.meta.source_message_id == human.id
    assert copy.meta.source_actor_id == human.author_actor_id
    assert thought.role == "agent" and thought.text == "hello mesh"
    assert thought.meta.source_conversation_id == forum_id and thought.meta.causation_id == copy.id


async def _next(queue: aio_pika.abc.AbstractQueue) -> aio_pika.abc.AbstractIncomingMessage:
    async def arrived() -> bool:
        return await queue.get(fail=False, no_ack=False) is not None

    async with queue.iterator() as messages:
        async for message in messages:
            await message.ack()
            return message
    raise AssertionError("no reply")


async def test_two_echo_agents_stop_at_the_hop_cap_and_answer_people_again(
    store: Store, client: Client, new_join: JoinFactory
) -> None:
    forum_id, first = await new_join(name="left")
    _, second = await new_join(forum_id, name="right")
    await say(client, forum_id, "ping")
    # Both answer the person (hops 1), then each answers the other up to hops 4, where the cap
    # stops them: two lines per hop level, nine in all.
    expected = [0, 1, 1, 2, 2, 3, 3, 4, 4]
    await lines_until(store, forum_id, lambda lines: len(lines) >= len(expected))
    await asyncio.sleep(1.5)  # a quiet period: a runaway would show itself here
    lines = await store.history(forum_id)
    assert sorted(line.meta.agent_hops for line in lines) == expected
    authors = {line.author_actor_id for line in agent_lines(lines)}
    assert authors == {first.agent_actor_id, second.agent_actor_id}
    # Each sees the other's lines in its monologue, never its own.
    for mine, theirs in ((first, second), (second, first)):
        copied = [m for m in await store.history(mine.monologue_id) if m.role == "user"]
        sources = {m.meta.source_actor_id for m in copied}
        assert theirs.agent_actor_id in sources and mine.agent_actor_id not in sources

    await say(client, forum_id, "again")
    lines = await lines_until(store, forum_id, lambda lines: len(lines) >= 2 * len(expected))
    assert sorted(line.meta.agent_hops for line in lines[len(expected) :]) == expected
    assert lines[len(expected)].text == "again"


async def test_tool_round_runs_both_tools_in_parallel_then_answers(
    store: Store, client: Client, new_join: JoinFactory
) -> None:
    script = [
        ScriptedOutput(
            tool_calls=[
                ScriptedCall(name="wait", input={"seconds": 1}),
                ScriptedCall(name="wait", input={"seconds": 1}),
            ]
        ),
        ScriptedOutput(text="both waits are done"),
    ]
    forum_id, join = await new_join(model="fixture-script", tools=["wait"], script=script)
    await say(client, forum_id, "please wait twice")
    forum = await lines_until(store, forum_id, lambda lines: len(lines) == 2)
    assert forum[1].text == "both waits are done"

    monologue = await store.history(join.monologue_id)
    kinds = [(m.role, m.author_actor_id) for m in monologue]
    assert kinds[1] == ("agent", join.agent_actor_id)
    assert kinds[2] == ("user", "system")
    results = [p for p in monologue[2].parts if isinstance(p, ToolResultPart)]
    assert len(results) == 2 and not any(r.is_error for r in results)
    spans = [json.loads(r.output) for r in results]
    assert max(s["startedAt"] for s in spans) < min(s["endedAt"] for s in spans)  # overlapped
    assert forum[1].meta.in_reply_to == forum[0].id


async def test_the_same_command_twice_makes_one_line_and_one_reply(
    store: Store, client: Client, new_join: JoinFactory
) -> None:
    forum_id, _ = await new_join()
    first = await client.submit(
        forum_id, "once", external_id="t:bo", display_name="Bo", idempotency_key="same"
    )
    second = await client.submit(
        forum_id, "once", external_id="t:bo", display_name="Bo", idempotency_key="same"
    )
    assert first.status == second.status == "accepted"
    assert first.duplicate is False and second.duplicate is True
    assert first.message_id == second.message_id
    await lines_until(store, forum_id, lambda lines: len(lines) == 2)
    await asyncio.sleep(1)
    assert len(await store.history(forum_id)) == 2


async def test_a_service_killed_mid_turn_still_gives_exactly_one_reply(
    store: Store, client: Client, new_join: JoinFactory, mesh: Mesh
) -> None:
    forum_id, _ = await new_join()
    lines = [f"line {i}" for i in range(20)]
    for text in lines:
        await say(client, forum_id, text)
    await mesh.restart("processor")
    await mesh.restart("egress")
    forum = await lines_until(
        store, forum_id, lambda found: len(agent_lines(found)) >= 20, timeout=60
    )
    await asyncio.sleep(1)
    forum = await store.history(forum_id)
    replies = agent_lines(forum)
    assert [r.text for r in replies] == lines
    humans = [line for line in forum if line.role == "user"]
    assert [r.meta.in_reply_to for r in replies] == [h.id for h in humans]


async def test_load_100_forums_of_10_lines_each_answered_once_in_order(
    store: Store, client: Client, new_join: JoinFactory
) -> None:
    forums = [(await new_join())[0] for _ in range(100)]

    async def talk(forum_id: str) -> None:
        for index in range(10):
            await say(client, forum_id, f"{forum_id[:6]} line {index}")

    await asyncio.gather(*(talk(forum_id) for forum_id in forums))

    async def all_answered() -> bool:
        counts = [len(await store.history(f)) for f in forums]
        return all(count >= 20 for count in counts)

    await eventually(all_answered, timeout=240, what="every line answered", interval=1)
    for forum_id in forums:
        forum = await store.history(forum_id)
        humans = [line for line in forum if line.role == "user"]
        replies = agent_lines(forum)
        assert len(humans) == len(replies) == 10
        assert [r.text for r in replies] == [h.text for h in humans]
        assert [r.meta.in_reply_to for r in replies] == [h.id for h in humans]


async def test_after_leave_the_agent_no_longer_answers(
    store: Store, client: Client, new_join: JoinFactory
) -> None:
    forum_id, join = await new_join()
    await say(client, forum_id, "before")
    await lines_until(store, forum_id, lambda lines: len(lines) == 2)
    assert await leave_conversation(store, join.agent_actor_id, forum_id)
    await say(client, forum_id, "after")
    # A second agent still in the forum proves lines still flow; the one that left stays quiet.
    _, witness = await new_join(forum_id, name="witness")
    await say(client, forum_id, "to the witness")
    lines = await lines_until(
        store,
        forum_id,
        lambda lines: any(m.author_actor_id == witness.agent_actor_id for m in lines),
    )
    left_lines = [line for line in lines if line.author_actor_id == join.agent_actor_id]
    assert [line.text for line in left_lines] == ["before"]


@pytest.mark.parametrize(
    ("body", "problem"),
    [
        (b"{not json", "not valid JSON"),
        (
            json.dumps({"conversationId": "x", "text": "hi", "idempotencyKey": "k"}).encode(),
            "author",
        ),
        (
            json.dumps(
                {
                    "conversationId": "no-such-forum",
                    "author": {"externalId": "a", "displayName": "A"},
                    "text": "hi",
                    "idempotencyKey": "k",
                }
            ).encode(),
            "unknown conversation",
        ),
    ],
)
async def test_bad_commands_are_rejected_naming_the_problem(
    store: Store, client: Client, body: bytes, problem: str
) -> None:
    before = await store.messages.count_documents({})
    reply = await client.submit_raw(body)
    assert reply.status == "rejected"
    assert reply.error and problem in reply.error
    assert await store.messages.count_documents({}) == before


async def test_oversized_text_is_rejected_and_the_door_keeps_serving(
    store: Store, client: Client, new_join: JoinFactory
) -> None:
    forum_id, _ = await new_join()
    reply = await client.submit(forum_id, "x" * 70_000, external_id="t:big", display_name="Big")
    assert reply.status == "rejected" and reply.error and "65536" in reply.error
    assert await store.history(forum_id) == []
    await say(client, forum_id, "small enough")
    await lines_until(store, forum_id, lambda lines: len(lines) == 2)


async def run_cli(mesh: Mesh, *args: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "yoke.cli",
        *args,
        env={**os.environ, **mesh.env},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )


async def test_yoke_tail_shows_lines_as_they_are_posted(
    client: Client, new_join: JoinFactory, mesh: Mesh
) -> None:
    forum_id, _ = await new_join(name="tailed")
    tail = await run_cli(mesh, "tail", forum_id)
    try:
        assert tail.stdout is not None
        # The tail's queue is bound once it runs: post until a line shows up, then its answer.
        seen: list[str] = []

        async def read_lines() -> None:
            assert tail.stdout is not None
            while len(seen) < 2:
                seen.append((await tail.stdout.readline()).decode().strip())

        reader = asyncio.create_task(read_lines())
        for attempt in range(50):
            await say(client, forum_id, f"tail me {attempt}", who="Tess")
            done, _ = await asyncio.wait({reader}, timeout=0.5)
            if done:
                break
        await asyncio.wait_for(reader, timeout=20)
        assert any("Tess: tail me" in line for line in seen)
        assert any("tailed: tail me" in line for line in seen)
    finally:
        tail.terminate()
        await tail.wait()


async def test_yoke_dlq_lists_dead_letters_with_service_and_error(
    mesh: Mesh, amqp_url: str
) -> None:
    bus = Bus(amqp_url, name="test-dlq")
    await bus.connect()
    try:
        await bus.publish(
            topology.EVENTS_EXCHANGE,
            "conversation.message.posted.nowhere",
            b"{}",
            message_id="dead-1",
            headers=FORUM_LINE_HEADERS,  # routed as a forum line, to the services that read those
        )
    finally:
        await bus.close()
    letters: list[dict[str, object]] = []

    async def listed() -> bool:
        nonlocal letters
        process = await run_cli(mesh, "dlq", "list")
        out, _ = await process.communicate()
        letters = [json.loads(line) for line in out.decode().splitlines()]
        return {str(x["service"]) for x in letters if x["messageId"] == "dead-1"} >= {
            "ingestion",
            "followup",
        }

    await eventually(listed, timeout=30, what="the dead letter in every service it reached")
    mine = [x for x in letters if x["messageId"] == "dead-1"]
    assert all("x-yoke-conversation" in str(x["error"]) for x in mine)
    assert all(x["routingKey"] == "conversation.message.posted.nowhere" for x in mine)


async def _ignore(message: aio_pika.abc.AbstractIncomingMessage) -> None:
    pass


async def test_a_least_privilege_publisher_can_bridge_but_not_impersonate(
    servers: tuple[str, str, str], amqp_url: str, store: Store, new_join: JoinFactory
) -> None:

    _, _, management = servers
    parts = urlsplit(amqp_url)
    vhost = unquote(parts.path[1:])
    admin = (parts.username or "guest", parts.password or "guest")
    user = f"bridge-{vhost[-6:]}"
    async with httpx.AsyncClient(base_url=management, auth=admin, timeout=30) as api:
        (
            await api.put(f"/api/users/{user}", json={"password": "bridge", "tags": ""})
        ).raise_for_status()
        permissions = topology.publisher_permissions(user)
        (await api.put(f"/api/permissions/{vhost}/{user}", json=permissions)).raise_for_status()
    bridge_url = urlunsplit(
        parts._replace(netloc=f"{user}:bridge@{parts.hostname}:{parts.port or 5672}")
    )
    try:
        forum_id, _ = await new_join(name="bridged")
        async with Client(bridge_url) as bridge:
            replies = bridge.watch(forum_id)
            first = asyncio.ensure_future(anext(replies))
            await asyncio.sleep(0.2)  # the watch queue is bound when anext starts consuming
            reply = await bridge.submit(
                forum_id, "from the bridge", external_id="b:1", display_name="Bri"
            )
            assert reply.status == "accepted"
            seen = [await asyncio.wait_for(first, 20)]
            while not any(m.role == "agent" for m in seen):
                seen.append(await asyncio.wait_for(anext(replies), 20))
            assert seen[-1].text == "from the bridge"

        connection = await aio_pika.connect(bridge_url)
        try:
            channel = await connection.channel()
            events = await channel.get_exchange(topology.EVENTS_EXCHANGE, ensure=False)
            with pytest.raises(ChannelAccessRefused):
                await events.publish(
                    aio_pika.Message(b"{}"), routing_key="conversation.message.posted.x"
                )
            channel = await connection.channel()
            queue = await channel.get_queue("yoke.processor.shard.000", ensure=False)
            with pytest.raises(ChannelAccessRefused):
                await queue.consume(_ignore)
        finally:
            await connection.close()
    finally:
        async with httpx.AsyncClient(base_url=management, auth=admin, timeout=30) as api:
            await api.delete(f"/api/users/{user}")


async def test_yoke_dlq_replay_sends_letters_back_where_they_came_from(
    mesh: Mesh, amqp_url: str
) -> None:
    bus = Bus(amqp_url, name="test-replay")
    await bus.connect()
    try:
        # Still malformed after a replay: each service dead-letters it again, proving it went
        # back to yoke.events under its original routing key.
        await bus.publish(
            topology.EVENTS_EXCHANGE,
            "conversation.message.posted.replayed",
            b"[]",
            message_id="dead-2",
            headers=FORUM_LINE_HEADERS,
        )
    finally:
        await bus.close()

    async def letters() -> list[dict[str, object]]:
        process = await run_cli(mesh, "dlq", "list")
        out, _ = await process.communicate()
        return [json.loads(line) for line in out.decode().splitlines()]

    async def three_dead() -> bool:  # one per service that reads forum lines
        return sum(x["messageId"] == "dead-2" for x in await letters()) == 2

    await eventually(three_dead, timeout=30, what="dead-2 in every service it reached")
    replay = await run_cli(mesh, "dlq", "replay")
    _, err = await replay.communicate()
    assert replay.returncode == 0 and "replayed" in err.decode()
    await eventually(three_dead, timeout=30, what="dead-2 dead-lettered again after the replay")

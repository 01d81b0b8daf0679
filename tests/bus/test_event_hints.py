"""Ephemeral events (``agent.activity``, ``agent.delta``) go out as hints: transient, without
confirms and not mandatory, in order, routed exactly as the confirmed events are; and the
envelope's wire encoding says what pydantic's would.

docs/architecture.md, "The step": what a live view sees of a step costs the step no round trip.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from typing import Any, cast

import aio_pika
import pytest
from aio_pika.abc import AbstractIncomingMessage

from yoke.bus import topology
from yoke.bus.broker import Bus
from yoke.core.models import AgentActivity, Envelope, Message, MessageMeta, MessagePosted, TextPart

FORUM = "forum-hints"


@pytest.fixture
async def bus(amqp_url: str) -> AsyncIterator[Bus]:
    bus = Bus(amqp_url, name="test-hints")
    await bus.connect()
    yield bus
    await bus.close()


def activity(state: str, forum: str = FORUM) -> Envelope:
    hint = AgentActivity.model_validate({"agentActorId": "a", "forumId": forum, "state": state})
    return Envelope.wrap(f"activity-{forum}-{state}", hint)


async def test_hints_reach_a_forum_reader_in_order_transient_and_with_the_routing_headers(
    bus: Bus, amqp_url: str
) -> None:
    connection = await aio_pika.connect(amqp_url)
    try:
        channel = await connection.channel()
        forum = await channel.get_exchange(topology.FORUM_EXCHANGE, ensure=False)
        queue = await channel.declare_queue(exclusive=True)
        await queue.bind(forum, routing_key=f"{AgentActivity.TYPE}.{FORUM}")
        got: asyncio.Queue[AbstractIncomingMessage] = asyncio.Queue()
        await queue.consume(got.put, no_ack=True)
        states = ["thinking", "idle", "tool", "idle"] * 5
        for index, state in enumerate(states):
            envelope = activity(state)
            envelope.id = f"hint-{index}"
            await bus.publish_hint(
                envelope, FORUM, {topology.KIND_HEADER: topology.PUBLIC_KIND}, expiration=60
            )
        seen = [await asyncio.wait_for(got.get(), 10) for _ in states]
    finally:
        await connection.close()
    assert [Envelope.model_validate_json(m.body).parse() for m in seen] == [
        AgentActivity.model_validate({"agentActorId": "a", "forumId": FORUM, "state": state})
        for state in states
    ]
    assert [m.message_id for m in seen] == [f"hint-{index}" for index in range(len(states))]
    assert {m.delivery_mode for m in seen} == {aio_pika.DeliveryMode.NOT_PERSISTENT}
    assert {m.expiration for m in seen} == {60}
    headers = seen[0].headers
    assert headers[topology.EVENT_HEADER] == AgentActivity.TYPE
    assert headers[topology.CONVERSATION_HEADER] == FORUM
    # On a channel of their own, without confirms: never on the confirming publisher.
    hints_channel = cast(Any, bus._hints).channel
    assert hints_channel is not bus.publisher and not hints_channel.publisher_confirms


async def test_a_hint_nobody_reads_is_dropped_by_the_broker_not_returned(
    bus: Bus, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    # A reader of one forum on the bus's own connection: the broker sends a returned hint back
    # before it routes the next, and one connection's frames are read in order, so once the
    # last hint arrives every return of those before it has been seen.
    channel = await bus.connection.channel()
    forum = await channel.get_exchange(topology.FORUM_EXCHANGE, ensure=False)
    queue = await channel.declare_queue(exclusive=True)
    await queue.bind(forum, routing_key=f"{AgentActivity.TYPE}.read")
    got: asyncio.Queue[AbstractIncomingMessage] = asyncio.Queue()
    await queue.consume(got.put, no_ack=True)
    for index in range(5):
        await bus.publish_hint(activity("idle", f"nobody-{index}"), f"nobody-{index}")
    await bus.publish_hint(
        activity("idle", "read"), "read", {topology.KIND_HEADER: topology.PUBLIC_KIND}
    )
    last = await asyncio.wait_for(got.get(), 10)
    assert last.headers[topology.CONVERSATION_HEADER] == "read"
    assert not [r for r in caplog.records if "returning" in r.getMessage()]


def test_the_wire_encoding_is_what_pydantic_would_write() -> None:
    line = Message(
        id="m1",
        conversation_id="c1",
        author_actor_id="a1",
        participant_id="p1",
        role="user",
        seq=7,
        parts=[TextPart(text='héllo \u2028 "quoted" \\ and more')],
        meta=MessageMeta(source_conversation_id="f1", source_message_id="s1", agent_hops=2),
    )
    for payload in (
        MessagePosted.of(line),
        AgentActivity(agent_actor_id="a", forum_id="f", state="tool"),
    ):
        envelope = Envelope.wrap("e1", payload)
        assert json.loads(envelope.to_json()) == json.loads(envelope.model_dump_json())
        back = Envelope.model_validate_json(envelope.to_json())
        assert back.parse() == payload and back.occurred_at == envelope.occurred_at
    # What orjson refuses (an int past 64 bits in a line's meta) is still written, by pydantic.
    envelope = Envelope.wrap("e2", AgentActivity(agent_actor_id="a", forum_id="f", state="idle"))
    envelope.payload["huge"] = 2**70
    assert json.loads(envelope.to_json())["payload"]["huge"] == 2**70

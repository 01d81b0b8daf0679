"""An agent's line drawn as it is written: ``agent.delta`` events, through the real mesh.

The services and the gateway run as real processes; the fake OpenAI server streams a known
answer in pieces. A bridge reads the forum's exchange (``yoke.forum``) as any bridge would, a
client reads the gateway's ``/stream``; both must see the deltas in index order, making up the
line that follows them, and nothing for a step that only calls tools. A model that fails
mid-answer leaves an abandoned draft, a notice and no partial line. The gateway's own bound
(a slow reader loses deltas before lines) is checked on its subscriber directly.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import aio_pika
import httpx
import pytest
from aio_pika.abc import AbstractIncomingMessage

from services.gateway import stream as gateway_stream
from tests.support.fake_openai import FakeOpenAI, completion, openai_env, streamed
from tests.support.mesh import JoinFactory, lines_until, say
from tests.support.processes import eventually
from tests.support.sse import Event, EventReader
from yoke.bus import topology
from yoke.client import Client
from yoke.core.models import AgentActivity, AgentDelta, Envelope, Message, MessagePosted, TextPart
from yoke.store.database import Store
from yoke.store.tokens import create_token, ensure_token_indexes

ANSWER = "Streaming, piece by piece, the answer that the forum's people watch being written."


@pytest.fixture(scope="module")
def mesh_env(fake_openai: FakeOpenAI) -> dict[str, str]:
    # A patient provider: a loaded machine must not turn a slow piece into a give-up.
    return openai_env(fake_openai.base_url, give_up_seconds=30)


Seen = list[MessagePosted | AgentDelta]


@contextlib.asynccontextmanager
async def bridge(
    amqp_url: str, forum_id: str, expirations: dict[str, set[object]] | None = None
) -> AsyncIterator[Seen]:
    """What a bridge bound to yoke.forum for the forum's lines and drafts receives, in order
    (and, in ``expirations``, the AMQP expiration each event type came with)."""
    seen: Seen = []
    connection = await aio_pika.connect(amqp_url)
    try:
        channel = await connection.channel()
        queue = await channel.declare_queue(exclusive=True, auto_delete=True)
        for event_type in (AgentDelta.TYPE, MessagePosted.TYPE):
            key = topology.routing_key(event_type, forum_id)
            await queue.bind(topology.FORUM_EXCHANGE, routing_key=key)

        async def on_event(delivery: AbstractIncomingMessage) -> None:
            payload = Envelope.model_validate_json(delivery.body).parse()
            if isinstance(payload, MessagePosted | AgentDelta):
                seen.append(payload)
                if expirations is not None:
                    expirations.setdefault(payload.TYPE, set()).add(delivery.expiration)

        await queue.consume(on_event, no_ack=True)
        yield seen
    finally:
        await connection.close()


async def agent_line_seen(seen: Seen, kind: str = "message") -> Message:
    """The first agent line of ``kind`` the bridge got (waited for)."""

    async def arrived() -> bool:
        return any(agent_lines(seen, kind))

    await eventually(arrived, timeout=60, what=f"an agent {kind} line on yoke.forum")
    return agent_lines(seen, kind)[0]


def agent_lines(seen: Seen, kind: str = "message") -> list[Message]:
    return [
        event.message
        for event in seen
        if isinstance(event, MessagePosted)
        and event.message.role == "agent"
        and event.message.type == kind
    ]


def arrival(seen: Seen, message_id: str, what: str) -> int:
    """Where in the bridge's order a draft's end (``end``) or a line (``line``) came."""
    for position, event in enumerate(seen):
        if event.message_id != message_id:
            continue
        if (what == "end" and isinstance(event, AgentDelta) and event.end is not None) or (
            what == "line" and isinstance(event, MessagePosted)
        ):
            return position
    raise AssertionError(f"no {what} of {message_id} on yoke.forum")


def deltas_of(seen: Seen) -> list[AgentDelta]:
    return [event for event in seen if isinstance(event, AgentDelta)]


def assert_one_draft_of(deltas: list[AgentDelta], end: str) -> str:
    """Deltas of one draft in index order from 0, the last one ending it; their text."""
    assert deltas, "nothing was streamed"
    assert [delta.index for delta in deltas] == list(range(len(deltas)))
    assert len({delta.message_id for delta in deltas}) == 1
    assert [delta.end for delta in deltas] == [None] * (len(deltas) - 1) + [end]
    return "".join(delta.text for delta in deltas)


@pytest.mark.slow
async def test_a_bridge_gets_the_deltas_in_order_and_then_the_line_they_make_up(
    amqp_url: str, store: Store, client: Client, new_join: JoinFactory, fake_openai: FakeOpenAI
) -> None:
    fake_openai.script(streamed(completion(ANSWER), pieces=12, piece_delay=0.05))
    forum_id, join = await new_join(model="gpt-test")
    expirations: dict[str, set[object]] = {}
    async with bridge(amqp_url, forum_id, expirations) as seen:
        asked = await say(client, forum_id, "tell me something", who="Ada")
        line = await agent_line_seen(seen)
    deltas = deltas_of(seen)
    assert assert_one_draft_of(deltas, "posted") == line.text == ANSWER
    assert len(deltas) >= 2, "the answer came in one piece: it was not streamed"
    assert {delta.message_id for delta in deltas} == {line.id}
    assert {delta.in_reply_to for delta in deltas} == {asked} == {line.meta.in_reply_to}
    assert {(delta.forum_id, delta.agent_actor_id) for delta in deltas} == {
        (forum_id, join.agent_actor_id)
    }
    assert arrival(seen, deltas[-1].message_id, "end") < arrival(seen, line.id, "line")
    stored = await store.get_message(line.id)
    assert stored is not None and stored.text == ANSWER
    # Drafts expire in a queue nobody reads (a bridge's that fell behind); lines never do.
    assert expirations[MessagePosted.TYPE] == {None}
    assert None not in expirations[AgentDelta.TYPE], expirations


@pytest.mark.slow
async def test_the_gateway_stream_sends_deltas_before_the_line_also_to_a_client_joining_late(
    gateway_url: str, store: Store, new_join: JoinFactory, fake_openai: FakeOpenAI
) -> None:
    """Deltas are ``delta`` events without an ``id:`` (Last-Event-ID counts lines only); a
    client that connects mid-answer gets the deltas from then on, and the line."""
    fake_openai.script(streamed(completion(ANSWER), pieces=30, piece_delay=0.1))
    forum_id, join = await new_join(model="gpt-test")
    await ensure_token_indexes(store)
    _, secret = await create_token(store, f"stream-{forum_id[:12]}", [forum_id])
    headers = {"Authorization": f"Bearer {secret}"}
    async with httpx.AsyncClient(base_url=gateway_url, timeout=30, headers=headers) as http:
        path = f"/v1/forums/{forum_id}/stream"
        async with http.stream("GET", path) as first:
            assert first.status_code == 200
            early = EventReader(first)
            body = {"author": {"externalId": "ada", "displayName": "Ada"}, "text": "go on"}
            posted = await http.post(f"/v1/forums/{forum_id}/messages", json=body)
            assert posted.status_code == 202, posted.text
            (mine,), _ = await early.messages(1)
            assert mine.data["id"] == posted.json()["messageId"]
            first_delta = await next_of(early, "delta")
            # Opened once the answer is under way: a draft already begun.
            async with http.stream("GET", path) as second:
                assert second.status_code == 200
                late = EventReader(second)
                late_events = await events_until_line(late)
            early_events = [first_delta, *await events_until_line(early)]
    line = early_events[-1]
    assert line.event == "message" and line.data["role"] == "agent"
    assert line.id == str(line.data["seq"]) and line.data["authorActorId"] == join.agent_actor_id
    early_deltas = [e.data for e in early_events if e.event == "delta"]
    assert [d["index"] for d in early_deltas] == list(range(len(early_deltas)))
    assert "".join(d["text"] for d in early_deltas) == line.data["parts"][0]["text"] == ANSWER
    assert {d["messageId"] for d in early_deltas} == {line.data["id"]}
    assert early_deltas[-1]["end"] == "posted" and all(e.id is None for e in early_events[:-1])
    assert AgentDelta.model_validate(early_deltas[0]).in_reply_to == mine.data["id"]
    # The late client: no line it has not seen yet but the answer, the deltas from then on.
    assert late_events[-1].data == line.data
    late_deltas = [e.data for e in late_events if e.event == "delta"]
    assert late_deltas, "the late client got no delta: the answer was over before it connected"
    assert late_deltas[0]["index"] > 0
    assert late_deltas == early_deltas[-len(late_deltas) :]


async def next_of(reader: EventReader, kind: str) -> Event:
    while (event := await reader.next(deltas=True)).event != kind:
        pass
    return event


async def events_until_line(reader: EventReader) -> list[Event]:
    """Deltas (and activity) up to and with the next agent line."""
    events: list[Event] = []
    while True:
        event = await reader.next(deltas=True)
        if event.event == "activity":
            continue
        events.append(event)
        if event.event == "message" and event.data["role"] == "agent":
            return events


@pytest.mark.slow
async def test_a_step_that_only_calls_tools_streams_nothing(
    amqp_url: str, store: Store, client: Client, new_join: JoinFactory, fake_openai: FakeOpenAI
) -> None:
    fake_openai.script(
        streamed(completion(tool_calls=[("call-1", "clock", "{}")]), pieces=5),
        streamed(completion("It is half past."), pieces=4, piece_delay=0.05),
    )
    forum_id, join = await new_join(model="gpt-test", tools=["clock"])
    async with bridge(amqp_url, forum_id) as seen:
        await say(client, forum_id, "what time is it?", who="Ada")
        line = await agent_line_seen(seen)
    monologue = await store.history(join.monologue_id)
    calls = [m for m in monologue if m.role == "agent" and m.type == "message" and not m.text]
    assert len(calls) == 1  # the tool step happened: a line of calls, without text
    deltas = deltas_of(seen)
    assert {delta.message_id for delta in deltas} == {line.id}  # the answer's draft only
    assert assert_one_draft_of(deltas, "posted") == line.text == "It is half past."


@pytest.mark.slow
async def test_a_model_failing_mid_answer_abandons_its_draft_and_posts_no_partial_line(
    amqp_url: str, store: Store, client: Client, new_join: JoinFactory, fake_openai: FakeOpenAI
) -> None:
    fake_openai.script(
        streamed(completion(ANSWER), pieces=10, piece_delay=0.05, break_after=3),
        completion("back again"),
    )
    forum_id, join = await new_join(model="gpt-test")
    async with bridge(amqp_url, forum_id) as seen:
        asked = await say(client, forum_id, "tell me a long story", who="Ada")
        notice = await agent_line_seen(seen, "notice")
        deltas = deltas_of(seen)
        partial = assert_one_draft_of(deltas, "abandoned")
        assert ANSWER.startswith(partial) and 0 < len(partial) < len(ANSWER)
        assert arrival(seen, deltas[-1].message_id, "end") < arrival(seen, notice.id, "line")
        assert notice.meta.in_reply_to == asked and "could not answer" in notice.text
        # The draft's line never was: not in the forum, not in the monologue.
        assert await store.get_message(deltas[0].message_id) is None
        forum = await store.history(forum_id)
        assert [m.type for m in forum if m.role == "agent"] == ["notice"]
        monologue = await store.history(join.monologue_id)
        assert not [m for m in monologue if m.role == "agent" and partial in m.text]

        await say(client, forum_id, "and now?", who="Ada")
        answered = await lines_until(
            store, forum_id, lambda lines: any(m.text == "back again" for m in lines)
        )
    assert [m.type for m in answered if m.role == "agent"] == ["notice", "message"]


def delta(index: int, text: str = "x", message_id: str = "m") -> AgentDelta:
    return AgentDelta(
        forum_id="f", agent_actor_id="a", message_id=message_id, index=index, text=text
    )


def line(seq: int) -> MessagePosted:
    message = Message(
        id=f"line-{seq}",
        conversation_id="f",
        seq=seq,
        author_actor_id="p",
        parts=[TextPart(text="hi")],
    )
    return MessagePosted(
        conversation_id="f",
        message_id=message.id,
        message_type="message",
        author_actor_id="p",
        seq=seq,
        message=message,
    )


async def test_a_slow_stream_drops_deltas_before_lines_and_holds_a_bounded_number() -> None:
    """Invariant 14: deltas have a budget of their own (count and characters); past it they
    are dropped, never a line, and what is kept stays in arrival order."""
    subscriber = gateway_stream.Subscriber("f")
    budget = gateway_stream.DELTA_BACKLOG
    for index in range(budget + 50):
        subscriber.offer(delta(index))
    for seq in range(1, gateway_stream.SUBSCRIBER_BACKLOG + 1):
        subscriber.offer(line(seq))
    assert not subscriber.missed  # every line found room, whatever the deltas took
    assert subscriber.inbox.qsize() == budget + gateway_stream.SUBSCRIBER_BACKLOG
    subscriber.offer(line(gateway_stream.SUBSCRIBER_BACKLOG + 1))
    assert subscriber.missed  # past the lines' own bound: the stream reads the store instead
    taken = [await subscriber.take() for _ in range(budget + 1)]
    assert [item.index for item in taken[:-1] if isinstance(item, AgentDelta)] == list(
        range(budget)
    )
    assert isinstance(taken[-1], MessagePosted) and taken[-1].seq == 1
    # Room again for deltas, as far as their characters allow.
    subscriber.offer(delta(0, "y" * gateway_stream.DELTA_BACKLOG_CHARS, "big"))
    subscriber.offer(delta(1, "z", "big"))
    assert subscriber.waiting_deltas == 1 and subscriber.waiting_delta_chars == (
        gateway_stream.DELTA_BACKLOG_CHARS
    )
    # Activity shares the lines' bound (one place left after the line taken), not the deltas'.
    subscriber.missed = False
    subscriber.offer(AgentActivity(forum_id="f", agent_actor_id="a", state="idle"))
    assert not subscriber.missed
    subscriber.offer(AgentActivity(forum_id="f", agent_actor_id="a", state="idle"))
    assert subscriber.missed

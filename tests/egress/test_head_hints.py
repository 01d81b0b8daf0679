"""The monologue-head hint of an agent's forum line (yoke.runtime.head_hints): readable by the
mesh, which shares one key, and by nobody without it; and published only sealed, the line's
event holding nothing else of the monologue while the stored line keeps it."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import aio_pika
import pytest
from aio_pika.abc import AbstractIncomingMessage

from tests.support.processes import eventually
from yoke.bus import topology
from yoke.bus.broker import Bus
from yoke.core.ids import new_id
from yoke.core.models import Message, MessageMeta, TextPart
from yoke.runtime.head_hints import HeadHints
from yoke.runtime.joins import create_forum
from yoke.runtime.posting import Poster
from yoke.store.database import Store

MONOLOGUE = "f06fbffd6e23f263e5835c74a0b6712e"


def test_a_hint_opens_for_its_own_line_under_the_key_it_was_sealed_with() -> None:
    hints = HeadHints(b"k" * 32)
    sealed = hints.seal("line-1", MONOLOGUE, 7)
    assert sealed is not None and MONOLOGUE not in sealed
    assert hints.open("line-1", sealed) == (MONOLOGUE, 7)
    assert hints.open("line-2", sealed) is None  # another line's
    assert HeadHints(b"j" * 32).open("line-1", sealed) is None  # another mesh's key
    assert HeadHints().open("line-1", sealed) is None and HeadHints().seal("l", "m", 1) is None
    flipped = sealed[:30] + ("A" if sealed[30] != "A" else "B") + sealed[31:]
    assert hints.open("line-1", flipped) is None
    assert hints.open("line-1", sealed[:-8]) is None
    assert hints.open("line-1", "not base64 at all!") is None and hints.open("line-1", 5) is None


def test_a_hint_says_nothing_of_how_far_the_monologue_is_by_its_length() -> None:
    hints = HeadHints(b"k" * 32)
    lengths = {len(hints.seal("line", MONOLOGUE, seq) or "") for seq in (1, 9, 10_000, 2**40)}
    assert len(lengths) == 1


async def test_every_process_of_a_mesh_loads_the_same_key(store: Store) -> None:
    first, second = HeadHints(), HeadHints()
    await first.load(store)
    await second.load(store)
    sealed = first.seal("line", MONOLOGUE, 3)
    assert sealed is not None and second.open("line", sealed) == (MONOLOGUE, 3)


@pytest.fixture
async def bus(amqp_url: str) -> AsyncIterator[Bus]:
    bus = Bus(amqp_url, name="test-head-hints")
    await bus.connect()
    yield bus
    await bus.close()


async def test_an_agents_forum_line_is_published_with_its_monologue_sealed_and_stored_whole(
    store: Store, bus: Bus, amqp_url: str
) -> None:
    await store.ensure_indexes()
    forum = await create_forum(store, "head hints")
    poster = Poster(store, bus, "test-head-hints")
    await poster.head_hints.load(store)
    connection = await aio_pika.connect(amqp_url)
    async with connection:
        channel = await connection.channel()
        queue = await channel.declare_queue(exclusive=True)
        await queue.bind(
            topology.FORUM_EXCHANGE, routing_key=f"conversation.message.posted.{forum.id}"
        )
        delivered: list[AbstractIncomingMessage] = []

        async def keep(delivery: AbstractIncomingMessage) -> None:
            delivered.append(delivery)

        await queue.consume(keep, no_ack=True)
        line = await poster.post(
            Message(
                id=new_id(),
                conversation_id=forum.id,
                author_actor_id="agent",
                role="agent",
                parts=[TextPart(text="hello")],
                meta=MessageMeta(
                    source_conversation_id=MONOLOGUE,
                    source_seq=4,
                    causation_id="monologue-line",
                    in_reply_to="asked",
                    covers_seq=1,
                ),
            )
        )

        async def arrived() -> bool:
            return bool(delivered)

        await eventually(arrived, timeout=10, what="the agent's line on the forum exchange")

    delivery = delivered[0]
    meta = json.loads(delivery.body)["payload"]["message"]["meta"]
    assert meta == {"inReplyTo": "asked", "agentHops": 0, "coversSeq": 1}
    assert MONOLOGUE not in delivery.body.decode() + str(delivery.headers)
    hint = (delivery.headers or {})[topology.HEAD_HEADER]
    assert poster.head_hints.open(line.id, hint) == (MONOLOGUE, 4)
    stored = await store.get_message(line.id)
    assert stored is not None and stored.meta.source_conversation_id == MONOLOGUE
    assert stored.meta.source_seq == 4 and stored.meta.causation_id == "monologue-line"

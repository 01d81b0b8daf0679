"""The suite's servers are real: behaviours an in-process stand-in would not have."""

from __future__ import annotations

import asyncio

import aio_pika
import pytest
from pymongo import ASCENDING, AsyncMongoClient
from pymongo.errors import DuplicateKeyError


async def test_unique_index_violation_raises_duplicate_key_error(mongodb_url: str) -> None:
    client: AsyncMongoClient[dict[str, object]] = AsyncMongoClient(mongodb_url)
    try:
        things = client.get_default_database()["things"]
        await things.create_index([("name", ASCENDING)], unique=True)
        await things.insert_one({"name": "a"})
        with pytest.raises(DuplicateKeyError):
            await things.insert_one({"name": "a"})
        assert await things.count_documents({}) == 1
    finally:
        await client.close()


async def test_query_by_indexed_field_returns_only_matches(mongodb_url: str) -> None:
    client: AsyncMongoClient[dict[str, object]] = AsyncMongoClient(mongodb_url)
    try:
        things = client.get_default_database()["things"]
        await things.create_index([("conversationId", ASCENDING)])
        await things.insert_many([{"conversationId": f"c{i % 3}", "n": i} for i in range(30)])
        found = [d async for d in things.find({"conversationId": "c1"})]
        assert sorted(int(str(d["n"])) for d in found) == list(range(1, 30, 3))
    finally:
        await client.close()


async def _collect(
    queue: aio_pika.abc.AbstractQueue, into: list[str], label: str, done: asyncio.Event
) -> str:
    async def on_message(message: aio_pika.abc.AbstractIncomingMessage) -> None:
        into.append(label)
        await message.ack()
        if len(into) >= 20:
            done.set()

    return await queue.consume(on_message)


async def test_single_active_consumer_quorum_queue_feeds_one_consumer(amqp_url: str) -> None:
    first = await aio_pika.connect(amqp_url)
    second = await aio_pika.connect(amqp_url)
    try:
        args = {"x-queue-type": "quorum", "x-single-active-consumer": True}
        q1 = await (await first.channel()).declare_queue("sac-smoke", durable=True, arguments=args)
        q2 = await (await second.channel()).declare_queue("sac-smoke", durable=True, arguments=args)
        got: list[str] = []
        done = asyncio.Event()
        await _collect(q1, got, "first", done)
        await _collect(q2, got, "second", done)
        publisher = await first.channel()
        for i in range(20):
            await publisher.default_exchange.publish(
                aio_pika.Message(str(i).encode()), routing_key="sac-smoke"
            )
        await asyncio.wait_for(done.wait(), timeout=10)
        assert len(got) == 20
        assert len(set(got)) == 1
    finally:
        await first.close()
        await second.close()


async def test_consistent_hash_exchange_routes_by_conversation_header(amqp_url: str) -> None:
    from yoke.bus.topology import CONVERSATION_HEADER

    connection = await aio_pika.connect(amqp_url)
    try:
        channel = await connection.channel()
        exchange = await channel.declare_exchange(
            "hash-smoke",
            "x-consistent-hash",
            arguments={"hash-header": CONVERSATION_HEADER},
        )
        queues = []
        for i in range(4):
            queue = await channel.declare_queue(f"hash-smoke-{i}", exclusive=True)
            await queue.bind(exchange, routing_key="1")
            queues.append(queue)
        keys = [f"conversation-{i}" for i in range(40)]
        for round_ in range(3):
            for key in keys:
                await exchange.publish(
                    aio_pika.Message(
                        f"{key}/{round_}".encode(), headers={CONVERSATION_HEADER: key}
                    ),
                    routing_key="",
                )
        seen: dict[str, list[tuple[int, int]]] = {}
        for index, queue in enumerate(queues):
            while (message := await queue.get(no_ack=True, fail=False)) is not None:
                key, round_text = message.body.decode().split("/")
                seen.setdefault(key, []).append((index, int(round_text)))
        assert sorted(seen) == sorted(keys)
        for key, hits in seen.items():
            assert len({queue_index for queue_index, _ in hits}) == 1, key
            assert [r for _, r in hits] == [0, 1, 2], key
        assert len({hits[0][0] for hits in seen.values()}) > 1  # keys spread over shards
    finally:
        await connection.close()

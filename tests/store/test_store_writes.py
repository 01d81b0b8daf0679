"""What the store decides under contention, on the real server (FerretDB behind the MongoDB wire).

Seqs: two writers of one line id (every processor's reaper ends the same overdue call in the same
second) leave the conversation dense and no writer's head cache ahead of the store.

Outbox: a line whose insert is slow, with a heartbeat during it and a crash after it, is still
published again by another process's sweep (invariant 2).

Rate limits: replicas and lanes taking lines of one speaker at once let no more through than
the limit (invariant 8: counted by unique inserts, not by a read-modify-write).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import timedelta
from typing import Any

import pytest
from pymongo.errors import DuplicateKeyError

from yoke.core.ids import new_id
from yoke.core.models import Message, TextPart, utcnow
from yoke.store.database import ID_KEY, SEQ_KEY, Store, duplicate_key
from yoke.store.outbox import OutboxSweep
from yoke.store.rate_limit import LineLimit


@pytest.fixture
async def writers(mongodb_url: str) -> AsyncIterator[tuple[Store, Store]]:
    """Two writers of one database, as two processes would be (each its own caches)."""
    left, right = Store(mongodb_url, app_name="left"), Store(mongodb_url, app_name="right")
    await left.ensure_indexes()
    try:
        yield left, right
    finally:
        await left.close()
        await right.close()


def _line(conversation_id: str, text: str, line_id: str | None = None) -> Message:
    return Message(
        id=line_id or new_id(),
        conversation_id=conversation_id,
        author_actor_id="writer",
        parts=[TextPart(text=text)],
    )


async def test_two_writers_of_one_line_id_leave_seqs_dense_and_no_head_ahead(
    writers: tuple[Store, Store],
) -> None:
    conversation = "monologue-two-reapers"
    rounds, others = 12, 3
    created: list[bool] = []

    async def write(store: Store, line: Message) -> None:
        stored, made = await store.insert_message(line)
        assert stored.id == line.id
        created.append(made)

    for index in range(rounds):
        # Both write the same id (the call's one end) while each also writes lines of its own.
        shared = _line(conversation, f"end-{index}", f"end-{index}")
        await asyncio.gather(
            *(
                write(store, line)
                for store in writers
                for line in (
                    *(
                        _line(conversation, f"{store.outbox.service}-{index}-{k}")
                        for k in range(others)
                    ),
                    shared,
                )
            )
        )
    for store in writers:  # a last line of each: it lands right after the head
        await write(store, _line(conversation, f"{store.outbox.service}-last"))

    stored = await writers[0].history(conversation)
    total = rounds * (2 * others + 1) + 2
    assert [line.seq for line in stored] == list(range(1, total + 1))
    assert len({line.id for line in stored}) == total
    assert created.count(False) == rounds  # each shared id written once, found once
    head = stored[-1].seq
    caches = [store._last_seq.get(conversation) or 0 for store in writers]
    assert max(caches) == head and all(cache <= head for cache in caches), caches


class _DuringInsert:
    """A messages collection whose inserts are slow enough for something to happen meanwhile
    (a heartbeat, the process stopping)."""

    def __init__(self, messages: Any, meanwhile: Callable[[], Awaitable[None]]) -> None:
        self._messages = messages
        self._meanwhile = meanwhile

    def __getattr__(self, name: str) -> Any:
        return getattr(self._messages, name)

    async def insert_one(self, document: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
        await self._meanwhile()
        return await self._messages.insert_one(document, *args, **kwargs)


async def test_a_line_whose_insert_outlived_a_heartbeat_is_published_after_a_crash(
    writers: tuple[Store, Store],
) -> None:
    crashing, surviving = writers
    heartbeats = crashing.db["writers"]
    crashing.messages = _DuringInsert(  # type: ignore[assignment]
        crashing.messages, lambda: crashing.outbox.beat(heartbeats)
    )
    # Made a while before it is stored (a slow insert, or a line built before a slow step).
    line = _line("forum-slow-insert", "made a while ago").model_copy(
        update={"created_at": utcnow() - timedelta(seconds=30)}
    )
    stored, made = await crashing.insert_message(line)
    assert made
    # The crash: no publish, no more heartbeats (close leaves an unconfirmed writer in place).
    await crashing.outbox.close(heartbeats)

    assert [(m.id, m.seq) for m in await _republished(surviving)] == [(stored.id, stored.seq)]


async def test_a_line_being_inserted_as_its_writer_stops_is_left_for_the_sweep(
    writers: tuple[Store, Store],
) -> None:
    stopping, surviving = writers
    heartbeats = stopping.db["writers"]
    stopping.messages = _DuringInsert(  # type: ignore[assignment]
        stopping.messages, lambda: stopping.outbox.close(heartbeats)
    )
    # Its writer stops while the insert is on its way (then dies before it publishes): it
    # must not forget itself as a writer with nothing unconfirmed.
    stored, _ = await stopping.insert_message(_line("forum-stopping", "on its way"))
    assert [m.id for m in await _republished(surviving)] == [stored.id]


async def _republished(sweeper: Store) -> list[Message]:
    """What ``sweeper``'s outbox sweep publishes again of the writers that stopped beating."""
    published: list[Message] = []

    async def publish(message: Message) -> None:
        published.append(message)

    sweep = OutboxSweep(
        sweeper.outbox, sweeper.db["writers"], sweeper.messages, publish, lambda _: None
    )
    await sweep.finish_dead_writers(silent_for=0)
    return published


async def test_a_speakers_limit_holds_when_replicas_take_its_lines_at_once(
    writers: tuple[Store, Store],
) -> None:
    per_minute, each = 5, 12
    limits = [LineLimit(store, per_minute) for store in writers]  # two ingestion replicas
    for window in range(2):  # a speaker's first window, then one begun after it ended
        now = utcnow() + window * timedelta(minutes=2)
        waits = await asyncio.gather(
            *(limit.take("bridge:alice", now) for limit in limits for _ in range(each))
        )
        taken = sum(wait is None for wait in waits)
        assert taken == per_minute, (window, waits)
        assert all(wait is None or 1 <= wait <= 60 for wait in waits), waits


@pytest.mark.parametrize(
    ("details", "key"),
    [
        # FerretDB 1.24 (read from the server): no key named, the caller looks the id up.
        ({"index": 0, "code": 11000, "errmsg": "E11000 duplicate key error collection: y.m"}, None),
        # MongoDB: the key pattern, or at least the index in the message.
        ({"keyPattern": {"conversationId": 1, "seq": 1}, "keyValue": {}}, SEQ_KEY),
        ({"keyPattern": {"_id": 1}, "keyValue": {"_id": "x"}}, ID_KEY),
        ({"errmsg": "E11000 duplicate key error collection: y.m index: conv_seq dup key"}, SEQ_KEY),
        ({"errmsg": "E11000 duplicate key error collection: y.m index: _id_ dup key"}, ID_KEY),
    ],
)
def test_a_duplicate_key_is_named_where_the_server_says_which(
    details: dict[str, object], key: str | None
) -> None:
    assert duplicate_key(DuplicateKeyError("E11000", 11000, details)) == key

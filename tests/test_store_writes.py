"""What the store decides under contention, on the real server (FerretDB behind the MongoDB wire).

Seqs: two writers of one line id (every processor's reaper ends the same overdue call in the same
second) leave the conversation dense and no writer's head cache ahead of the store.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from pymongo.errors import DuplicateKeyError

from yoke.ids import new_id
from yoke.models import Message, TextPart
from yoke.store import ID_KEY, SEQ_KEY, Store, duplicate_key


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

"""The memory store against the real MongoDB-wire server: keys, recall, bounds, erasure."""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta

import pytest

from yoke.core.ids import new_id
from yoke.runtime import memories as memories_module
from yoke.runtime.memories import Memories, Memory, MemoryRefused, MemorySource, scope_key
from yoke.runtime.recall import Candidate, rank, terms
from yoke.store.database import Store


@pytest.fixture
async def memories(mongodb_url: str) -> AsyncIterator[Memories]:
    store = Store(mongodb_url)
    await store.ensure_indexes()
    try:
        yield Memories(store)
    finally:
        await store.close()


def taught(person: str, forum: str = "f1", at: datetime | None = None) -> MemorySource:
    return MemorySource(
        forum_id=forum,
        message_id=new_id(),
        author_actor_id=person,
        author_name="Ana",
        at=at or datetime.now(UTC),
    )


def about(agent: str, person: str, text: str, **fields: object) -> Memory:
    return Memory.new(new_id(), agent, "person", person, text, taught(person), **fields)


def test_terms_are_words_not_syntax() -> None:
    assert terms("Ana is allergic to PEANUTS!") == ["ana", "allergic", "peanut"]
    assert terms("%_ .* $regex {$ne: 1}") == ["regex", "ne"]
    assert terms("\uff46\uff4f\uff4f") == ["foo"]  # NFKC: the full-width form is the same word


def test_rank_prefers_rarer_shared_terms_then_newer() -> None:
    old, new = datetime(2026, 1, 1, tzinfo=UTC), datetime(2026, 6, 1, tzinfo=UTC)
    a = Candidate("a", ["peanut", "allergy"], old)
    b = Candidate("b", ["peanut", "butter", "likes"], new)
    c = Candidate("c", ["cat", "name", "tom"], new)
    ranked = [candidate.id for candidate, _ in rank(["peanut", "allergy"], [a, b, c])]
    assert ranked == ["a", "b"]  # c shares nothing and is left out


async def test_recall_finds_only_the_scope_asked(memories: Memories) -> None:
    await memories.remember(about("agent", "ana", "Ana is allergic to peanuts"))
    await memories.remember(about("agent", "bob", "Bob is allergic to peanuts too"))
    await memories.remember(about("other-agent", "ana", "Ana likes peanuts"))
    found = await memories.recall([scope_key("agent", "person", "ana")], "peanuts?", 5)
    assert [r.memory.text for r in found] == ["Ana is allergic to peanuts"]


async def test_a_retried_write_is_one_memory(memories: Memories) -> None:
    memory = about("agent", "ana", "Ana's order is 42")
    first, created = await memories.remember(memory)
    again, created_again = await memories.remember(memory)
    assert (created, created_again) == (True, False)
    assert again.id == first.id
    assert len(await memories.listed(agent_actor_id="agent")) == 1


async def test_a_scope_is_bounded(memories: Memories, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(memories_module, "MAX_PER_SCOPE", 3)
    for n in range(3):
        await memories.remember(about("agent", "ana", f"fact {n}"))
    with pytest.raises(MemoryRefused, match="full"):
        await memories.remember(about("agent", "ana", "one too many"))
    await memories.remember(about("agent", "bob", "bob's own scope is not full"))


async def test_erasure_removes_what_a_person_is_and_taught_and_stays(
    memories: Memories,
) -> None:
    await memories.remember(about("agent", "ana", "Ana is allergic to peanuts"))
    forum_fact = Memory.new(new_id(), "agent", "forum", "f1", "the forum meets at 9", taught("ana"))
    await memories.remember(forum_fact)
    await memories.remember(about("agent", "bob", "Bob likes tea"))
    before = datetime.now(UTC) - timedelta(seconds=1)
    assert await memories.erase_person("ana") == 2
    assert [m.text for m in await memories.listed(agent_actor_id="agent")] == ["Bob likes tea"]
    late = Memory.new(
        new_id(), "agent", "person", "ana", "from an old line", taught("ana", at=before)
    )
    with pytest.raises(MemoryRefused, match="erased"):
        await memories.remember(late)
    after = taught("ana", at=datetime.now(UTC) + timedelta(seconds=1))
    await memories.remember(Memory.new(new_id(), "agent", "person", "ana", "a new line", after))


async def test_listing_by_forum_sees_only_those_forums(memories: Memories) -> None:
    await memories.remember(about("agent", "ana", "taught in f1"))
    elsewhere = Memory.new(new_id(), "agent", "person", "ana", "taught in f2", taught("ana", "f2"))
    await memories.remember(elsewhere)
    listed = await memories.listed(agent_actor_id="agent", forum_ids=["f2"])
    assert [m.text for m in listed] == ["taught in f2"]


async def test_erasure_lists_the_lines_that_remain(memories: Memories) -> None:
    from yoke.core.models import Actor, Message, TextPart
    from yoke.runtime.joins import create_forum, ensure_participant_id
    from yoke.runtime.memories import person_id_of, remaining_lines

    store = memories.store
    ana = person_id_of("cli:ana")
    await store.save_actor(Actor(id=ana, kind="human", name="Ana", external_id="cli:ana"))
    forum = await create_forum(store, "f")
    await ensure_participant_id(store, forum.id, ana)
    for n in range(2):
        await store.insert_message(
            Message(
                id=new_id(),
                conversation_id=forum.id,
                author_actor_id=ana,
                role="user",
                parts=[TextPart(text=f"line {n}")],
            )
        )
    remaining = await remaining_lines(store, ana)
    assert [(r.forum_id, r.lines) for r in remaining] == [(forum.id, 2)]
    assert await remaining_lines(store, ana, forum_ids=["another"]) == []

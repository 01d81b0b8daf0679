"""Two tenants of one agent, fuzzed: whatever ids their people send and whatever they ask, a
recall, a listing or an erasure of one never reaches a memory of the other.

Each tenant speaks through a bridge and a token (``amqp:bridge-a:`` and ``http:nsA:`` against
``amqp:bridge-b:`` and ``http:nsB:``); all their people send the same adversarial external ids
(query syntax, regex, prefixes of each other, look-alikes, case variants, and the other
tenant's namespaced ids and actor ids), each in its namespace, as the door stores them. Every
memory is recorded here as it is written, so each result is checked against the exact set it
may come from, and each erasure's count against the exact number it must remove.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Awaitable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

import pytest
from pydantic import ValidationError

from yoke.core.ids import derive_id
from yoke.core.models import CommandAuthor
from yoke.runtime.join_config import MemoryScope
from yoke.runtime.memories import (
    Memories,
    Memory,
    MemorySource,
    person_id_of,
    scope_key,
)
from yoke.store.database import Store

AGENT = "agent-serving-both"
MEMORIES_PER_TENANT = 1000
REMEMBERED_PER_TENANT = 150  # through Memories.remember (its checks), the rest in bulk
FORUMS_PER_TENANT = 6
# People whose recall is asked (each five times), chosen by the seeded generator: every
# person's takes too long on a loaded FerretDB (each recall reads three scopes).
RECALLED_PEOPLE = 25
# Store calls in flight at once (remembers, recalls): its latency, not its CPU, is the cost.
CONCURRENCY = 8
# The other tenant's ids a tenant's people also send as their own.
BORROWED_IDS = 10

# What people send as their id: query syntax, regex, operators, escapes, prefixes of each
# other, look-alikes (a Cyrillic a, full-width letters), case variants; U+0000 and a lone surrogate,
# which the door's check refuses, so they never name a person at all.
HOSTILE_IDS = (
    *("ana", "Ana", "ANA", "\u0430na", "\uff41\uff4e\uff41", "an", "ana ", " ana"),
    *("foo", "foobar", "fo", "foo.", "foo*", "foo.*", "foo%", "foo_"),
    *("%", "%%", "_", "__", ".*", "^.*$", ".", "*", "$", "$ne", "$gt", "$where", "$regex"),
    *("{", "}", "{}", '{"$ne": null}', '{"$regex": ".*"}', "[", "]", "(", "|"),
    *("\\", "\\\\", "a\\.b", "a.b", "\\x00", "\\u0000", "'", '"', "';--", "null", "0"),
    *("a\x00b", "\x00", "\ud800"),
)
UNSTORABLE = {"a\x00b", "\x00", "\ud800"}
SYNTAX_QUERIES = (
    "%",
    "_",
    ".*",
    "^.*$",
    "$ne",
    '{"$ne": null}',
    "$where: function() { return true }",
    "\\",
    "ana foo foobar",
    "\u0430na \uff41\uff4e\uff41 ANA",
    "%ana% foo_ .* $regex",
)
WORDS = (
    *("peanut", "allergy", "tea", "coffee", "invoice", "order", "berlin", "lisbon", "cat"),
    *("dog", "birthday", "march", "vegan", "meeting", "monday", "password", "plan", "blue"),
    *("ana", "foo", "foobar", "\u0430na", "\uff46\uff4f\uff4f", "$ne", ".*", "%", "_", "{"),
)


@dataclass
class Tenant:
    """One tenant's people, forums and the memories written for it (id -> memory)."""

    name: str
    namespaces: tuple[str, ...]
    people: dict[str, str] = field(default_factory=dict)  # actor id -> external id
    forums: list[str] = field(default_factory=list)
    memories: dict[str, Memory] = field(default_factory=dict)

    def keys_of(self, person_id: str) -> list[str]:
        """A person's scopes as a step in the tenant's forums reads them."""
        return [
            scope_key(AGENT, "person", person_id),
            *(scope_key(AGENT, "forum", forum) for forum in self.forums[:2]),
        ]

    def in_keys(self, keys: list[str]) -> set[str]:
        return {m.id for m in self.memories.values() if m.scope_key in keys}


def people(namespaces: tuple[str, ...], others: list[str]) -> dict[str, str]:
    """The people of the namespaces: each hostile id (and each of ``others``, the other tenant's
    external and actor ids sent as a bare value) as the door names it; those its check refuses
    name nobody."""
    found: dict[str, str] = {}
    for namespace, raw in ((n, raw) for n in namespaces for raw in (*HOSTILE_IDS, *others)):
        external = namespace + raw
        try:
            CommandAuthor(external_id=external, display_name="someone")
        except ValidationError:
            assert raw in UNSTORABLE, f"{raw!r} refused"
            continue
        assert raw not in UNSTORABLE, f"{raw!r} became a person"
        found[person_id_of(external)] = external
    return found


def forum_ids(tenant: str) -> list[str]:
    """Forum ids alike across tenants, as a careless query would confuse them."""
    shapes = ("f", "f.*", "f%", "F", "f_", "\uff46")
    return [f"{shape}{'' if tenant == 'a' else '-'}" for shape in shapes][:FORUMS_PER_TENANT]


def text(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 10)))


def memories_of(tenant: Tenant, rng: random.Random, now: datetime) -> list[Memory]:
    """Memories about the tenant's people (some taught by another of them), about its forums
    (taught by one of them, or added by an operator: taught by nobody)."""
    people_ids = sorted(tenant.people)
    made = []
    for index in range(MEMORIES_PER_TENANT):
        teacher = rng.choice(people_ids)
        roll = rng.random()
        forum = rng.choice(tenant.forums)
        scope: MemoryScope = "person" if roll < 0.7 else "forum"
        subject = (rng.choice(people_ids) if roll < 0.15 else teacher) if roll < 0.7 else forum
        curated = roll > 0.9
        source = MemorySource(
            forum_id=forum,
            message_id=derive_id("line", tenant.name, str(index)),
            author_actor_id=None if curated else teacher,
            author_name=None if curated else "someone",
            at=now - timedelta(minutes=10),
            added_by="cli:operator" if curated else None,
        )
        memory_id = derive_id("memory", tenant.name, str(index))
        made.append(
            Memory.new(
                memory_id,
                AGENT,
                scope,
                subject,
                text(rng),
                source,
                created_at=now - timedelta(seconds=rng.randint(0, 86_400)),
            )
        )
    return made


async def at_once(calls: Iterable[Awaitable[None]]) -> None:
    """A few at a time: the store's connections work in parallel, its latency is the cost."""
    gate = asyncio.Semaphore(CONCURRENCY)

    async def one(call: Awaitable[None]) -> None:
        async with gate:
            await call

    await asyncio.gather(*(one(call) for call in calls))


@pytest.fixture
async def memories(mongodb_url: str) -> AsyncIterator[Memories]:
    store = Store(mongodb_url)
    await store.ensure_indexes()
    try:
        yield Memories(store)
    finally:
        await store.close()


async def fill(memories: Memories, tenants: list[tuple[Tenant, list[Memory]]]) -> None:
    """Some of each tenant's through ``remember``, first (each counts its agent's memories: a
    slow read once thousands are there), then the rest in bulk."""

    async def remember(memory: Memory) -> None:
        stored, created = await memories.remember(memory)
        assert created and stored.id == memory.id

    for tenant, written in tenants:
        await at_once(remember(memory) for memory in written[:REMEMBERED_PER_TENANT])
        tenant.memories.update((memory.id, memory) for memory in written)
    for _, written in tenants:
        rest = [memory.to_document() for memory in written[REMEMBERED_PER_TENANT:]]
        await memories.collection.insert_many(rest)


async def check_recall(
    memories: Memories, tenant: Tenant, other: Tenant, rng: random.Random, people: int
) -> int:
    """``people`` persons' recall, asked the other tenant's texts, syntax and their own id and
    texts: only memories of their own scopes; their own text finds its memory. How many were
    found."""
    found: list[int] = []
    other_texts = [memory.text for memory in other.memories.values()]

    async def ask(keys: list[str], query: str, expected: str | None) -> None:
        allowed = tenant.in_keys(keys)
        ids = {r.memory.id for r in await memories.recall(keys, query, 20)}
        assert ids <= allowed, (tenant.name, query, ids - allowed)
        assert not ids & set(other.memories), (tenant.name, query)
        assert expected is None or expected in ids, (query, ids)
        found.append(len(ids))

    asked = []
    for person_id in rng.sample(sorted(tenant.people), people):
        keys = tenant.keys_of(person_id)
        queries = [*rng.sample(other_texts, 2), rng.choice(SYNTAX_QUERIES)]
        queries.append(tenant.people[person_id].split(":", 2)[2] or "ana")
        asked += [ask(keys, query, None) for query in queries]
        own = [m for m in tenant.memories.values() if m.scope_key == keys[0]]
        if own:
            mine = rng.choice(own)
            asked.append(ask(keys, mine.text, mine.id))
    await at_once(asked)
    return sum(found)


async def check_listing(memories: Memories, tenant: Tenant, other: Tenant) -> None:
    """Listed by person and by forum, in the tenant's forums' view: exactly its own."""
    for person_id in tenant.people:
        listed = await memories.listed(agent_actor_id=AGENT, scope="person", subject=person_id)
        key = scope_key(AGENT, "person", person_id)
        expected = {m.id for m in tenant.memories.values() if m.scope_key == key}
        assert {m.id for m in listed} == expected, tenant.people[person_id]
        seen_by_other = await memories.listed(
            agent_actor_id=AGENT, scope="person", subject=person_id, forum_ids=other.forums
        )
        assert seen_by_other == []
    for forum in tenant.forums:
        key = scope_key(AGENT, "forum", forum)
        expected = {m.id for m in tenant.memories.values() if m.scope_key == key}
        listed = await memories.listed(
            agent_actor_id=AGENT, scope="forum", subject=forum, forum_ids=tenant.forums
        )
        assert {m.id for m in listed} == expected, forum
        assert (
            await memories.listed(
                agent_actor_id=AGENT, scope="forum", subject=forum, forum_ids=other.forums
            )
            == []
        )
    every = await memories.listed(agent_actor_id=AGENT, forum_ids=tenant.forums)
    assert len(every) == MEMORIES_PER_TENANT
    assert {m.id for m in every} == set(tenant.memories)


async def check_erasure(
    memories: Memories, tenant: Tenant, other: Tenant, rng: random.Random
) -> None:
    """Erasing each of the tenant's people removes exactly what is about them or what they
    taught, and nothing of the other tenant's, whose people share their ids."""
    remaining = dict(tenant.memories)
    order = sorted(tenant.people)
    rng.shuffle(order)
    for person_id in order:
        gone = {
            m.id for m in remaining.values() if m.person_id == person_id or m.taught_by == person_id
        }
        assert await memories.erase_person(person_id) == len(gone), tenant.people[person_id]
        for memory_id in gone:
            del remaining[memory_id]
    kept = await memories.collection.find({}, {"_id": 1}).to_list()
    kept_ids = {document["_id"] for document in kept}
    assert kept_ids == set(remaining) | set(other.memories)
    assert all(m.taught_by is None and m.person_id is None for m in remaining.values())
    assert len(remaining) < MEMORIES_PER_TENANT * 0.2  # the curated forum memories alone


async def test_no_recall_listing_or_erasure_crosses_tenants(memories: Memories) -> None:
    rng = random.Random("memory isolation")
    now = datetime.now(UTC)
    a = Tenant("a", ("amqp:bridge-a:", "http:nsA:"), forums=forum_ids("a"))
    b = Tenant("b", ("amqp:bridge-b:", "http:nsB:"), forums=forum_ids("b"))
    a.people = people(a.namespaces, [])
    # Some of the other tenant's external ids and actor ids, sent as bare values.
    borrowed = [*rng.sample(sorted(a.people.values()), BORROWED_IDS), *sorted(a.people)[:5]]
    b.people = people(b.namespaces, borrowed)
    assert not set(a.people) & set(b.people)
    assert len(a.people) == 2 * (len(HOSTILE_IDS) - len(UNSTORABLE))
    # Look-alikes and case variants are people of their own (exact equality, never folded).
    assert person_id_of("amqp:bridge-a:ana") != person_id_of("amqp:bridge-a:\u0430na")
    assert person_id_of("amqp:bridge-a:ana") != person_id_of("amqp:bridge-a:Ana")
    await fill(memories, [(tenant, memories_of(tenant, rng, now)) for tenant in (a, b)])
    assert await memories.collection.count_documents({}) == 2 * MEMORIES_PER_TENANT

    found = await check_recall(memories, a, b, rng, RECALLED_PEOPLE)
    found += await check_recall(memories, b, a, rng, RECALLED_PEOPLE)
    assert found > 100  # the queries found memories: the isolation was tested, not vacuous
    await check_listing(memories, a, b)
    await check_listing(memories, b, a)
    await check_erasure(memories, a, b, rng)
    # Once tenant a's people are erased, tenant b's recall and listing are whole.
    await check_recall(memories, b, a, rng, RECALLED_PEOPLE // 5)
    await check_listing(memories, b, a)

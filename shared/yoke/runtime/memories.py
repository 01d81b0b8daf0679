"""Memories (docs/memory.md): what an agent remembers about a person, a forum, or for all its
forums, each naming the forum line that taught it and the step that wrote it.

Isolation is structural: every read is an exact equality on a derived key. A person is the
actor id the door derived from their namespaced external id (``amqp:<user>:``, ``http:<ns>:``,
``cli:``), so two namespaces never share one whatever ids they send, and a scope's key is
derived from the agent, the scope and that id: no caller's string is ever a pattern, a prefix
or an operator. FerretDB pushes only top-level equality down, so a recall reads one scope's
candidates and nothing of the rest of the store.

A memory a step writes takes its id from the step's tool call (a retried step writes nothing
twice). An erasure leaves a tombstone (one small document per erased person, kept for good),
so a step that was still working on a line the person wrote before the erasure, however late
it runs, cannot bring back what that line taught.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import UTC, datetime
from typing import Any

from pydantic import Field

from yoke.core.ages import BUCKET_FIELD, day_bucket
from yoke.core.ids import derive_id
from yoke.core.models import WireModel, utcnow
from yoke.runtime.join_config import MemoryScope
from yoke.runtime.recall import MAX_QUERY_TERMS, Candidate, rank, terms
from yoke.store.database import Store

MEMORIES = "memories"
MEMORY_ERASURES = "memory_erasures"

# Bounds (docs/memory.md).
MAX_MEMORY_CHARS = 1000
MAX_QUERY_CHARS = 500
MAX_PER_SCOPE = 10_000
MAX_PER_AGENT = 100_000
MAX_DIMENSIONS = 4096
# The most memories one recall ranks per scope (those sharing a term with the query), and the
# most a listing or an erasure reads at once.
MAX_CANDIDATES = 500
MAX_LISTED = 1000
MAX_RECALL_LIMIT = 20

# The built-in tools (offered when the join's ``memory.tools`` is on).
REMEMBER_TOOL = "remember"
RECALL_TOOL = "recall"
FORGET_TOOL = "forget"
MEMORY_TOOLS = (REMEMBER_TOOL, RECALL_TOOL, FORGET_TOOL)


def person_id_of(external_id: str) -> str:
    """The actor id of the person the door names ``external_id`` (namespaced as it stores it:
    ``cli:ana``, ``amqp:<user>:<id>``, ``http:<ns>:<id>``)."""
    return derive_id("human", external_id)


def scope_key(agent_actor_id: str, scope: MemoryScope, subject: str) -> str:
    """The one key a scope's memories are found by: the agent's, about ``subject`` (a person's
    actor id, a forum's id, or "" for the agent's own)."""
    return derive_id("memory-scope", agent_actor_id, scope, subject)


def memory_id_of_call(tool_effect_id: str) -> str:
    """The memory a ``remember`` call writes (its step's effect id of the call)."""
    return derive_id("memory", tool_effect_id)


class MemorySource(WireModel):
    """The forum line that taught a memory (or, for one an operator added, who added it)."""

    forum_id: str | None = None
    message_id: str | None = None
    author_actor_id: str | None = None
    author_name: str | None = None
    at: datetime
    added_by: str | None = None  # the CLI's or a token's person, for a curated memory


class MemoryStep(WireModel):
    """The step whose tool call wrote a memory."""

    join_key: str
    monologue_id: str
    line_id: str
    call_id: str


class Memory(WireModel):
    id: str = Field(alias="_id")
    agent_actor_id: str
    scope: MemoryScope
    subject: str = ""
    scope_key: str
    person_id: str | None = None
    text: str = Field(max_length=MAX_MEMORY_CHARS)
    terms: list[str] = Field(default_factory=list)
    vector: list[float] | None = None
    embedding_model: str | None = None
    source: MemorySource
    step: MemoryStep | None = None
    # Who taught it (the source line's author): erasing a person erases what they taught too.
    taught_by: str | None = None
    created_at: datetime = Field(default_factory=utcnow)

    @classmethod
    def new(
        cls,
        memory_id: str,
        agent_actor_id: str,
        scope: MemoryScope,
        subject: str,
        text: str,
        source: MemorySource,
        **fields: Any,
    ) -> Memory:
        """A memory with its key and terms made from what it is."""
        return cls.model_validate(
            {
                "_id": memory_id,
                "agentActorId": agent_actor_id,
                "scope": scope,
                "subject": subject,
                "scopeKey": scope_key(agent_actor_id, scope, subject),
                "personId": subject if scope == "person" else None,
                "text": text,
                "terms": terms(text),
                "source": source,
                "taughtBy": source.author_actor_id,
                **fields,
            }
        )

    def to_document(self) -> dict[str, Any]:
        document = self.model_dump(mode="python", by_alias=True, exclude_none=True)
        document[BUCKET_FIELD] = day_bucket(self.created_at)
        return document


class Recalled(WireModel):
    """A memory recall found, with its score (what the model and the prompt are shown)."""

    memory: Memory
    score: float


class MemoryRefused(Exception):
    """A memory that may not be written (the message says why: a bound, an erasure)."""


class Memories:
    """The ``memories`` collection and the erasure tombstones."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.collection = store.db[MEMORIES]
        self.erasures = store.db[MEMORY_ERASURES]

    async def ensure_indexes(self) -> None:
        """Every service's start makes them (``Store.ensure_indexes``); here for a process that
        uses memories without starting a service (the CLI's tests)."""
        await self.store.ensure_indexes()

    async def remember(self, memory: Memory) -> tuple[Memory, bool]:
        """Store ``memory`` within the bounds: the stored one, and whether this call stored
        it (False: a retried step's, already there). Raises :class:`MemoryRefused`."""
        found = await self.get(memory.id)
        if found is not None:
            return found, False
        if memory.taught_by is not None:
            erased = await self.erasures.find_one({"_id": memory.taught_by})
            if erased is not None and _utc(memory.source.at) <= _utc(erased["at"]):
                raise MemoryRefused("the person who said it asked for their memories to be erased")
        if memory.vector is not None and len(memory.vector) > MAX_DIMENSIONS:
            raise MemoryRefused(f"a vector has at most {MAX_DIMENSIONS} dimensions")
        held = await self.collection.count_documents(
            {"scopeKey": memory.scope_key}, limit=MAX_PER_SCOPE
        )
        if held >= MAX_PER_SCOPE:
            raise MemoryRefused(
                f"this {memory.scope} memory is full ({MAX_PER_SCOPE} memories); forget some first"
            )
        held = await self.collection.count_documents(
            {"agentActorId": memory.agent_actor_id}, limit=MAX_PER_AGENT
        )
        if held >= MAX_PER_AGENT:
            raise MemoryRefused(f"this agent's memory is full ({MAX_PER_AGENT} memories)")
        if await self.store.insert_if_absent(self.collection, memory.to_document()):
            return memory, True
        stored = await self.get(memory.id)
        return (stored if stored is not None else memory), False

    async def get(self, memory_id: str) -> Memory | None:
        document = await self.collection.find_one({"_id": memory_id})
        return Memory.model_validate(document) if document else None

    async def recall(
        self,
        keys: Iterable[str],
        query: str,
        limit: int,
        query_vector: list[float] | None = None,
    ) -> list[Recalled]:
        """The memories of the scopes ``keys`` most relevant to ``query``, best first."""
        wanted = terms(query, MAX_QUERY_TERMS)
        found: dict[str, Memory] = {}
        for key in dict.fromkeys(keys):
            where: dict[str, Any] = {"scopeKey": key}
            if query_vector is None:
                if not wanted:
                    continue
                where["terms"] = {"$in": wanted}
            documents = await self.collection.find(where).limit(MAX_CANDIDATES).to_list()
            for document in documents:
                memory = Memory.model_validate(document)
                found[memory.id] = memory
        candidates = [
            Candidate(m.id, m.terms, _utc(m.created_at), m.vector) for m in found.values()
        ]
        ranked = rank(wanted, candidates, query_vector)
        return [Recalled(memory=found[c.id], score=score) for c, score in ranked[:limit]]

    async def forget(self, memory_id: str) -> bool:
        result = await self.collection.delete_one({"_id": memory_id})
        return result.deleted_count > 0

    async def listed(
        self,
        *,
        agent_actor_id: str,
        scope: MemoryScope | None = None,
        subject: str | None = None,
        forum_ids: list[str] | None = None,
        limit: int = MAX_LISTED,
    ) -> list[Memory]:
        """An agent's memories, newest first: of one scope and subject, or all; only those
        taught in ``forum_ids`` when given (a token's view)."""
        where: dict[str, Any] = {"agentActorId": agent_actor_id}
        if scope is not None and subject is not None:
            where = {"scopeKey": scope_key(agent_actor_id, scope, subject)}
        if forum_ids is not None:
            where["source.forumId"] = {"$in": forum_ids}
        documents = await self.collection.find(where).limit(MAX_LISTED).to_list()
        memories = sorted(
            (Memory.model_validate(document) for document in documents),
            key=lambda memory: (_utc(memory.created_at), memory.id),
            reverse=True,
        )
        return memories[: max(1, min(limit, MAX_LISTED))]

    async def erase_person(self, person_id: str, at: datetime | None = None) -> int:
        """Every memory about ``person_id`` or taught by them, in every agent: how many went.
        The tombstone first, so a step still writing one of theirs is refused after."""
        moment = at or utcnow()
        await self.erasures.replace_one(
            {"_id": person_id},
            {"_id": person_id, "at": moment, BUCKET_FIELD: day_bucket(moment)},
            upsert=True,
        )
        erased = 0
        for field in ("personId", "taughtBy"):
            result = await self.collection.delete_many({field: person_id})
            erased += result.deleted_count
        return erased

    async def erase_agent(self, agent_actor_id: str) -> int:
        """Every memory of an agent (one that is gone, or starts over): how many went."""
        result = await self.collection.delete_many({"agentActorId": agent_actor_id})
        return result.deleted_count


class RemainingLines(WireModel):
    """A forum where an erased person's own lines remain (erasure lists them, never hides them)."""

    forum_id: str
    lines: int


# The most forums an erasure lists, and the most lines it counts in each.
MAX_REMAINING_FORUMS = 1000
MAX_COUNTED_LINES = 100_000


async def remaining_lines(
    store: Store, person_id: str, forum_ids: list[str] | None = None
) -> list[RemainingLines]:
    """The forums where ``person_id`` wrote lines, with how many (at most
    :data:`MAX_COUNTED_LINES` counted each), only ``forum_ids`` when given (a token's view)."""
    joined = (
        await store.participants.find({"actorId": person_id}, {"conversationId": 1})
        .limit(MAX_REMAINING_FORUMS)
        .to_list()
    )
    found: list[RemainingLines] = []
    for forum_id in sorted({document["conversationId"] for document in joined}):
        if forum_ids is not None and forum_id not in forum_ids:
            continue
        lines = await store.messages.count_documents(
            {"conversationId": forum_id, "authorActorId": person_id}, limit=MAX_COUNTED_LINES
        )
        if lines:
            found.append(RemainingLines(forum_id=forum_id, lines=lines))
    return found


def _utc(moment: datetime) -> datetime:
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)

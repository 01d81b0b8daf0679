"""MongoDB repositories (pymongo's async client), written for FerretDB 1.x as much as MongoDB.

No transactions, change streams or TTL indexes; and since FerretDB's updates are not atomic under
concurrency (docs/architecture.md, invariant 8), anything contended is decided by a unique insert.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from pymongo import ASCENDING, AsyncMongoClient, monitoring
from pymongo.asynchronous.collection import AsyncCollection
from pymongo.asynchronous.database import AsyncDatabase
from pymongo.errors import CollectionInvalid, DuplicateKeyError, OperationFailure

from yoke.core import tls, tracing
from yoke.core.lru import LRUCache
from yoke.core.metrics import IN_DELIVERY, STORE_DOCUMENTS_READ, STORE_OPERATIONS, STORE_ORIGIN
from yoke.core.models import Actor, Conversation, Message, Participant
from yoke.store import _upgrades as upgrades
from yoke.store.outbox import Outbox

Doc = dict[str, Any]
NAMESPACE_EXISTS = 48


# Multi-step procedures' records (docs/architecture.md, invariant 9): compaction's swap
# intents and follow-up's decisions, each under an id derived from what it is about.
PROCEDURES = "procedures"

# What an actor instance's lane writes of its document (a join writes the rest).
RUNTIME_FIELDS = ("watch", "watermark", "state", "failed")

# Messages are also filed by ``seq // BUCKET``: a range of lines is read by equality lookups.
BUCKET = 128
# Up to this many lines a range is read line by line (one indexed lookup each).
FEW_LINES = 3


def seq_bucket(seq: int) -> int:
    """Which of its conversation's buckets of :data:`BUCKET` seqs a line is filed in (not an
    age bucket: those are :mod:`yoke.core.ages`)."""
    return seq // BUCKET


def bucket_key(conversation_id: str, bucket: int) -> str:
    """The one field a bucket is looked up by (``convBucket``).

    One field, not ``(conversationId, bucket)``: a second index led by ``conversationId``
    lets PostgreSQL behind FerretDB answer a ``(conversationId, seq)`` lookup from it, reading
    the whole conversation and filtering on seq, whenever its statistics predate the
    conversation (they usually do: conversations grow between two analyses). With one index
    per lookup there is no such plan to choose.
    """
    return f"{conversation_id}/{bucket}"


async def highest_taken(taken: Callable[[int], Awaitable[bool]], low: int = 0) -> int:
    """The highest ``n`` with ``taken(n)`` in a dense run ``1..n`` (``low`` is known taken, 0:
    none is): galloping, then bisecting, a few lookups rather than a walk (seqs, slots)."""
    step = 1
    high = low + step
    while await taken(high):
        low, step = high, step * 2
        high = low + step
    while high - low > 1:
        middle = (low + high) // 2
        if await taken(middle):
            low = middle
        else:
            high = middle
    return low


def _origin() -> str:
    """What a store operation is for: a delivery, or the background task it runs in."""
    return "delivery" if IN_DELIVERY.get() else STORE_ORIGIN.get()


# Commands of traced work in flight whose span comes when they end: more means ends were missed.
MAX_TRACED_COMMANDS = 10_000


class OperationCounter(monitoring.CommandListener):
    """Counts every command this process sends (``yoke_store_operations``): what a turn costs.
    Inside a trace each is a span too (``find messages``), made when it ends (the listener is
    called on the task that sent it, so the span's parent is that task's)."""

    def __init__(self, service: str) -> None:
        self.service = service
        self._traced: dict[tuple[object, int], tuple[str, dict[str, str]]] = {}

    def started(self, event: monitoring.CommandStartedEvent) -> None:
        STORE_OPERATIONS.labels(self.service, event.command_name, _origin()).inc()
        if tracing.recording():
            if len(self._traced) >= MAX_TRACED_COMMANDS:
                self._traced.clear()
            collection = event.command.get(event.command_name)
            if not isinstance(collection, str):  # getMore names its cursor first
                collection = event.command.get("collection")
            target = collection if isinstance(collection, str) else ""
            self._traced[(event.connection_id, event.request_id)] = (
                f"{event.command_name} {target}".strip(),
                {
                    "db.system.name": "mongodb",
                    "db.namespace": event.database_name,
                    "db.operation.name": event.command_name,
                    "db.collection.name": target,
                },
            )

    def _span(
        self,
        event: monitoring.CommandSucceededEvent | monitoring.CommandFailedEvent,
        error: str | None = None,
    ) -> None:
        traced = self._traced.pop((event.connection_id, event.request_id), None)
        if traced is not None:
            name, attributes = traced
            tracing.finished_span(name, event.duration_micros / 1e6, attributes, error=error)

    def succeeded(self, event: monitoring.CommandSucceededEvent) -> None:
        if self._traced:
            self._span(event)
        # What a read returned (``yoke_store_documents_read``): a window read whole shows here.
        cursor = event.reply.get("cursor")
        if isinstance(cursor, dict):
            batch = cursor.get("firstBatch", cursor.get("nextBatch"))
            if batch:
                STORE_DOCUMENTS_READ.labels(self.service, event.command_name, _origin()).inc(
                    len(batch)
                )

    def failed(self, event: monitoring.CommandFailedEvent) -> None:
        if self._traced:
            self._span(event, str(event.failure.get("errmsg", "failed")))


ID_KEY, SEQ_KEY = "_id", "seq"


def duplicate_key(error: DuplicateKeyError) -> str | None:
    """Which unique key a message insert hit: :data:`ID_KEY`, :data:`SEQ_KEY`, or ``None``
    when the server does not say.

    MongoDB names it (``keyPattern``, and the index in ``errmsg``); FerretDB 1.24 answers only
    ``E11000 duplicate key error collection: <db>.<collection>``, so there the caller must
    look the id up to know.
    """
    details = error.details or {}
    pattern = details.get("keyPattern")
    if isinstance(pattern, Mapping) and pattern:
        return SEQ_KEY if SEQ_KEY in pattern else ID_KEY if ID_KEY in pattern else None
    message = str(details.get("errmsg", ""))
    if "index: conv_seq" in message:
        return SEQ_KEY
    if "index: _id_" in message:
        return ID_KEY
    return None


class SeqConflict(Exception):
    """Another writer took the seq this insert tried; read the newest and try again."""


class Store:
    """One MongoDB database: actors, conversations, participants, messages and actor state."""

    COLLECTIONS = (
        "actors",
        "conversations",
        "participants",
        "messages",
        "actor_states",
        "egress_joins",
        PROCEDURES,
        "failures",
        "join_configs",
        "guardian",
        "writers",
        "followups",
        "replicas",
        # The tools' (yoke.tools.catalog, yoke.runtime.calls): a call is the first
        # write to two of them, under load.
        "tool_catalog",
        "mcp_servers",
        "tool_calls",
        "tool_call_ends",
        # Approvals (yoke.runtime.calls.approvals, .approvers): the first decision on a
        # gated call, and the publishers that may decide.
        "tool_call_decisions",
        "approvers",
        # People take over (yoke.runtime.holds, yoke.runtime.escalations): a forum's hold, an
        # agent's request for a person and the one decision on it; the first write of each
        # comes under load.
        "forum_holds",
        "escalations",
        "escalation_decisions",
        # Memory (yoke.runtime.memories): an agent's memories and the erasures' tombstones.
        "memories",
        "memory_erasures",
    )

    def __init__(self, url: str, *, app_name: str = "yoke", pool_size: int = 16) -> None:
        self.client: AsyncMongoClient[Doc] = AsyncMongoClient(
            url,
            tz_aware=True,
            appname=app_name,
            maxPoolSize=pool_size,
            serverSelectionTimeoutMS=10_000,
            event_listeners=[OperationCounter(app_name)],
            **tls.mongodb_options(),
        )
        self.db: AsyncDatabase[Doc] = self.client.get_default_database(default="yoke")
        self.actors: AsyncCollection[Doc] = self.db["actors"]
        self.conversations: AsyncCollection[Doc] = self.db["conversations"]
        self.participants: AsyncCollection[Doc] = self.db["participants"]
        self.messages: AsyncCollection[Doc] = self.db["messages"]
        self.states: AsyncCollection[Doc] = self.db["actor_states"]
        self.failures: AsyncCollection[Doc] = self.db["failures"]
        # Highest seq this process knows to exist per conversation: saves a query per post.
        self._last_seq: LRUCache[str, int] = LRUCache()
        # This process as a writer: what it stored whose event is not confirmed yet.
        self.outbox = Outbox(app_name)
        # Documents that never change once written: read (or written) once per process.
        self._actors: LRUCache[str, Actor] = LRUCache()
        self._conversations: LRUCache[str, Conversation] = LRUCache()
        self._participants_made: LRUCache[str, bool] = LRUCache()
        # Small per-process memos of things read by id (their owners say when they go stale).
        self.memo: LRUCache[str, object] = LRUCache()

    async def create_collections(self, *names: str) -> None:
        """Create those of ``names`` that do not exist yet; call it before any traffic.

        FerretDB 1.x takes a global metadata lock to create a collection, and creating one
        lazily (by a first write) under concurrent load can hang the server. Modules with
        collections of their own (tokens, webhooks, the guardian's, follow-up's) call this too.
        """
        existing = set(await self.db.list_collection_names())
        for name in names:
            if name in existing:
                continue
            try:
                await self.db.create_collection(name)
            except (CollectionInvalid, OperationFailure) as error:
                # Another process created it first (FerretDB answers NamespaceExists).
                if isinstance(error, OperationFailure) and error.code != NAMESPACE_EXISTS:
                    raise

    async def ensure_indexes(self) -> None:
        """Create the core collections and their indexes; idempotent, every service runs it
        at start-up."""
        await self.create_collections(*self.COLLECTIONS)
        await self.messages.create_index(
            [("conversationId", ASCENDING), ("seq", ASCENDING)], unique=True, name="conv_seq"
        )
        await self.messages.create_index([("outbox", ASCENDING)], name="outbox")
        await self.messages.create_index([("convBucket", ASCENDING)], name="conv_bucket_key")
        await upgrades.drop_conversation_bucket_index(self.messages)
        await self.participants.create_index(
            [("conversationId", ASCENDING), ("actorId", ASCENDING)], unique=True, name="conv_actor"
        )
        await self.participants.create_index([("actorId", ASCENDING)], name="actor")
        await self.actors.create_index([("externalId", ASCENDING)], name="external_id")
        await self.conversations.create_index([("keptFor", ASCENDING)], name="kept_for")
        await self.states.create_index([("actor", ASCENDING), ("watch", ASCENDING)], name="watch")
        await self.failures.create_index([("stateId", ASCENDING)], name="state")
        # A forum's pending approvals (GET /v1/forums/{id}/approvals, yoke approvals, a stop).
        await self.db["tool_calls"].create_index([("forumId", ASCENDING)], name="forum")
        # The reaper's key (yoke.runtime.calls.reaper: a round reads the bucket due now).
        await self.db["tool_calls"].create_index([("dueBucket", ASCENDING)], name="due")
        # Escalations (yoke.runtime.escalations): inboxes and the deadline sweep read by state
        # (equality: FerretDB pushes no range or sort down); the bounds count by forum and agent.
        for field, name in (("state", "state"), ("forumId", "forum"), ("agentActorId", "agent")):
            await self.db["escalations"].create_index([(field, ASCENDING)], name=name)
        # Memories (yoke.runtime.memories): a recall reads one scope (scopeKey, the only key
        # FerretDB pushes down; terms after it serve MongoDB); erasures by person and teacher.
        memories = self.db["memories"]
        await memories.create_index(
            [("scopeKey", ASCENDING), ("terms", ASCENDING)], name="scope_terms"
        )
        for field, name in (
            ("agentActorId", "agent"),
            ("personId", "person"),
            ("taughtBy", "taught_by"),
        ):
            await memories.create_index([(field, ASCENDING)], name=name)

    async def ping(self) -> None:
        await self.db.command("ping")

    async def close(self) -> None:
        await self.outbox.close(self.db["writers"])
        await self.client.close()

    # --- generic documents -------------------------------------------------------------

    async def insert_if_absent(self, collection: AsyncCollection[Doc], document: Doc) -> bool:
        """Insert; ``False`` if a document with that ``_id`` (or unique key) already exists."""
        try:
            await collection.insert_one(document)
        except DuplicateKeyError:
            return False
        return True

    # --- actors, conversations, participants -------------------------------------------

    async def save_actor(self, actor: Actor) -> Actor:
        """Create the actor, or return the one already stored under its id."""
        if (known := self._actors.get(actor.id)) is not None:
            return known
        if await self.insert_if_absent(self.actors, actor.to_document()):
            self._actors[actor.id] = actor
            return actor
        found = await self.get_actor(actor.id)
        assert found is not None
        return found

    async def get_actor(self, actor_id: str) -> Actor | None:
        """An actor; they never change once written, so each is read once per process."""
        if (known := self._actors.get(actor_id)) is not None:
            return known
        document = await self.actors.find_one({"_id": actor_id})
        if document is None:
            return None
        actor = self._actors[actor_id] = Actor.from_document(document)
        return actor

    async def save_conversation(self, conversation: Conversation) -> Conversation:
        if await self.insert_if_absent(self.conversations, conversation.to_document()):
            return conversation
        found = await self.get_conversation(conversation.id)
        assert found is not None
        return found

    async def conversation_kind(self, conversation_id: str) -> str:
        """``forum`` or ``monologue`` (``unknown`` if absent); kinds never change: cached."""
        conversation = await self.get_conversation(conversation_id)
        return conversation.kind if conversation is not None else "unknown"

    async def mark_kept(self, conversation_id: str, namespace: str) -> None:
        """Say whose kept forum a forum made before forums said so is (the one change a
        conversation sees: the process's copy is read again)."""
        await self.conversations.update_one(
            {"_id": conversation_id}, {"$set": {"keptFor": namespace}}
        )
        self._conversations.pop(conversation_id, None)

    async def get_conversation(self, conversation_id: str) -> Conversation | None:
        """A conversation; never changed once written, so each is read once per process."""
        if (known := self._conversations.get(conversation_id)) is not None:
            return known
        document = await self.conversations.find_one({"_id": conversation_id})
        if document is None:
            return None
        conversation = self._conversations[conversation_id] = Conversation.from_document(document)
        return conversation

    async def save_participant(self, participant: Participant) -> Participant:
        if await self.insert_if_absent(self.participants, participant.to_document()):
            return participant
        document = await self.participants.find_one(
            {"conversationId": participant.conversation_id, "actorId": participant.actor_id}
        )
        assert document is not None
        return Participant.from_document(document)

    async def save_participant_once(self, participant: Participant) -> str:
        """Make sure the participant exists; its id, written once per process.

        For callers that need only the (derived) id: the participant's metadata may have moved
        on since, so what :meth:`save_participant` returns is not cached.
        """
        if participant.id not in self._participants_made:
            stored = await self.save_participant(participant)
            self._participants_made[stored.id] = True
            return stored.id
        return participant.id

    async def get_participant(self, participant_id: str) -> Participant | None:
        document = await self.participants.find_one({"_id": participant_id})
        return Participant.from_document(document) if document else None

    async def set_participant_metadata(
        self, participant_id: str, metadata: Mapping[str, Any]
    ) -> None:
        """Set metadata keys; the participant's join owns it (one writer)."""
        fields = {f"metadata.{key}": value for key, value in metadata.items()}
        await self.participants.update_one({"_id": participant_id}, {"$set": fields})

    # --- messages ----------------------------------------------------------------------

    async def get_message(self, message_id: str) -> Message | None:
        document = await self.messages.find_one({"_id": message_id})
        return Message.from_document(document) if document else None

    async def last_seq(self, conversation_id: str) -> int:
        """The highest seq stored in the conversation (0 when empty), never by a scan.

        Seqs are dense (each is taken by a unique insert, in order), so the head is found by
        galloping and then bisecting over ``(conversationId, seq)`` equality lookups, from the
        highest seq this process knows: a few indexed reads, not a sorted read of the whole
        conversation (which FerretDB 1.x would answer by reading every line).
        """
        known = self._last_seq.get(conversation_id) or 0
        low = await highest_taken(lambda seq: self._seq_taken(conversation_id, seq), known)
        self.observe_seq(conversation_id, low)
        return low

    async def _seq_taken(self, conversation_id: str, seq: int) -> bool:
        found = await self.messages.find_one(
            {"conversationId": conversation_id, "seq": seq}, {"_id": 1}
        )
        return found is not None

    def observe_seq(self, conversation_id: str, seq: int) -> None:
        """Remember that ``seq`` exists in the conversation (from an event or our own write)."""
        if seq > (self._last_seq.get(conversation_id) or 0):
            self._last_seq[conversation_id] = seq

    async def insert_message(self, message: Message) -> tuple[Message, bool]:
        """Store ``message`` under the next free seq of its conversation.

        Returns the stored message and whether this call wrote it (``False``: a message with
        this id already existed, as when a redelivered event repeats an effect). The seq is
        owned by whoever inserts it first under the unique ``(conversationId, seq)`` index; a
        lost race costs one more insert at the next seq (updates are not atomic on FerretDB),
        and from the second on, where the server does not say which key was taken (FerretDB),
        a lookup of the id.
        """
        if not self.outbox.registered:
            await self.outbox.register(self.db["writers"])
        # Pending before the insert, so a heartbeat during a slow one covers it (invariant 2).
        began = self.outbox.writing(message.id)
        try:
            stored, created = await self._insert_next(message)
        except BaseException:
            self.outbox.not_written(message.id, began)
            raise
        if created:
            self.outbox.written(stored)
        else:
            self.outbox.not_written(message.id, began)
        return stored, created

    async def _insert_next(self, message: Message) -> tuple[Message, bool]:
        conversation_id = message.conversation_id
        known = self._last_seq.get(conversation_id)
        candidate = (known if known is not None else await self.last_seq(conversation_id)) + 1
        for conflicts in range(1, 10_001):
            stored = message.model_copy(update={"seq": candidate})
            document = stored.to_document()
            document["convBucket"] = bucket_key(conversation_id, seq_bucket(candidate))
            self.outbox.stamp(document, stored)
            try:
                await self.messages.insert_one(document)
            except DuplicateKeyError as error:
                # The id (a repeated effect: the line is written) or the seq (another line took
                # it): told apart on every try but the first, or a taken id would be read as
                # seqs taken one after another and the head cache run ahead of the store (a
                # hole). The first is not looked into where the server does not say (FerretDB):
                # the next seq is tried, and nothing is learnt of the head from it, so the
                # common conflict (a head one line stale) costs no lookup.
                key = duplicate_key(error)
                if key == ID_KEY or (key is None and conflicts > 1):
                    existing = await self.get_message(message.id)
                    if existing is not None:
                        return existing, False
                if conflicts < 3:
                    candidate += 1
                else:  # far behind: find the head rather than walk to it
                    self.observe_seq(conversation_id, candidate)
                    candidate = await self.last_seq(conversation_id) + 1
                continue
            self.observe_seq(conversation_id, candidate)
            return stored, True
        raise SeqConflict(f"could not allocate a seq in conversation {conversation_id}")

    async def message_at(self, conversation_id: str, seq: int) -> Message | None:
        document = await self.messages.find_one({"conversationId": conversation_id, "seq": seq})
        return Message.from_document(document) if document else None

    async def history(
        self, conversation_id: str, *, after_seq: int = 0, up_to_seq: int | None = None
    ) -> list[Message]:
        """Messages of a conversation in seq order, ``after_seq < seq <= up_to_seq``.

        A bounded range reads only what it returns and little more: a few lines by seq, more
        by their buckets of :data:`BUCKET` seqs (equality lookups). Without ``up_to_seq`` it
        reads the whole conversation: for tools and tests, never on the path of a turn.
        """
        if up_to_seq is None:
            query: Doc = {"conversationId": conversation_id}
            if after_seq:
                query["seq"] = {"$gt": after_seq}
            found = await self.messages.find(query).to_list()
            return sorted((Message.from_document(d) for d in found), key=lambda m: m.seq)
        if up_to_seq <= after_seq:
            return []
        if up_to_seq - after_seq <= FEW_LINES:
            lines = [
                await self.message_at(conversation_id, seq)
                for seq in range(after_seq + 1, up_to_seq + 1)
            ]
            return [line for line in lines if line is not None]
        found = []
        for bucket in range(seq_bucket(after_seq + 1), seq_bucket(up_to_seq) + 1):
            documents = await self.messages.find(
                {"convBucket": bucket_key(conversation_id, bucket)}
            ).to_list()
            found.extend(d for d in documents if after_seq < d["seq"] <= up_to_seq)
        if len(found) < up_to_seq - after_seq:
            found = await upgrades.lines_before_buckets(
                self.messages, conversation_id, after_seq, up_to_seq
            )
        return sorted((Message.from_document(d) for d in found), key=lambda m: m.seq)

    async def states_watching(self, actor: str, conversation_id: str) -> list[Doc]:
        """State documents of ``actor``'s instances that follow ``conversation_id``."""
        return await self.states.find({"actor": actor, "watch": conversation_id}).to_list()

    # --- actor state -------------------------------------------------------------------

    async def load_state(self, state_id: str) -> Doc | None:
        return await self.states.find_one({"_id": state_id})

    async def save_state(self, state_id: str, document: Doc) -> bool:
        """Save what the instance's lane owns of its document (:data:`RUNTIME_FIELDS`): one
        writer, and the join's fields (``configVersion``) are left as the join wrote them.

        Never an upsert: a join that was left (its state deleted) stays left, whatever a step
        that was still running saves afterwards; False says it is gone.
        """
        saved = await self.states.update_one(
            {"_id": state_id}, {"$set": {k: document[k] for k in RUNTIME_FIELDS if k in document}}
        )
        return saved.matched_count > 0

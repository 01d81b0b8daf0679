"""The actor runtime: a processor actor is a config, a state, a filter and a handler.

An actor declares a pydantic config schema, a pydantic state schema (persisted in MongoDB), a
trigger filter and an async handler. Each *instance* (say, one per forum join) watches one
conversation and walks its messages in ``seq`` order behind a watermark:

- an event at or below the watermark was handled already (redelivery): nothing happens;
- an event past ``watermark + 1`` means earlier events are still on their way (two writers
  raced in one conversation): the messages in between are read from MongoDB and handled first.

So every message is handled once and in order whatever order its events arrive in
(docs/architecture.md, invariants 1 and 4), and the state holds a number, not a growing list.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from pydantic import BaseModel

from yoke.core.errors import SetAside, Stopping
from yoke.core.ids import SYSTEM_ACTOR_ID, derive_id
from yoke.core.lru import LRUCache
from yoke.core.models import Message, MessageMeta, MessagePosted, TextPart
from yoke.core.settings import Settings
from yoke.runtime.posting import Poster
from yoke.runtime.service import Service
from yoke.store.database import Store
from yoke.store.failures import Failure, close_failure, open_failures, record_failure

log = logging.getLogger(__name__)

C = TypeVar("C", bound=BaseModel)
S = TypeVar("S", bound=BaseModel)


@dataclass
class ActorContext(Generic[C, S]):
    """What a handler gets: its config and (mutable) state, the store and ``post()``."""

    actor: str
    instance_id: str
    config: C
    state: S
    store: Store
    poster: Poster
    trigger: Message
    watch: str
    service: str
    settings: Settings

    def effect_id(self, kind: str, *extra: str) -> str:
        """The trigger's effect id: equal on a redelivery, so the unique index drops the repeat."""
        return derive_id(kind, self.instance_id, self.trigger.id, *extra)

    async def post(self, message: Message) -> Message:
        stored = await self.poster.post(message, route=self.route)
        self.posted.append(stored)
        return stored

    save: Callable[[str, int], Awaitable[None]] | None = None
    repointed: bool = False
    # What the handler wrote: the runtime moves the watermark past its own lines that are not
    # triggers (they are not delivered back to it).
    posted: list[Message] = field(default_factory=list)
    # Extra routing headers for what the handler posts (see topology.posted_headers).
    route: dict[str, str] = field(default_factory=dict)

    async def repoint(self, conversation_id: str, watermark: int) -> None:
        """Follow another conversation from ``watermark`` on (the monologue swap), saved at once.

        Saved before the handler returns because the new conversation's lane may start
        delivering to this instance right away; after this, the handler must leave the state
        alone, and the rest of the old conversation is no longer this instance's to handle.
        """
        assert self.save is not None
        self.watch = conversation_id
        await self.save(conversation_id, watermark)
        self.repointed = True


@dataclass
class ActorDefinition(Generic[C, S]):
    """An actor type: schemas, trigger filter and handler."""

    name: str
    config_schema: type[C]
    state_schema: type[S]
    trigger: Callable[[C, S, Message], bool]
    handle: Callable[[ActorContext[C, S], Message], Awaitable[None]]
    # Reads the config for one line instead of the instance document's ``config`` (say, to
    # overlay a document of the instance's own that another writer updates).
    load_config: Callable[[Store, dict[str, Any]], Awaitable[C]] | None = None
    # The meta of the notice left when a line is set aside (say, to tell the forum's people);
    # by default it names only the line.
    notice_meta: Callable[[C, Message], MessageMeta] | None = None


def instance_state_id(actor: str, instance_id: str) -> str:
    return f"{actor}:{instance_id}"


def create_instance_document(
    actor: str,
    instance_id: str,
    *,
    watch: str,
    config: BaseModel,
    state: BaseModel,
    watermark: int = 0,
) -> dict[str, Any]:
    """The stored form of a new instance: config, state, what it watches and its watermark."""
    return {
        "_id": instance_state_id(actor, instance_id),
        "actor": actor,
        "instanceId": instance_id,
        "watch": watch,
        "watermark": watermark,
        "config": config.model_dump(mode="json", by_alias=True),
        "state": state.model_dump(mode="json", by_alias=True),
    }


class ActorRuntime:
    """Drives registered actor definitions from ``conversation.message.posted`` events.

    Each instance is advanced on its own: a line that fails one instance for good is set aside
    for that instance only (see :meth:`_set_aside`) and every other instance goes on.
    """

    def __init__(
        self,
        service: Service,
        definitions: list[ActorDefinition[Any, Any]],
        *,
        where: list[dict[str, str]] | None = None,
        kept: bool = False,
    ) -> None:
        """``where``: which posted messages reach this service at all (see ``Service.on_event``);
        lines not delivered are read by seq when a later event shows the gap.

        ``kept``: each conversation's watching instances are read once and kept, for actors
        whose documents only their own lane writes once made (no repoint, no configuration
        another writer changes). A join that adds an instance calls :meth:`forget` for its
        conversation (from its event, in that lane); an instance found gone when saved (a leave)
        is forgotten then; a hand-over forgets them all.
        """
        self.service = service
        self.definitions = definitions
        # Per instance and conversation: how far it got (see _advance), ahead of the store.
        self._passed: LRUCache[str, int] = LRUCache()
        # Per actor and conversation: the documents of the instances watching it, when kept.
        self._kept: LRUCache[str, list[dict[str, Any]]] | None = LRUCache() if kept else None
        self._generation = 0
        if kept:
            service.on_handover(self.forget)
        service.on_event(MessagePosted, self.on_posted, where=where)

    def forget(self, conversation_id: str | None = None) -> None:
        """Read the instances watching ``conversation_id`` (every one: None) anew next time."""
        self._generation += 1
        if self._kept is None:
            return
        if conversation_id is None:
            self._kept.clear()
            return
        for definition in self.definitions:
            self._kept.pop(f"{definition.name}|{conversation_id}", None)

    async def _watching(self, actor: str, conversation_id: str) -> list[dict[str, Any]]:
        """The documents of ``actor``'s instances that follow ``conversation_id``; kept, they are
        read once and then are this runtime's own, saved as it saves them."""
        if self._kept is None:
            return await self.service.store.states_watching(actor, conversation_id)
        key = f"{actor}|{conversation_id}"
        documents = self._kept.get(key)
        if documents is None:
            generation = self._generation
            documents = await self.service.store.states_watching(actor, conversation_id)
            if generation == self._generation:  # no join or hand-over while it was read
                self._kept[key] = documents
        return documents

    async def take(self, message: Message) -> bool:
        """Handle a line this process has just stored, in its conversation's lane, as its event
        would be (ingestion's door copies what it accepts): True when every instance is done
        with it, False when one set it aside (then its event is to come back here, and with it
        the letter for an operator's replay)."""
        try:
            await self.on_posted(MessagePosted.of(message))
        except SetAside:
            return False
        return True

    async def on_posted(self, event: MessagePosted) -> None:
        set_aside: list[str] = []
        for definition in self.definitions:
            # Read them all first: a cursor held open across handlers pins a server connection.
            documents = await self._watching(definition.name, event.conversation_id)
            for document in documents:
                set_aside += await self._advance(definition, document, event)
        if set_aside:
            # Recorded, noticed and passed over already: the letter is for an operator's replay.
            raise SetAside("; ".join(set_aside))

    async def _advance(
        self, definition: ActorDefinition[Any, Any], document: dict[str, Any], event: MessagePosted
    ) -> list[str]:
        """Handle the instance's lines up to the event's; returns what had to be set aside.

        Lines the instance only passes over (no trigger) move its watermark in this process's
        memory, not in the store: the next line it acts on saves it. After a restart, such lines
        are read again by seq and passed over again.
        """
        memo = f"{document['_id']}|{event.conversation_id}"
        watermark = max(int(document.get("watermark", 0)), self._passed.get(memo, 0))
        document["watermark"] = watermark
        if event.seq <= watermark:
            return await self._retry_set_aside(definition, document, event.seq)
        store = self.service.store
        if event.seq == watermark + 1:
            pending = [event.message]
        else:
            pending = await store.history(
                event.conversation_id, after_seq=watermark, up_to_seq=event.seq
            )
        set_aside: list[str] = []
        for message in pending:
            if message.seq <= int(document["watermark"]):
                continue  # passed already, as one of the instance's own lines
            outcome, through = await self._run(definition, document, message, event.conversation_id)
            if outcome == PASSED:
                document["watermark"] = self._passed[memo] = through
                continue
            if outcome == REPOINTED:
                break
            if outcome is not None:
                set_aside.append(outcome)
                _remember_failure(document, message.seq)
            await self._save(document, event.conversation_id, through)
        return set_aside

    async def _run(
        self,
        definition: ActorDefinition[Any, Any],
        document: dict[str, Any],
        message: Message,
        watch: str,
    ) -> tuple[str | None, int]:
        """Run the handler on ``message`` under the retry policy.

        Returns None when done, :data:`PASSED` when the line is no trigger for the instance,
        :data:`REPOINTED` when the instance now follows another conversation, or the reason the
        line was set aside after its last attempt; and the seq the instance is done through:
        the message's, or past the handler's own lines that directly follow it and are no
        triggers.
        """
        config = definition.config_schema.model_validate(document["config"])
        if not definition.trigger(
            config, definition.state_schema.model_validate(document["state"]), message
        ):
            return PASSED, message.seq
        if definition.load_config is not None:  # read only for a line it acts on
            config = await definition.load_config(self.service.store, document)
        state_id = str(document["_id"])
        repointed = False
        posted: list[Message] = []

        async def attempt() -> None:
            nonlocal repointed
            # A fresh state per attempt: a failed attempt's half-made changes are not kept.
            state = definition.state_schema.model_validate(document["state"])

            async def save(watch: str, watermark: int) -> None:
                document["state"] = state.model_dump(mode="json", by_alias=True)
                await self._save(document, watch, watermark)

            context = ActorContext(
                actor=definition.name,
                instance_id=str(document["instanceId"]),
                config=config,
                state=state,
                store=self.service.store,
                poster=self.service.poster,
                trigger=message,
                watch=watch,
                service=self.service.name,
                settings=self.service.settings,
                save=save,
            )
            try:
                await definition.handle(context, message)
            finally:
                posted[:] = context.posted
            repointed = context.repointed
            if not repointed:
                document["state"] = state.model_dump(mode="json", by_alias=True)

        try:
            await self.service.dispatcher.policy.run(
                attempt,
                stopping=self.service.stopping,
                describe=f"{definition.name} handler",
                extra={"conversationId": message.conversation_id, "messageId": message.id},
            )
        except Stopping:
            raise
        except Exception as error:
            log.error(
                "%s failed for good on a line; setting it aside: %r",
                definition.name,
                error,
                extra={"conversationId": message.conversation_id, "messageId": message.id},
                exc_info=True,
            )
            await self._set_aside(definition, state_id, message, error, config)
            reason = f"{definition.name} {document['instanceId']}: line {message.id}: {error!r}"
            return reason, message.seq
        if repointed:
            self.forget(watch)  # kept, it would be watching another conversation now
            self.forget(str(document["watch"]))
            return REPOINTED, message.seq
        through = message.seq
        state = definition.state_schema.model_validate(document["state"])
        for line in sorted(posted, key=lambda line: line.seq):
            if line.conversation_id != watch or line.seq != through + 1:
                continue
            if definition.trigger(config, state, line):
                break
            through = line.seq
        return None, through

    async def _set_aside(
        self,
        definition: ActorDefinition[Any, Any],
        state_id: str,
        message: Message,
        error: Exception,
        config: Any = None,
    ) -> None:
        """Record the failure (a unique insert) and say so once in the conversation.

        The watermark then moves past the line (the caller saves it), so the next lines are
        answered; ``yoke dlq replay`` of the letter runs the line again while its record is open.
        """
        store = self.service.store
        reason = f"{type(error).__name__}: {error}"[:500]
        await record_failure(
            store,
            Failure(
                id=derive_id("failure", state_id, message.id),
                state_id=state_id,
                actor=definition.name,
                service=self.service.name,
                conversation_id=message.conversation_id,
                message_id=message.id,
                seq=message.seq,
                error=reason,
            ),
        )
        await self.service.poster.post(
            Message(
                id=derive_id("failure-notice", state_id, message.id),
                conversation_id=message.conversation_id,
                author_actor_id=SYSTEM_ACTOR_ID,
                role="user",
                type="notice",
                parts=[
                    TextPart(
                        text=f"could not handle line {message.id} (seq {message.seq}): {reason}. "
                        "It was set aside for an operator (yoke dlq replay runs it again); "
                        "later lines are answered."
                    )
                ],
                meta=(
                    definition.notice_meta(config, message)
                    if definition.notice_meta is not None and config is not None
                    else MessageMeta(causation_id=message.id)
                ),
            )
        )

    async def _retry_set_aside(
        self, definition: ActorDefinition[Any, Any], document: dict[str, Any], up_to_seq: int
    ) -> list[str]:
        """A redelivery (say, a replayed dead letter): run again the lines set aside up to it."""
        seqs = sorted(seq for seq in _failed_seqs(document) if seq <= up_to_seq)
        if not seqs:
            return []
        store = self.service.store
        still: list[str] = []
        watch, watermark = str(document["watch"]), int(document["watermark"])
        for failure in await open_failures(store, str(document["_id"])):
            if failure.seq not in seqs:
                continue
            message = await store.get_message(failure.message_id)
            outcome = (
                (await self._run(definition, document, message, watch))[0]
                if message is not None
                else None
            )
            if outcome is not None and outcome not in (REPOINTED, PASSED):
                still.append(outcome)
                continue
            await close_failure(store, failure.id)
            document["failed"] = [seq for seq in _failed_seqs(document) if seq != failure.seq]
            await self._save(document, watch, watermark)
            log.info(
                "a line set aside earlier was handled on replay",
                extra={"conversationId": failure.conversation_id, "messageId": failure.message_id},
            )
        return still

    async def _save(self, document: dict[str, Any], watch: str, watermark: int) -> None:
        document["watch"] = watch
        document["watermark"] = watermark
        self._passed[f"{document['_id']}|{watch}"] = watermark
        if not await self.service.store.save_state(str(document["_id"]), document):
            self.forget(watch)  # gone (a leave): the next line reads who is left


# What _run says of a line besides a set-aside reason: no trigger for the instance (passed
# over), or the instance follows another conversation now.
PASSED = "passed"
REPOINTED = "repointed"

# An instance keeps the seqs of its open failures (bounded): a redelivery checks them for free.
MAX_REMEMBERED_FAILURES = 100


def _failed_seqs(document: dict[str, Any]) -> list[int]:
    return [int(seq) for seq in document.get("failed") or []]


def _remember_failure(document: dict[str, Any], seq: int) -> None:
    document["failed"] = [*_failed_seqs(document), seq][-MAX_REMEMBERED_FAILURES:]

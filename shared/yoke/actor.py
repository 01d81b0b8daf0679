"""The actor runtime: the Python form of the seeds' ``defineProcessorActor``.

An actor declares a pydantic config schema, a pydantic state schema (persisted in MongoDB), a
trigger filter and an async handler. Each *instance* (say, one per forum join) watches one
conversation and walks its messages in ``seq`` order behind a watermark:

- an event at or below the watermark was handled already (redelivery): nothing happens;
- an event past ``watermark + 1`` means earlier events are still on their way (two writers
  raced in one conversation): the messages in between are read from MongoDB and handled first.

So every message is handled once and in order whatever order its events arrive in
(DESIGN invariants 1 and 4), and the state holds a number, not a growing list.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from pydantic import BaseModel

from yoke.ids import derive_id
from yoke.models import Message, MessagePosted
from yoke.posting import Poster
from yoke.service import Service
from yoke.settings import Settings
from yoke.store import Store

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
        """A deterministic id for an effect of the trigger message (DESIGN invariant 4)."""
        return derive_id(kind, self.instance_id, self.trigger.id, *extra)

    async def post(self, message: Message) -> Message:
        return await self.poster.post(message)

    save: Callable[[str, int], Awaitable[None]] | None = None
    repointed: bool = False

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
    """Drives registered actor definitions from ``conversation.message.posted`` events."""

    def __init__(self, service: Service, definitions: list[ActorDefinition[Any, Any]]) -> None:
        self.service = service
        self.definitions = definitions
        service.on_event(MessagePosted, self.on_posted)

    async def on_posted(self, event: MessagePosted) -> None:
        for definition in self.definitions:
            # Read them all first: a cursor held open across handlers pins a server connection.
            documents = await self.service.store.states_watching(
                definition.name, event.conversation_id
            )
            for document in documents:
                await self._advance(definition, document, event)

    async def _advance(
        self, definition: ActorDefinition[Any, Any], document: dict[str, Any], event: MessagePosted
    ) -> None:
        watermark = int(document.get("watermark", 0))
        if event.seq <= watermark:
            return
        store = self.service.store
        if event.seq == watermark + 1:
            pending = [event.message]
        else:
            pending = await store.history(
                event.conversation_id, after_seq=watermark, up_to_seq=event.seq
            )
        config = definition.config_schema.model_validate(document["config"])
        state = definition.state_schema.model_validate(document["state"])
        state_id = str(document["_id"])

        async def save(watch: str, watermark: int) -> None:
            document["watch"] = watch
            document["watermark"] = watermark
            document["state"] = state.model_dump(mode="json", by_alias=True)
            await store.save_state(state_id, document)

        for message in pending:
            if definition.trigger(config, state, message):
                context = ActorContext(
                    actor=definition.name,
                    instance_id=str(document["instanceId"]),
                    config=config,
                    state=state,
                    store=store,
                    poster=self.service.poster,
                    trigger=message,
                    watch=event.conversation_id,
                    service=self.service.name,
                    settings=self.service.settings,
                    save=save,
                )
                await definition.handle(context, message)
                if context.repointed:
                    return
            await save(event.conversation_id, message.seq)

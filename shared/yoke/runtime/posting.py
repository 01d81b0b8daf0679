"""``post()``: how a message is written (stored, then published), and the outbox sweep behind it.

docs/architecture.md, invariants 1 and 2: the message is stored before its event is published with a
confirm; a crash in between leaves it to the outbox (:mod:`yoke.store.outbox`), never lost. Only
compaction's wake-up line is stored without being published here: it is left to the outbox on
purpose (see :mod:`yoke.runtime.compaction`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping

from yoke.bus import topology
from yoke.bus.broker import Bus
from yoke.core.ids import derive_id
from yoke.core.metrics import MESSAGES_POSTED, OUTBOX_REPUBLISHED
from yoke.core.models import Envelope, EventPayload, Message, MessagePosted
from yoke.runtime.head_hints import HeadHints
from yoke.runtime.tails import Tails
from yoke.store.database import Store
from yoke.store.outbox import OutboxSweep

log = logging.getLogger(__name__)


class Poster:
    """Writes messages and publishes their ``conversation.message.posted`` events."""

    def __init__(self, store: Store, bus: Bus, service: str) -> None:
        self.store = store
        self.bus = bus
        self.service = service
        # A processor's conversation tails (yoke.runtime.tails): what it writes joins them.
        self.tails: Tails | None = None
        # The mesh's key for the monologue-head hint of agents' forum lines (loaded by Service).
        self.head_hints = HeadHints()

    async def post(self, message: Message, *, route: Mapping[str, str] | None = None) -> Message:
        """Store ``message`` under the next seq and publish it; idempotent by message id.

        Posting an id that exists returns the stored message and publishes it again, so a
        redelivered event's effects are written once and their events are not lost.
        """
        stored, _ = await self.post_or_republish(message, route=route)
        return stored

    async def post_or_republish(
        self, message: Message, *, route: Mapping[str, str] | None = None
    ) -> tuple[Message, bool]:
        """:meth:`post`, also saying which it did: ``True``, this call stored it; ``False``, it
        was stored already, and its event is published again."""
        stored, created = await self._store(message)
        # Also when it was written before (a redelivered effect): its event may never have gone
        # out if its writer died in between, and publishing it again now, before anything that
        # follows it, keeps the conversation's order. Consumers take an event once.
        await self.publish(stored, route=route)
        if created:
            MESSAGES_POSTED.labels(self.service, stored.type).inc()
        return stored, created

    async def post_and_take(
        self,
        message: Message,
        take: Callable[[Message], Awaitable[bool]],
        *,
        route: Mapping[str, str] | None = None,
        stored_first: Callable[[Message, bool], Awaitable[None]] | None = None,
    ) -> tuple[Message, bool]:
        """:meth:`post_or_republish` of a line its writer's own service then handles in the same
        delivery (``take``: ingestion's door copies it as it accepts it), its event marked so
        (:data:`topology.COPIED_HEADER`) and not delivered back to that service.

        The event goes out first (whoever reads the forum sees the line before any answer to
        it), its confirm awaited beside ``take`` (a hop's worth of waiting less on every turn),
        and the outbox counts the line published only once ``take`` is done too: a
        crash in between leaves it to the outbox sweep, whose event is unmarked and so handled
        the usual way. ``take`` saying False (it set the line aside) publishes it again unmarked,
        for the same reason. ``stored_first`` hears of the stored line (and whether this call
        wrote it) before ``take`` begins: the door answers its submitter then, not after the
        copies.
        """
        stored, created = await self._store(message)
        marked = {**(route or {}), topology.COPIED_HEADER: "yes"}
        published = asyncio.ensure_future(self.publish(stored, route=marked, confirm=False))
        try:
            if stored_first is not None:
                await stored_first(stored, created)
            took = await take(stored)
        except BaseException:
            await asyncio.gather(published, return_exceptions=True)
            raise
        await published
        if took:
            self.store.outbox.confirmed(stored.id)
        else:
            await self.publish(stored, route=route)
        if created:
            MESSAGES_POSTED.labels(self.service, stored.type).inc()
        return stored, created

    async def _store(self, message: Message) -> tuple[Message, bool]:
        """Stored under the next seq (or found stored), and seen by the process's tails."""
        stored, created = await self.store.insert_message(message)
        if self.tails is not None:
            self.tails.saw(stored)
        return stored, created

    async def emit(self, payload: EventPayload, *, event_id: str) -> None:
        """Publish a non-message event (``agent.*``) under a caller-derived id."""
        await self.bus.publish_event(Envelope.wrap(event_id, payload), payload.key)

    async def publish(
        self, message: Message, *, route: Mapping[str, str] | None = None, confirm: bool = True
    ) -> None:
        """Publish a stored message's event, with the headers the services route on (and
        ``route``, what its writer adds: see :data:`topology.GUARDED_HEADER`); ``confirm``:
        the outbox counts it published now (else its caller says when)."""
        kind = await self.store.conversation_kind(message.conversation_id)
        headers = {**topology.posted_headers(message, kind), **(route or {})}
        if kind == topology.PUBLIC_KIND and message.role == "agent":
            # Bridges are delivered this very event: what it says of the monologue the line was
            # forwarded from goes only sealed, for the mesh (yoke.runtime.head_hints).
            headers.update(self.head_hint(message))
            message = message.seen_outside()
        payload = MessagePosted.of(message)
        # The event id derives from the message: a republished event is recognisably the same.
        await self.bus.publish_event(
            Envelope.wrap(derive_id("posted", message.id), payload), payload.key, headers
        )
        if confirm:
            self.store.outbox.confirmed(message.id)

    def head_hint(self, line: Message) -> dict[str, str]:
        """The sealed head of the monologue an agent's forum line was forwarded from (its stored
        ``sourceConversationId`` and ``sourceSeq``), when this process has the mesh's key."""
        meta = line.meta
        if not (meta.source_conversation_id and meta.source_seq):
            return {}
        sealed = self.head_hints.seal(line.id, meta.source_conversation_id, meta.source_seq)
        return {topology.HEAD_HEADER: sealed} if sealed else {}

    def outbox_sweep(self) -> OutboxSweep:
        """What republishes the events a crash left unconfirmed (see :mod:`yoke.store.outbox`)."""
        return OutboxSweep(
            self.store.outbox,
            self.store.db["writers"],
            self.store.messages,
            self.publish,
            lambda count: OUTBOX_REPUBLISHED.labels(self.service).inc(count),
        )

    async def run_outbox_sweep(self, grace: float, stopping: asyncio.Event) -> None:
        """Heartbeats, own retries and dead writers' leftovers until ``stopping`` is set."""
        await self.outbox_sweep().run(grace, stopping)

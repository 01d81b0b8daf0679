"""``post()``: the one way a message is written, and the outbox sweeper behind it.

DESIGN invariants 1 and 2: the message is stored (marked unpublished) before its event is
published with a confirm; a crash in between leaves it for the sweeper, never lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from datetime import UTC, datetime, timedelta

from yoke import topology
from yoke.bus import Bus
from yoke.ids import derive_id
from yoke.metrics import MESSAGES_POSTED, OUTBOX_REPUBLISHED
from yoke.models import Envelope, EventPayload, Message, MessagePosted
from yoke.store import Store

log = logging.getLogger(__name__)


class Poster:
    """Writes messages and publishes their ``conversation.message.posted`` events."""

    def __init__(self, store: Store, bus: Bus, service: str) -> None:
        self.store = store
        self.bus = bus
        self.service = service

    async def post(self, message: Message) -> Message:
        """Store ``message`` under the next seq and publish it; idempotent by message id.

        Posting an id that exists returns the stored message (publishing it if that never
        happened), so a redelivered event's effects are written once.
        """
        stored, _ = await self.post_new(message)
        return stored

    async def post_new(self, message: Message) -> tuple[Message, bool]:
        """:meth:`post`, also saying whether this call wrote it (``False``: it existed)."""
        stored, created = await self.store.insert_message(message)
        if created:
            await self._publish(stored)
            MESSAGES_POSTED.labels(self.service, stored.type).inc()
        elif not await self.store.is_published(stored.id):
            await self._publish(stored)
        return stored, created

    async def emit(self, payload: EventPayload, *, event_id: str) -> None:
        """Publish a non-message event (``agent.*``) under a caller-derived id."""
        await self.bus.publish_event(Envelope.wrap(event_id, payload), payload.key)

    async def _publish(self, message: Message) -> None:
        payload = MessagePosted.of(message)
        kind = await self.store.conversation_kind(message.conversation_id)
        # The event id derives from the message: a republished event is recognisably the same.
        await self.bus.publish_event(
            Envelope.wrap(derive_id("posted", message.id), payload),
            payload.key,
            topology.posted_headers(message, kind),
        )
        await self.store.mark_published(message.id)

    async def sweep_once(self, grace: float) -> int:
        """Publish messages left unpublished for longer than ``grace`` seconds."""
        cutoff = datetime.now(UTC) - timedelta(seconds=grace)
        pending = await self.store.unpublished_before(cutoff)
        for message in pending:
            log.warning(
                "republishing a message left unpublished",
                extra={"conversationId": message.conversation_id, "messageId": message.id},
            )
            await self._publish(message)
            OUTBOX_REPUBLISHED.labels(self.service).inc()
        return len(pending)

    async def run_sweeper(self, grace: float, stopping: asyncio.Event) -> None:
        """Sweep every ``grace / 2`` seconds until ``stopping`` is set."""
        while not stopping.is_set():
            try:
                await self.sweep_once(grace)
            except Exception:
                log.exception("outbox sweep failed; trying again")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stopping.wait(), timeout=max(grace / 2, 0.2))

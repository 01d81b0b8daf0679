"""Which written messages may still lack their event, without an update per message.

docs/architecture.md, invariant 2: a message is stored before its event is published, and a crash in
between must not lose the event. Recording "published" on every message would cost an update per
message (a read-modify-write on FerretDB), so instead:

- each process is a *writer* with an id of its own; every message it stores carries that id,
  the moment its insert began (``outboxAt``) and an *outbox slot* (writer and that minute, a
  field read by equality);
- the writer keeps its not-yet-confirmed messages in memory, from *before* their insert
  (so a heartbeat during a slow insert already counts it), publishes them again itself if a
  publish keeps failing, and every :data:`BEAT_SECONDS` stores a heartbeat: "alive, and
  everything I began writing before T is published";
- every :data:`SWEEP_SECONDS`, each process's *outbox sweep* claims (a unique insert) any
  writer whose heartbeat stopped and publishes again what that writer began storing from T
  on, read slot by slot; then forgets it.

A republished event is the same event (its id derives from the message): consumers dedupe.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import weakref
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from typing import Any

from pymongo.errors import DuplicateKeyError

from yoke.core.ages import BUCKET_FIELD, hour_bucket
from yoke.core.ids import new_id
from yoke.core.metrics import (
    IN_DELIVERY,
    OUTBOX_OLDEST_UNPUBLISHED_SECONDS,
    OUTBOX_UNPUBLISHED,
    STORE_ORIGIN,
)
from yoke.core.models import Message, as_utc

log = logging.getLogger(__name__)

Doc = dict[str, Any]

# A heartbeat this often; a writer silent for ``dead_after(grace)`` (three beats at least) is
# finished by others. Every beat is an idle process's store operation, and a dead writer waits
# out its silence anyway, so beating or reading for one more often than this buys nothing.
BEAT_SECONDS = 2.0
# Own overdue publishes are retried this often (memory only); the writers are read every
# SWEEP_SECONDS for dead ones.
RETRY_SECONDS = 2.0
SWEEP_SECONDS = 2 * BEAT_SECONDS
# What yoke_store_operations calls the store operations of the heartbeat and the sweep.
OUTBOX_ORIGIN = "outbox"
# A claim on a dead writer older than this is taken to have died with its outbox sweep.
CLAIM_EXPIRES_SECONDS = 60.0
# At most this many minutes of a dead writer are read back (older ones were settled).
MAX_SLOTS = 24 * 60


def dead_after(grace: float) -> float:
    """How long a writer may be silent before others finish its writes (three beats at least)."""
    return max(3 * BEAT_SECONDS, 3 * grace)


def slot_of(writer: str, when: datetime) -> str:
    return f"{writer}:{int(when.timestamp() // 60)}"


def _now() -> datetime:
    return datetime.now(UTC)


# Every writer of this process, for the gauges (a process may hold more than one store).
_WRITERS: weakref.WeakSet[Outbox] = weakref.WeakSet()


def unpublished(service: str) -> int:
    """Messages the service's writers in this process stored and have not seen confirmed."""
    return sum(len(o.unconfirmed) for o in list(_WRITERS) if o.service == service)


def oldest_unpublished_seconds(service: str) -> float:
    """How long the oldest of those has waited (0 with none): what the outbox alert watches."""
    oldest = [
        m.created_at for o in list(_WRITERS) if o.service == service for m in o.unconfirmed.values()
    ]
    return max(0.0, (_now() - min(oldest)).total_seconds()) if oldest else 0.0


class Outbox:
    """This process as a writer: its writes that lack a confirmed publish, and its heartbeat."""

    def __init__(self, service: str) -> None:
        self.service = service
        self.writer = new_id()
        # Stored, event not confirmed yet: what this writer publishes again itself.
        self.unconfirmed: dict[str, Message] = {}
        # When each message's insert began, from then until its event is confirmed: what
        # every heartbeat's ``settledBefore`` is the oldest of.
        self._since: dict[str, datetime] = {}
        _WRITERS.add(self)
        OUTBOX_UNPUBLISHED.labels(service).set_function(lambda: unpublished(service))
        OUTBOX_OLDEST_UNPUBLISHED_SECONDS.labels(service).set_function(
            lambda: oldest_unpublished_seconds(service)
        )
        # Announced before the first write, so a writer that dies at once is finished too.
        self.registered = False
        self.registering = asyncio.Lock()
        self._heart: asyncio.Task[None] | None = None

    async def register(self, writers: Any) -> None:
        """Announce this writer, then keep its heartbeat going for as long as the loop runs.

        Every process that writes messages beats (a service, the CLI, a test): a writer whose
        beat stops is taken for dead and its recent writes are published again by others.
        """
        async with self.registering:
            if self.registered:
                return
            await self.beat(writers)
            self.registered = True
            self._heart = asyncio.get_running_loop().create_task(self._beat_forever(writers))

    async def beat(self, writers: Any) -> None:
        """Store the heartbeat: alive now, and settled up to :meth:`settled_before`.

        Only :meth:`register` and then the heartbeat task write it: one writer.
        """
        document = {
            "_id": self.writer,
            "service": self.service,
            "beat": _now(),
            "settledBefore": self.settled_before(),
        }
        try:
            await writers.replace_one({"_id": self.writer}, document, upsert=True)
        except DuplicateKeyError:  # an upsert is no atomic insert on FerretDB: it exists
            await writers.replace_one({"_id": self.writer}, document)

    async def _beat_forever(self, writers: Any) -> None:
        # Its own task, though it may be started from a delivery (a first post): counted as the
        # outbox's store operations, never that delivery's.
        STORE_ORIGIN.set(OUTBOX_ORIGIN)
        IN_DELIVERY.set(False)
        while True:
            await asyncio.sleep(BEAT_SECONDS)
            try:
                await self.beat(writers)
            except Exception as error:
                log.warning("could not store the outbox heartbeat: %r", error)

    async def close(self, writers: Any) -> None:
        """Stop beating; with nothing left unconfirmed (nor an insert on its way), leave
        nothing for others to finish."""
        if self._heart is None:
            return
        self._heart.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._heart
        self._heart = None
        if not self.unconfirmed and not self._since:
            with contextlib.suppress(Exception):
                await writers.delete_one({"_id": self.writer})

    def writing(self, message_id: str) -> bool:
        """An insert of ``message_id`` begins: from now on every heartbeat covers it.

        ``False`` if this writer already had it pending (then :meth:`not_written` leaves it).
        """
        if message_id in self._since:
            return False
        self._since[message_id] = _now()
        return True

    def stamp(self, document: Doc, message: Message) -> None:
        """Mark a document about to be stored as this writer's, in its outbox slot: that of
        the moment its insert began (what a dead writer's sweep reads from)."""
        since = self._since.get(message.id) or _now()
        document["writer"] = self.writer
        document["outboxAt"] = since
        document["outbox"] = slot_of(self.writer, since)

    def written(self, message: Message) -> None:
        self._since.setdefault(message.id, _now())
        self.unconfirmed[message.id] = message

    def not_written(self, message_id: str, began: bool) -> None:
        """The insert :meth:`writing` announced stored nothing (the id existed, or it failed)."""
        if began and message_id not in self.unconfirmed:
            self._since.pop(message_id, None)

    def confirmed(self, message_id: str) -> None:
        self.unconfirmed.pop(message_id, None)
        self._since.pop(message_id, None)

    def settled_before(self) -> datetime:
        """Everything this writer began storing before this moment is published."""
        return min(self._since.values(), default=_now())

    def overdue(self, grace: float) -> list[Message]:
        """Own messages unconfirmed for longer than ``grace`` seconds (a failed publish)."""
        cutoff = _now() - timedelta(seconds=grace)
        return sorted(
            (m for m in self.unconfirmed.values() if self._since.get(m.id, m.created_at) <= cutoff),
            key=lambda m: (m.conversation_id, m.seq),
        )


class OutboxSweep:
    """The background half: heartbeats, own retries, and finishing dead writers."""

    def __init__(
        self,
        outbox: Outbox,
        writers: Any,
        messages: Any,
        publish: Callable[[Message], Awaitable[None]],
        on_republished: Callable[[int], None],
    ) -> None:
        self.outbox = outbox
        self.writers = writers
        self.messages = messages
        self.publish = publish
        self.on_republished = on_republished

    async def retry_own(self, grace: float) -> int:
        overdue = self.outbox.overdue(grace)
        for message in overdue:
            log.warning(
                "publishing again a message whose event was not confirmed",
                extra={"conversationId": message.conversation_id, "messageId": message.id},
            )
            await self.publish(message)
        return len(overdue)

    async def finish_dead_writers(self, silent_for: float) -> int:
        """Publish again what writers that stopped beating stored after their last settle."""
        now = _now()
        republished = 0
        for writer in await self.writers.find({"beat": {"$exists": True}}).to_list():
            beat = as_utc(writer["beat"])
            if writer["_id"] == self.outbox.writer or now - beat < timedelta(seconds=silent_for):
                continue
            if not await self._claim(str(writer["_id"]), now):
                continue
            republished += await self._finish(writer, now)
        return republished

    async def _claim(self, writer: str, now: datetime) -> bool:
        claim = f"sweep:{writer}"
        try:
            # A sweep that dies between claim and finish leaves it: retention removes it.
            await self.writers.insert_one(
                {"_id": claim, "claimedAt": now, BUCKET_FIELD: hour_bucket(now)}
            )
            return True
        except DuplicateKeyError:
            existing = await self.writers.find_one({"_id": claim})
            if existing is not None and now - as_utc(existing["claimedAt"]) > timedelta(
                seconds=CLAIM_EXPIRES_SECONDS
            ):
                await self.writers.delete_one({"_id": claim})  # its sweep died: next round
            return False

    async def _finish(self, writer: Doc, now: datetime) -> int:
        name = str(writer["_id"])
        since = as_utc(writer["settledBefore"]) - timedelta(seconds=2)
        first = int(since.timestamp() // 60)
        last = min(int(now.timestamp() // 60), first + MAX_SLOTS)
        found: list[Message] = []
        for minute in range(first, last + 1):
            for document in await self.messages.find({"outbox": f"{name}:{minute}"}).to_list():
                message = Message.from_document(document)
                # (Lines stored before ``outboxAt`` existed were slotted by ``createdAt``.)
                if as_utc(document.get("outboxAt") or message.created_at) >= since:
                    found.append(message)
        found.sort(key=lambda m: (m.conversation_id, m.seq))
        for message in found:
            await self.publish(message)
        if found:
            log.warning(
                "published again %d messages of a writer that stopped (%s, %s)",
                len(found),
                writer.get("service"),
                name,
            )
            self.on_republished(len(found))
        await self.writers.delete_one({"_id": name})
        await self.writers.delete_one({"_id": f"sweep:{name}"})
        return len(found)

    async def run(self, grace: float, stopping: asyncio.Event) -> None:
        """Retry own overdue publishes every :data:`RETRY_SECONDS`; finish dead writers every
        :data:`SWEEP_SECONDS`."""
        STORE_ORIGIN.set(OUTBOX_ORIGIN)  # the sweep's own task
        await self.outbox.register(self.writers)
        clock = asyncio.get_running_loop().time
        next_sweep = clock()
        while not stopping.is_set():
            try:
                await self.retry_own(grace)
                if clock() >= next_sweep:
                    next_sweep = clock() + SWEEP_SECONDS
                    await self.finish_dead_writers(dead_after(grace))
            except Exception:
                log.warning("outbox round failed; trying again", exc_info=True)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stopping.wait(), timeout=RETRY_SECONDS)

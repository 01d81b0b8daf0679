"""Lines a minute per bridge user and per gateway token: each line can cost a model call.

Shared, not per replica: the count lives in the store, so a bridge whose forums are spread over
several ingestion replicas (shards are shared out among them) still gets its limit once, not
once per replica. It is counted by unique inserts (invariant 8: FerretDB's ``$inc`` is a
read-modify-write, and replicas or lanes counting one speaker at once let more lines through
than the limit): a speaker's windows are fixed minutes from its first line (its *anchor*,
written once), and a line is taken by inserting one of the window's ``per_minute`` *slots*;
with every slot taken the line is refused, and ``retryAfter`` is exact: when the window ends.

A taken line costs one insert (a slot another replica took first costs one more, or a few
lookups when far behind); a refused one none once this process saw its window full. The
services' own user is exempt, so the CLI and the mesh's own turns pay nothing. Anchors are one
per bridge user or token namespace ever limited; slots carry their hour's ``ageBucket`` and
are swept by :func:`slot_rule` (invariant 14).
"""

from __future__ import annotations

import math
from datetime import datetime, timedelta

from pymongo.errors import DuplicateKeyError

from yoke.core.ages import BUCKET_FIELD, hour_bucket
from yoke.core.lru import LRUCache
from yoke.core.models import as_utc, utcnow
from yoke.store.database import Store, highest_taken
from yoke.store.retention import Rule

COLLECTION = "line_limits"
WINDOW = timedelta(minutes=1)
# Slots are needed for their minute only; an hour more is plenty for a clock that lags.
SLOT_KEEP_HOURS = 1.0


def slot_id(speaker: str, window: int, slot: int) -> str:
    """Never a speaker's anchor id (those are ``door:name``)."""
    return f"slot/{window}/{slot}/{speaker}"


def slot_rule() -> Rule:
    """Slots of past windows, swept by the process that takes them (ingestion)."""
    return Rule("line limit slots", COLLECTION, "hour", SLOT_KEEP_HOURS)


class LineLimit:
    """At most ``per_minute`` lines per speaker in each window (0: no limit)."""

    def __init__(self, store: Store, per_minute: int) -> None:
        self.store = store
        self.collection = store.db[COLLECTION]
        self.per_minute = per_minute
        self._created = False
        # A speaker's anchor (never changes once written), and its window this process last
        # counted in with the next slot to try there (past ``per_minute``: the window is full).
        self._anchors: LRUCache[str, datetime] = LRUCache()
        self._next: LRUCache[str, tuple[int, int]] = LRUCache()

    async def take(self, speaker: str, now: datetime | None = None) -> int | None:
        """Count one line of ``speaker``: None if it is within the limit, else whole seconds
        until its window ends (at least 1)."""
        if self.per_minute <= 0:
            return None
        if not self._created:
            # Made before its first write: FerretDB can hang creating a collection lazily
            # under load (Store.create_collections). Once per process, on a limited line only.
            await self.store.create_collections(COLLECTION)
            self._created = True
        now = now or utcnow()
        anchor = await self._anchor(speaker, now)
        window = (now - anchor) // WINDOW
        known_window, slot = self._next.get(speaker) or (window, 1)
        if known_window != window:
            slot = 1
        conflicts = 0
        while slot <= self.per_minute:
            document = {"_id": slot_id(speaker, window, slot), BUCKET_FIELD: hour_bucket(now)}
            try:
                await self.collection.insert_one(document)
            except DuplicateKeyError:  # another replica or lane took it: the next one
                conflicts += 1
                if conflicts < 3:
                    slot += 1
                else:  # far behind: find the window's last slot taken rather than walk to it
                    slot = await highest_taken(lambda n: self._taken(speaker, window, n), slot) + 1
                continue
            self._next[speaker] = (window, slot + 1)
            return None
        self._next[speaker] = (window, slot)  # full: refused here without asking the store
        ends = anchor + (window + 1) * WINDOW
        return max(1, math.ceil((ends - now).total_seconds()))

    async def _anchor(self, speaker: str, now: datetime) -> datetime:
        """When the speaker's windows begin: its first limited line's moment, written once (a
        document of the older shape, counted in place, gives its ``windowStart`` too)."""
        if (known := self._anchors.get(speaker)) is not None:
            return known
        anchor = now
        if not await self.store.insert_if_absent(
            self.collection, {"_id": speaker, "windowStart": now}
        ):
            found = await self.collection.find_one({"_id": speaker}, {"windowStart": 1})
            if found is not None and isinstance(found.get("windowStart"), datetime):
                anchor = as_utc(found["windowStart"])
        self._anchors[speaker] = anchor
        return anchor

    async def _taken(self, speaker: str, window: int, slot: int) -> bool:
        found = await self.collection.find_one({"_id": slot_id(speaker, window, slot)}, {"_id": 1})
        return found is not None

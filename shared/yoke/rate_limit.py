"""Lines a minute per bridge user and per gateway token: each line can cost a model call.

Shared, not per replica: the count lives in the store, one document per speaker, so a bridge
whose forums are spread over several ingestion replicas (shards are shared out among them)
still gets its limit once, not once per replica. It costs one store operation per line of a
limited speaker (two when a window begins); the services' own user is exempt, so the CLI and
the mesh's own turns pay nothing. Windows are fixed and begin at a speaker's first line, so
``retryAfter`` is exact: when the window ends. The collection holds one document per bridge
user or token namespace ever limited, each reset in place (invariant 14: bounded by the
operator's users and tokens, not by traffic).
"""

from __future__ import annotations

import math
from datetime import datetime, timedelta

from pymongo import ReturnDocument
from pymongo.errors import DuplicateKeyError

from yoke.models import as_utc, utcnow
from yoke.store import Store

COLLECTION = "line_limits"
WINDOW = timedelta(minutes=1)


class LineLimit:
    """At most ``per_minute`` lines per speaker in each window (0: no limit)."""

    def __init__(self, store: Store, per_minute: int) -> None:
        self.store = store
        self.collection = store.db[COLLECTION]
        self.per_minute = per_minute
        self._created = False

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
        for _ in range(2):
            counted = await self.collection.find_one_and_update(
                {"_id": speaker, "windowStart": {"$gt": now - WINDOW}},
                {"$inc": {"count": 1}},
                return_document=ReturnDocument.AFTER,
            )
            if counted is not None:
                if int(counted["count"]) <= self.per_minute:
                    return None
                ends = as_utc(counted["windowStart"]) + WINDOW
                return max(1, math.ceil((ends - now).total_seconds()))
            try:
                # No window in force: begin one (a speaker's first line, or one after a pause).
                await self.collection.update_one(
                    {
                        "_id": speaker,
                        "$or": [
                            {"windowStart": {"$lte": now - WINDOW}},
                            {"windowStart": {"$exists": False}},
                        ],
                    },
                    {"$set": {"windowStart": now, "count": 1}},
                    upsert=True,
                )
                return None
            except DuplicateKeyError:
                continue  # another replica began it a moment ago: count in that one
        return None

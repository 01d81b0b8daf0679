"""Every forum in creation order, for listing page by page (the console's forum list).

FerretDB 1.x pushes neither a sort nor a range down (docs/architecture.md, "The servers in
tests"), so "the newest forums" cannot be a sorted query on ``conversations``: past a few
hundred forums it reads them all, and a capped read of them in storage order loses the new
ones. Instead each forum takes the next position in ``forum_list`` when it is made, by a unique
insert (invariant 8: the insert that wins owns the position; a loser tries the next one), and
a page is read by equality on ``bucket`` (a hundred positions each), an indexed field: the
newest are the highest positions, found by galloping over ``_id`` lookups as ``Store.last_seq``
finds a conversation's head.

Forums made before the list existed are listed once, oldest first, by whichever process makes
the first position (they then come before every later forum).
"""

from __future__ import annotations

import contextlib
import weakref

from pymongo import ASCENDING
from pymongo.errors import BulkWriteError, DuplicateKeyError

from yoke.core.models import Conversation, utcnow
from yoke.store.database import Doc, Store

FORUM_LIST = "forum_list"
BUCKET = 100
# Written once the forums from before the list have been listed.
_BACKFILLED = "backfilled"


class ForumList:
    """The list's positions; keeps the highest one it has seen (a hint: positions only grow)."""

    @classmethod
    def of(cls, store: Store) -> ForumList:
        """The store's one list (its hint and its checked indexes shared by every caller)."""
        found = _LISTS.get(store)
        if found is None:
            found = _LISTS[store] = cls(store)
        return found

    def __init__(self, store: Store) -> None:
        self.store = store
        self.collection = store.db[FORUM_LIST]
        self._head = 0
        self._ready = False

    async def ensure_indexes(self) -> None:
        await self.store.create_collections(FORUM_LIST)
        await self.collection.create_index([("bucket", ASCENDING)], name="bucket")
        await self.collection.create_index([("forumId", ASCENDING)], unique=True, name="forum")

    async def add(self, forum: Conversation) -> int:
        """The forum's position (taken now, or the one it has: a forum is listed once)."""
        if not self._ready:
            await self.ensure_indexes()
            if await self.collection.find_one({"_id": _BACKFILLED}) is None:
                await self._backfill()
            self._ready = True
        return await self._list(forum.id)

    async def head(self) -> int:
        """The highest position taken (0: none), by a few ``_id`` lookups."""
        low, step = self._head, 1
        high = low + step
        while await self._taken(high):
            low, step = high, step * 2
            high = low + step
        while high - low > 1:
            middle = (low + high) // 2
            if await self._taken(middle):
                low = middle
            else:
                high = middle
        self._head = max(self._head, low)
        return low

    async def page(self, before: int | None, limit: int) -> tuple[list[str], int | None]:
        """Forum ids, newest first, below position ``before`` (None: from the newest), and the
        cursor of the next page (None: none left). Reads ``limit / 100 + 1`` buckets at most."""
        top = (await self.head()) + 1 if before is None else min(before, (await self.head()) + 1)
        found: list[tuple[int, str]] = []
        bucket = (top - 1) // BUCKET
        while len(found) < limit and bucket >= 0 and top > 1:
            documents = await self.collection.find({"bucket": bucket}).to_list()
            entries = sorted(
                ((int(d["position"]), str(d["forumId"])) for d in documents), reverse=True
            )
            found += [entry for entry in entries if entry[0] < top][: limit - len(found)]
            bucket -= 1
        shown = found[:limit]
        last = shown[-1][0] if shown else 1
        return [forum_id for _, forum_id in shown], (last if last > 1 else None)

    async def _taken(self, position: int) -> bool:
        return (
            await self.collection.find_one({"_id": _position_id(position)}, {"_id": 1}) is not None
        )

    async def _list(self, forum_id: str) -> int:
        while True:
            position = (await self.head()) + 1
            try:
                await self.collection.insert_one(_entry(position, forum_id))
                self._head = position
                return position
            except DuplicateKeyError:
                # Listed already (by an earlier try or a backfill), or the position was taken.
                listed = await self.collection.find_one({"forumId": forum_id})
                if listed is not None:
                    return int(listed["position"])

    async def _backfill(self) -> None:
        """List the forums stored before the list, oldest first (once: one scan of forums)."""
        query: Doc = {"kind": "forum"}
        forums = [
            Conversation.from_document(document)
            for document in await self.store.conversations.find(query).to_list()
        ]
        ordered = [forum.id for forum in sorted(forums, key=lambda f: (f.created_at, f.id))]
        start = (await self.head()) + 1
        try:  # one write when nobody else lists meanwhile (the usual case: an upgrade)
            if ordered:
                await self.collection.insert_many(
                    [_entry(start + n, forum_id) for n, forum_id in enumerate(ordered)]
                )
                self._head = start + len(ordered) - 1
        except BulkWriteError:  # someone did: one at a time, each under its unique insert
            for forum_id in ordered:
                await self._list(forum_id)
        with contextlib.suppress(DuplicateKeyError):  # another process finished it too
            await self.collection.insert_one({"_id": _BACKFILLED, "at": utcnow()})


_LISTS: weakref.WeakKeyDictionary[Store, ForumList] = weakref.WeakKeyDictionary()


def _position_id(position: int) -> str:
    return f"p{position}"


def _entry(position: int, forum_id: str) -> Doc:
    return {
        "_id": _position_id(position),
        "position": position,
        "bucket": position // BUCKET,
        "forumId": forum_id,
        "at": utcnow(),
    }

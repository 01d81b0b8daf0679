"""The answers the MCP door owes its callers: a call that ran out of time (or whose caller went)
leaves its line's answer to be collected by a later call in that conversation.

One document per line whose answer is owed (``_id`` ``<forum id>/<line id>``, with the forum,
the line and its seq, and the token namespace it is owed to): two calls of one conversation
that both ran out of time each told their caller to call again, so both answers are owed, and
the calls after hand them back one each, the oldest line first. A call deletes exactly the debt
it handed back, never one another call wrote meanwhile. Written once (owed again, it keeps the
age it was first owed at, so retention still ages it), deleted when handed back.

The gateway's own bookkeeping, like a webhook's cursor (its MongoDB role may write only such
collections), and in the store, not in a process: any replica collects what another owes.
Bounded (invariant 14): a token is owed at most ``YOKE_MCP_OWED_ANSWERS_PER_TOKEN`` answers
across its conversations (past it, its oldest debts are dropped: their answers stay in their
forums), and each carries its day's ``ageBucket``, so the gateway's sweep takes those never
collected after :data:`KEEP_DAYS`.
"""

from __future__ import annotations

from dataclasses import dataclass

from yoke.ages import BUCKET_FIELD, day_bucket
from yoke.models import Message, utcnow
from yoke.retention import Rule
from yoke.store import Store

COLLECTION = "mcp_owed_answers"
KEEP_DAYS = 1.0
# A forum whose lines were deleted under its debts is looked at this many times in one call at
# most (each a debt of a deleted line, dropped), so a lookup stays bounded.
MAX_STALE_DEBTS = 10


@dataclass(frozen=True)
class Debt:
    """An answer owed: the document's id (what paying it deletes) and the caller's line."""

    id: str
    line: Message


def retention_rule() -> Rule:
    return Rule("mcp owed answers", COLLECTION, "day", KEEP_DAYS)


async def ensure_indexes(store: Store) -> None:
    """The collection (made before any traffic: FerretDB can hang making one lazily under
    load) and the indexes of its two lookups: a forum's oldest debt, a token's debts by age."""
    await store.create_collections(COLLECTION)
    collection = store.db[COLLECTION]
    await collection.create_index([("forumId", 1), ("lineSeq", 1)], name="forum_line")
    await collection.create_index([("owner", 1), ("at", 1)], name="owner_age")


def debt_id(forum_id: str, line: Message) -> str:
    return f"{forum_id}/{line.id}"


async def oldest_owed(store: Store, forum_id: str) -> Debt | None:
    """The forum's oldest line whose answer its caller has not had, if any: one indexed read
    (and one more for the line when there is one)."""
    collection = store.db[COLLECTION]
    for _ in range(MAX_STALE_DEBTS):
        found = await collection.find_one({"forumId": forum_id}, sort=[("lineSeq", 1)])
        if found is None:
            return None
        line = await store.get_message(str(found["lineId"]))
        if line is not None:
            return Debt(str(found["_id"]), line)
        # The forum's lines were deleted meanwhile: nothing is owed for that one any more.
        await collection.delete_one({"_id": found["_id"]})
    return None


async def owe(store: Store, forum_id: str, line: Message, owner: str, limit: int) -> None:
    """Remember that ``line``'s answer is owed to ``owner`` (a token's namespace). Owed
    already, it is left as it was (its first age); past ``limit`` debts of the owner, its
    oldest are dropped."""
    owed = {
        "_id": debt_id(forum_id, line),
        "forumId": forum_id,
        "lineId": line.id,
        "lineSeq": line.seq,
        "owner": owner,
        "at": utcnow(),
        BUCKET_FIELD: day_bucket(),
    }
    if not await store.insert_if_absent(store.db[COLLECTION], owed):
        return
    await _bound(store, owner, limit)


async def _bound(store: Store, owner: str, limit: int) -> None:
    """Drop the owner's oldest debts past ``limit`` (one count, and a read and a delete only
    when there are too many)."""
    collection = store.db[COLLECTION]
    excess = await collection.count_documents({"owner": owner}) - limit
    if excess <= 0:
        return
    oldest = collection.find({"owner": owner}, {"_id": 1}).sort("at", 1).limit(excess)
    ids = [found["_id"] async for found in oldest]
    await collection.delete_many({"_id": {"$in": ids}})


async def paid(store: Store, debt: Debt) -> None:
    """The debt handed back: exactly it, never a debt of the same forum written meanwhile."""
    await store.db[COLLECTION].delete_one({"_id": debt.id})

"""The answers the MCP door owes its callers: a call that ran out of time (or whose caller went)
leaves its line's answer to be collected by a later call in that conversation.

One document per line whose answer is owed (``_id`` ``<forum id>/<line id>``, with the forum,
the line and its seq, and the token namespace it is owed to): two calls of one conversation
that both ran out of time each told their caller to call again, so both answers are owed, and
the calls after hand them back one each, the oldest line first. Written once (owed again, it
keeps the age it was first owed at, so retention still ages it).

Handing a debt back is decided by a unique insert (invariant 8: on FerretDB a read and a
delete are no claim): the call whose claim (``_id`` ``claim:<debt id>``) is inserted hands the
debt back and, as its answer goes out to the caller, deletes it, then deletes its claim; a
caller that went before its answer was sent gives the claim back, and the debt stays owed at
its first age. A call whose insert loses treats the debt as absent. The winner reads the debt
again after winning, as a claim given back after its debt was paid is one another call can
win. A claim is held only while its call hands the answer over (given back if that call is
refused, fails or loses its caller); one left by a gateway that died meanwhile keeps its debt
from being handed back (its answer stays in the forum) until retention takes both.

The gateway's own bookkeeping, like a webhook's cursor (its MongoDB role may write only such
collections), and in the store, not in a process: any replica collects what another owes.
Bounded (invariant 14): a token is owed at most ``YOKE_MCP_OWED_ANSWERS_PER_TOKEN`` answers
across its conversations (past it, its oldest debts are dropped: their answers stay in their
forums), and each carries its day's ``ageBucket``, so the gateway's sweep takes those never
collected after :data:`KEEP_DAYS`.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from dataclasses import dataclass

from yoke.core.ages import BUCKET_FIELD, day_bucket
from yoke.core.models import Message, utcnow
from yoke.store.database import Store
from yoke.store.retention import Rule

COLLECTION = "mcp_owed_answers"
KEEP_DAYS = 1.0
# A forum's debts looked at in one call at most, the oldest first (a debt of a deleted line is
# dropped on the way), so a lookup stays bounded.
MAX_STALE_DEBTS = 10
CLAIM_PREFIX = "claim:"


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


async def owed(store: Store, forum_id: str) -> AsyncGenerator[Debt]:
    """The forum's lines whose answers their callers have not had, the oldest first (at most
    :data:`MAX_STALE_DEBTS`): one indexed read, then each line as it is asked for."""
    collection = store.db[COLLECTION]
    found = collection.find({"forumId": forum_id}, {"lineId": 1}).sort("lineSeq", 1)
    for document in await found.limit(MAX_STALE_DEBTS).to_list():
        line = await store.get_message(str(document["lineId"]))
        if line is None:
            # The forum's lines were deleted meanwhile: nothing is owed for that one any more.
            await collection.delete_one({"_id": document["_id"]})
            continue
        yield Debt(str(document["_id"]), line)


def claim_id(debt: Debt) -> str:
    return CLAIM_PREFIX + debt.id


async def claim(store: Store, debt: Debt) -> bool:
    """Whether this call is the one to hand ``debt`` back: its claim inserted, and the debt
    still owed (not paid by the claim's holder before). A call that wins must
    :func:`paid` or :func:`give_back`."""
    collection = store.db[COLLECTION]
    claimed = {"_id": claim_id(debt), "at": utcnow(), BUCKET_FIELD: day_bucket()}
    if not await store.insert_if_absent(collection, claimed):
        return False
    if await collection.find_one({"_id": debt.id}, {"_id": 1}) is None:
        await give_back(store, debt)  # paid by the claim's holder before: owed no more
        return False
    return True


async def give_back(store: Store, debt: Debt) -> None:
    """The claim on ``debt`` given up: it is owed still, for a later call to hand back."""
    await store.db[COLLECTION].delete_one({"_id": claim_id(debt)})


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
    """The claimed debt handed back: exactly it (never a debt of the same forum written
    meanwhile), then its claim (after the debt: a call that wins the claim next finds no
    debt)."""
    await store.db[COLLECTION].delete_one({"_id": debt.id})
    await give_back(store, debt)

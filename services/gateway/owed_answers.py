"""The answers the MCP door owes its callers: a call that ran out of time (or whose caller went)
leaves its line's answer to be collected by the next call in that conversation.

One document per kept forum (``_id`` the forum's id, ``lineId`` the line whose answer is owed):
written when a call ends without its answer, deleted when a later call hands it over. The
gateway's own bookkeeping, like a webhook's cursor (its MongoDB role may write only such
collections), and in the store, not in a process: any replica collects what another owes.
Each carries its day's ``ageBucket``: the gateway's sweep takes those never collected after
:data:`KEEP_DAYS` (the answer itself stays in the forum; only the pointer to it goes).
"""

from __future__ import annotations

from yoke.ages import BUCKET_FIELD, day_bucket
from yoke.models import Message, utcnow
from yoke.retention import Rule
from yoke.store import Store

COLLECTION = "mcp_owed_answers"
KEEP_DAYS = 1.0


def retention_rule() -> Rule:
    return Rule("mcp owed answers", COLLECTION, "day", KEEP_DAYS)


async def owed_line(store: Store, forum_id: str) -> Message | None:
    """The line of the forum whose answer its caller has not had, if any: one read by id
    (and one more for the line when there is one)."""
    found = await store.db[COLLECTION].find_one({"_id": forum_id})
    if found is None:
        return None
    line = await store.get_message(str(found["lineId"]))
    if line is None:  # the forum's lines were deleted meanwhile: nothing is owed any more
        await paid(store, forum_id)
    return line


async def owe(store: Store, forum_id: str, line: Message) -> None:
    """Remember that ``line``'s answer is owed (replacing an earlier debt of the forum)."""
    owed = {"_id": forum_id, "lineId": line.id, "at": utcnow(), BUCKET_FIELD: day_bucket()}
    await store.db[COLLECTION].replace_one({"_id": forum_id}, owed, upsert=True)


async def paid(store: Store, forum_id: str) -> None:
    await store.db[COLLECTION].delete_one({"_id": forum_id})

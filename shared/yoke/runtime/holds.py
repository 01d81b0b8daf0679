"""Who holds a forum (docs/people-take-over.md): the door's record of a takeover.

A hold is a pair of forum lines, a person's ``/takeover`` and, later, a ``/handback``: the
lines are the truth (each join's processor reads them in order in its monologue and steps on
nothing in between), and this record is the door's index of them: whether a ``/takeover`` finds
the forum free, who may hand it back, and what ``yoke inbox``, the HTTP door and the metrics
show. The door writes it in the forum's lane (one writer), after the line it records.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from pydantic import Field

from yoke.core.models import CommandAuthor, Message, WireModel, utcnow
from yoke.runtime.instances import INGESTION, HeldSpan
from yoke.runtime.join_config import forum_join_configs
from yoke.runtime.while_busy import is_person_line
from yoke.store.database import Store

FORUM_HOLDS = "forum_holds"
MAX_HOLD_REASON_CHARS = 500


class ForumHold(WireModel):
    """A forum someone holds: stored under the forum's id, one at a time."""

    forum_id: str = Field(alias="_id")
    line_id: str  # the /takeover line
    holder: CommandAuthor
    reason: str | None = None
    since: datetime = Field(default_factory=utcnow)
    # The escalation the takeover claimed, if it was a claim.
    escalation_id: str | None = None

    def to_document(self) -> dict[str, Any]:
        return self.model_dump(mode="python", by_alias=True, exclude_none=True)


class Holds:
    """The ``forum_holds`` collection."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.collection = store.db[FORUM_HOLDS]

    async def get(self, forum_id: str) -> ForumHold | None:
        document = await self.collection.find_one({"_id": forum_id})
        return ForumHold.model_validate(document) if document else None

    async def take(self, hold: ForumHold) -> ForumHold:
        """Record ``hold`` unless the forum is held already: the hold that stands (a unique
        insert decides, docs/architecture.md invariant 8)."""
        if await self.store.insert_if_absent(self.collection, hold.to_document()):
            return hold
        stored = await self.get(hold.forum_id)
        return stored if stored is not None else hold

    async def release(self, forum_id: str, line_id: str) -> bool:
        """End the hold that ``line_id`` began (never a later one): whether it was there."""
        result = await self.collection.delete_one({"_id": forum_id, "lineId": line_id})
        return result.deleted_count > 0

    async def listed(self, forum_ids: list[str] | None = None, limit: int = 100) -> list[ForumHold]:
        query: dict[str, Any] = {} if forum_ids is None else {"_id": {"$in": forum_ids}}
        documents = await self.collection.find(query).limit(limit).to_list()
        return [ForumHold.model_validate(document) for document in documents]

    async def count(self) -> int:
        return await self.collection.count_documents({})


async def allowed_to_hold(store: Store, forum_id: str, external_id: str) -> bool:
    """Whether some join of the forum names ``external_id`` in its ``takeoverBy``: read only
    for a ``/takeover`` or ``/handback`` line, never on a turn's path."""
    configs = await forum_join_configs(store, forum_id, "takeoverBy", INGESTION)
    return any(external_id in (document.get("takeoverBy") or []) for document in configs)


def fold_held(transcript: list[Message], spans: list[HeldSpan]) -> list[Message]:
    """The transcript without people's lines said while the forum was held: the ``handback``
    instruction line says what they said, as what happened, not as lines to answer."""
    return [
        line
        for line in transcript
        if not (is_person_line(line) and (line.meta.held or any(s.holds(line) for s in spans)))
    ]

"""A line an actor instance failed on for good: recorded once, passed over, replayable.

docs/architecture.md, invariant 5: the record is a unique insert under an id derived from the
instance and the line, so a redelivery records nothing twice; it stays ``open`` until a replay
handles it. The record and what is done with it live here, above the store, which only holds
the collection (``Store.failures``).
"""

from __future__ import annotations

from datetime import datetime

from pydantic import Field

from yoke.core.ages import BUCKET_FIELD, day_bucket
from yoke.core.models import Document, utcnow
from yoke.store.database import Store


class Failure(Document):
    state_id: str
    actor: str
    service: str
    conversation_id: str
    message_id: str
    seq: int
    error: str
    open: bool = True
    created_at: datetime = Field(default_factory=utcnow)
    resolved_at: datetime | None = None
    # yoke.store.retention: the day it was recorded, then the day it was handled (kept from then).
    age_bucket: str = Field(default_factory=day_bucket)


async def record_failure(store: Store, failure: Failure) -> None:
    await store.insert_if_absent(store.failures, failure.to_document())


async def open_failures(store: Store, state_id: str) -> list[Failure]:
    found = await store.failures.find({"stateId": state_id, "open": True}).to_list()
    return sorted((Failure.from_document(d) for d in found), key=lambda f: f.seq)


async def close_failure(store: Store, failure_id: str) -> None:
    """Mark a failure handled; its instance's lane is its one writer."""
    await store.failures.update_one(
        {"_id": failure_id},
        # Retention counts from now: the same update, no operation more.
        {"$set": {"open": False, "resolvedAt": utcnow(), BUCKET_FIELD: day_bucket()}},
    )

"""A line an actor instance failed on for good: recorded once, passed over, replayable.

docs/architecture.md, invariant 5: the record is a unique insert under an id derived from the
instance and the line, so a redelivery records nothing twice; it stays ``open`` until a replay
handles it.
"""

from __future__ import annotations

from datetime import datetime

from pydantic import Field

from yoke.models import Document, utcnow
from yoke.retention import day_bucket


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
    # yoke.retention: the day it was recorded, then the day it was handled (kept from then).
    age_bucket: str = Field(default_factory=day_bucket)

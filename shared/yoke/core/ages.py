"""Age buckets: the UTC day or hour a record was written in, the key its retention sweeps by.

docs/architecture.md, invariant 14. FerretDB 1.x has no TTL indexes and reads a range on a
field by scanning the collection, so a record kept only for a while carries ``ageBucket``
(:data:`BUCKET_FIELD`), the day (``2026-12-01``) or the hour (``2026-12-01T16``) it was written
in: a string looked up by equality under an index. A leaf module, so that whatever writes such
records (the store, the outbox, failures) needs nothing of the sweep (:mod:`yoke.store.retention`).
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Literal

Unit = Literal["day", "hour"]

BUCKET_FIELD = "ageBucket"
SPAN = {"day": timedelta(days=1), "hour": timedelta(hours=1)}
_FORMAT = {"day": "%Y-%m-%d", "hour": "%Y-%m-%dT%H"}
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def age_bucket(unit: Unit, when: datetime | None = None) -> str:
    """The ``ageBucket`` of a record written at ``when`` (now by default)."""
    return (when or datetime.now(UTC)).astimezone(UTC).strftime(_FORMAT[unit])


def day_bucket(when: datetime | None = None) -> str:
    return age_bucket("day", when)


def hour_bucket(when: datetime | None = None) -> str:
    return age_bucket("hour", when)


def bucket_index(unit: Unit, when: datetime) -> int:
    """The bucket ``when`` falls in, as a count of units since the epoch: buckets a sweep can
    count through, where their names only compare."""
    return int((when - _EPOCH) // SPAN[unit])


def bucket_at(unit: Unit, index: int) -> str:
    """The ``ageBucket`` of the bucket :func:`bucket_index` counts as ``index``."""
    return age_bucket(unit, _EPOCH + index * SPAN[unit])

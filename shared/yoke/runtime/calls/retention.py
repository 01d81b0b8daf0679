"""How long a call's end and decision are kept once the call is over.

An end answers a late or repeated answer (``call_closed``, ``duplicate``), a decision a late
or repeated decision (``already_decided``), so both outlive their call by
``YOKE_RETENTION_DECISION_DAYS``; while the call is open they are kept whatever their age.
"""

from __future__ import annotations

from typing import Any

from yoke.runtime.calls.records import (
    TOOL_CALL_DECISIONS_COLLECTION,
    TOOL_CALL_ENDS_COLLECTION,
    TOOL_CALLS_COLLECTION,
)
from yoke.store.database import Store
from yoke.store.retention import Rule


def call_rules(store: Store, days: float) -> list[Rule]:
    """Ends and decisions, kept ``days`` and while their call is open: the processor's
    retention sweep owns them, by bucket, in bounded rounds."""
    calls = store.db[TOOL_CALLS_COLLECTION]

    async def call_open(document: dict[str, Any]) -> bool:
        return await calls.find_one({"_id": document["_id"]}, {"_id": 1}) is not None

    return [
        Rule("tool call ends", TOOL_CALL_ENDS_COLLECTION, "day", days, live=call_open),
        Rule("tool call decisions", TOOL_CALL_DECISIONS_COLLECTION, "day", days, live=call_open),
    ]

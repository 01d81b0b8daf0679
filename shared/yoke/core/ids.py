"""The one place ids are made: random for new things, derived for effects of a cause.

Derived ids make redelivery harmless (docs/architecture.md, invariant 4): the same cause yields the
same id, and the unique ``_id`` index turns the second write into a no-op.
"""

from __future__ import annotations

import hashlib
import uuid


def new_id() -> str:
    """A fresh opaque id (no dots, safe in routing keys)."""
    return uuid.uuid4().hex


def derive_id(kind: str, *causes: str) -> str:
    """A stable id for the effect ``kind`` of ``causes``: equal inputs, equal ids."""
    digest = hashlib.sha256("\x1f".join((kind, *causes)).encode()).hexdigest()
    return digest[:32]


def forwarded_line_id(monologue_line_id: str) -> str:
    """The id of the forum line egress makes of an agent's monologue line (the processor names
    it in advance: a streamed draft says which line will replace it)."""
    return derive_id("egress", monologue_line_id)


def submitted_line_id(conversation_id: str, idempotency_key: str) -> str:
    """The id of the line a submit command writes (its key as the door stores it): a repeat
    finds the line already written, and a door can name the line before it asks."""
    return derive_id("submit", conversation_id, idempotency_key)


# The author of lines the mesh itself writes: tool results, notices.
SYSTEM_ACTOR_ID = "system"

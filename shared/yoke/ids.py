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


# The author of lines the mesh itself writes: tool results, notices.
SYSTEM_ACTOR_ID = "system"

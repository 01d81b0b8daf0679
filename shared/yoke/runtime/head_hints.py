"""The monologue head an agent's forum line hints at, sealed so that only the mesh can read it.

Egress posts an agent's reply in the forum right after the processor wrote it in the agent's
monologue; whoever is delivered that forum line (ingestion, with the next person's line to copy)
writes in that monologue next, and learns its head from the line instead of from a failed insert
(docs/architecture.md, invariant 11). Bridges are delivered the very same event on
``yoke.forum``, and must learn neither the monologue's id nor its seqs: so the hint travels in
:data:`topology.HEAD_HEADER`, encrypted and authenticated under a key of the mesh's own, kept in
the store (which no outsider reads) and loaded by each process as it starts.

The seal is AES-256-GCM (``cryptography``), its associated data the forum line's id: a hint
opens only for the line it was sealed for. A hint that does not open (another key, or none
loaded yet) is no hint: it only ever saves an insert, never decides one.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import os
import secrets

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from pymongo.errors import DuplicateKeyError

from yoke.store.database import Store

KEYS = "mesh_keys"
KEY_ID = "monologue-head"
NONCE_BYTES = 12
SEQ_BYTES = 8  # a fixed width: the sealed length says nothing of how far the monologue is


class HeadHints:
    """Seals and opens ``(monologue id, seq)`` for one forum line, under the mesh's key."""

    def __init__(self, key: bytes | None = None) -> None:
        self._key = key

    @property
    def ready(self) -> bool:
        return self._key is not None

    async def load(self, store: Store) -> None:
        """The mesh's key, made by the first process that needs it (before any traffic)."""
        await store.create_collections(KEYS)
        keys = store.db[KEYS]
        document = await keys.find_one({"_id": KEY_ID})
        if document is None:
            # Another process may make it first: then theirs is the mesh's.
            with contextlib.suppress(DuplicateKeyError):
                await keys.insert_one({"_id": KEY_ID, "key": secrets.token_hex(32)})
            document = await keys.find_one({"_id": KEY_ID})
        assert document is not None
        self._key = bytes.fromhex(str(document["key"]))

    def seal(self, line_id: str, monologue_id: str, seq: int) -> str | None:
        """The hint for forum line ``line_id``; None until the key is loaded."""
        if self._key is None or not 0 < seq < 1 << (8 * SEQ_BYTES):
            return None
        plain = seq.to_bytes(SEQ_BYTES, "big") + monologue_id.encode()
        nonce = os.urandom(NONCE_BYTES)
        sealed = nonce + AESGCM(self._key).encrypt(nonce, plain, line_id.encode())
        return base64.urlsafe_b64encode(sealed).decode()

    def open(self, line_id: str, hint: object) -> tuple[str, int] | None:
        """``(monologue id, seq)`` from a hint sealed for ``line_id`` under this key, or None."""
        if self._key is None or not isinstance(hint, str):
            return None
        try:
            sealed = base64.urlsafe_b64decode(hint.encode())
            nonce, cipher = sealed[:NONCE_BYTES], sealed[NONCE_BYTES:]
            plain = AESGCM(self._key).decrypt(nonce, cipher, line_id.encode())
            monologue_id = plain[SEQ_BYTES:].decode()
        except (binascii.Error, ValueError, InvalidTag, UnicodeDecodeError):
            return None
        if len(plain) <= SEQ_BYTES:
            return None
        return monologue_id, int.from_bytes(plain[:SEQ_BYTES], "big")

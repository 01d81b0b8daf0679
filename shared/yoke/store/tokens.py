"""The HTTP gateway's bearer tokens (``yoke token create/list/revoke``).

Only a token's SHA-256 is stored: the secret is shown once, when it is made, and a copy of the
database gives nobody a working token. A token is named (the name is its ``_id``: unique by
insert) and scoped to the forums it names, or to all. What a token's callers say about
themselves is namespaced (:func:`namespaced`) by the token's own namespace, random and made
with it, so one token cannot speak as the people of another, nor a token revoked and made
again under the same name as the old one's people or with its idempotency keys. Tokens stored
before namespaces were random keep their name as namespace. Deciding a tool call's approval
is a right of its own (``can_approve``): a token that only posts lines, say a website's,
cannot also let an agent's tool run. So is reading what an agent keeps to itself, its
monologues (``can_read_monologues``): such a token reads its forums, never the agents' private
working there. Taking a forum over from its agents (``/takeover``, ``/handback``) and claiming
or canceling the escalations of its forums is one more (``can_take_over``), and so is
reading and erasing what agents remember of the people and lines of its forums
(``can_manage_memory``: docs/memory.md). Calling a
published agent (:mod:`yoke.store.publishing`) through the MCP and A2A doors is a right per
name (``can_call``). A right absent from a stored token is a right it has not
(stored before it existed, it never gains it).
"""

from __future__ import annotations

import hashlib
import re
import secrets
from datetime import datetime

from pydantic import Field
from pymongo.asynchronous.collection import AsyncCollection

from yoke.core.models import Document, utcnow
from yoke.store.database import Doc, Store

COLLECTION = "tokens"
# Letters, digits, '-' and '_': no ':' (the namespace separator) and short enough that a
# namespaced external id stays within the command's limits.
NAME_PATTERN = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
SECRET_PREFIX = "yoke_"


class TokenError(Exception):
    """A token command that cannot be carried out (the message says why)."""


class Token(Document):
    """A stored token: its name (``id``), the secret's hash, its forums (None: all, unless it
    may call agents), and whether its callers may decide approvals, read the agents'
    monologues and take the forums over in those forums."""

    hash: str
    forums: list[str] | None = None
    can_approve: bool = False
    can_read_monologues: bool = False
    # Take its forums over (a hold) and claim or cancel their escalations.
    can_take_over: bool = False
    # List, forget and erase the agents' memories taught in its forums, about its people.
    can_manage_memory: bool = False
    # Published agents' names its callers may call through the MCP and A2A doors.
    can_call: list[str] = Field(default_factory=list)
    created_at: datetime = Field(default_factory=utcnow)
    # None on tokens stored before namespaces were random: their name is their namespace.
    namespace: str | None = None

    @property
    def all_forums(self) -> bool:
        """Every forum is in scope: a token made without ``--forum`` and not to call agents. A
        caller's token (``--can-call``) reaches only the forums it was given: its calls go to
        forums kept for it, never to anyone else's (invariant 13)."""
        return self.forums is None and not self.can_call

    def allows(self, forum_id: str) -> bool:
        return self.all_forums or forum_id in (self.forums or [])

    def may_call(self, name: str) -> bool:
        return name in self.can_call

    def namespaced(self, value: str) -> str:
        return namespaced(self.namespace or self.id, value)


def namespaced(namespace: str, value: str) -> str:
    """``http:<namespace>:<value>``: an external id or idempotency key as a token's own."""
    return f"http:{namespace}:{value}"


def new_namespace(name: str) -> str:
    """``<name>~<64 random bits>``: readable in a line's external id, and never a name (no
    token name holds '~'), so never the namespace of a token stored before."""
    return f"{name}~{secrets.token_hex(8)}"


def hash_secret(secret: str) -> str:
    # The secret is 256 random bits: a plain digest is as good as a slow hash here, and cheap
    # enough to check on every request.
    return hashlib.sha256(secret.encode()).hexdigest()


def collection(store: Store) -> AsyncCollection[Doc]:
    return store.db[COLLECTION]


async def ensure_token_indexes(store: Store) -> None:
    """The collection (before first use: see :meth:`Store.create_collections`) and its unique
    hash index."""
    await store.create_collections(COLLECTION)
    await collection(store).create_index("hash", unique=True, name="hash")


async def create_token(
    store: Store,
    name: str,
    forums: list[str] | None = None,
    *,
    can_approve: bool = False,
    can_read_monologues: bool = False,
    can_take_over: bool = False,
    can_manage_memory: bool = False,
    can_call: list[str] | None = None,
) -> tuple[Token, str]:
    """A new token and its secret (the only time the secret exists outside the caller)."""
    if not NAME_PATTERN.match(name):
        raise TokenError(f"invalid token name {name!r}: use 1-64 letters, digits, '-' or '_'")
    for callee in can_call or []:
        # A published agent's name follows the token names' rule (yoke.store.publishing).
        if not NAME_PATTERN.match(callee):
            raise TokenError(f"invalid --can-call name {callee[:80]!r}")
    secret = SECRET_PREFIX + secrets.token_urlsafe(32)
    token = Token(
        id=name,
        hash=hash_secret(secret),
        forums=sorted(set(forums)) if forums else None,
        can_approve=can_approve,
        can_read_monologues=can_read_monologues,
        can_take_over=can_take_over,
        can_manage_memory=can_manage_memory,
        can_call=sorted(set(can_call or [])),
        namespace=new_namespace(name),
    )
    if not await store.insert_if_absent(collection(store), token.to_document()):
        raise TokenError(f"a token named {name!r} exists; revoke it first")
    return token, secret


async def list_tokens(store: Store) -> list[Token]:
    """Every token (operators have a handful: this is not a path any request takes)."""
    found = await collection(store).find({}).to_list()
    return sorted((Token.from_document(document) for document in found), key=lambda t: t.id)


async def revoke_token(store: Store, name: str) -> bool:
    """Delete the token; False if there was none by that name. Takes effect at once."""
    result = await collection(store).delete_one({"_id": name})
    return result.deleted_count > 0


async def find_token(store: Store, secret: str) -> Token | None:
    """The token whose secret this is (one indexed lookup), or None."""
    if not secret.startswith(SECRET_PREFIX) or len(secret) > 200:
        return None
    document = await collection(store).find_one({"hash": hash_secret(secret)})
    return Token.from_document(document) if document else None


async def token_in_force(store: Store, token: Token) -> bool:
    """``token`` (as found earlier) is still stored: not revoked, nor revoked and made again
    under its name. What an open stream checks now and then (one lookup by id)."""
    document = await collection(store).find_one({"_id": token.id}, {"hash": 1})
    return document is not None and document.get("hash") == token.hash

"""Outgoing webhooks: subscriptions, their cursors and dead letters, and the signature.

A subscription POSTs each agent line of one forum to a URL (``yoke webhook add``). What has
been delivered is a cursor per subscription (the forum seq handled last), not a held AMQP
delivery: a receiver may fail for an hour, far past RabbitMQ's consumer timeout. The gateway's
delivery worker (``services/gateway/webhooks.py``) is the cursor's one writer, under a lease.

Each POST body is signed: ``X-Yoke-Signature: sha256=<hex HMAC-SHA256 of the body, keyed by the
subscription's secret>``, and carries ``X-Yoke-Delivery``, an id derived from the subscription
and the line, the same for every retry of it (receivers deduplicate on it).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from datetime import datetime
from urllib.parse import urlsplit

from pydantic import Field
from pymongo import ASCENDING
from pymongo.asynchronous.collection import AsyncCollection

from yoke.ids import derive_id, new_id
from yoke.models import Document, Message, WireModel, utcnow
from yoke.store import Doc, Store

SUBSCRIPTIONS = "webhooks"
CURSORS = "webhook_cursors"
LEASES = "webhook_leases"
DEAD_LETTERS = "webhook_dead_letters"
COLLECTIONS = (SUBSCRIPTIONS, CURSORS, LEASES, DEAD_LETTERS)

SIGNATURE_HEADER = "X-Yoke-Signature"
DELIVERY_HEADER = "X-Yoke-Delivery"
SECRET_PREFIX = "whsec_"
MAX_URL_CHARS = 2000


class WebhookError(Exception):
    """A webhook command that cannot be carried out (the message says why)."""


class WebhookSubscription(Document):
    """One forum's agent lines, POSTed to ``url`` and signed with ``secret``."""

    forum_id: str
    url: str
    secret: str
    created_at: datetime = Field(default_factory=utcnow)


class Cursor(Document):
    """A subscription's progress (``id`` is the subscription's); one writer: the lease holder.

    ``seq``: the forum line handled last (delivered, refused or dead-lettered). While the
    receiver fails, ``failing_since`` marks the start of the streak (the retry window runs from
    it), ``attempts`` counts the failed tries of the line after ``seq`` and ``retry_at`` is
    when it is tried again.
    """

    forum_id: str
    seq: int = 0
    failing_since: datetime | None = None
    attempts: int = 0
    retry_at: datetime | None = None
    last_error: str | None = None


class DeadLetter(Document):
    """A line a subscription gave up on (``id`` is the delivery id): refused, or failing past
    the retry window. Kept for operators (the console, ``yoke webhook list``)."""

    subscription_id: str
    forum_id: str
    message_id: str
    seq: int
    url: str
    reason: str
    status: int | None = None
    attempts: int
    created_at: datetime = Field(default_factory=utcnow)


class Delivery(WireModel):
    """The body of one POST."""

    delivery_id: str
    subscription_id: str
    forum_id: str
    message: Message


def delivery_id(subscription_id: str, message_id: str) -> str:
    """Stable across retries and replicas: the same line to the same subscription."""
    return derive_id("webhook-delivery", subscription_id, message_id)


def sign(secret: str, body: bytes) -> str:
    """The ``X-Yoke-Signature`` value of ``body``."""
    return "sha256=" + hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()


def signature_matches(secret: str, body: bytes, header: str) -> bool:
    """What a receiver checks (in constant time) before it trusts a delivery."""
    return hmac.compare_digest(sign(secret, body), header)


def deliverable(line: Message) -> bool:
    """An agent's line for people: what a subscription POSTs (its answers, and the notices
    that tell the forum it could not answer)."""
    return line.role == "agent" and line.type in ("message", "notice")


def collection(store: Store, name: str) -> AsyncCollection[Doc]:
    return store.db[name]


async def ensure_webhook_indexes(store: Store) -> None:
    """The webhook collections (before first use: see :meth:`Store.create_collections`) and
    their indexes."""
    await store.create_collections(*COLLECTIONS)
    await collection(store, SUBSCRIPTIONS).create_index([("forumId", ASCENDING)], name="forum")
    await collection(store, LEASES).create_index(
        [("subscriptionId", ASCENDING)], name="subscription"
    )
    letters = collection(store, DEAD_LETTERS)
    await letters.create_index([("subscriptionId", ASCENDING)], name="subscription")
    await letters.create_index([("forumId", ASCENDING)], name="forum")


def shown_url(url: str) -> str:
    """``url`` as a dead letter may show it: its origin only. A receiver's password, or a secret
    kept in its path or query (Slack-style hooks), stays in the subscription, named by its id."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    port = f":{parts.port}" if parts.port else ""
    rest = "/…" if (parts.path not in ("", "/") or parts.query) else "/"
    return f"{parts.scheme}://{host}{port}{rest}"


def check_url(url: str) -> str:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise WebhookError(f"invalid webhook URL {url!r}: use http:// or https:// and a host")
    if len(url) > MAX_URL_CHARS:
        raise WebhookError(f"webhook URL is {len(url)} characters; the limit is {MAX_URL_CHARS}")
    return url


async def add_webhook(store: Store, forum_id: str, url: str) -> WebhookSubscription:
    """A new subscription with a fresh secret; it delivers the forum's lines from now on."""
    forum = await store.get_conversation(forum_id)
    if forum is None or forum.kind != "forum":
        raise WebhookError(f"unknown forum {forum_id}")
    subscription = WebhookSubscription(
        id=new_id(),
        forum_id=forum_id,
        url=check_url(url),
        secret=SECRET_PREFIX + secrets.token_urlsafe(32),
    )
    # The cursor first, at the forum's head: the worker never sees a subscription without one.
    cursor = Cursor(id=subscription.id, forum_id=forum_id, seq=await store.last_seq(forum_id))
    await store.insert_if_absent(collection(store, CURSORS), cursor.to_document())
    await collection(store, SUBSCRIPTIONS).insert_one(subscription.to_document())
    return subscription


async def list_webhooks(store: Store) -> list[WebhookSubscription]:
    """Every subscription (a few per forum at most: read whole, off the path of a turn)."""
    found = await collection(store, SUBSCRIPTIONS).find({}).to_list()
    return sorted(
        (WebhookSubscription.from_document(document) for document in found),
        key=lambda s: (s.created_at, s.id),
    )


async def load_cursor(store: Store, subscription_id: str) -> Cursor | None:
    document = await collection(store, CURSORS).find_one({"_id": subscription_id})
    return Cursor.from_document(document) if document else None


async def dead_letters(
    store: Store, forum_ids: list[str] | None = None, limit: int = 200
) -> list[DeadLetter]:
    """Dead letters, newest first, of the given forums (or all); removing a subscription
    keeps its letters."""
    query: Doc = {} if forum_ids is None else {"forumId": {"$in": forum_ids}}
    found = await collection(store, DEAD_LETTERS).find(query).limit(10_000).to_list()
    letters = [DeadLetter.from_document(document) for document in found]
    return sorted(letters, key=lambda letter: letter.created_at, reverse=True)[:limit]


async def remove_webhook(store: Store, subscription_id: str) -> bool:
    """Delete the subscription (its worker stops within seconds); False if there was none."""
    result = await collection(store, SUBSCRIPTIONS).delete_one({"_id": subscription_id})
    await collection(store, CURSORS).delete_one({"_id": subscription_id})
    await collection(store, LEASES).delete_many({"subscriptionId": subscription_id})
    return result.deleted_count > 0

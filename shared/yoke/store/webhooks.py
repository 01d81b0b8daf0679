"""Outgoing webhooks: subscriptions, their cursors and dead letters, and the signature.

A subscription POSTs each agent line of one forum to a URL (``yoke webhook add``). What has
been delivered is a cursor per subscription (the forum seq handled last), not a held AMQP
delivery: a receiver may fail for an hour, far past RabbitMQ's consumer timeout. The gateway's
delivery worker (``services/gateway/webhooks.py``) is the cursor's one writer, under a lease.

Each POST is signed: ``X-Yoke-Timestamp`` is when it was sent (Unix seconds) and
``X-Yoke-Signature: sha256=<hex HMAC-SHA256 of "<timestamp>." + body, keyed by the subscription's
secret>``, so a captured delivery cannot be sent again later (a receiver refuses a timestamp
outside its tolerance); ``X-Yoke-Delivery`` is an id derived from the subscription and the line,
the same for every retry of it (receivers deduplicate on it, which also refuses a copy sent
again within the tolerance: :class:`ReplayGuard`).
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import time
from collections import OrderedDict
from datetime import datetime
from urllib.parse import urlsplit

from pydantic import Field
from pymongo import ASCENDING
from pymongo.asynchronous.collection import AsyncCollection

from yoke.core.ages import day_bucket
from yoke.core.ids import derive_id, new_id
from yoke.core.models import Document, Message, WireModel, utcnow
from yoke.store.database import Doc, Store

SUBSCRIPTIONS = "webhooks"
CURSORS = "webhook_cursors"
LEASES = "webhook_leases"
DEAD_LETTERS = "webhook_dead_letters"
COLLECTIONS = (SUBSCRIPTIONS, CURSORS, LEASES, DEAD_LETTERS)

SIGNATURE_HEADER = "X-Yoke-Signature"
DELIVERY_HEADER = "X-Yoke-Delivery"
TIMESTAMP_HEADER = "X-Yoke-Timestamp"
# How far a receiver lets a delivery's timestamp be from its own clock (signature_matches).
TOLERANCE_SECONDS = 300.0
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
    # An A2A task's push notifications (services/gateway/a2a/push.py): that task's turn only,
    # as A2A events, until it ends; the door removes the subscription then.
    task_id: str | None = None


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
    # yoke.store.retention: kept YOKE_RETENTION_WEBHOOK_DEAD_LETTER_DAYS from this day.
    age_bucket: str = Field(default_factory=day_bucket)


class Delivery(WireModel):
    """The body of one POST."""

    delivery_id: str
    subscription_id: str
    forum_id: str
    message: Message


def delivery_id(subscription_id: str, message_id: str) -> str:
    """Stable across retries and replicas: the same line to the same subscription."""
    return derive_id("webhook-delivery", subscription_id, message_id)


def sign(secret: str, body: bytes, timestamp: str) -> str:
    """The ``X-Yoke-Signature`` value of ``body`` sent at ``timestamp`` (both are signed)."""
    signed = timestamp.encode() + b"." + body
    return "sha256=" + hmac.new(secret.encode(), signed, hashlib.sha256).hexdigest()


def signature_matches(
    secret: str,
    body: bytes,
    signature: str,
    timestamp: str,
    *,
    tolerance_seconds: float = TOLERANCE_SECONDS,
    now: float | None = None,
) -> bool:
    """What a receiver checks before it trusts a delivery: the signature (in constant time)
    over the timestamp and the body, and a timestamp within ``tolerance_seconds`` of ``now``
    (a delivery captured and sent again later is stale)."""
    if not re.fullmatch(r"[0-9]{1,12}", timestamp):
        return False
    if abs((time.time() if now is None else now) - int(timestamp)) > tolerance_seconds:
        return False
    return hmac.compare_digest(sign(secret, body, timestamp), signature)


class ReplayGuard:
    """A receiver's memory of the deliveries it took within the tolerance window.

    A copy of a delivery sent again within the window passes :func:`signature_matches`; its
    ``deliveryId`` (in the signed body) tells it apart. Older entries are forgotten (a copy
    that old is stale anyway), and at most ``limit`` are kept: memory stays bounded.
    """

    def __init__(self, tolerance_seconds: float = TOLERANCE_SECONDS, limit: int = 100_000) -> None:
        self.tolerance_seconds = tolerance_seconds
        self.limit = limit
        self._seen: OrderedDict[str, float] = OrderedDict()

    def first_time(self, delivery_id: str, timestamp: str, now: float | None = None) -> bool:
        """True the first time a delivery is seen (act on it); False for a copy (do not)."""
        now = time.time() if now is None else now
        while self._seen and (
            len(self._seen) >= self.limit
            or next(iter(self._seen.values())) < now - 2 * self.tolerance_seconds
        ):
            self._seen.popitem(last=False)
        if delivery_id in self._seen:
            return False
        self._seen[delivery_id] = now
        return True


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


class InvalidWebhookUrl(WebhookError):
    """A URL nothing could ever be delivered to (``yoke webhook add`` exits 2)."""


# A host name's characters (IDNA names are given in their xn-- form); IP literals pass too.
_HOST = re.compile(r"[A-Za-z0-9._~-]+|\[[0-9A-Fa-f:.]+\]")


def url_problem(url: str) -> str | None:
    """Why nothing could ever be delivered to ``url`` (None: it is usable).

    Checked when a subscription is added and again before delivering (one stored before this
    check, or by hand): a URL that can never work is reported, never retried."""
    if len(url) > MAX_URL_CHARS:
        return f"it is {len(url)} characters; the limit is {MAX_URL_CHARS}"
    if any(ord(char) <= 0x20 or ord(char) == 0x7F for char in url):
        return "it holds a space or a control character"
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as error:
        if "port" in str(error).lower():
            return "its port is not a number from 1 to 65535"
        return str(error)
    if parts.scheme not in ("http", "https"):
        return "use http:// or https://"
    if parts.username is not None or parts.password is not None:
        return "it holds credentials (user:password@); put a secret in the path or query instead"
    if not parts.hostname:
        return "it needs a host"
    if not _HOST.fullmatch(parts.netloc.rsplit(":", 1)[0] if port is not None else parts.netloc):
        return f"its host {parts.hostname!r} is not a valid host name"
    if port == 0:
        return "its port is not a number from 1 to 65535"
    return None


def check_url(url: str) -> str:
    if (problem := url_problem(url)) is not None:
        raise InvalidWebhookUrl(f"invalid webhook URL: {problem}")
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


async def trim_dead_letters(store: Store, subscription_id: str, kept: int) -> None:
    """Keep a subscription's newest ``kept`` letters (by forum seq), not one per line it ever
    gave up on (invariant 14; retention also drops them by age).

    Trimmed once a tenth more have piled up (at once for small bounds), so a receiver that
    refuses every line costs a read of its letters every ``kept // 10`` lines, not each one."""
    letters = collection(store, DEAD_LETTERS)
    query: Doc = {"subscriptionId": subscription_id}
    if await letters.count_documents(query) <= kept + kept // 10:
        return
    found = await letters.find(query, {"_id": 1, "seq": 1}).to_list()
    found.sort(key=lambda letter: (letter.get("seq", 0), str(letter["_id"])), reverse=True)
    for letter in found[kept:]:
        await letters.delete_one({"_id": letter["_id"]})


async def remove_webhook(store: Store, subscription_id: str) -> bool:
    """Delete the subscription (its worker stops within seconds); False if there was none."""
    result = await collection(store, SUBSCRIPTIONS).delete_one({"_id": subscription_id})
    await collection(store, CURSORS).delete_one({"_id": subscription_id})
    await collection(store, LEASES).delete_many({"subscriptionId": subscription_id})
    return result.deleted_count > 0

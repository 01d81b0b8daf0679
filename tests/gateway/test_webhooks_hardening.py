"""Webhooks against bad URLs, absent receivers and replayed deliveries.

The delivery worker runs in this process (on a database of each test's own) against a real
receiver over TCP; ``yoke webhook add`` runs as the real CLI. Nothing here needs the mesh: an
agent line is written to the store and announced on the bus as a poster would.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

import pytest

from services.gateway.webhooks import REFRESH_SECONDS, WebhookWorker
from tests.support.cli import run_yoke
from tests.support.processes import eventually, free_port
from tests.support.webhook_receiver import Receiver
from yoke.bus.broker import Bus
from yoke.core.ids import new_id
from yoke.core.models import Message, TextPart
from yoke.core.settings import Settings
from yoke.runtime.joins import create_forum
from yoke.runtime.posting import Poster
from yoke.store.database import Store
from yoke.store.webhooks import (
    CURSORS,
    DEAD_LETTERS,
    SUBSCRIPTIONS,
    TIMESTAMP_HEADER,
    Cursor,
    ReplayGuard,
    WebhookSubscription,
    add_webhook,
    collection,
    ensure_webhook_indexes,
    load_cursor,
    signature_matches,
)

pytestmark = pytest.mark.slow


@pytest.fixture
async def worker_store(mongodb_url: str) -> AsyncIterator[Store]:
    store = Store(mongodb_url)
    await store.ensure_indexes()
    await ensure_webhook_indexes(store)
    yield store
    await store.close()


@pytest.fixture
async def bus(amqp_url: str) -> AsyncIterator[Bus]:
    bus = Bus(amqp_url, name="test-webhook-hardening")
    await bus.connect()
    yield bus
    await bus.close()


async def agent_line(store: Store, bus: Bus, forum_id: str, text: str) -> None:
    await Poster(store, bus, "test").post(
        Message(
            id=new_id(),
            conversation_id=forum_id,
            author_actor_id="agent",
            role="agent",
            parts=[TextPart(text=text)],
        )
    )


@pytest.mark.parametrize(
    ("url", "said"),
    [
        ("ftp://127.0.0.1/hook", "http:// or https://"),
        ("http:///hook", "a host"),
        ("http://127.0.0.1:99999/hook", "port"),
        ("http://127.0.0.1:0/hook", "port"),
        ("http://127.0.0.1:abc/hook", "port"),
        ("https://user:secret@example.com/hook", "credentials"),
        ("http://exa mple.com/hook", "space"),
        ("http://bad!host/hook", "host"),
        ("http://[::1/hook", "invalid webhook URL"),
    ],
)
async def test_yoke_webhook_add_refuses_a_url_that_can_never_be_delivered_to(
    worker_store: Store, mongodb_url: str, url: str, said: str
) -> None:
    forum = await create_forum(worker_store, "bad urls")
    code, out, err = await run_yoke(
        {"YOKE_MONGODB_URL": mongodb_url}, "webhook", "add", "--forum", forum.id, "--url", url
    )
    assert code == 2, (out, err)
    assert said in err and "Traceback" not in err, err
    assert out == ""
    assert await collection(worker_store, SUBSCRIPTIONS).count_documents({}) == 0


async def test_a_stored_bad_url_is_reported_once_and_does_not_spin(
    amqp_url: str,
    mongodb_url: str,
    worker_store: Store,
    bus: Bus,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A subscription stored before URLs were checked (or written by hand): one clear warning,
    the problem on its cursor (``yoke webhook list`` shows it), no retry loop, no traceback."""
    forum = await create_forum(worker_store, "stored bad url")
    bad = WebhookSubscription(
        id=new_id(), forum_id=forum.id, url="http://127.0.0.1:99999/hook", secret="whsec_x"
    )
    await collection(worker_store, CURSORS).insert_one(
        Cursor(id=bad.id, forum_id=forum.id).to_document()
    )
    await collection(worker_store, SUBSCRIPTIONS).insert_one(bad.to_document())
    worker = WebhookWorker(
        Settings(amqp_url=amqp_url, mongodb_url=mongodb_url, webhook_backoff_seconds=0.05),
        worker_store,
    )
    caplog.set_level(logging.INFO, logger="services.gateway.webhooks")
    await worker.start()
    try:
        await agent_line(worker_store, bus, forum.id, "for nobody")

        async def reported() -> bool:
            cursor = await load_cursor(worker_store, bad.id)
            return cursor is not None and "invalid webhook URL" in (cursor.last_error or "")

        await eventually(reported, timeout=30, what="the bad URL on the subscription's cursor")
        await agent_line(worker_store, bus, forum.id, "and again")
        # Absence cannot be polled for: give a spinning runner several rounds to show itself.
        await asyncio.sleep(3 * REFRESH_SECONDS)
    finally:
        await worker.stop()
    mine = [r for r in caplog.records if bad.id in r.getMessage()]
    assert len(mine) == 1, [r.getMessage() for r in mine]
    assert mine[0].levelno == logging.WARNING and mine[0].exc_info is None
    assert "invalid webhook URL" in mine[0].getMessage() and "port" in mine[0].getMessage()
    assert await collection(worker_store, DEAD_LETTERS).count_documents({}) == 0


async def test_an_unreachable_receiver_backs_off_with_one_line_warnings(
    amqp_url: str,
    mongodb_url: str,
    worker_store: Store,
    bus: Bus,
    caplog: pytest.LogCaptureFixture,
) -> None:
    forum = await create_forum(worker_store, "nobody listens")
    subscription = await add_webhook(worker_store, forum.id, f"http://127.0.0.1:{free_port()}/")
    settings = Settings(
        amqp_url=amqp_url,
        mongodb_url=mongodb_url,
        webhook_backoff_seconds=0.1,
        webhook_backoff_cap_seconds=0.4,
    )
    worker = WebhookWorker(settings, worker_store)
    caplog.set_level(logging.INFO, logger="services.gateway.webhooks")
    await worker.start()
    try:
        await agent_line(worker_store, bus, forum.id, "anyone?")

        async def tried_often() -> bool:
            cursor = await load_cursor(worker_store, subscription.id)
            return cursor is not None and cursor.attempts >= 5

        await eventually(tried_often, timeout=30, what="five failed attempts")
    finally:
        await worker.stop()
    mine = [r for r in caplog.records if subscription.id in r.getMessage()]
    assert len(mine) >= 5
    assert all(r.levelno == logging.WARNING and r.exc_info is None for r in mine)
    assert all("\n" not in r.getMessage() for r in mine)
    # Bounded exponential: 0.1, 0.2, 0.4, 0.4 ... s.
    waits = [float(r.getMessage().rsplit("again in ", 1)[1].split(" ")[0]) for r in mine[:5]]
    assert waits[:3] == sorted(waits[:3]) and waits[0] < waits[2]
    assert max(waits) <= 0.4 + 0.05
    cursor = await load_cursor(worker_store, subscription.id)
    assert cursor is not None and cursor.seq == 0  # not given up on: within the retry window


async def test_a_subscriptions_dead_letters_are_bounded_by_count(
    amqp_url: str, mongodb_url: str, worker_store: Store, bus: Bus, receiver: Receiver
) -> None:
    """A receiver refusing every line leaves at most the newest N letters, not one per line."""
    forum = await create_forum(worker_store, "refused lines")
    path = f"/refusing-{new_id()}"
    receiver.answer(path, then=400)
    subscription = await add_webhook(worker_store, forum.id, receiver.url(path))
    settings = Settings(amqp_url=amqp_url, mongodb_url=mongodb_url, webhook_dead_letters_kept=3)
    worker = WebhookWorker(settings, worker_store)
    await worker.start()
    try:
        for n in range(7):
            await agent_line(worker_store, bus, forum.id, f"refused {n}")

        async def all_refused() -> bool:
            return len(receiver.at(path)) >= 7

        await eventually(all_refused, timeout=60, what="seven refused deliveries")

        async def settled() -> bool:
            cursor = await load_cursor(worker_store, subscription.id)
            return cursor is not None and cursor.seq >= 7

        await eventually(settled, timeout=30, what="the cursor past the seventh line")
    finally:
        await worker.stop()
    letters = (
        await collection(worker_store, DEAD_LETTERS)
        .find({"subscriptionId": subscription.id})
        .to_list()
    )
    assert sorted(letter["seq"] for letter in letters) == [5, 6, 7]


async def test_a_receiver_refuses_a_stale_or_replayed_delivery(
    amqp_url: str, mongodb_url: str, worker_store: Store, bus: Bus, receiver: Receiver
) -> None:
    """What a receiver does with a real delivery: the signature covers the timestamp, a stale
    timestamp or a changed one fails, and a second copy of a delivery is told apart."""
    forum = await create_forum(worker_store, "timestamped")
    path = f"/timestamped-{new_id()}"
    subscription = await add_webhook(worker_store, forum.id, receiver.url(path))
    worker = WebhookWorker(Settings(amqp_url=amqp_url, mongodb_url=mongodb_url), worker_store)
    await worker.start()
    try:
        await agent_line(worker_store, bus, forum.id, "signed with its time")

        async def delivered() -> bool:
            return len(receiver.delivered(path)) >= 1

        await eventually(delivered, timeout=30, what="the delivery")
    finally:
        await worker.stop()
    [request] = receiver.delivered(path)
    secret, body = subscription.secret, request.body
    signature = request.headers["x-yoke-signature"]
    stamp = request.headers[TIMESTAMP_HEADER.lower()]
    assert abs(int(stamp) - time.time()) < 30
    assert signature_matches(secret, body, signature, stamp)
    # The timestamp is signed: moved forward, the signature no longer matches.
    assert not signature_matches(secret, body, signature, str(int(stamp) + 1))
    assert not signature_matches(secret, body.replace(b"its time", b"a forgery"), signature, stamp)
    assert not signature_matches("whsec_other", body, signature, stamp)
    assert not signature_matches(secret, body, signature, "not a number")
    # Captured and sent again later: stale, whatever the signature says.
    later = int(stamp) + 301
    assert not signature_matches(secret, body, signature, stamp, now=later)
    assert signature_matches(secret, body, signature, stamp, now=later, tolerance_seconds=600)
    # Sent again within the window: the guard has seen the delivery already.
    guard = ReplayGuard()
    assert guard.first_time(request.json["deliveryId"], stamp)
    assert not guard.first_time(request.json["deliveryId"], stamp)
    assert guard.first_time(new_id(), stamp)

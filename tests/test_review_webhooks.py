"""Webhook defects found in review, each pinned by a test that failed on the code before.

- A replica that lost a subscription's lease mid-POST never moves its cursor back. Replica A
  POSTs a line; the receiver holds the request while A loses the store (its lease runs out)
  and replica B takes the subscription over and delivers that line and the next ones. When
  A's POST finally returned, A used to write the cursor it had over B's: B then sent the later
  lines again, after lines it had already sent (out of order, twice).
- A webhook dead letter names its receiver by origin only: no password, path or query.
  Letters are shown to every token whose scope holds their forum (the console) and printed by
  ``yoke webhook list``; a receiver's basic-auth password, or a secret kept in its path or
  query (Slack-style hooks), must not reach them (the subscription keeps the whole URL, to
  deliver; its id names it).
- A stopping gateway hands its webhook subscriptions over within seconds, store or no store.
  Releasing a held subscription deletes its lease buckets; with the store away each delete
  used to wait out the driver's server selection (10 s) in turn, two buckets per
  subscription, so a SIGTERM'd gateway took minutes to exit.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator

import pytest

from services.gateway.webhooks import WebhookWorker
from tests.support.processes import eventually, free_port
from yoke.bus import Bus
from yoke.ids import new_id
from yoke.models import Message, TextPart
from yoke.runtime.joins import create_forum
from yoke.runtime.posting import Poster
from yoke.settings import Settings
from yoke.store import Store
from yoke.webhooks import add_webhook, dead_letters, ensure_webhook_indexes, load_cursor


@pytest.fixture
async def store(mongodb_url: str) -> AsyncIterator[Store]:
    store = Store(mongodb_url)
    await store.ensure_indexes()
    await ensure_webhook_indexes(store)
    yield store
    await store.close()


LEASE_SECONDS = 2.0
# What a stopping replica may take to leave with the store away (ownership's bound is 5 s).
STOP_SECONDS = 8.0


class HoldingReceiver:
    """Answers 200 at once, except the first POST of the text ``held``: until ``release``."""

    def __init__(self) -> None:
        self.texts: list[str] = []
        self.release = asyncio.Event()
        self.holding = asyncio.Event()
        self._server: asyncio.Server | None = None
        self.port = 0

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        self.release.set()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await reader.readline()
            length = 0
            while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
                name, _, value = line.decode("latin-1").partition(":")
                if name.strip().lower() == "content-length":
                    length = int(value)
            body = json.loads(await reader.readexactly(length))
            text = body["message"]["parts"][0]["text"]
            first_held = text == "held" and not self.holding.is_set()
            self.texts.append(text)
            if first_held:
                self.holding.set()
                await self.release.wait()
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
            await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()


async def test_a_replica_that_lost_the_lease_mid_post_leaves_the_cursor_alone(
    amqp_url: str, mongodb_url: str, store: Store
) -> None:
    receiver = HoldingReceiver()
    await receiver.start()
    forum = await create_forum(store, "cursor")
    subscription = await add_webhook(store, forum.id, f"http://127.0.0.1:{receiver.port}/hook")
    settings = Settings(
        amqp_url=amqp_url,
        mongodb_url=mongodb_url,
        webhook_lease_seconds=LEASE_SECONDS,
        webhook_timeout_seconds=60,
    )
    bus = Bus(amqp_url, name="test-cursor")
    await bus.connect()
    poster = Poster(store, bus, "test")
    first, second = WebhookWorker(settings, store), WebhookWorker(settings, store)
    away = Store(f"mongodb://127.0.0.1:{free_port()}/yoke")  # nobody listens there

    async def say(text: str) -> None:
        await poster.post(
            Message(
                id=new_id(),
                conversation_id=forum.id,
                author_actor_id="agent",
                role="agent",
                parts=[TextPart(text=text)],
            )
        )

    try:
        await first.start()

        async def first_holds() -> bool:
            return first.leases.held() == 1

        await eventually(first_holds, timeout=30, what="the first replica to hold it")
        await second.start()
        await say("held")
        await asyncio.wait_for(receiver.holding.wait(), 30)
        first.leases.store = away  # the first replica loses the store: its lease runs out

        async def second_holds() -> bool:
            return second.leases.held() == 1 and not first.leases.holds(subscription.id)

        await eventually(second_holds, timeout=30, what="the second replica to take over")
        for text in ("one", "two"):
            await say(text)

        async def delivered_two() -> bool:
            return "two" in receiver.texts

        await eventually(delivered_two, timeout=30, what="the second replica to deliver")
        head = (await load_cursor(store, subscription.id)).seq  # type: ignore[union-attr]
        receiver.release.set()  # the first replica's POST returns at last
        await asyncio.sleep(3 * LEASE_SECONDS)
        cursor = await load_cursor(store, subscription.id)
        assert cursor is not None and cursor.seq >= head
        assert receiver.texts.count("one") == 1 and receiver.texts.count("two") == 1, receiver.texts
    finally:
        await second.stop()
        await first.stop()
        await away.close()
        await bus.close()
        await receiver.close()


async def test_a_dead_letter_shows_no_url_password(
    amqp_url: str, mongodb_url: str, store: Store
) -> None:
    forum = await create_forum(store, "letters")
    # Nobody listens there, and the retry window is zero: the first failure is a dead letter.
    port = free_port()
    url = f"http://hook-user:hunter2-secret@127.0.0.1:{port}/hook/T0/pathsecret42?k=querysecret42"
    subscription = await add_webhook(store, forum.id, url)
    settings = Settings(amqp_url=amqp_url, mongodb_url=mongodb_url, webhook_retry_window_seconds=0)
    worker = WebhookWorker(settings, store)
    bus = Bus(amqp_url, name="test-letters")
    await bus.connect()
    await worker.start()
    try:
        await Poster(store, bus, "test").post(
            Message(
                id=new_id(),
                conversation_id=forum.id,
                author_actor_id="agent",
                role="agent",
                parts=[TextPart(text="an agent line")],
            )
        )

        async def dead_lettered() -> bool:
            return bool(await dead_letters(store, [forum.id]))

        await eventually(dead_lettered, timeout=60, what="the line to be dead-lettered")
    finally:
        await worker.stop()
        await bus.close()
    [letter] = await dead_letters(store, [forum.id])
    assert letter.subscription_id == subscription.id
    shown = letter.model_dump_json()
    for secret in ("hunter2-secret", "pathsecret42", "querysecret42"):
        assert secret not in shown, shown
    assert letter.url == f"http://127.0.0.1:{port}/…"


async def test_stopping_with_the_store_away_takes_seconds(
    amqp_url: str, mongodb_url: str, store: Store
) -> None:
    forums = [await create_forum(store, f"webhook stop {n}") for n in range(3)]
    for forum in forums:
        # Nothing is ever POSTed (the forums stay silent): the URL need not answer.
        await add_webhook(store, forum.id, "http://127.0.0.1:9/hook")
    worker = WebhookWorker(
        Settings(amqp_url=amqp_url, mongodb_url=mongodb_url, webhook_lease_seconds=30), store
    )
    await worker.start()
    away = Store(f"mongodb://127.0.0.1:{free_port()}/yoke")  # nobody listens there
    try:

        async def holds_all() -> bool:
            return worker.leases.held() == len(forums)

        await eventually(holds_all, timeout=30, what="the worker to hold every subscription")
        worker.leases.store = away  # the store goes away
        started = time.monotonic()
        await worker.stop()
        took = time.monotonic() - started
    finally:
        await away.close()
    assert took < STOP_SECONDS, f"stopping took {took:.1f} s with the store away"

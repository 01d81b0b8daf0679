"""A replica that lost a subscription's lease mid-POST never moves its cursor back.

Replica A POSTs a line; the receiver holds the request while A loses the store (its lease
runs out) and replica B takes the subscription over and delivers that line and the next ones.
When A's POST finally returns, A used to write the cursor it had (that first line) over B's:
B then sent the later lines again, after lines it had already sent (out of order, twice).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import pytest

from services.gateway.webhooks import WebhookWorker
from tests.support.processes import eventually, free_port
from yoke.bus import Bus
from yoke.ids import new_id
from yoke.joins import create_forum
from yoke.models import Message, TextPart
from yoke.posting import Poster
from yoke.settings import Settings
from yoke.store import Store
from yoke.webhooks import add_webhook, ensure_webhook_indexes, load_cursor

LEASE_SECONDS = 2.0


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


@pytest.fixture
async def store(mongodb_url: str) -> AsyncIterator[Store]:
    store = Store(mongodb_url)
    await store.ensure_indexes()
    await ensure_webhook_indexes(store)
    yield store
    await store.close()


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

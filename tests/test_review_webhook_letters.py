"""A webhook dead letter names its receiver by origin only: no password, path or query.

Letters are shown to every token whose scope holds their forum (the console) and printed by
``yoke webhook list``; a receiver's basic-auth password in the subscription URL, or a secret
kept in its path or query (Slack-style hooks), must not reach them (the subscription itself
keeps the whole URL, to deliver; its id names it).
"""

from __future__ import annotations

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
from yoke.webhooks import add_webhook, dead_letters, ensure_webhook_indexes


@pytest.fixture
async def store(mongodb_url: str) -> AsyncIterator[Store]:
    store = Store(mongodb_url)
    await store.ensure_indexes()
    await ensure_webhook_indexes(store)
    yield store
    await store.close()


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

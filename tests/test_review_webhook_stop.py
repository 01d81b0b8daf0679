"""A stopping gateway hands its webhook subscriptions over within seconds, store or no store.

Releasing a held subscription deletes its lease buckets; with the store away each delete used
to wait out the driver's server selection (10 s) in turn, two buckets per subscription, so a
SIGTERM'd gateway took minutes to exit (``yoke up`` kills it after its grace period).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import pytest

from services.gateway.webhooks import WebhookWorker
from tests.support.processes import eventually, free_port
from yoke.joins import create_forum
from yoke.settings import Settings
from yoke.store import Store
from yoke.webhooks import add_webhook, ensure_webhook_indexes

# What a stopping replica may take to leave with the store away (ownership's bound is 5 s).
STOP_SECONDS = 8.0


@pytest.fixture
async def store(mongodb_url: str) -> AsyncIterator[Store]:
    store = Store(mongodb_url)
    await store.ensure_indexes()
    await ensure_webhook_indexes(store)
    yield store
    await store.close()


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

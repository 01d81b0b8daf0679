"""How much the store grows per 1,000 echo turns, collection by collection (docs/operations.md).

    .venv/bin/python -m bench.store_growth --turns 1000 --forums 10

Runs the five services on a throwaway vhost and database (:mod:`bench.sandbox`), joins an echo
agent to ``--forums`` forums, then submits ``--turns`` lines through the door (one at a time per
forum, each until its answer is seen), and prints one JSON line per collection: the documents
and bytes (``collStats`` size, i.e. the documents' data) it gained, scaled to 1,000 turns.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from bench.sandbox import management_url_for, sandbox
from bench.services import Services
from bench.turns import Tracker, Turns
from yoke.bus.broker import Bus
from yoke.client import Client
from yoke.core.settings import Settings
from yoke.runtime.joins import create_agent, create_forum, join_conversation
from yoke.runtime.posting import Poster
from yoke.store.database import Store


async def sizes(store: Store) -> dict[str, tuple[int, int]]:
    """(documents, bytes) of every collection."""
    found: dict[str, tuple[int, int]] = {}
    for name in sorted(await store.db.list_collection_names()):
        stats: dict[str, Any] = await store.db.command("collStats", name)
        found[name] = (int(stats.get("count", 0)), int(stats.get("size", 0)))
    return found


async def measure(turns: int, forums: int) -> list[dict[str, object]]:
    settings = Settings()
    management = management_url_for(settings.amqp_url, settings.management_url)
    async with sandbox(settings.amqp_url, settings.mongodb_url, management) as box:
        env = {
            **os.environ,
            "YOKE_AMQP_URL": box.amqp_url,
            "YOKE_MONGODB_URL": box.mongodb_url,
            "YOKE_SHARDS": "2",
            "YOKE_LOG_LEVEL": "WARNING",
        }
        services = Services(env, Path(tempfile.mkdtemp(prefix="yoke-growth-")))
        await services.start(within=120)
        store = Store(box.mongodb_url, app_name="bench-growth")
        bus = Bus(box.amqp_url, name="bench-growth")
        tracker = Tracker(box.amqp_url)
        try:
            await store.ensure_indexes()
            await bus.connect()
            await tracker.start()
            poster = Poster(store, bus, "bench")
            agent = await create_agent(store, "echo")
            ids = []
            for index in range(forums):
                forum = await create_forum(store, f"growth {index}")
                await join_conversation(store, poster, agent.id, forum.id)
                tracker.forums.add(forum.id)
                ids.append(forum.id)
            async with Client(box.amqp_url) as client:
                run = Turns(client, tracker, patience=60)
                await run.turn(ids[0])  # every service warm, every collection made
                before = await sizes(store)
                per_forum = max(1, turns // forums)

                async def loop(forum_id: str) -> None:
                    for _ in range(per_forum):
                        await run.turn(forum_id)

                # A turn ends when its forum reply is seen: egress's write is the last one.
                await asyncio.gather(*(loop(forum_id) for forum_id in ids))
                after = await sizes(store)
            done = per_forum * forums
            rows: list[dict[str, object]] = []
            for name, (count, size) in after.items():
                was_count, was_size = before.get(name, (0, 0))
                if (count, size) == (was_count, was_size):
                    continue
                rows.append(
                    {
                        "collection": name,
                        "documentsPer1000Turns": round((count - was_count) * 1000 / done),
                        "kbPer1000Turns": round((size - was_size) * 1000 / done / 1024, 1),
                    }
                )
            return rows
        finally:
            await tracker.close()
            await bus.close()
            await store.close()
            await services.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=1000)
    parser.add_argument("--forums", type=int, default=10)
    args = parser.parse_args()
    for row in asyncio.run(measure(args.turns, args.forums)):
        print(json.dumps(row))


if __name__ == "__main__":
    main()

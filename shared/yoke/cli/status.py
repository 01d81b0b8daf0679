"""``yoke status``: each service's live replicas, the shards each owns, and their queue depth.

One JSON line per replica, from the ``replicas`` collection (:mod:`yoke.coordination.ownership`)
and a passive look at the shard queues: ``{"service", "replica", "pid", "metricsPort", "shards",
"queueDepth"}`` (plus ``host``: under docker compose, whose replicas share one replica
number, the container). ``queueDepth`` counts the messages waiting in the shards it owns.
"""

from __future__ import annotations

import argparse
import json
from datetime import UTC, datetime, timedelta
from typing import Any

from yoke.coordination.ownership import EXPIRES_SECONDS, REPLICAS, dead_here
from yoke.coordination.reshard import connection_to, shard_queues
from yoke.core.models import as_utc
from yoke.core.settings import Settings
from yoke.store.database import Store


async def replica_lines(
    amqp_url: str, mongodb_url: str, services: list[str] | None = None
) -> list[dict[str, Any]]:
    """What ``yoke status`` prints, one dict per live replica, by service and replica."""
    store = Store(mongodb_url, app_name="yoke-cli")
    try:
        documents = await store.db[REPLICAS].find({}).to_list()
    finally:
        await store.close()
    now = datetime.now(UTC)
    live = [
        document
        for document in documents
        if (services is None or document.get("service") in services)
        and now - as_utc(document["beat"]) < timedelta(seconds=EXPIRES_SECONDS)
        and not dead_here(document)
    ]
    depths: dict[str, list[int]] = {}
    async with connection_to(amqp_url) as connection:
        for service in sorted({str(document["service"]) for document in live}):
            depths[service] = [queue.messages for queue in await shard_queues(connection, service)]
    lines = []
    for document in sorted(
        live, key=lambda d: (d["service"], d.get("replica", 0), as_utc(d["startedAt"]))
    ):
        shards = [int(shard) for shard in document.get("shards", [])]
        counts = depths.get(str(document["service"]), [])
        lines.append(
            {
                "service": document["service"],
                "replica": document.get("replica", 0),
                "pid": document.get("pid"),
                "metricsPort": document.get("metricsPort"),
                "shards": shards,
                "queueDepth": sum(counts[shard] for shard in shards if shard < len(counts)),
                "host": document.get("host"),
            }
        )
    return lines


async def status(args: argparse.Namespace) -> None:
    settings = Settings()
    for line in await replica_lines(settings.amqp_url, settings.mongodb_url, args.service):
        print(json.dumps(line, separators=(",", ":")))


def register(commands: Any) -> None:
    """Adds ``yoke status`` to the CLI's subcommands."""
    text = "each service's live replicas: one JSON line with the shards it owns and queue depth"
    sub: argparse.ArgumentParser = commands.add_parser("status", help=text, description=text)
    sub.set_defaults(handler=status)
    sub.add_argument("--service", action="append", help="only this service (repeatable)")

"""Waits until a RabbitMQ (AMQP connect) or a MongoDB-wire server (``ping``) answers.

Used by ``services.sh``; prints a progress line every few seconds and exits 1 at the deadline.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import time

from pymongo import AsyncMongoClient

from yoke.bus import amqp_nodes
from yoke.core import tls


async def amqp_answers(url: str) -> None:
    """Any node of ``url`` (one URL or a comma-separated list of a cluster's nodes) answers."""
    connection = await amqp_nodes.connect(url, connect_timeout=3)
    await connection.close()


async def mongodb_answers(url: str) -> None:
    client: AsyncMongoClient[dict[str, object]] = AsyncMongoClient(
        url, serverSelectionTimeoutMS=3000, **tls.mongodb_options()
    )
    try:
        await client.admin.command("ping")
    finally:
        await client.close()


async def wait(kind: str, url: str, deadline: float) -> bool:
    check = amqp_answers if kind == "amqp" else mongodb_answers
    started = time.monotonic()
    last_report = started
    while True:
        try:
            await check(url)
            return True
        except Exception as error:
            now = time.monotonic()
            if now - started > deadline:
                print(f"[services] {kind}: still no answer: {error}", file=sys.stderr)
                return False
            if now - last_report >= 5:
                print(f"[services] {kind}: not yet ({now - started:.0f}s)", flush=True)
                last_report = now
            await asyncio.sleep(0.5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("kind", choices=["amqp", "mongodb"])
    parser.add_argument("url")
    parser.add_argument("--deadline", type=float, default=120)
    args = parser.parse_args()
    # Refused connections are expected while a server starts; the progress lines say enough.
    logging.disable(logging.CRITICAL)
    sys.exit(0 if asyncio.run(wait(args.kind, args.url, args.deadline)) else 1)


if __name__ == "__main__":
    main()

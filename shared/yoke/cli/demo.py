"""``make run``: the mesh as ``yoke up`` runs it, plus a demo agent and forum on first run."""

from __future__ import annotations

import asyncio
import contextlib
import sys

import httpx

from yoke.bus.broker import Bus
from yoke.cli import supervisor
from yoke.core.ids import derive_id
from yoke.core.settings import SERVICES, Settings
from yoke.runtime.joins import create_agent, create_forum, join_conversation
from yoke.runtime.posting import Poster
from yoke.store.database import Store

DEMO_AGENT_ID = derive_id("demo", "agent")
DEMO_FORUM_ID = derive_id("demo", "forum")


async def all_healthy() -> bool:
    async with httpx.AsyncClient(timeout=2) as client:
        for port in SERVICES.values():
            try:
                if (await client.get(f"http://127.0.0.1:{port}/healthz")).status_code != 200:
                    return False
            except httpx.HTTPError:
                return False
    return True


async def wait_healthy(deadline: float = 120) -> None:
    loop = asyncio.get_running_loop()
    give_up = loop.time() + deadline
    while not await all_healthy():
        if loop.time() > give_up:
            raise SystemExit("[demo] services did not become healthy; see their logs above")
        await asyncio.sleep(0.5)


async def ensure_demo(settings: Settings) -> None:
    """Idempotent: the same agent, forum and join on every run."""
    store = Store(settings.mongodb_url, app_name="yoke-demo")
    bus = Bus(settings.amqp_url, name="yoke-demo")
    try:
        await store.ensure_indexes()
        await bus.connect()
        await create_agent(store, "echo", actor_id=DEMO_AGENT_ID)
        await create_forum(store, "demo", forum_id=DEMO_FORUM_ID)
        # No configuration: a join made earlier keeps the one ``yoke join --config`` gave it.
        await join_conversation(store, Poster(store, bus, "demo"), DEMO_AGENT_ID, DEMO_FORUM_ID)
    finally:
        await bus.close()
        await store.close()


async def main() -> None:
    settings = Settings()
    mesh = asyncio.create_task(supervisor.run())
    await wait_healthy()
    await ensure_demo(settings)
    print(
        "\n[demo] the mesh is up with an echo agent in forum 'demo'. In another terminal:\n"
        f"    .venv/bin/yoke chat --forum {DEMO_FORUM_ID} --as you\n"
        "[demo] to give the join a configuration (follow-up, guardian: see docs/using.md):\n"
        f"    .venv/bin/yoke join --agent {DEMO_AGENT_ID} --forum {DEMO_FORUM_ID} "
        "--config join.json\n"
        "[demo] Ctrl-C stops the services.\n",
        flush=True,
    )
    await mesh


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(main())
    sys.exit(0)

"""Posts N lines into one conversation from a process of its own (seq contention, outbox)."""

from __future__ import annotations

import asyncio
import sys

from yoke.bus.broker import Bus
from yoke.core.ids import new_id
from yoke.core.models import Message, TextPart
from yoke.core.settings import Settings
from yoke.runtime.posting import Poster
from yoke.store.database import Store


async def main(conversation_id: str, count: int, label: str) -> None:
    settings = Settings()
    store = Store(settings.mongodb_url)
    bus = Bus(settings.amqp_url, name=f"post-lines-{label}")
    await bus.connect()
    poster = Poster(store, bus, "test")
    for index in range(count):
        await poster.post(
            Message(
                id=new_id(),
                conversation_id=conversation_id,
                author_actor_id=label,
                parts=[TextPart(text=f"{label}-{index}")],
            )
        )
    await bus.close()
    await store.close()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], int(sys.argv[2]), sys.argv[3]))

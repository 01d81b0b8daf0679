"""Watching the forums fill with answers, to time how long the mesh takes to recover.

The store is the truth (an answer is a stored forum line with ``meta.inReplyTo``), and polling
it keeps working across broker restarts, which a bus subscription would have to survive first.
Polls fail while the store is away; that is simply time in which nothing is seen to flow.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field

from yoke.store.database import Store


@dataclass
class Answers:
    store: Store
    forum_ids: list[str]
    interval: float = 0.5
    # answer id -> (the line it answers, when the harness first saw it)
    seen: dict[str, tuple[str, float]] = field(default_factory=dict)
    answered: set[str] = field(default_factory=set)  # the lines answered (their ids)
    poll_errors: int = 0

    def first_seen_by_line(self) -> dict[str, float]:
        first: dict[str, float] = {}
        for line_id, at in self.seen.values():
            first[line_id] = min(at, first.get(line_id, at))
        return first

    async def poll_once(self) -> None:
        for forum_id in self.forum_ids:
            cursor = self.store.messages.find(
                {"conversationId": forum_id, "role": "agent"}, {"meta.inReplyTo": 1}
            )
            async for document in cursor:
                reply_to = (document.get("meta") or {}).get("inReplyTo")
                if reply_to and document["_id"] not in self.seen:
                    self.seen[document["_id"]] = (str(reply_to), time.monotonic())
                    self.answered.add(str(reply_to))

    async def run(self, stopping: asyncio.Event) -> None:
        while not stopping.is_set():
            try:
                async with asyncio.timeout(15):
                    await self.poll_once()
            except Exception:
                self.poll_errors += 1
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stopping.wait(), self.interval)

"""TEMPORARY, for services/processor only, while it is being made a package (issue #31).

The calls' modules are :mod:`yoke.runtime.calls`; this keeps the processor's imports and its
``OpenCalls(store, poster, share=...)``, ``run_reaper`` and ``end_for_forum`` working until its
lines are changed to them. Delete it then; nothing else may import it.
"""

from __future__ import annotations

import asyncio

from yoke.models import CommandAuthor
from yoke.runtime.calls import repository
from yoke.runtime.calls.reaper import Reaper, ReapShare
from yoke.runtime.calls.records import OpenCall, open_call_id
from yoke.runtime.calls.records import own_result_line_id as result_line_id
from yoke.runtime.calls.records import round_results_line_id as round_results_id
from yoke.runtime.calls.retention import call_rules
from yoke.runtime.calls.stops import stop_forum_calls
from yoke.runtime.posting import Poster
from yoke.store import Store

__all__ = [
    "OpenCall",
    "OpenCalls",
    "ReapShare",
    "call_rules",
    "open_call_id",
    "result_line_id",
    "round_results_id",
]


class OpenCalls(repository.OpenCalls):
    def __init__(self, store: Store, poster: Poster, *, share: ReapShare | None = None) -> None:
        super().__init__(store, poster)
        self._reaper = Reaper(self, share)

    async def run_reaper(self, stopping: asyncio.Event) -> None:
        await self._reaper.run(stopping)

    async def end_for_forum(
        self, forum_id: str, by: CommandAuthor, *, agent_actor_id: str | None = None
    ) -> int:
        return await stop_forum_calls(self, forum_id, by, agent_actor_id=agent_actor_id)

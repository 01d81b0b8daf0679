"""Follow-up: nudges an agent that spoke last in a forum when nobody answered (``scheduler``).

Forum lines arrive as ``conversation.message.posted`` (monologue lines are ignored from a
cache); a scheduler task in the same process fires what is due once the service serves.
"""

from __future__ import annotations

import asyncio
import logging

from services.followup.scheduler import FollowUps
from yoke.models import MessagePosted
from yoke.runtime.service import Service

log = logging.getLogger(__name__)

SERVING_CHECK_SECONDS = 0.2
# The loop keeps only weak references to tasks.
_schedulers: set[asyncio.Task[None]] = set()


async def schedule_when_serving(service: Service, followups: FollowUps) -> None:
    """The scheduler, from the moment the process consumes (its nudges need the broker)."""
    while await service.problems():
        if service.stopping.is_set():
            return
        await asyncio.sleep(SERVING_CHECK_SECONDS)
    await followups.run(service.stopping)


def register(service: Service) -> None:
    followups = FollowUps(service.store, service.poster)
    service.on_event(
        MessagePosted, followups.on_posted, where=[{"kind": "forum", "type": "message"}]
    )
    scheduler = asyncio.get_running_loop().create_task(schedule_when_serving(service, followups))

    def report(task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error("the follow-up scheduler stopped", exc_info=task.exception())

    _schedulers.add(scheduler)
    scheduler.add_done_callback(report)
    scheduler.add_done_callback(_schedulers.discard)

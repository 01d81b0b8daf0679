"""A task's events for a subscriber the running process cannot serve: read from the mesh.

a2a-sdk serves a resubscription (``SubscribeToTask``, 0.3's ``tasks/resubscribe``) from the
process running the task when it is this one; otherwise it tails a :class:`TaskEventStream`.
Here that stream is the mesh itself: the task's record names its forum and line, and the turn
is followed from the forum's events and the store (:func:`~services.gateway.calling.follow_turn`)
exactly as the process running it follows it. So a subscriber reaches a task after that
process restarted or died, on any gateway, and nothing need be published: :meth:`publish` is
a no-op.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncGenerator

from a2a.server.cluster.event_stream import TaskEventStream, VersionedEvent
from a2a.server.cluster.version import TaskVersion

from services.gateway.a2a.task_store import MeshTaskStore
from services.gateway.a2a.turns import TurnTranslator, following_turn
from services.gateway.calling import Answered, Failed
from services.gateway.deps import Gateway


class MeshEventStream(TaskEventStream):
    def __init__(self, state: Gateway, tasks: MeshTaskStore) -> None:
        self.state = state
        self.tasks = tasks

    async def publish(self, task_id: str, event: VersionedEvent) -> None:
        """Nothing to send: every process follows the forum itself."""

    async def destroy(self, task_id: str) -> None:
        """Nothing held per task."""

    async def subscribe(
        self, task_id: str, *, after: TaskVersion
    ) -> AsyncGenerator[VersionedEvent, None]:
        """The task's turn from now to its end (the SDK has sent the task as it stands)."""
        record = await self.tasks.record(task_id)
        if record is None or record.forum_id is None or record.line_id is None:
            return
        line = await self.state.store.get_message(record.line_id)
        translator = TurnTranslator(task_id, record.context_id)
        deadline = time.monotonic() + self.state.settings.a2a_follow_seconds
        while line is not None:
            events = following_turn(self.state, record.forum_id, line, deadline)
            ended: Answered | Failed | None = None
            async with contextlib.aclosing(events) as following:
                async for event in following:
                    if isinstance(event, Answered | Failed):
                        ended = event
                        break
                    for translated in translator.events(event):
                        yield VersionedEvent(translated, TaskVersion.MISSING)
            if ended is None:
                return
            # A second message may have moved the task to a newer line meanwhile.
            fresh = await self.tasks.record(task_id)
            if fresh is not None and fresh.line_id not in (None, line.id):
                line = await self.state.store.get_message(fresh.line_id or "")
                translator.moved()
                continue
            for translated in translator.events(ended):
                yield VersionedEvent(translated, TaskVersion.MISSING)
            return

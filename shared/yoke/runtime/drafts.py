"""A draft: the text an agent is writing for a forum, streamed as ``agent.delta`` events.

The model hands each piece to :meth:`Draft.push`, which only buffers; one task per draft
publishes what gathered, merged, at most every :data:`INTERVAL_SECONDS` (about 20 deltas a
second), in order, on ``yoke.events`` routed like a forum line (``yoke-kind: forum``, key the
forum) so that it reaches ``yoke.forum`` and nothing inside the mesh. Nothing is stored; a
slow or absent broker drops deltas, never delays or fails the step (its end waits at most
:data:`END_WAIT_SECONDS`). The finished forum line is the truth and replaces the draft.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Literal

from yoke.bus import topology
from yoke.bus.broker import Bus
from yoke.core.ids import derive_id
from yoke.core.models import AgentDelta, Envelope

log = logging.getLogger(__name__)

INTERVAL_SECONDS = 0.05
# One delta's publish may take this long before the draft gives up on the rest.
PUBLISH_SECONDS = 2.0
# How long a step's end waits for the draft's last delta.
END_WAIT_SECONDS = 1.0
# A delta unread this long is dropped by the broker: a bridge's queue bound to yoke.forum that
# nobody reads holds no stale drafts (invariant 14); the lines stay.
DELTA_TTL_SECONDS = 60.0
# Text buffered and not yet published, at most (a broker that cannot keep up loses pieces, and
# then the draft: the finished line still comes).
MAX_PENDING_CHARS = 1 << 20

DraftEnd = Literal["posted", "abandoned"]


class Draft:
    """One step's text for one forum line-to-be (``message_id``)."""

    def __init__(
        self,
        bus: Bus,
        *,
        forum_id: str,
        agent_actor_id: str,
        message_id: str,
        in_reply_to: str | None,
    ) -> None:
        self.bus = bus
        self.forum_id = forum_id
        self.agent_actor_id = agent_actor_id
        self.message_id = message_id
        self.in_reply_to = in_reply_to
        self.index = 0
        self._pending: list[str] = []
        self._pending_chars = 0
        self._end: DraftEnd | None = None
        self._broken = False
        self._wake = asyncio.Event()
        self._ending = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def push(self, piece: str) -> None:
        """The model's next piece (called from the model's loop; never blocks)."""
        if self._end is not None or self._broken or not piece:
            return
        if self._pending_chars + len(piece) > MAX_PENDING_CHARS:
            self._broken = True
            log.warning("a draft for forum %s fell behind; its deltas stop", self.forum_id)
            return
        self._pending.append(piece)
        self._pending_chars += len(piece)
        if self._task is None:
            self._task = asyncio.create_task(self._publish_loop())
        self._wake.set()

    async def end(self, how: DraftEnd) -> None:
        """The last delta (with what is still pending), if any delta was due at all."""
        if self._end is not None:
            return
        self._end = how
        self._ending.set()
        if self._task is None:
            return  # nothing was streamed: no draft to end
        self._wake.set()
        try:
            await asyncio.wait_for(asyncio.shield(self._task), END_WAIT_SECONDS)
        except TimeoutError:
            self._task.cancel()
            log.warning("a draft for forum %s did not end in time; dropped", self.forum_id)
        except Exception as error:  # the loop logs and stops on its own failures
            log.warning("a draft for forum %s failed: %r", self.forum_id, error)

    async def close(self) -> None:
        """Stop publishing (the step ended some other way)."""
        if self._task is not None and not self._task.done():
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _publish_loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            text, self._pending, self._pending_chars = "".join(self._pending), [], 0
            end = self._end
            if (text or end is not None) and not await self._publish(text, end):
                return
            if end is not None:
                return
            # Merge what comes meanwhile; the end goes at once (the line waits for it).
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._ending.wait(), INTERVAL_SECONDS)

    async def _publish(self, text: str, end: DraftEnd | None) -> bool:
        delta = AgentDelta(
            forum_id=self.forum_id,
            agent_actor_id=self.agent_actor_id,
            message_id=self.message_id,
            in_reply_to=self.in_reply_to,
            index=self.index,
            text=text,
            end=end,
        )
        try:
            await asyncio.wait_for(
                self.bus.publish_hint(
                    Envelope.wrap(derive_id("delta", self.message_id, str(self.index)), delta),
                    delta.key,
                    {topology.KIND_HEADER: topology.PUBLIC_KIND},
                    expiration=DELTA_TTL_SECONDS,
                ),
                PUBLISH_SECONDS,
            )
        except Exception as error:
            self._broken = True
            log.warning("agent.delta not published (the draft stops): %r", error)
            return False
        self.index += 1
        return True

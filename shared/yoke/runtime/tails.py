"""The recent lines of the conversations a process steps, so that a step reads only what is new.

Single active consumer and shard ownership (docs/architecture.md, invariant 3) have one process
at a time step a monologue, and each of its steps reads nearly the same window as the one
before (``YOKE_CONTEXT_LINES`` lines). A :class:`Tails` keeps, per conversation, a *tail*: a run
of consecutive seqs ending at the newest line this process knows, and a step reads from the
store only the lines past it, by ``(conversationId, seq)``.

Why serving from memory is safe (invariant 1: a step sees exactly what the store holds):

- stored lines never change and are never deleted, so a line read once stays true;
- seqs are dense (each is taken by a unique insert only after the one before it exists), so a
  run of consecutive seqs has no line missing inside it, and whatever is newer than its head
  is found by asking for ``head + 1``, ``head + 2``, ... until one is absent;
- a line enters a tail only from the store (a read, or this process's own insert, see
  :meth:`Tails.saw`) and only as the next seq of the run; anything else (a gap, a read that
  comes back short) drops the tail, and the store answers as it did before.

Other writers (ingestion's copies, tool results, the guardian's steering) need no hand-over:
their lines are past the head and are read. Tails are dropped anyway wherever this process
cannot vouch for them: on a shard hand-over, after a step that failed, on a monologue swap.
Bounded (invariant 14): an LRU of ``YOKE_TAIL_CACHE_CONVERSATIONS`` tails of at most ``lines``
lines each.
"""

from __future__ import annotations

import logging
from typing import Protocol

from yoke.core.lru import LRUCache
from yoke.core.metrics import TAIL_DROPS, TAIL_LINES
from yoke.core.models import Message

log = logging.getLogger(__name__)

# Lines past a tail's head asked for one seq at a time before the head is looked for by
# galloping (Store.last_seq): past this many, a burst is read by its buckets.
PROBES = 3


class LineStore(Protocol):
    """What a tail reads through (:class:`yoke.store.database.Store`)."""

    async def message_at(self, conversation_id: str, seq: int) -> Message | None: ...

    async def history(
        self, conversation_id: str, *, after_seq: int = 0, up_to_seq: int | None = None
    ) -> list[Message]: ...

    async def last_seq(self, conversation_id: str) -> int: ...

    def observe_seq(self, conversation_id: str, seq: int) -> None: ...


def consecutive(lines: list[Message], after_seq: int, up_to_seq: int) -> bool:
    """Whether ``lines`` are exactly the seqs ``after_seq < seq <= up_to_seq``, in order."""
    return len(lines) == up_to_seq - after_seq and all(
        line.seq == after_seq + 1 + index for index, line in enumerate(lines)
    )


def joined(run: list[Message], more: list[Message]) -> list[Message] | None:
    """Two runs of consecutive seqs as one, when they overlap or touch (else ``None``); where
    both hold a seq, ``run``'s line is kept."""
    if not run:
        return list(more)
    if not more:
        return list(run)
    if more[0].seq > run[-1].seq + 1 or run[0].seq > more[-1].seq + 1:
        return None
    before = more[: max(0, run[0].seq - more[0].seq)]
    after = more[max(0, run[-1].seq + 1 - more[0].seq) :]
    return [*before, *run, *after]


def as_stored(line: Message) -> Message:
    """The line as the store gives it back: BSON keeps milliseconds, not microseconds."""
    moment = line.created_at
    if moment.microsecond % 1000 == 0:
        return line
    return line.model_copy(
        update={"created_at": moment.replace(microsecond=moment.microsecond // 1000 * 1000)}
    )


class Tails:
    """Per conversation, its newest lines as stored (see the module's docstring)."""

    def __init__(self, conversations: int, lines: int) -> None:
        """``conversations``: 0 keeps none (every read goes to the store)."""
        self.lines = max(1, lines)
        self._tails: LRUCache[str, list[Message]] | None = (
            LRUCache(conversations) if conversations > 0 else None
        )

    def __len__(self) -> int:
        return len(self._tails) if self._tails is not None else 0

    def tail(self, conversation_id: str) -> list[Message]:
        """The conversation's tail (a copy; empty when none is kept)."""
        if self._tails is None:
            return []
        return list(self._tails.get(conversation_id) or [])

    def saw(self, line: Message) -> None:
        """A line known to be stored (this process wrote it, or its event started a step): it
        joins its conversation's tail if it is the tail's next seq; past it, the lines in
        between are read when a step asks for them."""
        if self._tails is None:
            return
        run = self._tails.get(line.conversation_id)
        if run and line.seq == run[-1].seq + 1:
            run.append(as_stored(line))
            del run[: max(0, len(run) - self.lines)]

    def drop(self, conversation_id: str, reason: str) -> None:
        """Forget a conversation's tail: its next step reads its window from the store."""
        if self._tails is not None and self._tails.pop(conversation_id, None) is not None:
            TAIL_DROPS.labels(reason).inc()

    def clear(self, reason: str) -> None:
        """Forget every tail (a shard was gained or handed over)."""
        if self._tails:
            TAIL_DROPS.labels(reason).inc(len(self._tails))
            self._tails.clear()

    def _keep(self, conversation_id: str, lines: list[Message]) -> None:
        """Join freshly read consecutive lines to the tail; a run that does not touch it
        replaces it when newer (both are true; the newer serves the next step)."""
        assert self._tails is not None
        if not lines:
            return
        run = self._tails.get(conversation_id) or []
        merged = joined(run, lines)
        if merged is None:
            if run and run[-1].seq > lines[-1].seq:
                return
            merged = list(lines)
        self._tails[conversation_id] = merged[-self.lines :]

    async def history(
        self, store: LineStore, conversation_id: str, *, after_seq: int, up_to_seq: int
    ) -> list[Message]:
        """``Store.history`` for ``after_seq < seq <= up_to_seq``: the lines the tail holds
        from memory, the rest from the store (and kept)."""
        if self._tails is None:
            return await store.history(conversation_id, after_seq=after_seq, up_to_seq=up_to_seq)
        if up_to_seq <= after_seq:
            return []
        run = self.tail(conversation_id)
        if not run or up_to_seq < run[0].seq - 1 or after_seq > run[-1].seq:
            lines = await store.history(conversation_id, after_seq=after_seq, up_to_seq=up_to_seq)
            TAIL_LINES.labels("store").inc(len(lines))
            if consecutive(lines, after_seq, up_to_seq):
                self._keep(conversation_id, lines)
            return lines
        first, head = run[0].seq, run[-1].seq
        older: list[Message] = []
        newer: list[Message] = []
        if after_seq + 1 < first:
            older = await store.history(conversation_id, after_seq=after_seq, up_to_seq=first - 1)
        if up_to_seq > head:
            newer = await store.history(conversation_id, after_seq=head, up_to_seq=up_to_seq)
        if not consecutive(older, after_seq, max(after_seq, first - 1)) or not consecutive(
            newer, head, max(head, up_to_seq)
        ):
            # A seq missing below one the store holds (or the range past the newest line):
            # the tail cannot be vouched for; the store answers on its own.
            self.drop(conversation_id, "gap")
            lines = await store.history(conversation_id, after_seq=after_seq, up_to_seq=up_to_seq)
            TAIL_LINES.labels("store").inc(len(lines))
            return lines
        held = [line for line in run if after_seq < line.seq <= up_to_seq]
        TAIL_LINES.labels("tail").inc(len(held))
        TAIL_LINES.labels("store").inc(len(older) + len(newer))
        lines = [*older, *held, *newer]
        if older or newer:
            self._keep(conversation_id, lines)
        return lines

    async def last_seq(self, store: LineStore, conversation_id: str, *, at_least: int = 0) -> int:
        """``Store.last_seq`` (but never below ``at_least``, a seq known to exist): asked past
        the tail's head one seq at a time, each line found joining the tail (the step reads it
        next), and by galloping only past :data:`PROBES` new lines."""
        run = self.tail(conversation_id)
        if not run:
            return max(at_least, await store.last_seq(conversation_id))
        head = run[-1].seq
        if at_least > head:  # lines up to at_least exist: the step reads them anyway
            await self.history(store, conversation_id, after_seq=head, up_to_seq=at_least)
            head = at_least
        found: list[Message] = []
        for _ in range(PROBES):
            line = await store.message_at(conversation_id, head + 1)
            if line is None:
                break
            found.append(line)
            head = line.seq
        else:
            head = max(head, await store.last_seq(conversation_id))
        if found:
            TAIL_LINES.labels("store").inc(len(found))
            run = self.tail(conversation_id)
            if run and found[0].seq == run[-1].seq + 1:
                self._keep(conversation_id, found)
        store.observe_seq(conversation_id, head)
        return head

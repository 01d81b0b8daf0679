"""Conversation tails (yoke.runtime.tails): a window served from memory is exactly what the
store holds, and a step at a tail's head reads only the lines past it.

The cache's own logic, over an in-memory store with the real one's semantics (dense seqs,
lines never changed); the mesh-level proof is in test_turn_cost.py and the hand-over, scale-out,
compaction and tool-round suites.
"""

from __future__ import annotations

import random
from datetime import UTC, datetime

from yoke.core.models import Message, TextPart
from yoke.runtime.tails import Tails, as_stored, consecutive, joined

CONVERSATION = "monologue"


def line(seq: int, conversation: str = CONVERSATION) -> Message:
    return Message(
        id=f"{conversation}-{seq}",
        conversation_id=conversation,
        seq=seq,
        author_actor_id="someone",
        parts=[TextPart(text=f"line {seq}")],
        created_at=datetime(2026, 12, 1, 12, 0, 0, 123456, tzinfo=UTC),
    )


class LinesInMemory:
    """The store's reads as the real one answers them, counting the lines each returns."""

    def __init__(self) -> None:
        self.lines: dict[str, list[Message]] = {}
        self.read = 0
        self.observed: dict[str, int] = {}

    def append(self, conversation: str = CONVERSATION) -> Message:
        run = self.lines.setdefault(conversation, [])
        stored = as_stored(line(len(run) + 1, conversation))
        run.append(stored)
        return stored

    async def message_at(self, conversation_id: str, seq: int) -> Message | None:
        run = self.lines.get(conversation_id, [])
        found = run[seq - 1] if 0 < seq <= len(run) else None
        self.read += found is not None
        return found

    async def history(
        self, conversation_id: str, *, after_seq: int = 0, up_to_seq: int | None = None
    ) -> list[Message]:
        run = self.lines.get(conversation_id, [])
        found = [m for m in run if m.seq > after_seq and (up_to_seq is None or m.seq <= up_to_seq)]
        self.read += len(found)
        return found

    async def last_seq(self, conversation_id: str) -> int:
        return len(self.lines.get(conversation_id, []))

    def observe_seq(self, conversation_id: str, seq: int) -> None:
        self.observed[conversation_id] = seq


def test_runs_join_only_when_they_touch() -> None:
    assert [m.seq for m in joined([line(1), line(2)], [line(3)]) or []] == [1, 2, 3]
    assert [m.seq for m in joined([line(2), line(3)], [line(1), line(2)]) or []] == [1, 2, 3]
    assert joined([line(1)], [line(3)]) is None
    assert consecutive([line(3), line(4)], 2, 4)
    assert not consecutive([line(3), line(5)], 2, 4)
    assert not consecutive([line(3)], 2, 4)


def test_a_line_written_here_is_kept_as_the_store_gives_it_back() -> None:
    assert as_stored(line(1)).created_at.microsecond == 123000


async def test_a_step_at_the_tails_head_reads_only_the_lines_past_it() -> None:
    store, tails = LinesInMemory(), Tails(8, 50)
    for _ in range(300):
        store.append()
    window = await tails.history(store, CONVERSATION, after_seq=250, up_to_seq=300)
    assert [m.seq for m in window] == list(range(251, 301)) and store.read == 50
    store.read = 0
    tails.saw(store.append())  # the agent's answer, written by this process: no read
    trigger = store.append()  # a copied forum line, its event the step's trigger
    tails.saw(trigger)
    window = await tails.history(store, CONVERSATION, after_seq=252, up_to_seq=302)
    assert [m.seq for m in window] == list(range(253, 303)) and store.read == 0
    store.append()  # written by another process while the step ran
    store.append()
    assert await tails.last_seq(store, CONVERSATION, at_least=302) == 304
    window = await tails.history(store, CONVERSATION, after_seq=254, up_to_seq=304)
    assert [m.seq for m in window] == list(range(255, 305)) and store.read == 2
    assert len(tails.tail(CONVERSATION)) == 50  # bounded


async def test_a_line_seen_past_a_gap_never_joins_the_tail() -> None:
    store, tails = LinesInMemory(), Tails(8, 50)
    for _ in range(5):
        store.append()
    await tails.history(store, CONVERSATION, after_seq=0, up_to_seq=5)
    store.append()  # seq 6, by another writer
    tails.saw(store.append())  # seq 7 by us: not the tail's next line
    assert tails.tail(CONVERSATION)[-1].seq == 5
    window = await tails.history(store, CONVERSATION, after_seq=0, up_to_seq=7)
    assert [m.seq for m in window] == list(range(1, 8))


async def test_a_read_that_comes_back_short_drops_the_tail() -> None:
    store, tails = LinesInMemory(), Tails(8, 50)
    for _ in range(5):
        store.append()
    await tails.history(store, CONVERSATION, after_seq=0, up_to_seq=5)
    window = await tails.history(store, CONVERSATION, after_seq=0, up_to_seq=9)  # 6..9 absent
    assert [m.seq for m in window] == [1, 2, 3, 4, 5]
    assert tails.tail(CONVERSATION) == []


async def test_with_no_conversations_kept_every_read_goes_to_the_store() -> None:
    store, tails = LinesInMemory(), Tails(0, 50)
    for _ in range(5):
        store.append()
    tails.saw(line(6))
    assert len(await tails.history(store, CONVERSATION, after_seq=0, up_to_seq=5)) == 5
    assert len(await tails.history(store, CONVERSATION, after_seq=0, up_to_seq=5)) == 5
    assert store.read == 10 and len(tails) == 0


async def test_the_least_recently_stepped_conversation_is_forgotten_first() -> None:
    store, tails = LinesInMemory(), Tails(2, 50)
    for conversation in ("a", "b", "c"):
        store.append(conversation)
        await tails.history(store, conversation, after_seq=0, up_to_seq=1)
    assert len(tails) == 2 and tails.tail("a") == [] and tails.tail("c") != []


async def test_any_interleaving_of_writers_reads_what_the_store_holds() -> None:
    """Other writers, this process's own lines, queue and coalesce windows, drops and clears
    in any order: every window and head is the store's."""
    for seed in range(20):
        rng = random.Random(seed)
        store, tails = LinesInMemory(), Tails(3, rng.choice([5, 20, 64]))
        conversations = ["a", "b", "c", "d"]
        for _ in range(300):
            conversation = rng.choice(conversations)
            action = rng.random()
            if action < 0.35:
                store.append(conversation)  # another process writes
            elif action < 0.55:
                tails.saw(store.append(conversation))  # this process writes
            elif action < 0.58:
                tails.drop(conversation, "test")
            elif action < 0.6:
                tails.clear("test")
            else:
                head = await store.last_seq(conversation)
                if head == 0:
                    continue
                if rng.random() < 0.5:  # whileBusy queue: up to a trigger
                    trigger = rng.randint(max(1, head - 5), head)
                    tails.saw(store.lines[conversation][trigger - 1])
                    up_to = trigger
                else:  # coalesce: up to the newest line
                    up_to = await tails.last_seq(store, conversation, at_least=head)
                    assert up_to == head
                after = max(0, up_to - rng.randint(1, 30))
                got = await tails.history(store, conversation, after_seq=after, up_to_seq=up_to)
                want = await store.history(conversation, after_seq=after, up_to_seq=up_to)
                assert [m.id for m in got] == [m.id for m in want], (seed, conversation)
                assert got == want

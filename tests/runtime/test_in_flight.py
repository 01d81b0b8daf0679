"""The registry of model calls in flight (yoke.runtime.in_flight): who may cancel what, and
which lines the processor tells it of.

Pure logic over asyncio tasks; the mesh-level behaviour is in tests/processor/test_while_busy.py.
"""

from __future__ import annotations

import asyncio

import pytest

from yoke.core.models import Message, MessageMeta, TextPart, ToolResultPart
from yoke.runtime.in_flight import Arrival, InFlight, cancelled_here
from yoke.runtime.while_busy import WhileBusyPolicy, is_person_line, is_stop_line

CONVERSATION = "m1"
INTERRUPT, QUEUE = WhileBusyPolicy("interrupt"), WhileBusyPolicy("queue")


def line(seq: int, conversation: str = CONVERSATION) -> Arrival:
    return Arrival(conversation, seq, f"line-{seq}", "alice")


async def forever() -> None:
    await asyncio.Event().wait()


async def test_a_newer_line_interrupts_an_interruptible_call_and_the_step_knows_it() -> None:
    registry = InFlight()
    task = asyncio.ensure_future(forever())
    with registry.track(CONVERSATION, task, trigger_seq=3, covered_seq=5, policy=INTERRUPT) as call:
        assert not registry.interrupt(line(5))  # shown to the model already (or redelivered)
        assert not registry.interrupt(line(9, "m2"))  # another conversation
        assert registry.interrupt(line(6))
        with pytest.raises(asyncio.CancelledError):
            await task
        assert cancelled_here(call)
        assert call.cancelled == ("interrupt", line(6))
        assert not registry.interrupt(line(7))  # once
    assert registry.call_in(CONVERSATION) is None


async def test_a_call_under_queue_or_coalesce_is_not_interrupted() -> None:
    registry = InFlight()
    task = asyncio.ensure_future(forever())
    with registry.track(CONVERSATION, task, trigger_seq=3, covered_seq=3, policy=QUEUE):
        assert not registry.interrupt(line(4))
        await asyncio.sleep(0)
        assert not task.done()
    task.cancel()


async def test_a_stop_cancels_the_call_for_an_earlier_line_only() -> None:
    registry = InFlight()
    later = asyncio.ensure_future(forever())
    with registry.track(CONVERSATION, later, trigger_seq=8, covered_seq=8, policy=INTERRUPT):
        # A redelivered stop, older than the line being answered: it stops nothing again.
        assert not registry.stop(line(6))
        await asyncio.sleep(0)
        assert not later.done()
    later.cancel()
    earlier = asyncio.ensure_future(forever())
    with registry.track(CONVERSATION, earlier, trigger_seq=9, covered_seq=12, policy=QUEUE):
        assert registry.stop(line(10))  # whatever whileBusy says
        with pytest.raises(asyncio.CancelledError):
            await earlier
    # The lines before the stop, still queued, are not to be answered; the stop and later are.
    assert registry.stop_after(CONVERSATION, 9) == line(10)
    assert registry.stop_after(CONVERSATION, 10) is None
    assert registry.stop_after("m2", 1) is None


async def test_a_stop_seen_before_the_call_starts_cancels_it_at_once() -> None:
    registry = InFlight()
    registry.stop(line(5))
    task = asyncio.ensure_future(forever())
    with registry.track(CONVERSATION, task, trigger_seq=4, covered_seq=4, policy=QUEUE) as call:
        with pytest.raises(asyncio.CancelledError):
            await task
        assert call.cancelled == ("stop", line(5))


async def test_an_answer_being_posted_is_not_cancelled() -> None:
    registry = InFlight()
    task = asyncio.ensure_future(asyncio.sleep(0, result="the answer"))
    with registry.track(CONVERSATION, task, trigger_seq=2, covered_seq=2, policy=INTERRUPT) as call:
        assert await task == "the answer"
        assert call.settle()
        assert not registry.interrupt(line(3))
        assert not registry.stop(line(3))
    assert call.cancelled is None


async def test_the_step_itself_cancelled_is_not_taken_for_an_interrupt() -> None:
    """A service stopping cancels the step: that CancelledError goes on up, even when an
    interrupt came in the same instant."""
    registry = InFlight()
    seen: list[bool] = []

    async def step() -> None:
        task = asyncio.ensure_future(forever())
        with registry.track(CONVERSATION, task, trigger_seq=1, covered_seq=1, policy=INTERRUPT):
            try:
                await task
            except asyncio.CancelledError:
                call = registry.call_in(CONVERSATION)
                assert call is not None and call.cancelled is not None
                seen.append(cancelled_here(call))
                raise

    running = asyncio.ensure_future(step())
    await asyncio.sleep(0)
    assert registry.interrupt(line(2))
    running.cancel()
    with pytest.raises(asyncio.CancelledError):
        await running
    assert seen == [False]


async def test_a_line_arriving_before_the_call_is_registered_still_interrupts_it() -> None:
    """The step reads its window, then starts the call: a line in between is not lost."""
    registry = InFlight()
    registry.interrupt(line(7))  # the lane is busy, no call yet
    covering = asyncio.ensure_future(forever())
    # A step whose prompt holds it (its own, say) is not cancelled by it.
    with registry.track(CONVERSATION, covering, trigger_seq=6, covered_seq=7, policy=INTERRUPT):
        await asyncio.sleep(0)
        assert not covering.done()
    covering.cancel()
    registry.interrupt(line(9))
    task = asyncio.ensure_future(forever())
    with registry.track(CONVERSATION, task, trigger_seq=8, covered_seq=8, policy=INTERRUPT) as call:
        with pytest.raises(asyncio.CancelledError):
            await task
        assert call.cancelled == ("interrupt", line(9))
    registry.interrupt(line(11))
    queued = asyncio.ensure_future(forever())
    with registry.track(CONVERSATION, queued, trigger_seq=10, covered_seq=10, policy=QUEUE):
        await asyncio.sleep(0)
        assert not queued.done()  # under queue and coalesce nothing interrupts
    queued.cancel()


def test_stops_are_bounded() -> None:
    registry = InFlight(max_stops=2)
    for conversation in ("a", "b", "c"):
        registry.stop(Arrival(conversation, 5, "stop", "bob"))
    assert registry.stop_after("a", 1) is None
    assert registry.stop_after("c", 1) is not None


def copied(text: str, **meta: object) -> Message:
    """A monologue line as ingestion copies it from the forum (a person's, by default)."""
    fields: dict[str, object] = {
        "source_conversation_id": "forum",
        "source_message_id": "forum-line",
        "agent_hops": 0,
        **meta,
    }
    return Message(
        id="line",
        conversation_id=CONVERSATION,
        seq=4,
        author_actor_id="shadow",
        role="user",
        parts=[TextPart(text=text)],
        meta=MessageMeta.model_validate(fields),
    )


def test_only_a_persons_line_may_interrupt_and_only_a_persons_stop_stops() -> None:
    assert is_person_line(copied("hello")) and not is_stop_line(copied("hello"))
    assert is_stop_line(copied("/stop")) and is_stop_line(copied("  /stop now "))
    assert not is_stop_line(copied("/stopwatch"))
    # Another agent's line in the forum, a nudge or steering, context a compaction carried,
    # a line the mesh wrote itself: none of them is a person's.
    for line in (
        copied("/stop", agent_hops=1),
        copied("/stop", instruction="follow-up"),
        copied("/stop", carried_from="old-monologue"),
        copied("/stop", source_message_id=None),
    ):
        assert not is_person_line(line) and not is_stop_line(line)
    results = copied("done").model_copy(
        update={"parts": [ToolResultPart(call_id="c", name="clock", output="now")]}
    )
    assert not is_person_line(results)

"""A tool round's vocabulary: which calls a line makes, which it answers, which still wait.

A *round* is one agent line's ``tool_call`` parts (its *call line*) and their results. A call
is answered by a later line holding a ``tool_result`` of its call id: the round's results line
for the calls that answered in the round's step, a line of its own for each call that waited in
the store (:mod:`yoke.runtime.calls`). A round is *open*, in a transcript, while some of
its calls have no result there. The model answers a round once, in the step of its last result
(docs/architecture.md, invariant 10), so a step that finds the latest round open leaves its
line to that step; and compaction never cuts a transcript holding an unanswered call, or the
result would land in a monologue that no longer holds its call.
"""

from __future__ import annotations

from yoke.core.models import Message, ToolCallPart, ToolResultPart


def call_ids(line: Message) -> set[str]:
    """The ids of the calls ``line`` makes (none for a line that is not a call line)."""
    return {part.call_id for part in line.parts if isinstance(part, ToolCallPart)}


def result_ids(line: Message) -> set[str]:
    """The ids of the calls ``line`` holds results for."""
    return {part.call_id for part in line.parts if isinstance(part, ToolResultPart)}


def unanswered(called: set[str], later: list[Message]) -> set[str]:
    """The call ids among ``called`` that no line of ``later`` answers."""
    answered: set[str] = set()
    for line in later:
        answered |= result_ids(line)
    return called - answered


def open_round(transcript: list[Message]) -> Message | None:
    """The call line of the transcript's latest round, if that round is open."""
    for index in range(len(transcript) - 1, -1, -1):
        line = transcript[index]
        called = call_ids(line)
        if line.role != "agent" or not called:
            continue
        return line if unanswered(called, transcript[index + 1 :]) else None
    return None


def has_unanswered_call(transcript: list[Message]) -> bool:
    """Whether any call in the transcript, of any round, has no result in it."""
    called = set().union(*(call_ids(line) for line in transcript if line.role == "agent"))
    answered = set().union(*(result_ids(line) for line in transcript))
    return bool(called - answered)


def round_pending_after(transcript: list[Message], trigger: Message) -> bool:
    """Whether the open round was begun after ``trigger`` (a transcript read past it): the step
    of that round's last result answers the trigger too."""
    call_line = open_round(transcript)
    return call_line is not None and call_line.seq > trigger.seq


def call_line_index(transcript: list[Message], results: Message) -> int | None:
    """Where in the transcript the agent made the calls ``results`` answer (None: not in it)."""
    answered = result_ids(results)
    for index in range(len(transcript) - 1, -1, -1):
        line = transcript[index]
        if line.role == "agent" and any(
            isinstance(part, ToolCallPart) and part.call_id in answered for part in line.parts
        ):
            return index
    return None

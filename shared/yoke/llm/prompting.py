"""The one place a transcript becomes a chat prompt.

Agent lines become assistant turns (text and tool calls), tool results become tool messages,
people are named by display name (never by id), injected instructions are marked as such,
and notices are left out. The system prompt carries the agent's instructions, what it
remembers (marked as its memory, never as a line someone said) and the time.
Whatever order lines were written in, the chat obeys the provider's tool-call order rules
(docs/architecture.md, invariant 10).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from yoke.core.models import Message, TextPart, ToolCallPart, ToolResultPart
from yoke.core.text import printable
from yoke.llm.base import PromptMemory

ChatMessage = dict[str, Any]

NO_RESULT = "no result is available for this call (the tool run did not finish)"


MEMORY_HEADING = "What you remember (from your memory, not said in this conversation):"


def system_prompt(instructions: str, now: datetime, memory: Sequence[PromptMemory] = ()) -> str:
    lines = [instructions.strip()] if instructions.strip() else ["You are a helpful agent."]
    lines.append(
        "You are in a conversation with several people; each user line starts with the "
        "speaker's name."
    )
    if memory:
        lines.append(remembered(memory))
    lines.append(f"The current time is {now.isoformat(timespec='seconds')}.")
    return "\n\n".join(lines)


def remembered(memory: Sequence[PromptMemory]) -> str:
    """The memory section: one line each, marked as memory, with what it is about and when it
    was learned (one line whatever the text holds, its layout flattened: a memory cannot fake
    a heading or a turn)."""
    return "\n".join(
        [MEMORY_HEADING]
        + [
            f"- [about {printable(item.about)}] {printable(' '.join(item.text.split()))} "
            f"(learned {item.learned.date().isoformat()})"
            for item in memory
        ]
    )


def to_chat_messages(
    transcript: list[Message],
    names: dict[str, str],
    instructions: str,
    now: datetime,
    memory: Sequence[PromptMemory] = (),
) -> list[ChatMessage]:
    """The transcript as chat messages that obey the provider's order rules for any interleaving.

    Each assistant turn with tool calls is followed at once by one tool message per call: the
    first result of that call later in the transcript is pulled up to it, so lines written while
    the tools ran (a person's, an instruction, even another agent line) come after the results.
    A call id the transcript already used is dropped, and so is a result with no call before it
    in the window (the window started mid-round, after a ``/reset`` or a compaction cut). A call
    whose result never came (the transcript ends mid-round, the tool run failed) gets a
    synthetic error result rather than being dropped: the model keeps a true record of what it
    asked and learns that it got nothing back, so it can retry or say so, instead of forgetting
    the request, or seeing an assistant turn with neither text nor calls.
    """
    results: dict[str, list[tuple[int, ToolResultPart]]] = {}
    for index, message in enumerate(transcript):
        if message.role != "agent" and message.type != "notice":
            for part in message.parts:
                if isinstance(part, ToolResultPart):
                    results.setdefault(part.call_id, []).append((index, part))
    system = system_prompt(instructions, now, memory)
    chat: list[ChatMessage] = [{"role": "system", "content": system}]
    called: set[str] = set()
    for index, message in enumerate(transcript):
        if message.type == "notice":
            continue
        text = "\n".join(p.text for p in message.parts if isinstance(p, TextPart))
        if message.role == "agent":
            calls: list[ToolCallPart] = []
            for part in message.parts:
                if isinstance(part, ToolCallPart) and part.call_id not in called:
                    called.add(part.call_id)
                    calls.append(part)
            if not text and not calls:
                continue
            chat.append(assistant_turn(text, calls))
            for call in calls:
                result = next((r for at, r in results.get(call.call_id, []) if at > index), None)
                chat.append(tool_message(call, result))
            continue
        if not text:
            continue  # tool results went out with their calls above
        if message.meta.instruction:
            chat.append(
                {"role": "user", "content": f"[{message.meta.instruction} instruction] {text}"}
            )
        else:
            speaker = names.get(message.author_actor_id, "someone")
            chat.append({"role": "user", "content": f"{speaker}: {text}"})
    return chat


def unanswered_last(transcript: list[Message], answered_through: int) -> list[Message]:
    """The transcript with the user text lines after ``answered_through`` moved to its end.

    A step that answers a burst of lines at once (``whileBusy`` coalesce or interrupt) reads up
    to the newest line, and some of what it reads was written after the burst began: the
    agent's answer to an earlier line, a tool round. In seq order the prompt would end with
    that answer, as if the agent had spoken last; so the burst goes last, in its own order.
    Only user text lines move (nothing that calls or answers a tool), so the prompt stays
    valid (invariant 10) for any interleaving.
    """
    burst = [
        line
        for line in transcript
        if line.seq > answered_through
        and line.role == "user"
        and line.type == "message"
        and line.text
        and not any(isinstance(part, ToolResultPart) for part in line.parts)
    ]
    moved = {line.id for line in burst}
    return [line for line in transcript if line.id not in moved] + burst


def assistant_turn(text: str, calls: list[ToolCallPart]) -> ChatMessage:
    turn: ChatMessage = {"role": "assistant", "content": text or None}
    if calls:
        turn["tool_calls"] = [
            {
                "id": call.call_id,
                "type": "function",
                "function": {"name": call.name, "arguments": json.dumps(call.input)},
            }
            for call in calls
        ]
    return turn


def tool_message(call: ToolCallPart, result: ToolResultPart | None) -> ChatMessage:
    if result is None:
        output = f"ERROR: {NO_RESULT}"
    else:
        output = f"ERROR: {result.output}" if result.is_error else result.output
    return {"role": "tool", "tool_call_id": call.call_id, "content": output}

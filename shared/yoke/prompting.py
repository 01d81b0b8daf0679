"""The one place a transcript becomes a chat prompt.

Agent lines become assistant turns (text and tool calls), tool results become tool messages,
people are named by display name (never by id), injected instructions are marked as such,
and notices are left out. The system prompt carries the agent's instructions and the time.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

from yoke.models import Message, TextPart, ToolCallPart, ToolResultPart

ChatMessage = dict[str, Any]


def system_prompt(instructions: str, now: datetime) -> str:
    lines = [instructions.strip()] if instructions.strip() else ["You are a helpful agent."]
    lines.append(
        "You are in a conversation with several people; each user line starts with the "
        "speaker's name."
    )
    lines.append(f"The current time is {now.isoformat(timespec='seconds')}.")
    return "\n\n".join(lines)


def to_chat_messages(
    transcript: list[Message], names: dict[str, str], instructions: str, now: datetime
) -> list[ChatMessage]:
    chat: list[ChatMessage] = [{"role": "system", "content": system_prompt(instructions, now)}]
    for message in transcript:
        if message.type == "notice":
            continue
        text = "\n".join(p.text for p in message.parts if isinstance(p, TextPart))
        if message.role == "agent":
            calls = [p for p in message.parts if isinstance(p, ToolCallPart)]
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
            chat.append(turn)
            continue
        results = [p for p in message.parts if isinstance(p, ToolResultPart)]
        for result in results:
            output = f"ERROR: {result.output}" if result.is_error else result.output
            chat.append({"role": "tool", "tool_call_id": result.call_id, "content": output})
        if not text:
            continue
        if message.meta.instruction:
            chat.append(
                {"role": "user", "content": f"[{message.meta.instruction} instruction] {text}"}
            )
        else:
            speaker = names.get(message.author_actor_id, "someone")
            chat.append({"role": "user", "content": f"{speaker}: {text}"})
    return chat

"""OpenAI's message-order rules for chat completions, in one place.

The fake OpenAI server refuses a prompt that breaks them (HTTP 400, as OpenAI does), and the
prompting tests check ``to_chat_messages`` against the same function, so the two cannot drift.
The messages follow OpenAI's own 400 answers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

ROLES = {"system", "developer", "user", "assistant", "tool"}


@dataclass(frozen=True)
class Violation:
    """The first rule a prompt breaks: OpenAI's ``param`` and ``message`` for its 400."""

    param: str
    message: str

    def error_body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": "invalid_request_error",
                "param": self.param,
                "code": None,
            }
        }


def _unanswered(index: int, pending: list[str]) -> Violation:
    return Violation(
        f"messages.[{index}].role",
        "An assistant message with 'tool_calls' must be followed by tool messages responding "
        "to each 'tool_call_id'. The following tool_call_ids did not have response messages: "
        + ", ".join(pending),
    )


def first_violation(messages: list[dict[str, Any]]) -> Violation | None:
    """None when ``messages`` obey the rules, else the first rule broken.

    Every assistant message with ``tool_calls`` is followed at once by one ``tool`` message per
    call id (any order, nothing else in between, none missing); a ``tool`` message answers a call
    of that preceding assistant message, once; call ids are never reused; an assistant message
    has content or tool calls.
    """
    if not messages:
        return Violation("messages", "[] is too short - 'messages'")
    pending: list[str] = []  # call ids of the open round, not yet answered
    seen: set[str] = set()
    for index, message in enumerate(messages):
        role = message.get("role")
        if role not in ROLES:
            return Violation(f"messages.[{index}].role", f"Invalid value: {role!r}.")
        if pending and role != "tool":
            return _unanswered(index, pending)
        if role == "tool":
            call_id = message.get("tool_call_id")
            if call_id not in pending:
                return Violation(
                    f"messages.[{index}].role",
                    "Invalid parameter: messages with role 'tool' must be a response to a "
                    "preceeding message with 'tool_calls'.",
                )
            pending.remove(call_id)
            if not isinstance(message.get("content"), str):
                return Violation(
                    f"messages.[{index}].content", "Invalid value for 'content': expected a string."
                )
            continue
        if role != "assistant":
            if not isinstance(message.get("content"), str):
                return Violation(
                    f"messages.[{index}].content", "Invalid value for 'content': expected a string."
                )
            continue
        calls = message.get("tool_calls") or []
        if not calls and not message.get("content"):
            return Violation(
                f"messages.[{index}].content",
                "Invalid value for 'content': expected a string, got null.",
            )
        for call in calls:
            call_id = call.get("id")
            if not isinstance(call_id, str) or not call_id:
                return Violation(f"messages.[{index}].tool_calls", "Missing required parameter.")
            if call_id in seen:
                return Violation(
                    f"messages.[{index}].tool_calls",
                    f"Invalid parameter: duplicate tool_call id {call_id!r} in messages.",
                )
            seen.add(call_id)
            pending.append(call_id)
    if pending:
        return _unanswered(len(messages), pending)
    return None

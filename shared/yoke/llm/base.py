"""What every model provider shares: the request, the result, the protocol and its one error.

Nothing here knows the runtime, the bus or the store: a provider turns a transcript (and the
tools it may call) into outputs plus token usage, and that is all.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Protocol

from pydantic import ConfigDict, Field, JsonValue

from yoke.core.models import Message, TextPart, ToolCallPart, ToolResultPart, Usage, WireModel
from yoke.core.text import storable, storable_json
from yoke.tools.base import ToolSpec


class ProviderFailed(Exception):
    """The model could not answer (gave up after retries, or refused the request)."""


@dataclass(frozen=True)
class PromptMemory:
    """A memory the prompt carries: what the agent remembers, whom or what it is about (a
    person's name, "this conversation", "everyone"), and when it learned it."""

    text: str
    about: str
    learned: datetime


@dataclass
class InferenceRequest:
    transcript: list[Message]
    # What the model may call (shown by name, description and schema; run elsewhere).
    tools: Mapping[str, ToolSpec]
    # Prefix for ids of the tool calls this step makes: derived, so a redelivery repeats them.
    call_id_prefix: str
    instructions: str = ""
    names: dict[str, str] = field(default_factory=dict)
    now: datetime = field(default_factory=lambda: datetime.now(UTC))
    # Given each piece of the answer's text as the model produces it (never blocks: the caller
    # buffers); a provider that cannot stream gives the whole text once.
    on_text: Callable[[str], None] | None = None
    # What the agent remembers that bears on the lines answered (shown as memory, in the system
    # prompt, never as a line someone said).
    memory: list[PromptMemory] = field(default_factory=list)

    def streamed(self, piece: str) -> None:
        if self.on_text is not None and piece:
            self.on_text(storable(piece))


@dataclass
class InferenceResult:
    """What a model answered, made storable as it is made (``yoke.core.text.storable``): every
    provider's output enters the mesh here, and a U+0000 or a lone surrogate in it would make
    the line it becomes fail to store on every attempt."""

    text: str | None = None
    tool_calls: list[ToolCallPart] = field(default_factory=list)
    usage: Usage | None = None

    def __post_init__(self) -> None:
        if self.text is not None:
            self.text = storable(self.text)
        self.tool_calls = [_storable_call(call) for call in self.tool_calls]

    @property
    def empty(self) -> bool:
        return not self.text and not self.tool_calls


def _storable_call(call: ToolCallPart) -> ToolCallPart:
    made = ToolCallPart(
        call_id=storable(call.call_id),
        name=storable(call.name),
        input=storable_json(call.input),
        input_error=None if call.input_error is None else storable(call.input_error),
    )
    return call if made == call else made


class Provider(Protocol):
    model: str

    async def infer(self, request: InferenceRequest) -> InferenceResult: ...


def newest_user_text(transcript: list[Message]) -> str | None:
    for message in reversed(transcript):
        if message.role == "user" and message.type == "message":
            texts = [part.text for part in message.parts if isinstance(part, TextPart)]
            if texts:
                return "\n".join(texts)
    return None


def estimate_tokens(messages: list[Message]) -> int:
    """About four characters a token, plus a little per message."""
    characters = 0
    for message in messages:
        for part in message.parts:
            if isinstance(part, TextPart):
                characters += len(part.text)
            elif isinstance(part, ToolCallPart):
                characters += len(part.name) + len(json.dumps(part.input))
            elif isinstance(part, ToolResultPart):
                characters += len(part.output)
    return characters // 4 + 4 * len(messages)


class _Strict(WireModel):
    """Unknown fields are an error: a typo in a script must not pass silently."""

    model_config = ConfigDict(extra="forbid")


class ScriptedCall(_Strict):
    name: str
    input: dict[str, JsonValue] = Field(default_factory=dict)


class ScriptedOutput(_Strict):
    """One step of the ``fixture-script`` model: text and/or tool calls."""

    text: str | None = None
    tool_calls: list[ScriptedCall] = Field(default_factory=list)
    input_tokens: int = 0
    output_tokens: int = 0
    # On the last entry: play it again for every later step (a model stuck in a loop).
    repeat: bool = False

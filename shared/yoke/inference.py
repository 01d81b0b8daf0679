"""Models behind ``infer``: one call from a transcript (and tools) to outputs plus usage.

``fixture-echo`` answers its trigger line verbatim; ``fixture-script`` plays a list of outputs,
one per agent step, for tests. Other model ids go to the OpenAI provider.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from yoke.joins import ScriptedOutput
from yoke.models import Message, TextPart, ToolCallPart, Usage
from yoke.tools import Tool


@dataclass
class InferenceResult:
    text: str | None = None
    tool_calls: list[ToolCallPart] = field(default_factory=list)
    usage: Usage | None = None

    @property
    def empty(self) -> bool:
        return not self.text and not self.tool_calls


class Provider(Protocol):
    async def infer(
        self, transcript: list[Message], tools: dict[str, Tool], *, call_id_prefix: str
    ) -> InferenceResult: ...


def newest_user_text(transcript: list[Message]) -> str | None:
    for message in reversed(transcript):
        if message.role == "user" and message.type == "message":
            texts = [part.text for part in message.parts if isinstance(part, TextPart)]
            if texts:
                return "\n".join(texts)
    return None


class EchoProvider:
    """Replies to the newest user text with that text, verbatim; never calls a tool."""

    model = "fixture-echo"

    async def infer(
        self, transcript: list[Message], tools: dict[str, Tool], *, call_id_prefix: str
    ) -> InferenceResult:
        text = newest_user_text(transcript)
        return InferenceResult(text=text, usage=Usage(model=self.model))


class ScriptedProvider:
    """Step *k* of an agent (its *k*-th line in the monologue) plays ``script[k]``."""

    model = "fixture-script"

    def __init__(self, script: list[ScriptedOutput]) -> None:
        self.script = script

    async def infer(
        self, transcript: list[Message], tools: dict[str, Tool], *, call_id_prefix: str
    ) -> InferenceResult:
        step = sum(1 for message in transcript if message.role == "agent")
        if step >= len(self.script):
            return InferenceResult()
        output = self.script[step]
        calls = [
            ToolCallPart(call_id=f"{call_id_prefix}-{index}", name=call.name, input=call.input)
            for index, call in enumerate(output.tool_calls)
        ]
        return InferenceResult(text=output.text, tool_calls=calls, usage=Usage(model=self.model))


def provider_for(model: str, script: list[ScriptedOutput]) -> Provider:
    if model == "fixture-echo":
        return EchoProvider()
    if model == "fixture-script":
        return ScriptedProvider(script)
    raise LookupError(f"no provider for model {model!r} (OpenAI models are not wired yet)")

"""``infer``: one call from a transcript (and tools) to outputs plus token usage.

``fixture-echo`` answers its trigger line verbatim; ``fixture-script`` plays a list of outputs,
one per agent step, for tests; ``fixture-slow-<seconds>`` sleeps that long, then echoes (a slow
model, for the bench's isolation phase); any other model id goes to the OpenAI provider
(:mod:`yoke.openai_provider`), which works with any OpenAI-compatible server.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Protocol

from yoke.joins import ScriptedOutput
from yoke.metrics import LLM_LATENCY, LLM_REQUESTS, model_label
from yoke.models import Message, TextPart, ToolCallPart, ToolResultPart, Usage
from yoke.settings import Settings
from yoke.tools import Tool


class ProviderFailed(Exception):
    """The model could not answer (gave up after retries, or refused the request)."""


@dataclass
class InferenceRequest:
    transcript: list[Message]
    tools: dict[str, Tool]
    # Prefix for ids of the tool calls this step makes: derived, so a redelivery repeats them.
    call_id_prefix: str
    instructions: str = ""
    names: dict[str, str] = field(default_factory=dict)
    now: datetime = field(default_factory=lambda: datetime.now(UTC))


@dataclass
class InferenceResult:
    text: str | None = None
    tool_calls: list[ToolCallPart] = field(default_factory=list)
    usage: Usage | None = None

    @property
    def empty(self) -> bool:
        return not self.text and not self.tool_calls


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


class EchoProvider:
    """Replies to the newest user text with that text, verbatim; never calls a tool.

    Its usage is estimated like a real model's (four characters a token), so a demo's token
    panels and budgets behave as they would with one.
    """

    model = "fixture-echo"

    async def infer(self, request: InferenceRequest) -> InferenceResult:
        text = newest_user_text(request.transcript)
        usage = Usage(
            model=self.model,
            input_tokens=estimate_tokens(request.transcript),
            output_tokens=len(text or "") // 4,
        )
        return InferenceResult(text=text, usage=usage)


class SlowEchoProvider(EchoProvider):
    """Echoes after ``seconds``: one forum's slow model must not slow every other forum."""

    def __init__(self, model: str, seconds: float) -> None:
        self.model = model
        self.seconds = seconds

    async def infer(self, request: InferenceRequest) -> InferenceResult:
        await asyncio.sleep(self.seconds)
        return await super().infer(request)


SLOW_PREFIX = "fixture-slow-"
SLOWEST_SECONDS = 600.0


def slow_seconds(model: str) -> float | None:
    """Seconds of a ``fixture-slow-<seconds>`` model (None for any other name or a bad one)."""
    if not model.startswith(SLOW_PREFIX):
        return None
    try:
        seconds = float(model.removeprefix(SLOW_PREFIX))
    except ValueError:
        return None
    return seconds if 0 <= seconds <= SLOWEST_SECONDS else None


class ScriptedProvider:
    """Step *k* of an agent (its *k*-th line in the transcript) plays ``script[k]``.

    A script whose last entry has ``repeat`` set plays that entry forever (loop tests).
    """

    model = "fixture-script"

    def __init__(self, script: list[ScriptedOutput]) -> None:
        self.script = script

    async def infer(self, request: InferenceRequest) -> InferenceResult:
        step = sum(1 for message in request.transcript if message.role == "agent")
        if step >= len(self.script):
            if not (self.script and self.script[-1].repeat):
                return InferenceResult()
            step = len(self.script) - 1
        output = self.script[step]
        calls = [
            ToolCallPart(
                call_id=f"{request.call_id_prefix}-{index}", name=call.name, input=call.input
            )
            for index, call in enumerate(output.tool_calls)
        ]
        return InferenceResult(
            text=output.text,
            tool_calls=calls,
            usage=Usage(
                model=self.model,
                input_tokens=output.input_tokens,
                output_tokens=output.output_tokens,
            ),
        )


class Measured:
    """A fixture model's calls recorded like any model's: requests and latency by model.

    (The OpenAI provider records its own, per HTTP request; tokens are recorded by the caller.)
    """

    def __init__(self, provider: Provider) -> None:
        self.provider = provider
        self.model = provider.model

    async def infer(self, request: InferenceRequest) -> InferenceResult:
        label = model_label(self.model)
        started = time.monotonic()
        try:
            result = await self.provider.infer(request)
        except Exception:
            LLM_REQUESTS.labels(label, "error").inc()
            raise
        LLM_REQUESTS.labels(label, "ok").inc()
        LLM_LATENCY.labels(label).observe(time.monotonic() - started)
        return result


def provider_for(model: str, script: list[ScriptedOutput], settings: Settings) -> Provider:
    if model == "fixture-echo":
        return Measured(EchoProvider())
    if model == "fixture-script":
        return Measured(ScriptedProvider(script))
    seconds = slow_seconds(model)
    if seconds is not None:
        return Measured(SlowEchoProvider(model, seconds))
    if model.startswith("fixture-"):
        raise ProviderFailed(f"unknown fixture model {model!r}")
    from yoke.openai_provider import OpenAIProvider

    return OpenAIProvider(model, settings)


def cost_of(usage: Usage, settings: Settings) -> float:
    """USD for the usage, from the price table (0 for models it does not list)."""
    prices = settings.prices.get(usage.model)
    if prices is None:
        return 0.0
    per_input, per_output = prices
    return (usage.input_tokens * per_input + usage.output_tokens * per_output) / 1_000_000

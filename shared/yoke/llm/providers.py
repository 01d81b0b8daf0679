"""``provider_for``: a model id to the provider that answers it, measured; ``cost_of`` its price.

Any model id not starting ``fixture-`` goes to the OpenAI provider, which works with any
OpenAI-compatible server.

Prices (``YOKE_PRICES``) are listed by model family, while an API answers with the dated
snapshot it ran (``gpt-4o-mini-2024-07-18``): :func:`price_of` maps a snapshot to its family,
so a budget sees what was spent. A model without a price is not free: ``cost_of`` says None,
and a cost budget refuses such a model rather than count it as 0.
"""

from __future__ import annotations

import re
import time
from collections.abc import Mapping

from yoke.core import tracing
from yoke.core.metrics import LLM_LATENCY, LLM_REQUESTS, model_label
from yoke.core.models import TextPart, ToolCallPart, ToolResultPart, Usage
from yoke.core.settings import Settings
from yoke.llm.base import (
    InferenceRequest,
    InferenceResult,
    Provider,
    ProviderFailed,
    ScriptedOutput,
)
from yoke.llm.fixtures import (
    EchoProvider,
    ScriptedProvider,
    SlowEchoProvider,
    StreamingEchoProvider,
    slow_seconds,
    stream_rate,
)
from yoke.llm.openai_provider import OpenAIProvider


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
        LLM_LATENCY.labels(label).observe(time.monotonic() - started, tracing.exemplar())
        return result


class Traced:
    """A model call as a span after the OpenTelemetry GenAI conventions (``chat <model>``:
    the models asked and answering, tokens, and ``yoke.cost_usd`` by the price table); the
    prompt and the completion only when ``YOKE_TRACE_CONTENT`` says so."""

    def __init__(self, provider: Provider, settings: Settings) -> None:
        self.provider = provider
        self.model = provider.model
        self.settings = settings
        self.system = "openai" if isinstance(provider, OpenAIProvider) else "yoke.fixture"

    async def infer(self, request: InferenceRequest) -> InferenceResult:
        with tracing.span(
            f"chat {self.model}",
            kind="client",
            attributes={
                "gen_ai.operation.name": "chat",
                "gen_ai.provider.name": self.system,
                "gen_ai.request.model": self.model,
            },
        ):
            if tracing.content_enabled():
                tracing.annotate(
                    {
                        "gen_ai.system_instructions": tracing.content(request.instructions),
                        "gen_ai.input.messages": tracing.content(input_messages(request)),
                    }
                )
            result = await self.provider.infer(request)
            tracing.annotate(self.answered(result))
            return result

    def answered(self, result: InferenceResult) -> dict[str, str | int | float | bool]:
        usage = result.usage
        attributes: dict[str, str | int | float | bool] = {
            "gen_ai.response.model": usage.model if usage is not None else self.model,
            "yoke.tool_calls": len(result.tool_calls),
        }
        if usage is not None:
            attributes["gen_ai.usage.input_tokens"] = usage.input_tokens
            attributes["gen_ai.usage.output_tokens"] = usage.output_tokens
            cost = cost_of(usage, self.settings, self.model)
            if cost is not None:
                attributes["yoke.cost_usd"] = cost
        if tracing.content_enabled():
            parts: list[dict[str, object]] = []
            if result.text:
                parts.append({"type": "text", "content": result.text})
            parts.extend(
                {
                    "type": "tool_call",
                    "id": call.call_id,
                    "name": call.name,
                    "arguments": call.input,
                }
                for call in result.tool_calls
            )
            attributes["gen_ai.output.messages"] = tracing.content(
                [{"role": "assistant", "parts": parts}]
            )
        return attributes


def input_messages(request: InferenceRequest) -> list[dict[str, object]]:
    """The transcript as GenAI input messages (role and text; tool calls and results named)."""
    messages: list[dict[str, object]] = []
    for line in request.transcript:
        parts: list[dict[str, object]] = []
        for part in line.parts:
            if isinstance(part, TextPart):
                parts.append({"type": "text", "content": part.text})
            elif isinstance(part, ToolCallPart):
                parts.append({"type": "tool_call", "id": part.call_id, "name": part.name})
            elif isinstance(part, ToolResultPart):
                parts.append(
                    {"type": "tool_call_response", "id": part.call_id, "response": part.output}
                )
        role = "assistant" if line.role == "agent" else "user"
        messages.append({"role": role, "parts": parts})
    return messages


def provider_for(model: str, script: list[ScriptedOutput], settings: Settings) -> Provider:
    """The provider of ``model``, measured, and traced when tracing is on."""
    provider = _provider_for(model, script, settings)
    return Traced(provider, settings) if tracing.enabled() else provider


def _provider_for(model: str, script: list[ScriptedOutput], settings: Settings) -> Provider:
    if model == "fixture-echo":
        return Measured(EchoProvider())
    if model == "fixture-script":
        return Measured(ScriptedProvider(script))
    seconds = slow_seconds(model)
    if seconds is not None:
        return Measured(SlowEchoProvider(model, seconds))
    rate = stream_rate(model)
    if rate is not None:
        return Measured(StreamingEchoProvider(model, *rate))
    if model.startswith("fixture-"):
        raise ProviderFailed(f"unknown fixture model {model!r}")
    return OpenAIProvider(model, settings)


# USD per million tokens, (input, output).
Price = tuple[float, float]
# The fixture models cost nothing, and that is known: a cost budget accepts them.
FIXTURE_PRICE: Price = (0.0, 0.0)
# What a dated snapshot adds to its family's id: -2024-07-18, -20241022, or -0613.
SNAPSHOT_SUFFIX = re.compile(r"-(?:\d{4}-\d{2}-\d{2}|\d{8}|\d{4})")


def priced_family(model: str, prices: Mapping[str, Price]) -> str | None:
    """The price table's entry for ``model``: itself, or the longest listed id of which it is
    a dated snapshot (so ``gpt-4o-mini-2024-07-18`` is never taken for ``gpt-4o``)."""
    if model in prices:
        return model
    for listed in sorted(prices, key=len, reverse=True):
        rest = model[len(listed) :]
        if model.startswith(listed) and SNAPSHOT_SUFFIX.fullmatch(rest):
            return listed
    return None


def price_of(model: str, prices: Mapping[str, Price]) -> Price | None:
    """What ``model`` costs per million tokens; None when nobody said (never taken as 0)."""
    family = priced_family(model, prices)
    if family is not None:
        return prices[family]
    if model.startswith("fixture-"):
        return FIXTURE_PRICE
    return None


def cost_of(usage: Usage, settings: Settings, requested: str | None = None) -> float | None:
    """USD for the usage, priced by the model that answered (a snapshot: by its family), else
    by the one ``requested``; None when neither has a price."""
    price = price_of(usage.model, settings.prices)
    if price is None and requested is not None:
        price = price_of(requested, settings.prices)
    if price is None:
        return None
    per_input, per_output = price
    return (usage.input_tokens * per_input + usage.output_tokens * per_output) / 1_000_000

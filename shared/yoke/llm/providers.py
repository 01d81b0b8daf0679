"""``provider_for``: a model id to the provider that answers it, measured; ``cost_of`` its price.

Any model id not starting ``fixture-`` goes to the OpenAI provider, which works with any
OpenAI-compatible server.
"""

from __future__ import annotations

import time

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
from yoke.metrics import LLM_LATENCY, LLM_REQUESTS, model_label
from yoke.models import Usage
from yoke.settings import Settings


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
    rate = stream_rate(model)
    if rate is not None:
        return Measured(StreamingEchoProvider(model, *rate))
    if model.startswith("fixture-"):
        raise ProviderFailed(f"unknown fixture model {model!r}")
    return OpenAIProvider(model, settings)


def cost_of(usage: Usage, settings: Settings) -> float:
    """USD for the usage, from the price table (0 for models it does not list)."""
    prices = settings.prices.get(usage.model)
    if prices is None:
        return 0.0
    per_input, per_output = prices
    return (usage.input_tokens * per_input + usage.output_tokens * per_output) / 1_000_000

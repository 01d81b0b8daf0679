"""Models: the provider protocol, fixture models, the OpenAI provider, prompts, the inference loop.

Imports models, settings and errors, never the runtime, the bus or the store.
"""

from yoke.llm.base import InferenceRequest, InferenceResult, Provider, ProviderFailed
from yoke.llm.providers import cost_of, provider_for

__all__ = [
    "InferenceRequest",
    "InferenceResult",
    "Provider",
    "ProviderFailed",
    "cost_of",
    "provider_for",
]

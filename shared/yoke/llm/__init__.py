"""Models: the provider protocol, fixture models, the OpenAI provider, prompts, the inference loop.

Imports models, settings and errors, never the runtime, the bus or the store. Importing the
package loads only the protocol (``yoke.llm.base``): the providers (and the ``openai``
package behind them) load on first use, so a schema that names a scripted output stays light.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from yoke.llm.base import InferenceRequest, InferenceResult, Provider, ProviderFailed

if TYPE_CHECKING:
    from yoke.llm.providers import cost_of, provider_for

__all__ = [
    "InferenceRequest",
    "InferenceResult",
    "Provider",
    "ProviderFailed",
    "cost_of",
    "provider_for",
]


def __getattr__(name: str) -> Any:
    if name in ("cost_of", "provider_for"):
        from yoke.llm import providers

        return getattr(providers, name)
    raise AttributeError(f"module 'yoke.llm' has no attribute {name!r}")

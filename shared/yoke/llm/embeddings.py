"""Embedding models: text to vectors, so recall can rank by meaning as well as by words.

``embedder_for`` names the model as ``provider_for`` does for chat: ``fixture-embed`` is a
deterministic local embedder (tests and demos need no server), any other ``fixture-`` name is
an error, and every other id goes to an OpenAI-compatible ``/v1/embeddings`` through the same
shared ``openai`` client as chat (``OPENAI_BASE_URL``, ``OPENAI_API_KEY``).

A server's answer is checked before anyone stores it: one finite vector per text, all of one
length, at most ``MAX_DIMENSIONS`` long; anything else is a ``ProviderFailed`` saying what was
wrong, never a vector that poisons every later similarity.
"""

from __future__ import annotations

import hashlib
import math
import re
import time
from typing import Any, Protocol

import httpx
import openai

from yoke.core import tracing
from yoke.core.metrics import LLM_LATENCY, LLM_REQUESTS, model_label
from yoke.core.settings import Settings
from yoke.llm.base import ProviderFailed
from yoke.llm.openai_provider import describe, shared_client

# A vector longer than this is refused (the largest common models return 3072).
MAX_DIMENSIONS = 4096
FIXTURE_EMBED = "fixture-embed"
FIXTURE_DIMENSIONS = 64
_WORD = re.compile(r"\w+")


class Embedder(Protocol):
    """A model that turns texts into vectors; ``dimensions`` is None when the server decides."""

    model: str
    dimensions: int | None

    async def embed(self, texts: list[str]) -> list[list[float]]: ...


def embedder_for(model: str, settings: Settings) -> Embedder:
    """The embedder of ``model``; an unknown ``fixture-`` name fails as chat's does."""
    if model == FIXTURE_EMBED:
        return HashingEmbedder()
    if model.startswith("fixture-"):
        raise ProviderFailed(f"unknown fixture embedding model {model!r}")
    return OpenAIEmbedder(model, settings)


class HashingEmbedder:
    """Each lower-cased word adds a signed unit to the dimension its stable hash picks; the sum
    is L2-normalised. Texts that share words point the same way; a text without words is the
    zero vector (similar to nothing)."""

    model = FIXTURE_EMBED
    dimensions: int | None = FIXTURE_DIMENSIONS

    async def embed(self, texts: list[str]) -> list[list[float]]:
        return [hashed_vector(text, FIXTURE_DIMENSIONS) for text in texts]


def hashed_vector(text: str, dimensions: int) -> list[float]:
    vector = [0.0] * dimensions
    for word in _WORD.findall(text.lower()):
        digest = hashlib.blake2b(word.encode(), digest_size=8).digest()
        number = int.from_bytes(digest, "big")
        vector[number % dimensions] += 1.0 if number >> 63 else -1.0
    norm = math.sqrt(sum(x * x for x in vector))
    return [x / norm for x in vector] if norm else vector


class OpenAIEmbedder:
    """One request per call, no retries: a caller that cannot wait (a recall in a step) falls
    back to words rather than hold the turn for a retry policy's worth of time."""

    def __init__(self, model: str, settings: Settings) -> None:
        self.model = model
        self.dimensions: int | None = None
        self.label = model_label(model, settings.prices)
        self.timeout = min(
            settings.provider_request_timeout_seconds, settings.provider_give_up_seconds
        )
        self.client = shared_client(settings.provider_request_timeout_seconds)

    async def embed(self, texts: list[str]) -> list[list[float]]:
        if not texts:
            return []
        started = time.monotonic()
        try:
            response = await self.client.embeddings.create(
                model=self.model,
                input=texts,
                # Floats, not the client's default base64: every compatible server speaks them.
                encoding_format="float",
                timeout=self.timeout,
            )
            vectors = checked_vectors(self.model, response.data, len(texts))
        except openai.APITimeoutError as error:
            LLM_REQUESTS.labels(self.label, "error").inc()
            raise ProviderFailed(
                f"{self.model}: embeddings timed out after {self.timeout:g}s"
            ) from error
        except openai.APIStatusError as error:
            LLM_REQUESTS.labels(self.label, "error").inc()
            raise ProviderFailed(
                f"{self.model}: embeddings: {describe(error)}: {error.message}"
            ) from error
        except (openai.OpenAIError, httpx.TransportError) as error:
            LLM_REQUESTS.labels(self.label, "error").inc()
            raise ProviderFailed(f"{self.model}: embeddings: {describe(error)}") from error
        except ProviderFailed:
            LLM_REQUESTS.labels(self.label, "error").inc()
            raise
        LLM_REQUESTS.labels(self.label, "ok").inc()
        LLM_LATENCY.labels(self.label).observe(time.monotonic() - started, tracing.exemplar())
        return vectors


def checked_vectors(model: str, data: list[Any], expected: int) -> list[list[float]]:
    """The answer's vectors in the order of the texts, or ProviderFailed saying what is wrong."""
    if len(data) != expected:
        raise ProviderFailed(f"{model}: {len(data)} embeddings for {expected} texts")
    ordered = sorted(data, key=lambda item: getattr(item, "index", 0))
    vectors: list[list[float]] = []
    for item in ordered:
        raw = getattr(item, "embedding", None)
        if not isinstance(raw, list) or not raw:
            raise ProviderFailed(f"{model}: an embedding is not a list of numbers")
        if len(raw) > MAX_DIMENSIONS:
            raise ProviderFailed(
                f"{model}: an embedding of {len(raw)} dimensions (at most {MAX_DIMENSIONS})"
            )
        if vectors and len(raw) != len(vectors[0]):
            raise ProviderFailed(
                f"{model}: embeddings of {len(vectors[0])} and {len(raw)} dimensions"
            )
        if not all(
            isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x) for x in raw
        ):
            raise ProviderFailed(f"{model}: an embedding holds something other than finite numbers")
        vectors.append([float(x) for x in raw])
    return vectors

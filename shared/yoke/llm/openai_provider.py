"""The OpenAI provider: chat completions with tools through the ``openai`` async client.

Works with any OpenAI-compatible server (``OPENAI_BASE_URL``: vLLM, Ollama, ...). Answers are
streamed (``stream_options.include_usage`` asks for the usage in the last chunk) and each text
piece is handed to the request's ``on_text`` as it comes. Retries only
provider failures (timeouts, connection errors, 429, 5xx) with exponential backoff, jitter and
``Retry-After`` (capped), and gives up within ``YOKE_PROVIDER_GIVE_UP_SECONDS``; 4xx other than
429 fail at once. The client's own retries are off so this is the one policy.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import openai
from openai import AsyncOpenAI

from yoke.core import tracing
from yoke.core.metrics import LLM_LATENCY, LLM_REQUESTS, model_label
from yoke.core.models import ToolCallPart, Usage
from yoke.core.settings import Settings
from yoke.llm.base import InferenceRequest, InferenceResult, ProviderFailed
from yoke.llm.prompting import to_chat_messages

log = logging.getLogger(__name__)

RETRYABLE = (
    openai.APITimeoutError,
    openai.APIConnectionError,
    openai.RateLimitError,
    openai.InternalServerError,
)


def retry_after_seconds(error: Exception) -> float | None:
    response = getattr(error, "response", None)
    value = response.headers.get("retry-after") if response is not None else None
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None


def describe(error: Exception) -> str:
    status = getattr(error, "status_code", None)
    kind = type(error).__name__
    return f"{kind} (HTTP {status})" if status else kind


_CLIENTS: dict[tuple[float, str | None, str | None], AsyncOpenAI] = {}


def shared_client(timeout: float) -> AsyncOpenAI:
    """One client (one connection pool) per process and server, not one per step.

    Keyed by what the client reads from the environment too, so a changed OPENAI_BASE_URL or
    key (tests start servers of their own) gets a client of its own.
    """
    key = (timeout, os.environ.get("OPENAI_BASE_URL"), os.environ.get("OPENAI_API_KEY"))
    client = _CLIENTS.get(key)
    if client is None:
        client = _CLIENTS[key] = AsyncOpenAI(max_retries=0, timeout=timeout)
    return client


class OpenAIProvider:
    def __init__(self, model: str, settings: Settings) -> None:
        self.model = model
        self.settings = settings
        # The model as a metric label: bounded, whatever a person typed after /model.
        self.label = model_label(model, settings.prices)
        self.client = shared_client(settings.provider_request_timeout_seconds)

    async def infer(self, request: InferenceRequest) -> InferenceResult:
        arguments: dict[str, Any] = {
            "model": self.model,
            "messages": to_chat_messages(
                request.transcript,
                request.names,
                request.instructions,
                request.now,
                request.memory,
            ),
        }
        if request.tools:
            arguments["tools"] = [
                {
                    "type": "function",
                    "function": {
                        "name": tool.name,
                        "description": tool.description,
                        "parameters": tool.json_schema(),
                    },
                }
                for tool in request.tools.values()
            ]
        return await self._stream_with_retries(arguments, request)

    async def _stream_with_retries(
        self, arguments: dict[str, Any], request: InferenceRequest
    ) -> InferenceResult:
        """Stream one answer (usage reported in its last chunk), retrying provider failures
        until the give-up bound; once text has been streamed, a failure is final (the draft
        people saw is abandoned, never restarted under them)."""
        settings = self.settings
        started = time.monotonic()
        deadline = started + settings.provider_give_up_seconds
        attempt = 0
        while True:
            attempt += 1
            remaining = deadline - time.monotonic()
            request_started = time.monotonic()
            answer = StreamedAnswer()
            try:
                stream = await self.client.chat.completions.create(
                    **arguments,
                    stream=True,
                    stream_options={"include_usage": True},
                    timeout=max(0.1, min(settings.provider_request_timeout_seconds, remaining)),
                )
                async for chunk in stream:
                    answer.add(chunk, request)
            except (*RETRYABLE, httpx.TransportError) as error:
                if answer.streamed:
                    LLM_REQUESTS.labels(self.label, "error").inc()
                    raise ProviderFailed(
                        f"{self.model}: the answer broke off after {answer.pieces} pieces "
                        f"({describe(error)})"
                    ) from error
                LLM_REQUESTS.labels(self.label, "retryable_error").inc()
                delay = min(8.0, 0.5 * 2 ** (attempt - 1)) * random.uniform(0.5, 1.0)
                hinted = retry_after_seconds(error)
                if hinted is not None:
                    delay = min(hinted, settings.provider_retry_after_cap_seconds)
                if time.monotonic() + delay >= deadline:
                    raise ProviderFailed(
                        f"{self.model}: {describe(error)}; gave up after {attempt} attempts "
                        f"in {time.monotonic() - started:.1f}s"
                    ) from error
                log.warning("model %s: %s; retrying in %.1fs", self.model, describe(error), delay)
                await asyncio.sleep(delay)
                continue
            except openai.APIStatusError as error:
                LLM_REQUESTS.labels(self.label, "error").inc()
                raise ProviderFailed(f"{self.model}: {describe(error)}: {error.message}") from error
            except openai.OpenAIError as error:
                LLM_REQUESTS.labels(self.label, "error").inc()
                raise ProviderFailed(f"{self.model}: {describe(error)}") from error
            LLM_REQUESTS.labels(self.label, "ok").inc()
            LLM_LATENCY.labels(self.label).observe(
                time.monotonic() - request_started, tracing.exemplar()
            )
            return answer.result(self.model, request.call_id_prefix)


@dataclass
class _CallSlot:
    call_id: str | None = None
    name: str = ""
    arguments: str = ""


@dataclass
class StreamedAnswer:
    """An answer put together from its chunks: text pieces, tool calls by index, usage."""

    text: list[str] = field(default_factory=list)
    calls: dict[int, _CallSlot] = field(default_factory=dict)
    usage: Any = None
    model: str | None = None
    choices: int = 0

    @property
    def pieces(self) -> int:
        return len(self.text)

    @property
    def streamed(self) -> bool:
        return bool(self.text)

    def add(self, chunk: Any, request: InferenceRequest) -> None:
        self.model = getattr(chunk, "model", None) or self.model
        if getattr(chunk, "usage", None) is not None:
            self.usage = chunk.usage
        for choice in getattr(chunk, "choices", None) or []:
            if choice.index != 0:
                continue
            self.choices += 1
            delta = choice.delta
            if delta is None:
                continue
            if delta.content:
                self.text.append(delta.content)
                request.streamed(delta.content)
            for call in delta.tool_calls or []:
                slot = self.calls.setdefault(call.index, _CallSlot())
                slot.call_id = call.id or slot.call_id
                function = call.function
                if function is not None:
                    slot.name += function.name or ""
                    slot.arguments += function.arguments or ""

    def result(self, model: str, call_id_prefix: str) -> InferenceResult:
        if not self.choices and self.usage is None:
            raise ProviderFailed(f"{model}: the response had no choices")
        calls = [
            tool_call(slot.call_id or f"{call_id_prefix}-{index}", slot.name, slot.arguments)
            for index, slot in sorted(self.calls.items())
            if slot.name
        ]
        usage = self.usage
        return InferenceResult(
            text="".join(self.text) or None,
            tool_calls=calls,
            usage=Usage(
                model=self.model or model,
                input_tokens=usage.prompt_tokens if usage else 0,
                output_tokens=usage.completion_tokens if usage else 0,
            ),
        )


def tool_call(call_id: str, name: str, arguments: str) -> ToolCallPart:
    """A model's call; arguments that are not a JSON object are kept as the reason it fails."""
    try:
        parsed = json.loads(arguments or "{}")
        if not isinstance(parsed, dict):
            raise ValueError("arguments are not a JSON object")
        return ToolCallPart(call_id=call_id, name=name, input=parsed)
    except ValueError as error:
        return ToolCallPart(
            call_id=call_id,
            name=name,
            input_error=f"arguments are not valid JSON ({error}): {arguments[:200]}",
        )

"""The OpenAI provider: chat completions with tools through the ``openai`` async client.

Works with any OpenAI-compatible server (``OPENAI_BASE_URL``: vLLM, Ollama, ...). Retries only
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
from typing import Any

import openai
from openai import AsyncOpenAI

from yoke.llm.base import InferenceRequest, InferenceResult, ProviderFailed
from yoke.llm.prompting import to_chat_messages
from yoke.metrics import LLM_LATENCY, LLM_REQUESTS, model_label
from yoke.models import ToolCallPart, Usage
from yoke.settings import Settings

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
                request.transcript, request.names, request.instructions, request.now
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
        response = await self._create_with_retries(arguments)
        return self._result(response, request.call_id_prefix)

    async def _create_with_retries(self, arguments: dict[str, Any]) -> Any:
        settings = self.settings
        started = time.monotonic()
        deadline = started + settings.provider_give_up_seconds
        attempt = 0
        while True:
            attempt += 1
            remaining = deadline - time.monotonic()
            request_started = time.monotonic()
            try:
                response = await self.client.chat.completions.create(
                    **arguments,
                    timeout=max(0.1, min(settings.provider_request_timeout_seconds, remaining)),
                )
            except RETRYABLE as error:
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
            LLM_LATENCY.labels(self.label).observe(time.monotonic() - request_started)
            return response

    def _result(self, response: Any, call_id_prefix: str) -> InferenceResult:
        if not response.choices:
            raise ProviderFailed(f"{self.model}: the response had no choices")
        message = response.choices[0].message
        calls: list[ToolCallPart] = []
        for index, call in enumerate(message.tool_calls or []):
            function = getattr(call, "function", None)
            if function is None:
                continue
            call_id = call.id or f"{call_id_prefix}-{index}"
            try:
                parsed = json.loads(function.arguments or "{}")
                if not isinstance(parsed, dict):
                    raise ValueError("arguments are not a JSON object")
                calls.append(ToolCallPart(call_id=call_id, name=function.name, input=parsed))
            except ValueError as error:
                calls.append(
                    ToolCallPart(
                        call_id=call_id,
                        name=function.name,
                        input_error=f"arguments are not valid JSON ({error}): "
                        f"{function.arguments[:200]}",
                    )
                )
        usage = response.usage
        return InferenceResult(
            text=message.content or None,
            tool_calls=calls,
            usage=Usage(
                model=response.model or self.model,
                input_tokens=usage.prompt_tokens if usage else 0,
                output_tokens=usage.completion_tokens if usage else 0,
            ),
        )

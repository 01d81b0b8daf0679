"""A tool: a name, a description, a pydantic input model and the coroutine that runs it."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from pydantic import BaseModel


@dataclass(frozen=True)
class ToolContext:
    """Given to each run; ``idempotency_key`` is derived from the call, stable on redelivery."""

    idempotency_key: str
    conversation_id: str


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    input_model: type[BaseModel]
    run: Callable[[Any, ToolContext], Awaitable[str]]
    timeout: float = 30.0
    # Polling tools may be called with the same arguments again and again on purpose.
    repeat_safe: bool = False

    def json_schema(self) -> dict[str, Any]:
        return self.input_model.model_json_schema()


class ToolSpec(Protocol):
    """What a model is shown of a tool: a ``Tool`` run here, or a catalog entry run elsewhere."""

    @property
    def name(self) -> str: ...

    @property
    def description(self) -> str: ...

    def json_schema(self) -> dict[str, Any]: ...

"""A tool: a name, a description, a pydantic input model and the function that runs it."""

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
    """``run`` is a sync function or a coroutine function answering the model's text; a
    plugin's runs on a thread of its own under ``timeout`` (docs/tools.md, "Plugins")."""

    name: str
    description: str
    input_model: type[BaseModel]
    run: Callable[[Any, ToolContext], Awaitable[str] | str]
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

"""Run a mesh service whose actor handlers fail for good on chosen lines: a poison line.

    python -m tests.support.poison processor

``YOKE_TEST_POISON`` is the text that makes a handler raise a (permanent) bug-like error, on
every attempt; ``YOKE_TEST_POISON_AGENT``, if set, limits that to one agent's instance. The
product modules know nothing of this: the wrapper replaces the handlers of the definitions the
service hands its actor runtime as it registers (some are built inside ``register``).
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any

from yoke.core.models import Message
from yoke.runtime.actor import ActorContext, ActorDefinition, ActorRuntime
from yoke.runtime.service import Service, run_service


class PoisonError(RuntimeError):
    """What a poisoned handler raises: a bug, as far as the runtime can tell."""


def poison(definition: ActorDefinition[Any, Any], text: str, agent: str | None) -> None:
    original = definition.handle

    async def handle(context: ActorContext[Any, Any], message: Message) -> None:
        hit = text in message.text
        if hit and (agent is None or getattr(context.config, "agent_actor_id", None) == agent):
            raise PoisonError(f"poisoned line {message.id}")
        await original(context, message)

    definition.handle = handle


def main() -> None:
    name = sys.argv[1]
    app = importlib.import_module(f"services.{name}.app")
    text = os.environ["YOKE_TEST_POISON"]
    agent = os.environ.get("YOKE_TEST_POISON_AGENT") or None

    def poisoned_runtime(
        service: Service, definitions: list[ActorDefinition[Any, Any]], **options: Any
    ) -> ActorRuntime:
        for definition in definitions:
            poison(definition, text, agent)
        return ActorRuntime(service, definitions, **options)

    app.ActorRuntime = poisoned_runtime  # type: ignore[attr-defined]
    run_service(name, app.register)


if __name__ == "__main__":
    main()

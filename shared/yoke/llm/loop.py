"""``run_inference_loop``: infer -> tools -> infer, up to a bound, inside one call.

For ephemeral actors (the guardian's runner) that need a complete pass in one delivery. The
mesh's processor never loops: it takes one step per event (see services/processor).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from functools import partial

from yoke.core.ids import SYSTEM_ACTOR_ID, derive_id
from yoke.core.models import Message, Part, TextPart, ToolCallPart
from yoke.llm.base import InferenceRequest, Provider
from yoke.tools.base import Tool
from yoke.tools.run import run_tool_calls

MAX_ROUNDS = 8


def _tool_key(prefix: str, call: ToolCallPart) -> str:
    return derive_id("loop-tool", prefix, call.call_id)


@dataclass
class LoopResult:
    text: str | None
    rounds: int
    # The lines the loop produced (agent turns and tool results), not persisted.
    messages: list[Message] = field(default_factory=list)
    exhausted: bool = False


async def run_inference_loop(
    provider: Provider,
    request: InferenceRequest,
    *,
    agent_actor_id: str,
    conversation_id: str,
    max_rounds: int = MAX_ROUNDS,
    tools: Mapping[str, Tool] | None = None,
) -> LoopResult:
    """Run rounds until the model answers without tool calls, or ``max_rounds`` pass.

    The calls run here, in-process: ``tools`` (by default the request's, where they are
    ``Tool``s this process can run).
    """
    runnable = (
        dict(tools)
        if tools is not None
        else {name: tool for name, tool in request.tools.items() if isinstance(tool, Tool)}
    )
    transcript = list(request.transcript)
    produced: list[Message] = []
    for round_index in range(max_rounds):
        prefix = f"{request.call_id_prefix}-{round_index}"
        result = await provider.infer(
            replace(request, transcript=transcript, call_id_prefix=prefix)
        )
        parts: list[Part] = [TextPart(text=result.text)] if result.text else []
        parts.extend(result.tool_calls)
        turn = Message(
            id=derive_id("loop-turn", prefix),
            conversation_id=conversation_id,
            author_actor_id=agent_actor_id,
            role="agent",
            parts=parts,
            usage=result.usage,
        )
        transcript.append(turn)
        produced.append(turn)
        if not result.tool_calls:
            return LoopResult(text=result.text, rounds=round_index + 1, messages=produced)
        outputs = await run_tool_calls(
            result.tool_calls,
            runnable,
            key_of=partial(_tool_key, prefix),
            conversation_id=conversation_id,
        )
        answer = Message(
            id=derive_id("loop-results", prefix),
            conversation_id=conversation_id,
            author_actor_id=SYSTEM_ACTOR_ID,
            role="user",
            parts=list(outputs),
        )
        transcript.append(answer)
        produced.append(answer)
    return LoopResult(text=None, rounds=max_rounds, messages=produced, exhausted=True)

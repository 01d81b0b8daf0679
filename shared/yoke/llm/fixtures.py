"""Deterministic models for tests and demos, behind the same protocol as a real one.

``fixture-echo`` answers its trigger line verbatim; ``fixture-script`` plays a list of outputs,
one per agent step; ``fixture-slow-<seconds>`` sleeps that long, then echoes (a slow model, for
the bench's isolation phase).
"""

from __future__ import annotations

import asyncio

from yoke.core.models import ToolCallPart, Usage
from yoke.llm.base import (
    InferenceRequest,
    InferenceResult,
    ScriptedOutput,
    estimate_tokens,
    newest_user_text,
)


class EchoProvider:
    """Replies to the newest user text with that text, verbatim; never calls a tool.

    Its usage is estimated like a real model's (four characters a token), so a demo's token
    panels and budgets behave as they would with one.
    """

    model = "fixture-echo"

    # The echo is streamed in this many pieces (none: the default echo, which load tests and
    # demos run by the thousand, does not double the broker's publishes per turn with deltas;
    # ``fixture-stream-<pieces>-<seconds>`` is the echo that streams).
    pieces = 0

    async def infer(self, request: InferenceRequest) -> InferenceResult:
        text = newest_user_text(request.transcript)
        usage = Usage(
            model=self.model,
            input_tokens=estimate_tokens(request.transcript),
            output_tokens=len(text or "") // 4,
        )
        for piece in split_pieces(text or "", self.pieces):
            await self.before_piece()
            request.streamed(piece)
        return InferenceResult(text=text, usage=usage)

    async def before_piece(self) -> None:
        """Where a slower model takes its time between pieces."""


class SlowEchoProvider(EchoProvider):
    """Echoes after ``seconds``: one forum's slow model must not slow every other forum."""

    def __init__(self, model: str, seconds: float) -> None:
        self.model = model
        self.seconds = seconds

    async def infer(self, request: InferenceRequest) -> InferenceResult:
        await asyncio.sleep(self.seconds)
        return await super().infer(request)


class StreamingEchoProvider(EchoProvider):
    """``fixture-stream-<pieces>-<seconds>``: the echo in ``pieces`` pieces spread over
    ``seconds`` (a model streaming at a set rate, for tests and the bench)."""

    def __init__(self, model: str, pieces: int, seconds: float) -> None:
        self.model = model
        self.pieces = pieces
        self.interval = seconds / pieces

    async def before_piece(self) -> None:
        await asyncio.sleep(self.interval)


def split_pieces(text: str, pieces: int) -> list[str]:
    """``text`` cut into at most ``pieces`` consecutive pieces (joined, they are the text)."""
    if not text or pieces <= 0:
        return []
    size = max(1, -(-len(text) // pieces))
    return [text[start : start + size] for start in range(0, len(text), size)]


STREAM_PREFIX = "fixture-stream-"
MOST_PIECES = 10_000


def stream_rate(model: str) -> tuple[int, float] | None:
    """(pieces, seconds) of a ``fixture-stream-<pieces>-<seconds>`` model, else None."""
    if not model.startswith(STREAM_PREFIX):
        return None
    pieces, _, seconds = model.removeprefix(STREAM_PREFIX).partition("-")
    try:
        rate = int(pieces), float(seconds)
    except ValueError:
        return None
    if not (1 <= rate[0] <= MOST_PIECES and 0 <= rate[1] <= SLOWEST_SECONDS):
        return None
    return rate


SLOW_PREFIX = "fixture-slow-"
SLOWEST_SECONDS = 600.0


def slow_seconds(model: str) -> float | None:
    """Seconds of a ``fixture-slow-<seconds>`` model (None for any other name or a bad one)."""
    if not model.startswith(SLOW_PREFIX):
        return None
    try:
        seconds = float(model.removeprefix(SLOW_PREFIX))
    except ValueError:
        return None
    return seconds if 0 <= seconds <= SLOWEST_SECONDS else None


class ScriptedProvider:
    """Step *k* of an agent (its *k*-th line in the transcript) plays ``script[k]``.

    A script whose last entry has ``repeat`` set plays that entry forever (loop tests).
    """

    model = "fixture-script"

    def __init__(self, script: list[ScriptedOutput]) -> None:
        self.script = script

    async def infer(self, request: InferenceRequest) -> InferenceResult:
        step = sum(1 for message in request.transcript if message.role == "agent")
        if step >= len(self.script):
            if not (self.script and self.script[-1].repeat):
                return InferenceResult()
            step = len(self.script) - 1
        output = self.script[step]
        calls = [
            ToolCallPart(
                call_id=f"{request.call_id_prefix}-{index}", name=call.name, input=call.input
            )
            for index, call in enumerate(output.tool_calls)
        ]
        request.streamed(output.text or "")
        return InferenceResult(
            text=output.text,
            tool_calls=calls,
            usage=Usage(
                model=self.model,
                input_tokens=output.input_tokens,
                output_tokens=output.output_tokens,
            ),
        )

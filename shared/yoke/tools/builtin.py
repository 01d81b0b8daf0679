"""The built-in tools, safe for demos: ``clock``, ``calculator`` and ``wait``."""

from __future__ import annotations

import ast
import asyncio
import json
import operator
import time
from collections.abc import Callable
from datetime import UTC, datetime

from pydantic import BaseModel, Field

from yoke.tools.base import Tool, ToolContext


class ClockInput(BaseModel):
    pass


async def _clock(_: ClockInput, __: ToolContext) -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


class CalculatorInput(BaseModel):
    expression: str = Field(max_length=200, description="Arithmetic, e.g. (2 + 3) * 4 / 5")


# The largest integer the calculator makes (about 1,233 decimal digits). The calculator runs on
# the event loop, so its work is bounded before it is done: a result's size is estimated before
# each ``*`` and ``**`` (``(((9**99)**99)**99)**99`` would be a 36 MiB integer, minutes of CPU).
MAX_BITS = 4096


_OPERATORS: dict[type[ast.AST], Callable[..., float]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}


def _bits(value: float) -> int:
    """An integer's size; a float's is fixed (it overflows instead of growing)."""
    return abs(value).bit_length() if isinstance(value, int) else 0


def _check_size(op: ast.operator, left: float, right: float) -> None:
    """Refuse a product or power whose result would pass :data:`MAX_BITS`, before making it."""
    if isinstance(op, ast.Mult):
        bits = _bits(left) + _bits(right)
    elif isinstance(op, ast.Pow) and isinstance(right, int) and right > 0:
        bits = _bits(left) * right
    else:
        return  # + - / // % make nothing much larger than their operands
    if bits > MAX_BITS:
        raise ValueError(
            f"the result would be too large (about {bits} bits; the most is {MAX_BITS} bits)"
        )


def _evaluate(node: ast.AST) -> float:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > 100:
            raise ValueError("exponent too large")
        _check_size(node.op, left, right)
        return _OPERATORS[type(node.op)](left, right)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
        return _OPERATORS[type(node.op)](_evaluate(node.operand))
    raise ValueError("only numbers and + - * / // % ** are allowed")


async def _calculate(arguments: CalculatorInput, _: ToolContext) -> str:
    value = _evaluate(ast.parse(arguments.expression, mode="eval"))
    if isinstance(value, int):
        return str(value)
    if not isinstance(value, float):  # (-8) ** 0.5 is a complex number
        raise ValueError("the result is not a real number")
    return str(int(value) if value.is_integer() else value)


class WaitInput(BaseModel):
    seconds: float = Field(ge=0, le=10, description="How long to wait")


async def _wait(arguments: WaitInput, _: ToolContext) -> str:
    started = time.time()
    await asyncio.sleep(arguments.seconds)
    return json.dumps({"waited": arguments.seconds, "startedAt": started, "endedAt": time.time()})


BUILTIN_TOOLS: dict[str, Tool] = {
    tool.name: tool
    for tool in (
        Tool("clock", "The current date and time (UTC).", ClockInput, _clock),
        Tool("calculator", "Evaluates an arithmetic expression.", CalculatorInput, _calculate),
        Tool("wait", "Waits a few seconds, then says when it started and ended.", WaitInput, _wait),
    )
}

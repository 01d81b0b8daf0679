"""Tools an agent can call: pydantic input models, per-tool timeouts, parallel execution.

Whatever goes wrong (unknown tool, invalid input, an exception, a timeout) becomes a
``tool_result`` with ``isError`` that the model sees; nothing escapes into the processor.
"""

from __future__ import annotations

import ast
import asyncio
import json
import operator
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from pydantic import BaseModel, Field, ValidationError

from yoke.models import ToolCallPart, ToolResultPart


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


# --- built-in tools (safe for demos) ---------------------------------------------------


class ClockInput(BaseModel):
    pass


async def _clock(_: ClockInput, __: ToolContext) -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


class CalculatorInput(BaseModel):
    expression: str = Field(max_length=200, description="Arithmetic, e.g. (2 + 3) * 4 / 5")


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


def _evaluate(node: ast.AST) -> float:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > 100:
            raise ValueError("exponent too large")
        return _OPERATORS[type(node.op)](left, right)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
        return _OPERATORS[type(node.op)](_evaluate(node.operand))
    raise ValueError("only numbers and + - * / // % ** are allowed")


async def _calculate(arguments: CalculatorInput, _: ToolContext) -> str:
    value = _evaluate(ast.parse(arguments.expression, mode="eval"))
    return str(int(value) if float(value).is_integer() else value)


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


def resolve_tools(names: Iterable[str]) -> dict[str, Tool]:
    """The agent's registry: named built-ins (unknown names are left out, and reported)."""
    return {name: BUILTIN_TOOLS[name] for name in names if name in BUILTIN_TOOLS}


async def run_tool_call(
    call: ToolCallPart, tools: dict[str, Tool], context: ToolContext
) -> ToolResultPart:
    def result(output: str, is_error: bool = False) -> ToolResultPart:
        return ToolResultPart(
            call_id=call.call_id, name=call.name, output=output, is_error=is_error
        )

    if call.input_error:
        return result(f"could not read the input for {call.name}: {call.input_error}", True)
    tool = tools.get(call.name)
    if tool is None:
        known = ", ".join(sorted(tools)) or "none"
        return result(f"unknown tool {call.name!r}; available: {known}", True)
    try:
        arguments = tool.input_model.model_validate(call.input)
    except ValidationError as error:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or 'input'}: {e['msg']}" for e in error.errors()
        )
        return result(f"invalid input for {call.name}: {problems}", True)
    try:
        async with asyncio.timeout(tool.timeout):
            return result(await tool.run(arguments, context))
    except TimeoutError:
        return result(f"{call.name} timed out after {tool.timeout:g}s", True)
    except Exception as error:
        return result(f"{call.name} failed: {error}", True)


async def run_tool_calls(
    calls: list[ToolCallPart],
    tools: dict[str, Tool],
    key_of: Callable[[ToolCallPart], str],
    conversation_id: str,
) -> list[ToolResultPart]:
    """Run every call at once; results come back in call order."""
    return list(
        await asyncio.gather(
            *(
                run_tool_call(call, tools, ToolContext(key_of(call), conversation_id))
                for call in calls
            )
        )
    )

"""Running tools in this process: input checked, timeout applied, calls in parallel.

Whatever goes wrong (unknown tool, invalid input, an exception, a timeout) becomes a
``tool_result`` with ``isError`` that the model sees; nothing escapes into the caller.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from pydantic import ValidationError

from yoke.errors import describe_validation_error
from yoke.models import ToolCallPart, ToolResultPart
from yoke.tools.base import Tool, ToolContext


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
        problems = describe_validation_error(error, root="input")
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

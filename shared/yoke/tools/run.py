"""Running tools in this process: input checked, timeout applied, calls in parallel.

Whatever goes wrong (unknown tool, invalid input, an exception, a timeout) becomes a
``tool_result`` with ``isError`` that the model sees; nothing escapes into the caller. The
built-ins run on the event loop (they bound their own work); every other tool's code runs on a
thread of its own (:mod:`yoke.tools.threads`), so no plugin can hold the loop. A result's text
is made storable here (:func:`yoke.core.text.storable`), whatever the tool answered.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable

from pydantic import ValidationError

from yoke.core.errors import describe_validation_error
from yoke.core.models import ToolCallPart, ToolResultPart
from yoke.core.text import storable
from yoke.tools import threads
from yoke.tools.base import Tool, ToolContext
from yoke.tools.builtin import BUILTIN_TOOLS


async def run_tool_call(
    call: ToolCallPart, tools: dict[str, Tool], context: ToolContext
) -> ToolResultPart:
    def result(output: str, is_error: bool = False) -> ToolResultPart:
        return ToolResultPart(
            call_id=call.call_id, name=call.name, output=storable(output), is_error=is_error
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
    waiting = threads.Waiting(for_thread=False)
    try:
        async with asyncio.timeout(tool.timeout):
            output = await _run(tool, arguments, context, waiting)
    except TimeoutError:
        if waiting.for_thread:
            return result(f"{call.name} did not run: {threads.busy_text()}", True)
        return result(f"{call.name} timed out after {tool.timeout:g}s", True)
    except Exception as error:
        return result(f"{call.name} failed: {error}", True)
    if not isinstance(output, str):
        return result(f"{call.name} answered a {type(output).__name__}, not a string", True)
    return result(output)


async def _run(
    tool: Tool, arguments: object, context: ToolContext, waiting: threads.Waiting
) -> object:
    if BUILTIN_TOOLS.get(tool.name) is tool:  # ours, each bounding its own work: on the loop
        output = tool.run(arguments, context)
        return await output if inspect.isawaitable(output) else output
    waiting.for_thread = True
    return await threads.run_in_thread(lambda: tool.run(arguments, context), tool.name, waiting)


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

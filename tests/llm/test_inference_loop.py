"""run_inference_loop: complete passes in one call, bounded at 8 rounds."""

from __future__ import annotations

from yoke.core.models import Message, TextPart, ToolResultPart
from yoke.llm.base import InferenceRequest, ScriptedCall, ScriptedOutput
from yoke.llm.fixtures import ScriptedProvider
from yoke.llm.loop import run_inference_loop
from yoke.tools.builtin import BUILTIN_TOOLS


def request() -> InferenceRequest:
    line = Message(id="m", conversation_id="c", author_actor_id="h", parts=[TextPart(text="go")])
    return InferenceRequest(transcript=[line], tools=dict(BUILTIN_TOOLS), call_id_prefix="run")


async def test_tools_then_an_answer_in_one_call() -> None:
    script = [
        ScriptedOutput(tool_calls=[ScriptedCall(name="calculator", input={"expression": "6*7"})]),
        ScriptedOutput(text="it is 42"),
    ]
    result = await run_inference_loop(
        ScriptedProvider(script), request(), agent_actor_id="a", conversation_id="c"
    )
    assert (result.text, result.rounds, result.exhausted) == ("it is 42", 2, False)
    [tool_result] = [p for m in result.messages for p in m.parts if isinstance(p, ToolResultPart)]
    assert tool_result.output == "42"


async def test_a_model_that_never_stops_calling_tools_is_cut_at_eight_rounds() -> None:
    forever = [ScriptedOutput(tool_calls=[ScriptedCall(name="clock")], repeat=True)]
    result = await run_inference_loop(
        ScriptedProvider(forever), request(), agent_actor_id="a", conversation_id="c"
    )
    assert result.exhausted and result.rounds == 8 and result.text is None
    assert len(result.messages) == 16

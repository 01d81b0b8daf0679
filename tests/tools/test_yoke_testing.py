"""``yoke.testing``, what a user's own tests stand on: a scripted model that keeps what it was
asked, and a plugin's tools loaded and called as a mesh process loads and calls them.

No mesh, broker or store: ``yoke-example-tools`` and ``yoke-broken-tools`` (tests/plugins)
are the installed plugins; the other tools are made here.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import re
import subprocess
import sys
import threading
from importlib.metadata import PackageNotFoundError
from pathlib import Path
from typing import Any, cast

import pytest
from pydantic import BaseModel

from yoke.core.models import Message, TextPart, ToolResultPart
from yoke.llm.base import InferenceRequest
from yoke.runtime.join_config import JoinConfig
from yoke.testing import PluginTools, ScriptedModel, ToolUnavailable, reply, run_turn, tool_call
from yoke.tools.base import Tool, ToolContext
from yoke.tools.builtin import BUILTIN_TOOLS


class Text(BaseModel):
    text: str


class Seconds(BaseModel):
    seconds: float


def _echo(arguments: Text, _: ToolContext) -> str:
    return arguments.text


def _thread(_: Text, __: ToolContext) -> str:
    return threading.current_thread().name


def _context(_: Text, context: ToolContext) -> str:
    return json.dumps([context.idempotency_key, context.conversation_id])


async def _sleep(arguments: Seconds, _: ToolContext) -> str:
    await asyncio.sleep(arguments.seconds)
    return "slept"


def _raise(_: Text, __: ToolContext) -> str:
    raise ValueError("no such order")


def _number(_: Text, __: ToolContext) -> int:
    return 42


def tool(name: str, run: object, model: type[BaseModel] = Text, timeout: float = 5.0) -> Tool:
    return Tool(name, f"the {name} test tool", model, cast(Any, run), timeout=timeout)


def line(text: str) -> Message:
    return Message(
        id=f"line-{text}", conversation_id="c", author_actor_id="ada", parts=[TextPart(text=text)]
    )


def agent_line(text: str) -> Message:
    return Message(
        id=f"agent-{text}",
        conversation_id="c",
        author_actor_id="agent",
        role="agent",
        parts=[TextPart(text=text)],
    )


def request(*transcript: Message, prefix: str = "step") -> InferenceRequest:
    return InferenceRequest(transcript=list(transcript), tools={}, call_id_prefix=prefix)


# --- the scripted model ---------------------------------------------------------------------


async def test_the_reply_played_is_the_steps_by_agent_lines_so_a_retried_step_repeats_it() -> None:
    model = ScriptedModel(["first", reply("second", input_tokens=7, output_tokens=3)])

    first = await model.infer(request(line("hi")))
    again = await model.infer(request(line("hi")))
    second = await model.infer(request(line("hi"), agent_line("first"), line("and?")))
    past_the_end = await model.infer(request(line("hi"), agent_line("first"), agent_line("second")))

    assert (first.text, again.text, second.text) == ("first", "first", "second")
    assert second.usage is not None
    assert (second.usage.model, second.usage.input_tokens, second.usage.output_tokens) == (
        "fixture-script",
        7,
        3,
    )
    assert past_the_end.empty


async def test_tool_calls_take_their_ids_from_the_requests_prefix_and_repeat_plays_forever() -> (
    None
):
    looking = reply(
        "looking", calls=[tool_call("lookup_order", {"orderId": "A1"}), tool_call("clock")]
    )
    model = ScriptedModel([looking, reply(calls=[tool_call("clock")], repeat=True)])

    first = await model.infer(request(line("hi"), prefix="p"))
    later = await model.infer(request(*[agent_line(str(n)) for n in range(5)], prefix="q"))

    assert first.text == "looking"
    assert [(call.call_id, call.name, call.input) for call in first.tool_calls] == [
        ("p-0", "lookup_order", {"orderId": "A1"}),
        ("p-1", "clock", {}),
    ]
    assert [(call.call_id, call.name) for call in later.tool_calls] == [("q-0", "clock")]


async def test_it_keeps_every_request_as_it_was_asked_and_streams_its_text() -> None:
    model = ScriptedModel(["hello there"])
    pieces: list[str] = []
    transcript = [line("hi")]
    asked = InferenceRequest(
        transcript=transcript,
        tools=dict(BUILTIN_TOOLS),
        call_id_prefix="s",
        instructions="Be brief.",
        on_text=pieces.append,
    )

    await model.infer(asked)
    transcript.append(agent_line("hello there"))  # the caller goes on with its list

    [kept] = model.requests
    assert [message.text for message in kept.transcript] == ["hi"]
    assert (kept.instructions, set(kept.tools)) == ("Be brief.", set(BUILTIN_TOOLS))
    assert "".join(pieces) == "hello there"


def test_the_script_is_a_join_configurations_script() -> None:
    model = ScriptedModel(["hi", reply(calls=[tool_call("clock")], repeat=True)])

    config = JoinConfig.model_validate(
        {"model": model.model, "script": [output.to_wire() for output in model.script]}
    )

    assert config.script == model.script


# --- a plugin's tools -----------------------------------------------------------------------


async def test_an_installed_plugins_tools_load_ready_and_answer_what_the_model_reads() -> None:
    tools = PluginTools.installed("yoke-example-tools")

    shipped = await tools.call("lookup_order", {"orderId": "A1001"})
    slug = await tools.call("slugify", {"text": "  Crème Brûlée, 2 ways!"})
    days = await tools.call("estimate_delivery", {"orderId": "B2", "country": "NO"})

    assert tools.unavailable == {}
    assert set(tools.tools) == {"lookup_order", "estimate_delivery", "slugify"}
    assert {entry.origin for entry in tools.entries} == {
        "orders = yoke_example_tools:ORDER_TOOLS",
        "slugify = yoke_example_tools:slugify",
    }
    assert (shipped.name, shipped.is_error) == ("lookup_order", False)
    assert json.loads(shipped.output) == {
        "orderId": "A1001",
        "status": "shipped",
        "carrier": "PostNord",
    }
    assert (slug.output, slug.is_error) == ("creme-brulee-2-ways", False)
    assert json.loads(days.output)["days"] == 7


async def test_input_against_the_schema_is_refused_before_run_with_the_models_error_text() -> None:
    tools = PluginTools.installed("yoke-example-tools")

    empty = await tools.call("lookup_order", {"orderId": ""})
    missing = await tools.call("lookup_order", {"order": "A1"})
    country = await tools.call("estimate_delivery", {"orderId": "A1", "country": "sweden"})

    assert empty.is_error
    assert empty.output == (
        "invalid input for lookup_order: orderId: String should have at least 1 character"
    )
    assert missing.is_error
    assert missing.output.startswith("invalid input for lookup_order: orderId:")
    assert country.is_error
    assert "country" in country.output


def test_a_broken_plugin_is_unavailable_with_the_reason_the_catalog_gives() -> None:
    broken = PluginTools.installed("yoke-broken-tools")

    assert broken.tools == {}
    assert broken.unavailable == {
        "broken_on_purpose": "failed to load: RuntimeError: this plugin is broken on purpose",
        "not_a_tool": "it is a dict, not a Tool or a list of Tools",
    }


async def test_calling_an_unavailable_or_unknown_tool_raises_saying_why() -> None:
    broken = PluginTools.installed("yoke-broken-tools")
    tools = PluginTools.installed("yoke-example-tools")

    with pytest.raises(ToolUnavailable, match="'not_a_tool' is unavailable: it is a dict"):
        await broken.call("not_a_tool")
    with pytest.raises(ToolUnavailable, match="no tool 'lookup' here; ready: estimate_delivery"):
        await tools.call("lookup")


def test_a_distribution_missing_or_without_tools_is_an_error() -> None:
    with pytest.raises(PackageNotFoundError):
        PluginTools.installed("yoke-no-such-tools")
    with pytest.raises(LookupError, match=r"pydantic declares no 'yoke\.tools' entry points"):
        PluginTools.installed("pydantic")


def test_given_tools_are_checked_as_an_entry_points_would_be() -> None:
    echo = tool("echo", _echo)
    other_echo = tool("echo", _thread)

    given = PluginTools.of(
        [echo, tool("bad name", _echo)],
        tool("clock", _echo),
        tool("never", _echo, timeout=0),
        other_echo,
        cast(Any, "not a tool"),
    )

    assert given.tools == {"echo": echo}  # the first argument keeps a name given twice
    assert given.unavailable == {
        "bad name": given.unavailable["bad name"],
        "clock": "name taken by the built-in tool",
        "never": "timeout must be more than 0 seconds, not 0",
        "echo": "name taken by plugin argument-001 = yoke.testing:given",
        "argument-005": "it is a str, not a Tool or a list of Tools",
    }
    assert given.unavailable["bad name"].startswith("tool name 'bad name' must match")


async def test_a_call_runs_on_a_thread_of_its_own_with_its_own_key_and_conversation() -> None:
    tools = PluginTools.of(tool("where", _thread), tool("context", _context))

    where = await tools.call("where", {"text": ""})
    first = json.loads((await tools.call("context", {"text": ""})).output)
    second = json.loads((await tools.call("context", {"text": ""})).output)
    given = json.loads(
        (
            await tools.call(
                "context", {"text": ""}, idempotency_key="refund-7", conversation_id="forum-1"
            )
        ).output
    )

    assert where.output == "tool where"
    assert first[0] != second[0]  # two calls, two keys
    assert first[1] == "conversation"
    assert given == ["refund-7", "forum-1"]


async def test_errors_and_timeouts_end_in_the_error_result_the_model_reads() -> None:
    tools = PluginTools.of(
        tool("fails", _raise),
        tool("number", _number),
        tool("sleepy", _sleep, model=Seconds, timeout=0.2),
    )

    failed = await tools.call("fails", {"text": "x"})
    number = await tools.call("number", {"text": "x"})
    timed_out = await tools.call("sleepy", {"seconds": 5})
    shortened = await tools.call("sleepy", {"seconds": 0.5}, timeout_seconds=0.05)
    in_time = await tools.call("sleepy", {"seconds": 0.01})

    assert (failed.output, failed.is_error) == ("fails failed: no such order", True)
    assert (number.output, number.is_error) == ("number answered a int, not a string", True)
    assert (timed_out.output, timed_out.is_error) == ("sleepy timed out after 0.2s", True)
    assert (shortened.output, shortened.is_error) == ("sleepy timed out after 0.05s", True)
    assert (in_time.output, in_time.is_error) == ("slept", False)
    assert tools.tools["sleepy"].timeout == 0.2  # the override was for that call only


# --- a whole turn ---------------------------------------------------------------------------


async def test_a_turn_runs_the_models_calls_and_shows_it_their_results() -> None:
    tools = PluginTools.installed("yoke-example-tools")
    model = ScriptedModel(
        [
            reply(calls=[tool_call("lookup_order", {"orderId": "A1001"})]),
            reply("Your order has shipped."),
        ]
    )

    turn = await run_turn(model, "Where is order A1001?", tools, instructions="Be brief.")

    assert (turn.text, turn.rounds, turn.exhausted) == ("Your order has shipped.", 2, False)
    first, second = model.requests
    assert [message.text for message in first.transcript] == ["Where is order A1001?"]
    assert set(first.tools) == {"lookup_order", "estimate_delivery", "slugify"}
    assert first.instructions == "Be brief."
    [result] = second.transcript[-1].parts
    assert isinstance(result, ToolResultPart)
    assert (result.name, result.is_error) == ("lookup_order", False)
    assert json.loads(result.output)["status"] == "shipped"


async def test_a_model_that_never_stops_calling_ends_the_turn_at_max_rounds() -> None:
    model = ScriptedModel([reply(calls=[tool_call("echo", {"text": "again"})], repeat=True)])

    turn = await run_turn(model, "go", {"echo": tool("echo", _echo)}, max_rounds=3)

    assert (turn.text, turn.rounds, turn.exhausted) == (None, 3, True)
    assert len(model.requests) == 3
    outputs = [
        part.output
        for message in turn.messages
        for part in message.parts
        if isinstance(part, ToolResultPart)
    ]
    assert outputs == ["again", "again", "again"]


async def test_the_plugin_tests_in_docs_tools_md_pass() -> None:
    docs = (Path(__file__).parents[2] / "docs" / "tools.md").read_text()
    section = docs.split("### 5. Test it without a mesh", 1)[1]
    [example] = re.findall(r"```python\n(.*?)```", section.split("\n## ", 1)[0], re.DOTALL)
    namespace: dict[str, Any] = {}
    exec(compile(example, "docs/tools.md", "exec"), namespace)

    tests = {name: test for name, test in namespace.items() if name.startswith("test_")}
    for test in tests.values():
        outcome = test()
        if inspect.isawaitable(outcome):
            await outcome
    assert len(tests) == 4


def test_importing_it_loads_no_runtime_bus_store_or_model_client() -> None:
    loaded = subprocess.run(
        [sys.executable, "-c", "import sys, yoke.testing; print('\\n'.join(sys.modules))"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout.split()

    # (yoke.core.errors classifies the drivers' exceptions, so their exception modules do load.)
    mesh = (
        "yoke.runtime",
        "yoke.bus.broker",
        "yoke.store.database",
        "yoke.bus.consumer",
        "yoke.cli",
        "services",
    )
    clients = ("aio_pika", "openai", "httpx", "mcp")
    assert [name for name in loaded if name.startswith(mesh + clients)] == []

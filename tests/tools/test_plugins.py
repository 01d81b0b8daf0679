"""Tools users bring as plugins: installed ones load, broken ones are listed with their error.

``yoke-example-tools`` and ``yoke-broken-tools`` (tests/plugins) are installed in the
virtualenv by ``make test``; the other cases are entry points made here, loading objects of
this module or of modules written to a temporary directory.
"""

from __future__ import annotations

import json
import logging
from importlib.metadata import EntryPoint
from pathlib import Path

import pytest
from pydantic import BaseModel, ConfigDict, RootModel

from yoke.core.models import ToolCallPart
from yoke.tools.base import Tool, ToolContext
from yoke.tools.builtin import BUILTIN_TOOLS
from yoke.tools.catalog import CatalogEntry
from yoke.tools.plugins import ENTRY_POINT_GROUP, builtin_entries, load_plugins
from yoke.tools.run import run_tool_call


class EchoInput(BaseModel):
    text: str


async def _echo(arguments: EchoInput, _: ToolContext) -> str:
    return arguments.text


async def _first(_: EchoInput, __: ToolContext) -> str:
    return "first"


async def _second(_: EchoInput, __: ToolContext) -> str:
    return "second"


class Opaque:
    pass


class OpaqueInput(BaseModel):
    model_config = ConfigDict(arbitrary_types_allowed=True)
    thing: Opaque


ECHO_FIRST = Tool("echo_twice", "Says it first.", EchoInput, _first)
ECHO_SECOND = Tool("echo_twice", "Says it second.", EchoInput, _second)
FAKE_CLOCK = Tool("clock", "Not the real clock.", EchoInput, _echo)
ECHO = Tool("echo", "Says the text back.", EchoInput, _echo)
BAD_NAME = Tool("echo back", "A space in its name.", EchoInput, _echo)
NO_SCHEMA = Tool("opaque", "An input model without a JSON Schema.", OpaqueInput, _echo)
NOT_AN_OBJECT = Tool("number", "Takes a bare number.", RootModel[int], _echo)
LIST_WITH_A_STRING = [ECHO, "not a tool"]


def entry_point(name: str, attribute: str, module: str = __name__) -> EntryPoint:
    return EntryPoint(name=name, value=f"{module}:{attribute}", group=ENTRY_POINT_GROUP)


def by_name(entries: list[CatalogEntry]) -> dict[str, list[CatalogEntry]]:
    found: dict[str, list[CatalogEntry]] = {}
    for entry in entries:
        found.setdefault(entry.id, []).append(entry)
    return found


def context() -> ToolContext:
    return ToolContext(idempotency_key="call-1-key", conversation_id="conversation-1")


def test_installed_example_plugin_tools_are_ready_with_their_schemas() -> None:
    loaded = load_plugins()

    assert {"lookup_order", "estimate_delivery", "slugify"} <= set(loaded.tools)
    entries = by_name(loaded.entries)
    lookup = entries["lookup_order"]
    assert len(lookup) == 1
    assert lookup[0].status == "ready"
    assert lookup[0].source == "plugin"
    assert lookup[0].origin == "orders = yoke_example_tools:ORDER_TOOLS"
    assert lookup[0].timeout_seconds == 10.0
    assert lookup[0].input_schema["properties"]["orderId"]["type"] == "string"
    assert lookup[0].input_schema["required"] == ["orderId"]
    # One entry point with a list, one with a single Tool.
    assert entries["estimate_delivery"][0].origin == lookup[0].origin
    slugify = entries["slugify"][0]
    assert (slugify.status, slugify.origin) == ("ready", "slugify = yoke_example_tools:slugify")
    assert set(slugify.input_schema["properties"]) == {"text"}


async def test_lookup_order_runs_through_run_tool_call() -> None:
    tools = load_plugins().tools

    shipped = await run_tool_call(
        ToolCallPart(call_id="call-1", name="lookup_order", input={"orderId": "A1001"}),
        tools,
        context(),
    )
    pending = await run_tool_call(
        ToolCallPart(call_id="call-2", name="lookup_order", input={"orderId": "B2002"}),
        tools,
        context(),
    )
    invalid = await run_tool_call(
        ToolCallPart(call_id="call-3", name="lookup_order", input={"order": "A1"}),
        tools,
        context(),
    )
    slug = await run_tool_call(
        ToolCallPart(call_id="call-4", name="slugify", input={"text": "  Crème Brûlée, 2 ways!"}),
        tools,
        context(),
    )

    assert (shipped.call_id, shipped.is_error) == ("call-1", False)
    assert json.loads(shipped.output) == {
        "orderId": "A1001",
        "status": "shipped",
        "carrier": "PostNord",
    }
    assert json.loads(pending.output)["status"] == "processing"
    assert invalid.is_error
    assert "orderId" in invalid.output
    assert (slug.output, slug.is_error) == ("creme-brulee-2-ways", False)


def test_broken_plugins_are_unavailable_with_their_error_and_the_others_still_load(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger="yoke.tools.plugins"):
        loaded = load_plugins()

    entries = by_name(loaded.entries)
    [exploding] = entries["broken_on_purpose"]
    assert exploding.status == "unavailable"
    assert exploding.origin == "broken_on_purpose = yoke_broken_tools.exploding:tool"
    assert exploding.reason == "failed to load: RuntimeError: this plugin is broken on purpose"
    [not_a_tool] = entries["not_a_tool"]
    assert not_a_tool.status == "unavailable"
    assert not_a_tool.reason == "it is a dict, not a Tool or a list of Tools"
    assert "broken_on_purpose" not in loaded.tools
    assert "not_a_tool" not in loaded.tools
    # Sorted after yoke-broken-tools, the example plugin still loads.
    assert entries["lookup_order"][0].ready
    assert "lookup_order" in loaded.tools
    warnings = [record.getMessage() for record in caplog.records]
    assert sum("broken on purpose" in message for message in warnings) == 1
    assert sum("'not_a_tool'" in message for message in warnings) == 1


def test_plugins_that_fail_to_import_are_unavailable_with_the_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "yoke_test_syntax_plugin.py").write_text("tool = Tool(\n")
    (tmp_path / "yoke_test_import_plugin.py").write_text("import yoke_no_such_module\n")
    monkeypatch.syspath_prepend(str(tmp_path))

    loaded = load_plugins(
        [
            entry_point("syntax", "tool", "yoke_test_syntax_plugin"),
            entry_point("imports", "tool", "yoke_test_import_plugin"),
            entry_point("missing_attribute", "NO_SUCH_TOOL"),
            entry_point("echo", "ECHO"),
        ]
    )

    reasons = {entry.id: entry.reason for entry in loaded.entries if not entry.ready}
    assert reasons["syntax"] is not None
    assert reasons["syntax"].startswith("failed to load: SyntaxError: ")
    assert reasons["imports"] == (
        "failed to load: ModuleNotFoundError: No module named 'yoke_no_such_module'"
    )
    assert reasons["missing_attribute"] is not None
    assert "NO_SUCH_TOOL" in reasons["missing_attribute"]
    assert set(loaded.tools) == {"echo"}


def test_two_plugins_offering_one_name_the_first_in_order_keeps_it() -> None:
    # Given in the other order: the load order is by entry point name, not by discovery.
    loaded = load_plugins(
        [entry_point("b_second", "ECHO_SECOND"), entry_point("a_first", "ECHO_FIRST")]
    )

    assert loaded.tools == {"echo_twice": ECHO_FIRST}
    winner, loser = by_name(loaded.entries)["echo_twice"]
    assert (winner.status, winner.origin) == ("ready", f"a_first = {__name__}:ECHO_FIRST")
    assert (loser.status, loser.origin) == ("unavailable", f"b_second = {__name__}:ECHO_SECOND")
    assert loser.reason == f"name taken by plugin a_first = {__name__}:ECHO_FIRST"


def test_a_plugin_tool_cannot_take_a_builtin_name() -> None:
    loaded = load_plugins([entry_point("fake_clock", "FAKE_CLOCK"), entry_point("echo", "ECHO")])

    assert set(loaded.tools) == {"echo"}
    [clock] = by_name(loaded.entries)["clock"]
    assert clock.status == "unavailable"
    assert clock.reason == "name taken by the built-in tool"
    assert BUILTIN_TOOLS["clock"].description != FAKE_CLOCK.description
    # Ready entries come first, so a unique insert in list order keeps every winner.
    assert [entry.ready for entry in loaded.entries] == [True, False]


@pytest.mark.parametrize(
    ("attribute", "name", "reason"),
    [
        ("BAD_NAME", "echo back", "tool name 'echo back' must match"),
        ("NO_SCHEMA", "opaque", "input model has no JSON Schema: "),
        ("NOT_AN_OBJECT", "number", "input model's JSON Schema is not an object"),
        ("LIST_WITH_A_STRING", "bad_list", "item 1 of its list is a str, not a Tool"),
    ],
)
def test_a_tool_the_catalog_cannot_offer_is_unavailable_with_why(
    attribute: str, name: str, reason: str
) -> None:
    loaded = load_plugins([entry_point("bad_list", attribute), entry_point("echo", "ECHO")])

    [entry] = by_name(loaded.entries)[name]
    assert entry.status == "unavailable"
    assert entry.reason is not None
    assert entry.reason.startswith(reason)
    assert set(loaded.tools) == {"echo"}


def test_builtin_entries_list_every_builtin_ready() -> None:
    entries = {entry.id: entry for entry in builtin_entries()}

    assert set(entries) == set(BUILTIN_TOOLS) == {"clock", "calculator", "wait"}
    assert all(
        (entry.source, entry.origin, entry.status) == ("builtin", "builtin", "ready")
        for entry in entries.values()
    )
    assert entries["calculator"].input_schema["required"] == ["expression"]

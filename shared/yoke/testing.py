"""For your own tests: a scripted model, and a plugin's tools run as a mesh process runs them.

Nothing here needs a mesh, a broker or a store (an import-linter contract keeps it so). A
plugin's tools are loaded by :func:`yoke.tools.plugins.load_plugins` and called through
:func:`yoke.tools.run.run_tool_call`, the code a processor loads and runs them with, so a
test sees what production does: the same refusals at load, the same input validation
against the tool's schema, the same timeout, and the result or error text the model would
read. docs/tools.md ("Plugins", "Test it without a mesh") shows a plugin's tests using it.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Iterable, Mapping
from dataclasses import replace
from importlib.metadata import EntryPoint

from pydantic import JsonValue

from yoke.core.ids import derive_id
from yoke.core.models import Message, TextPart, ToolCallPart, ToolResultPart
from yoke.llm.base import InferenceRequest, InferenceResult, Provider, ScriptedCall, ScriptedOutput
from yoke.llm.fixtures import ScriptedProvider
from yoke.llm.loop import MAX_ROUNDS, LoopResult, run_inference_loop
from yoke.tools.base import Tool, ToolContext
from yoke.tools.catalog import CatalogEntry
from yoke.tools.plugins import ENTRY_POINT_GROUP, LoadedPlugins, load_plugins
from yoke.tools.run import run_tool_call

__all__ = [
    "PluginTools",
    "ScriptedModel",
    "ToolUnavailable",
    "reply",
    "run_turn",
    "tool_call",
]


# --- a scripted model -------------------------------------------------------------------------


def tool_call(name: str, input: Mapping[str, JsonValue] | None = None) -> ScriptedCall:
    """A call the scripted model makes: the tool's name and the input it gives."""
    return ScriptedCall(name=name, input=dict(input or {}))


def reply(
    text: str | None = None,
    *,
    calls: Iterable[ScriptedCall] = (),
    input_tokens: int = 0,
    output_tokens: int = 0,
    repeat: bool = False,
) -> ScriptedOutput:
    """One step's answer: text, tool calls or both, and the usage to report; ``repeat`` on the
    last reply plays it for every later step (a model stuck calling a tool)."""
    return ScriptedOutput(
        text=text,
        tool_calls=list(calls),
        input_tokens=input_tokens,
        output_tokens=output_tokens,
        repeat=repeat,
    )


class ScriptedModel:
    """A :class:`~yoke.llm.base.Provider` that plays its replies and keeps what it was asked.

    It is the mesh's ``fixture-script`` model: the reply a request gets is chosen by the
    number of agent lines in its transcript, not by how often it was called, so a retried step
    plays the same reply again; past the last reply it answers nothing (unless that one is
    marked ``repeat``). ``script`` is what a join's configuration takes as ``script`` with
    ``"model": "fixture-script"``, to play the same replies in a mesh.
    """

    model = "fixture-script"

    def __init__(self, replies: Iterable[ScriptedOutput | str]) -> None:
        self.script = [reply(one) if isinstance(one, str) else one for one in replies]
        # Every request, in order, its transcript copied as it was then (callers such as
        # ``run_inference_loop`` go on appending to the list they passed).
        self.requests: list[InferenceRequest] = []
        self._provider = ScriptedProvider(self.script)

    async def infer(self, request: InferenceRequest) -> InferenceResult:
        self.requests.append(replace(request, transcript=list(request.transcript)))
        return await self._provider.infer(request)


# --- a plugin's tools -------------------------------------------------------------------------


class ToolUnavailable(LookupError):
    """The tool called is not one the plugin offers ready: the catalog would not list it so."""


class _Given(EntryPoint):
    """An entry point whose object is given rather than imported, so tools made in a test go
    through the same loading as an installed plugin's."""

    def __init__(self, index: int, offered: object) -> None:
        # Zero-padded: load_plugins settles a name offered twice by entry point name order.
        super().__init__(f"argument-{index + 1:03d}", f"{__name__}:given", ENTRY_POINT_GROUP)
        vars(self)["offered"] = offered

    def load(self) -> object:
        return vars(self)["offered"]


class PluginTools:
    """A plugin's tools as a mesh process loads them, ready to be called as a processor calls
    them (each on a thread of its own, under its timeout).

    ``unavailable`` names each tool (or entry point) the catalog would list ``unavailable``,
    with the reason ``yoke tools list`` would print; ``tools`` holds the ready ones.
    """

    def __init__(self, loaded: LoadedPlugins) -> None:
        self.tools = dict(loaded.tools)
        self.entries: list[CatalogEntry] = list(loaded.entries)
        self._calls = 0

    @classmethod
    def installed(cls, distribution: str) -> PluginTools:
        """The tools of an installed distribution (``pip install -e .``), from the entry
        points its metadata declares: a typo in ``pyproject.toml`` shows here too."""
        found = [
            entry_point
            for entry_point in importlib.metadata.distribution(distribution).entry_points
            if entry_point.group == ENTRY_POINT_GROUP
        ]
        if not found:
            raise LookupError(f"{distribution} declares no {ENTRY_POINT_GROUP!r} entry points")
        return cls(load_plugins(found))

    @classmethod
    def of(cls, *offered: Tool | list[Tool] | tuple[Tool, ...]) -> PluginTools:
        """Tools not installed yet: each argument is what an entry point may name (a ``Tool``
        or a list of them), loaded in the order given."""
        return cls(load_plugins([_Given(index, one) for index, one in enumerate(offered)]))

    @property
    def unavailable(self) -> dict[str, str]:
        return {entry.id: entry.reason or "" for entry in self.entries if not entry.ready}

    async def call(
        self,
        name: str,
        input: Mapping[str, JsonValue] | None = None,
        *,
        idempotency_key: str | None = None,
        conversation_id: str = "conversation",
        timeout_seconds: float | None = None,
    ) -> ToolResultPart:
        """Run one call as a model would make it; what comes back is what the model reads
        (``output``, and ``is_error`` for an invalid input, an exception or a timeout).

        Each call gets an idempotency key of its own unless one is given: give a call's key
        again to run it as its redelivery would. ``timeout_seconds`` replaces the tool's own
        ``timeout``, so a test of a slow call need not wait for it.
        """
        tool = self.tools.get(name)
        if tool is None:
            raise ToolUnavailable(self._why_not(name))
        if timeout_seconds is not None:
            tool = replace(tool, timeout=timeout_seconds)
        self._calls += 1
        call_id = f"call-{self._calls}"
        call = ToolCallPart(call_id=call_id, name=name, input=dict(input or {}))
        key = idempotency_key or derive_id("testing-call", conversation_id, call_id)
        return await run_tool_call(call, {name: tool}, ToolContext(key, conversation_id))

    def _why_not(self, name: str) -> str:
        reason = self.unavailable.get(name)
        if reason is not None:
            return f"tool {name!r} is unavailable: {reason}"
        offered = ", ".join(sorted(self.tools)) or "none"
        return f"no tool {name!r} here; ready: {offered}"


# --- a whole turn -----------------------------------------------------------------------------


async def run_turn(
    model: Provider,
    text: str,
    tools: PluginTools | Mapping[str, Tool] | None = None,
    *,
    instructions: str = "",
    max_rounds: int = MAX_ROUNDS,
) -> LoopResult:
    """A person's ``text``, then model and tool calls in turn until the model answers in text
    (or ``max_rounds`` pass): ``yoke.llm.loop``, the bounded loop of ephemeral runners. The
    processor takes one step per line instead, but runs each call the same way.
    """
    runnable = tools.tools if isinstance(tools, PluginTools) else dict(tools or {})
    line = Message(
        id=derive_id("testing-line", text),
        conversation_id="conversation",
        author_actor_id="person",
        parts=[TextPart(text=text)],
    )
    request = InferenceRequest(
        transcript=[line], tools=runnable, call_id_prefix="turn", instructions=instructions
    )
    return await run_inference_loop(
        model,
        request,
        agent_actor_id="agent",
        conversation_id=line.conversation_id,
        max_rounds=max_rounds,
        tools=runnable,
    )

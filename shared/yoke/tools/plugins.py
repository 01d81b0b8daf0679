"""Tools users bring as Python packages: entry points in the ``yoke.tools`` group.

A package installed beside the mesh declares ``NAME = "module:attr"`` under
``[project.entry-points."yoke.tools"]``, where ``attr`` is a ``Tool`` or a list of them.
Loading one runs the user's code, so everything that can go wrong (an import that raises, an
object that is not a Tool, a name the OpenAI API refuses, an input model without a JSON
Schema, a name another tool has) is caught here and becomes an ``unavailable`` catalog entry
with its reason: one broken plugin never stops a process nor hides another plugin's tools.
Entry points are read when a process starts, so a newly installed plugin needs a restart.
"""

from __future__ import annotations

import importlib.metadata
import logging
from collections.abc import Iterable
from importlib.metadata import EntryPoint
from typing import Any, NamedTuple

from pydantic import BaseModel

from yoke.tools.base import Tool
from yoke.tools.builtin import BUILTIN_TOOLS
from yoke.tools.catalog import CatalogEntry, name_problem

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "yoke.tools"


class LoadedPlugins(NamedTuple):
    """What the plugins offer: the tools this process can run, and the catalog's view of them.

    ``entries`` lists every ready tool first, then every unavailable one, so that writing
    them in order with a unique insert keeps each name for the tool that won it; an
    unavailable entry may share its name with the winner (a built-in or an earlier plugin).
    """

    tools: dict[str, Tool]
    entries: list[CatalogEntry]


def builtin_entries() -> list[CatalogEntry]:
    """The built-ins as the catalog lists them."""
    return [
        CatalogEntry(
            id=tool.name,
            description=tool.description,
            input_schema=tool.json_schema(),
            source="builtin",
            origin="builtin",
            timeout_seconds=tool.timeout,
        )
        for tool in BUILTIN_TOOLS.values()
    ]


def load_plugins(entry_points: Iterable[EntryPoint] | None = None) -> LoadedPlugins:
    """Load every ``yoke.tools`` entry point installed (or those given), never raising.

    Order is stable (distribution name, then entry point name) because two plugins offering
    one name is settled by it: the first keeps the name. Built-in names are never available.
    """
    if entry_points is None:
        try:
            entry_points = importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)
        except Exception as error:  # a distribution's metadata unreadable: no plugins at all
            log.warning("tool plugins not loaded: entry points unreadable: %s", _describe(error))
            return LoadedPlugins({}, [])
    owners = {name: "the built-in tool" for name in BUILTIN_TOOLS}
    tools: dict[str, Tool] = {}
    ready: list[CatalogEntry] = []
    unavailable: list[CatalogEntry] = []

    def refuse(
        name: str,
        entry_point: EntryPoint,
        reason: str,
        description: object = "",
        error: BaseException | None = None,
    ) -> None:
        origin = _origin(entry_point)
        where = _distribution(entry_point) or "no distribution"
        # The traceback only where the plugin's own code raised: it is what its author needs.
        log.warning(
            "tool %r is unavailable (plugin %s, from %s): %s",
            name,
            origin,
            where,
            reason,
            exc_info=error,
        )
        unavailable.append(
            CatalogEntry(
                id=name,
                description=description if isinstance(description, str) else "",
                source="plugin",
                origin=origin,
                status="unavailable",
                reason=reason,
            )
        )

    for entry_point in sorted(entry_points, key=_load_order):
        try:
            loaded = entry_point.load()
        except (Exception, SystemExit) as error:  # the plugin's own code: anything may escape
            refuse(
                entry_point.name, entry_point, f"failed to load: {_describe(error)}", error=error
            )
            continue
        offered = _offered_tools(loaded)
        if isinstance(offered, str):
            refuse(entry_point.name, entry_point, offered)
            continue
        if not offered:
            log.warning("tool plugin %s offers no tools", _origin(entry_point))
        for tool in offered:
            name = tool.name if isinstance(tool.name, str) else entry_point.name
            schema = _checked_schema(tool)
            if isinstance(schema, str):
                refuse(name, entry_point, schema, tool.description)
                continue
            if name in owners:
                refuse(name, entry_point, f"name taken by {owners[name]}", tool.description)
                continue
            owners[name] = f"plugin {_origin(entry_point)}"
            tools[name] = tool
            ready.append(
                CatalogEntry(
                    id=name,
                    description=tool.description,
                    input_schema=schema,
                    source="plugin",
                    origin=_origin(entry_point),
                    timeout_seconds=tool.timeout,
                )
            )
    return LoadedPlugins(tools, ready + unavailable)


def _load_order(entry_point: EntryPoint) -> tuple[str, str, str]:
    return (_distribution(entry_point) or "", entry_point.name, entry_point.value)


def _distribution(entry_point: EntryPoint) -> str | None:
    dist = getattr(entry_point, "dist", None)
    return None if dist is None else str(dist.name)


def _origin(entry_point: EntryPoint) -> str:
    return f"{entry_point.name} = {entry_point.value}"


def _offered_tools(loaded: object) -> list[Tool] | str:
    """The Tools an entry point's object offers, or why it offers none."""
    if isinstance(loaded, Tool):
        return [loaded]
    if isinstance(loaded, list | tuple):
        for index, item in enumerate(loaded):
            if not isinstance(item, Tool):
                return f"item {index} of its list is a {_kind(item)}, not a Tool"
        return list(loaded)
    return f"it is a {_kind(loaded)}, not a Tool or a list of Tools"


def _checked_schema(tool: Tool) -> dict[str, Any] | str:
    """The tool's input schema, or why the catalog cannot offer it to a model."""
    problem = name_problem(tool.name) if isinstance(tool.name, str) else "name is not a string"
    if problem is not None:
        return problem
    if not isinstance(tool.description, str):
        return "description is not a string"
    if not callable(tool.run):
        return "run is not callable"
    # asyncio.timeout() of zero or less would end every call before it starts.
    if isinstance(tool.timeout, bool) or not isinstance(tool.timeout, int | float):
        return "timeout is not a number of seconds"
    if tool.timeout <= 0:
        return f"timeout must be more than 0 seconds, not {tool.timeout}"
    if not (isinstance(tool.input_model, type) and issubclass(tool.input_model, BaseModel)):
        return "input_model is not a pydantic model class"
    try:
        schema = tool.json_schema()
    except Exception as error:
        return f"input model has no JSON Schema: {_describe(error)}"
    # Function-calling APIs take an object of named arguments, nothing else.
    if schema.get("type") != "object":
        return "input model's JSON Schema is not an object"
    return schema


def _kind(value: object) -> str:
    return type(value).__name__


def _describe(error: BaseException) -> str:
    return f"{_kind(error)}: {error}"

"""The catalog's model: every tool an agent may name, from whichever source offers it.

One document per tool name in the store's ``tool_catalog`` collection (``_id`` = the name),
written by whatever hosts the source (every process for the built-ins and plugins, the
processes that connect to an MCP server for its tools, ``yoke tools add-worker`` for a
worker). The processor, join validation (``yoke agent create``, ``yoke join``) and
``yoke tools list`` all read this one catalog (the guardian's runner has only its own
``steer`` tool). Two sources offering one name: the first registered keeps it (a unique
insert decides), the other is listed ``unavailable``.

A tool's input schema is stored as JSON text (``inputSchemaJson``), not as a document: JSON
Schema's own keys (``$schema``, ``$ref``, ``$defs``) and a server's property names (``a.b``, a
NUL) are not all storable as field names, and FerretDB refuses a key that starts with ``$`` or
holds a dot. As text (ASCII, every control character escaped) any schema a server sends is
stored and read back key for key; an entry written as a document before (``inputSchema``) still
reads.
"""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime
from typing import Any, Literal, Self

from pydantic import Field

from yoke.core.models import Document, WireModel

CATALOG = "tool_catalog"
# What the OpenAI API accepts as a function name.
TOOL_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
# An MCP server's name: its tools are NAME__TOOL, so NAME itself holds no underscore.
MCP_SERVER_NAME = re.compile(r"^[a-zA-Z0-9-]{1,30}$")
MCP_SEPARATOR = "__"
DEFAULT_WORKER_TIMEOUT_SECONDS = 300.0

ToolSource = Literal["builtin", "plugin", "mcp", "worker"]
ToolStatus = Literal["ready", "unavailable"]


class CatalogEntry(Document):
    """``id`` is the tool's name, as agents and models use it."""

    description: str = ""
    input_schema: dict[str, Any] = Field(default_factory=lambda: {"type": "object"})
    source: ToolSource
    # Which one of its source: ``builtin``, a plugin's entry point, an MCP server's name, or
    # the worker tool's own name.
    origin: str
    timeout_seconds: float = 30.0
    status: ToolStatus = "ready"
    reason: str | None = None
    updated_at: datetime = Field(default_factory=lambda: datetime.now(UTC))

    @property
    def name(self) -> str:
        return self.id

    @property
    def ready(self) -> bool:
        return self.status == "ready"

    def json_schema(self) -> dict[str, Any]:
        return self.input_schema

    def to_document(self) -> dict[str, Any]:
        document = super().to_document()
        document[SCHEMA_FIELD] = json.dumps(document.pop(OLD_SCHEMA_FIELD), separators=(",", ":"))
        return document

    @classmethod
    def from_document(cls, document: dict[str, Any]) -> Self:
        text = document.get(SCHEMA_FIELD)
        if isinstance(text, str):
            fields = {key: value for key, value in document.items() if key != SCHEMA_FIELD}
            try:
                document = {**fields, OLD_SCHEMA_FIELD: json.loads(text)}
            except json.JSONDecodeError as error:
                raise ValueError(f"catalog entry {document.get('_id')!r}: {error}") from error
        return super().from_document(document)


# Where an entry's schema is stored, as JSON text; and where it was, as a document.
SCHEMA_FIELD = "inputSchemaJson"
OLD_SCHEMA_FIELD = "inputSchema"


class McpServer(Document):
    """An MCP server the operator registered (``yoke tools add-mcp``); ``id`` is its name.

    Exactly one of ``command`` (stdio: the mesh starts it) and ``url`` (streamable HTTP).
    """

    command: list[str] | None = None
    url: str | None = None
    headers: dict[str, str] = Field(default_factory=dict)
    # Environment variables the stdio server gets besides the allow-listed ones.
    env: dict[str, str] = Field(default_factory=dict)
    timeout_seconds: float = 30.0
    created_at: datetime = Field(default_factory=lambda: datetime.now(UTC))


MCP_SERVERS = "mcp_servers"


class ToolListing(WireModel):
    """One line of ``yoke tools list --json``."""

    name: str
    description: str
    input_schema: dict[str, Any]
    source: ToolSource
    origin: str
    status: ToolStatus
    reason: str | None = None


def mcp_tool_name(server: str, tool: str) -> str:
    return f"{server}{MCP_SEPARATOR}{tool}"


def name_problem(name: str) -> str | None:
    """Why ``name`` cannot be a tool's name (None when it can)."""
    if TOOL_NAME.fullmatch(name) is None:
        return f"tool name {name!r} must match {TOOL_NAME.pattern} (what the OpenAI API accepts)"
    return None


def is_tool_pattern(name: str) -> bool:
    """A tool list's entry: a tool's name, or ``SERVER__*`` (every tool of an MCP server)."""
    if name.endswith(MCP_SEPARATOR + "*"):
        return MCP_SERVER_NAME.fullmatch(name.removesuffix(MCP_SEPARATOR + "*")) is not None
    return TOOL_NAME.fullmatch(name) is not None

"""A real MCP server for the MCP host's tests, built on the ``mcp`` package's own server side.

``python -m tests.support.mcp_server --transport stdio`` speaks over stdin/stdout, as an
operator's ``--command`` server does; ``--transport http --port N`` serves streamable HTTP on
``http://127.0.0.1:N/mcp``, and ``--require-header "Name: value"`` makes it refuse (401) every
request that lacks that header, as an authenticated server would. Its tools misbehave on
demand (hang, crash mid-call, fail, answer with non-text content) so the host's handling of
each can be checked against a real peer rather than a stand-in. ``schematic`` is listed with
:data:`RAW_SCHEMA`, a schema as TypeScript servers write them (``$schema``, ``$defs``,
``$ref``) with keys no MongoDB-wire store takes as field names; ``--list-gate FILE`` holds
every ``tools/list`` answer until FILE exists, so a test can act while a listing is under way.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import os
import sys
from pathlib import Path
from typing import Any

import uvicorn
from mcp.server.mcpserver import Context, Image, MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp.types import (
    CallToolResult,
    EmbeddedResource,
    ResourceLink,
    TextContent,
    TextResourceContents,
    Tool,
)
from starlette.types import ASGIApp, Receive, Scope, Send

# How a test starts this server over stdio (from the repository root).
STDIO_COMMAND = [sys.executable, "-m", "tests.support.mcp_server", "--transport", "stdio"]

# A 1x1 transparent PNG: small, and really an image.
PIXEL_PNG = base64.b64decode(
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNkYPhfDwAChwGA60e6kgAAAABJRU5ErkJggg=="
)


def echo(text: str) -> str:
    """Answers with its input."""
    return text


def add(a: int, b: int) -> int:
    """Adds two integers."""
    return a + b


async def slow(seconds: float) -> str:
    """Sleeps, then answers."""
    await asyncio.sleep(seconds)
    return f"slept {seconds}"


async def hang() -> str:
    """Never answers."""
    await asyncio.Event().wait()
    return "unreachable"


def crash() -> str:
    """Ends the whole server process at once, in the middle of the call."""
    os._exit(3)


def fail(message: str) -> str:
    """Raises, so the answer is a result with isError set."""
    raise ToolError(message)


def picture() -> Image:
    """Answers with image content only."""
    return Image(data=PIXEL_PNG, format="png")


def resources() -> list[TextContent | EmbeddedResource | ResourceLink]:
    """Answers with a text part, an embedded text resource and a resource link."""
    return [
        TextContent(text="two resources follow"),
        EmbeddedResource(
            resource=TextResourceContents(
                uri="file:///notes.txt", mime_type="text/plain", text="the notes"
            )
        ),
        ResourceLink(uri="file:///big.csv", name="big", mime_type="text/csv"),
    ]


def structured() -> CallToolResult:
    """Answers with structured content and no content blocks at all."""
    return CallToolResult(content=[], structured_content={"answer": 42})


def env(name: str) -> str:
    """The value of an environment variable of this process, or ``<unset>``."""
    return os.environ.get(name, "<unset>")


def append_line(path: str, line: str) -> None:
    with open(path, "a") as file:
        file.write(line + "\n")


async def count(path: str, key: str, seconds: float = 0) -> str:
    """Appends ``key`` to the file ``path`` (a line a run: a test counts runs), then sleeps."""
    append_line(path, key)
    await asyncio.sleep(seconds)
    return f"counted {key}"


def pid() -> int:
    """This process's id, so a test can tell a restarted server from the first one."""
    return os.getpid()


# Names that are fine for MCP but not as a mesh tool's full name (too long once prefixed with
# the server's name, and a character the OpenAI API refuses).
LONG_NAME = "long_" + "x" * 55


def long_named() -> str:
    """Its name is too long to be a tool's full name in the mesh."""
    return "long"


def dotted() -> str:
    """Its name holds a character the mesh's tool names may not."""
    return "dotted"


def late(text: str) -> str:
    """Registered only by ``add_tool``."""
    return f"late: {text}"


async def add_tool(ctx: Context) -> str:
    """Registers the tool ``late`` and tells the client that the list of tools changed."""
    ctx.mcp_server.add_tool(late)
    await ctx.session.send_tool_list_changed()
    return "added late"


def schematic(text: str) -> str:
    """Listed with RAW_SCHEMA (its keys start with $, hold dots and a NUL)."""
    return f"schematic: {text}"


# Sent as the input schema of ``schematic``, key for key (the function's own schema still
# checks a call's arguments).
RAW_SCHEMA: dict[str, Any] = {
    "$schema": "http://json-schema.org/draft-07/schema#",
    "type": "object",
    "properties": {
        "text": {"type": "string", "description": "what to say"},
        "options": {"$ref": "#/$defs/options"},
    },
    "required": ["text"],
    "additionalProperties": False,
    "$defs": {
        "options": {
            "type": "object",
            "properties": {
                "a.b": {"type": "string"},
                "$weird": {"type": "integer", "$comment": "a $-key in a nested schema"},
                "nul\u0000key": {"type": "boolean"},
            },
            "patternProperties": {"^x\\.": {"type": "number"}},
        }
    },
}


def nul_described() -> str:
    """Its description (NUL_DESCRIPTION) holds a character the store cannot."""
    return "described"


NUL_DESCRIPTION = "Holds a NUL (\0) in its description."


class TestServer(MCPServer[Any]):
    """The SDK's server, but listing ``schematic`` with RAW_SCHEMA, and behind ``list_gate``."""

    def __init__(self, list_gate: Path | None) -> None:
        super().__init__("yoke-test", log_level="WARNING")
        self.list_gate = list_gate

    async def list_tools(self) -> list[Tool]:
        # Polled: the file is made by another process, which no Event here can hear.
        while self.list_gate is not None and not self.list_gate.exists():  # noqa: ASYNC110
            await asyncio.sleep(0.05)
        return [
            tool.model_copy(update={"input_schema": RAW_SCHEMA})
            if tool.name == "schematic"
            else tool
            for tool in await super().list_tools()
        ]


def build_server(list_gate: Path | None = None) -> MCPServer[Any]:
    """Built only when served: constructing an MCPServer configures the root logger."""
    server = TestServer(list_gate)
    tools = (echo, add, slow, hang, crash, fail, picture, resources, structured, env, pid)
    for tool in (*tools, schematic, count):
        server.add_tool(tool)
    server.add_tool(long_named, name=LONG_NAME)
    server.add_tool(dotted, name="dotted.name")
    server.add_tool(add_tool)
    server.add_tool(nul_described, description=NUL_DESCRIPTION)
    return server


def header_gate(app: ASGIApp, name: str, value: str) -> ASGIApp:
    """Refuses with 401 every HTTP request whose ``name`` header is not ``value``."""
    wanted = (name.lower().encode(), value.encode())

    async def gated(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and wanted not in list(scope["headers"]):
            await send(
                {
                    "type": "http.response.start",
                    "status": 401,
                    "headers": [(b"content-type", b"text/plain")],
                }
            )
            await send({"type": "http.response.body", "body": b"missing credentials"})
            return
        await app(scope, receive, send)

    return gated


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--transport", choices=["stdio", "http"], default="stdio")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--require-header", default=None, help='"Name: value"')
    parser.add_argument("--list-gate", type=Path, help="answer tools/list once this file exists")
    args = parser.parse_args()
    server = build_server(args.list_gate)
    if args.transport == "stdio":
        asyncio.run(server.run_stdio_async())
        return
    app: ASGIApp = server.streamable_http_app()
    if args.require_header:
        name, _, value = args.require_header.partition(":")
        app = header_gate(app, name.strip(), value.strip())
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()

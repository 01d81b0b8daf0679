"""A real MCP server for the MCP host's tests, built on the ``mcp`` package's own server side.

``python -m tests.support.mcp_server --transport stdio`` speaks over stdin/stdout, as an
operator's ``--command`` server does; ``--transport http --port N`` serves streamable HTTP on
``http://127.0.0.1:N/mcp``, and ``--require-header "Name: value"`` makes it refuse (401) every
request that lacks that header, as an authenticated server would. Its tools misbehave on
demand (hang, crash mid-call, fail, answer with non-text content) so the host's handling of
each can be checked against a real peer rather than a stand-in.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import os
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
)
from starlette.types import ASGIApp, Receive, Scope, Send

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


def build_server() -> MCPServer[Any]:
    """Built only when served: constructing an MCPServer configures the root logger."""
    server: MCPServer[Any] = MCPServer("yoke-test", log_level="WARNING")
    tools = (echo, add, slow, hang, crash, fail, picture, resources, structured, env, pid, count)
    for tool in tools:
        server.add_tool(tool)
    server.add_tool(long_named, name=LONG_NAME)
    server.add_tool(dotted, name="dotted.name")
    server.add_tool(add_tool)
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
    args = parser.parse_args()
    server = build_server()
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

"""An MCP server over stdio whose one tool reads a "binary file" as text, as a filesystem server's
``read_text_file`` does: its answer holds NULs, which no MongoDB-wire store can hold.

    python -m tests.support.binary_mcp_server

(A lone surrogate cannot be sent over MCP at all: the SDK's JSON writer refuses it, and its
reader refuses the ``\\ud800`` escape another server might write.)
"""

from __future__ import annotations

import asyncio
from typing import Any

from mcp.server.mcpserver import MCPServer

# What the tool answers: the first bytes of a PNG file, read as text.
BINARY_TEXT = "\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\x00"


def read_text_file(path: str) -> str:
    """Reads a file as text."""
    return BINARY_TEXT


def main() -> None:
    server: MCPServer[Any] = MCPServer("yoke-binary", log_level="WARNING")
    server.add_tool(read_text_file)
    asyncio.run(server.run_stdio_async())


if __name__ == "__main__":
    main()

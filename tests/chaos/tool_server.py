"""The MCP server the tools scenario registers, over stdio (each processor starts its own) and
over streamable HTTP (one process the harness runs): its tools record every run they start.

    python -m tests.chaos.tool_server --transport stdio           # CHAOS_RUNS=FILE from --env
    python -m tests.chaos.tool_server --transport http --port N --runs FILE
"""

from __future__ import annotations

import argparse
import asyncio
import os
from typing import Any

import uvicorn
from mcp.server.mcpserver import MCPServer

from tests.chaos.runs import RUNS_VARIABLE, ToolRun, record_run

# The tools: ``tally`` runs at once (or after ``seconds``: a call past the inline bound waits in
# the store); ``held`` is the same, under the name a join gates.
TALLY = "tally"
HELD = "held"


def build_server(runs: str) -> MCPServer[Any]:
    server: MCPServer[Any] = MCPServer("yoke-chaos", log_level="WARNING")

    def tool(name: str) -> Any:
        async def run(tag: str, seconds: float = 0.0) -> str:
            record_run(runs, ToolRun(tag=tag, tool=name, pid=os.getpid()))
            if seconds > 0:
                await asyncio.sleep(seconds)
            return f"ran {tag}"

        run.__doc__ = f"Records that the call {{tag}} ran ({name}), then answers."
        return run

    server.add_tool(tool(TALLY), name=TALLY)
    server.add_tool(tool(HELD), name=HELD)
    return server


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--transport", choices=["stdio", "http"], default="stdio")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--runs", default=os.environ.get(RUNS_VARIABLE))
    args = parser.parse_args()
    if not args.runs:
        parser.error(f"--runs or {RUNS_VARIABLE} names the file runs are recorded in")
    server = build_server(args.runs)
    if args.transport == "stdio":
        asyncio.run(server.run_stdio_async())
        return
    uvicorn.run(server.streamable_http_app(), host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()

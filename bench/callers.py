"""A published agent called as the systems outside the mesh call it: through the gateway's MCP
server with the official ``mcp`` client (one session kept open, as Claude Desktop or another
agent keeps one), and as an A2A agent with ``a2a-sdk``'s client. Each call is timed from the
request to the agent's answer in hand."""

from __future__ import annotations

import contextlib
import time

import httpx2
from mcp import ClientSession
from mcp.client.streamable_http import streamable_http_client
from mcp.types import TextContent


class McpCaller:
    """One MCP session on the gateway's ``/mcp``, calling the tool ``name``."""

    def __init__(self, base_url: str, secret: str, name: str, patience: float) -> None:
        self.url = f"{base_url}/mcp"
        self.secret = secret
        self.name = name
        self.patience = patience
        self._stack = contextlib.AsyncExitStack()
        self._session: ClientSession | None = None

    async def open(self) -> None:
        timeout = httpx2.Timeout(30.0, read=self.patience)
        http = await self._stack.enter_async_context(
            httpx2.AsyncClient(headers={"Authorization": f"Bearer {self.secret}"}, timeout=timeout)
        )
        read, write = await self._stack.enter_async_context(
            streamable_http_client(self.url, http_client=http)
        )
        self._session = await self._stack.enter_async_context(ClientSession(read, write))
        await self._session.initialize()

    async def close(self) -> None:
        await self._stack.aclose()

    async def call(self, text: str) -> float:
        """Seconds from ``tools/call`` to its result (the agent's reply)."""
        assert self._session is not None, "open() first"
        started = time.perf_counter()
        result = await self._session.call_tool(
            self.name, {"message": text, "conversation": "bench"}
        )
        took = time.perf_counter() - started
        answer = "".join(part.text for part in result.content if isinstance(part, TextContent))
        if result.is_error or text not in answer:
            raise RuntimeError(f"the MCP call was not answered with its echo: {answer[:200]!r}")
        return took

"""The official ``mcp`` client against a gateway's ``/mcp``, as the door tests drive it."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx2
from mcp import ClientSession
from mcp.client.streamable_http import streamable_http_client


@asynccontextmanager
async def mcp_client(gateway_url: str, secret: str | None) -> AsyncIterator[ClientSession]:
    """A session of the official client (not yet initialised), sending ``secret`` as its
    bearer."""
    headers = {"Authorization": f"Bearer {secret}"} if secret is not None else {}
    timeout = httpx2.Timeout(30.0, read=120.0)
    async with (
        httpx2.AsyncClient(headers=headers, timeout=timeout) as http_client,
        streamable_http_client(f"{gateway_url}/mcp", http_client=http_client) as (read, write),
        ClientSession(read, write) as session,
    ):
        yield session


@asynccontextmanager
async def mcp_session(gateway_url: str, secret: str) -> AsyncIterator[ClientSession]:
    """An initialised session of the official client."""
    async with mcp_client(gateway_url, secret) as session:
        await session.initialize()
        yield session

"""A published agent called as the systems outside the mesh call it: through the gateway's MCP
server with the official ``mcp`` client (one session kept open, as Claude Desktop or another
agent keeps one), and as an A2A agent with ``a2a-sdk``'s client. Each call is timed from the
request to the agent's answer in hand."""

from __future__ import annotations

import contextlib
import time
import uuid

import httpx
import httpx2
from a2a.client import A2ACardResolver, Client, ClientConfig, ClientFactory
from a2a.types.a2a_pb2 import Message, Part, Role, SendMessageRequest, TaskState
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


class A2aCaller:
    """``a2a-sdk``'s client for the A2A agent ``/a2a/NAME``, made from its card; each call a
    message in one context, timed to its task's completion."""

    def __init__(self, base_url: str, secret: str, name: str, patience: float) -> None:
        self.url = f"{base_url}/a2a/{name}"
        self.secret = secret
        self.patience = patience
        self._stack = contextlib.AsyncExitStack()
        self._client: Client | None = None

    async def open(self) -> None:
        http = await self._stack.enter_async_context(
            httpx.AsyncClient(
                headers={"Authorization": f"Bearer {self.secret}"}, timeout=self.patience
            )
        )
        card = await A2ACardResolver(http, self.url).get_agent_card()
        self._client = ClientFactory(ClientConfig(streaming=False, httpx_client=http)).create(card)
        self._stack.push_async_callback(self._client.close)

    async def close(self) -> None:
        await self._stack.aclose()

    async def call(self, text: str) -> float:
        """Seconds from ``message/send`` to its completed task (the agent's reply)."""
        assert self._client is not None, "open() first"
        message = Message(
            role=Role.ROLE_USER,
            message_id=uuid.uuid4().hex,
            context_id="bench",
            parts=[Part(text=text)],
        )
        started = time.perf_counter()
        sent = self._client.send_message(SendMessageRequest(message=message))
        responses = [response async for response in sent]
        took = time.perf_counter() - started
        task = responses[-1].task if responses and responses[-1].HasField("task") else None
        reply = "".join(part.text for part in task.status.message.parts) if task else ""
        if task is None or task.status.state != TaskState.TASK_STATE_COMPLETED or text != reply:
            raise RuntimeError(f"the A2A task did not complete with its echo: {responses!r:.300}")
        return took

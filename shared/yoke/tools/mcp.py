"""The MCP host: the mesh's side of the Model Context Protocol servers an operator registers.

One :class:`McpConnection` per server per process keeps a session open (stdio: the mesh starts
the server's process; or streamable HTTP with the configured headers), lists its tools as
catalog entries ``SERVER__TOOL`` and runs calls. :class:`McpHost` holds the connections for the
registered servers and routes a full tool name to its connection.

Why it is shaped this way:

- **One task owns a session.** The ``mcp`` package builds transports and sessions from anyio
  task groups, whose cancel scopes must be left in the task that entered them; a session opened
  in one task and closed in another fails ("exit cancel scope in a different task"). So
  :meth:`McpConnection.run` opens the transport and the session, initialises, lists, watches,
  and closes, all in its own task, and reopens them with capped backoff (0.5 s doubling to
  10 s, back to 0.5 s after a session that lasted) whenever the server exits or the
  connection breaks.
- **Calls go to the session from the caller's task.** ``ClientSession.call_tool`` ends in the
  dispatcher's ``send_raw_request``, which is built for concurrent callers from any task: each
  request gets its own one-slot stream keyed by its id, nothing in it enters a task group or a
  cancel scope the session owns, and when the connection ends every waiting request is woken
  with ``CONNECTION_CLOSED`` (a request sent after the end gets the same at once). Handing calls
  to the owning task through a queue would add a buffer and a hop for no safety gained. The
  call runs in a task of its own that the caller waits for at most ``timeout``: on expiry it is
  cancelled (the SDK then tells the server, within its own 5 s bound) while the caller already
  has its answer, so nothing the SDK does on the way out can hold the caller past ``timeout``.
- **Nothing is lost when a server is down.** ``on_tools`` is awaited only with a listing the
  server gave (at every connect, and after ``notifications/tools/list_changed``), never with an
  empty list because the server went away: the catalog keeps the entries and calls fail with a
  text that says why, for the model to read. A listing ``on_tools`` failed to record (the
  store away) is handed to it again at the session's next idle moment (the ping interval).
- **Stdio servers get no secrets.** Their environment is an allow-list of harmless basics
  (:data:`INHERITED_ENV`) plus the server's own ``env``; nothing else of this process's
  environment (``YOKE_*``, ``OPENAI_API_KEY``, broker and store URLs) reaches them.
  Nor can they read it from ``/proc``: this process is not dumpable (:mod:`yoke.core.hardening`),
  and when it is root they run as an unprivileged user (:mod:`yoke.tools.stdio_user`).
- **Bounded** (invariant 14): at most :data:`MAX_TOOLS` tools in :data:`MAX_LIST_PAGES` pages
  per listing, at most ``max_calls_in_flight`` calls per connection (those waiting for a
  session while the server starts or reconnects included), no queue anywhere.

What a call's result becomes (:func:`result_text`), content block by content block, joined by
blank lines: text as it is; an image as ``[image: MIME, N bytes of base64]``; audio as
``[audio: MIME, N bytes of base64]``; an embedded resource as ``[resource: URI (MIME)]``
followed by its text when it is a text resource, or ``[resource: URI (MIME), N bytes of
base64]`` for a blob; a resource link as ``[resource link: URI (MIME) NAME: DESCRIPTION]``.
The binary data itself is dropped (a model reads text here). ``structuredContent`` is
serialised as JSON only when no content block holds text, since servers are asked to repeat it
as text. ``isError`` gives ``(text, True)``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import anyio
import httpx2
import mcp.types as types
from mcp import ClientSession, MCPError, StdioServerParameters, stdio_client
from mcp.client.session import IncomingMessage
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.message import SessionMessage
from pydantic import ValidationError

from yoke.core.text import storable
from yoke.tools.catalog import (
    MCP_SEPARATOR,
    MCP_SERVER_NAME,
    CatalogEntry,
    McpServer,
    mcp_tool_name,
    name_problem,
)
from yoke.tools.stdio_user import server_command

log = logging.getLogger(__name__)

OnTools = Callable[[list[CatalogEntry]], Awaitable[None]]

# What a stdio server may see of this process's environment, besides its own ``env``: enough
# to find programs, write temporary files and speak the locale; never a credential.
INHERITED_ENV = (
    "HOME",
    "LANG",
    "LANGUAGE",
    "LC_ALL",
    "LC_CTYPE",
    "LOGNAME",
    "PATH",
    "SHELL",
    "TERM",
    "TMPDIR",
    "TZ",
    "USER",
    # What programs on Windows need to start at all.
    "APPDATA",
    "COMSPEC",
    "HOMEDRIVE",
    "HOMEPATH",
    "LOCALAPPDATA",
    "PATHEXT",
    "PROCESSOR_ARCHITECTURE",
    "SYSTEMDRIVE",
    "SYSTEMROOT",
    "TEMP",
    "TMP",
    "USERNAME",
    "USERPROFILE",
    "WINDIR",
)
MAX_TOOLS = 500
MAX_LIST_PAGES = 20
BACKOFF_INITIAL_SECONDS = 0.5
BACKOFF_MAX_SECONDS = 10.0
# A session that lasted this long was healthy: the next reconnect starts from the short delay.
STABLE_SESSION = 30.0
# The least a server is given to start, initialise and list its tools (its call timeout if
# longer).
START_SECONDS = 30.0
PING_INTERVAL_SECONDS = 15.0
PING_TIMEOUT_SECONDS = 10.0
MAX_CALLS_IN_FLIGHT = 64
CLIENT_INFO = types.Implementation(name="yoke-mesh", version="0.1.0")


def server_environment(server: McpServer) -> dict[str, str]:
    """The whole environment a stdio server starts with: the allow-list, then its own ``env``."""
    inherited = {
        name: value
        for name in INHERITED_ENV
        # A value starting with "()" is an exported shell function, a known injection path.
        if (value := os.environ.get(name)) is not None and not value.startswith("()")
    }
    return inherited | server.env


def server_problem(server: McpServer) -> str | None:
    """Why ``server`` cannot be connected to as configured (None when it can)."""
    if MCP_SERVER_NAME.fullmatch(server.id) is None:
        return f"mcp server name {server.id!r} must match {MCP_SERVER_NAME.pattern}"
    if (server.command is None) == (server.url is None):
        return f"mcp server {server.id} needs exactly one of a command and a url"
    if server.command is not None and not server.command:
        return f"mcp server {server.id} has an empty command"
    return None


def catalog_entry(server: McpServer, tool: types.Tool) -> CatalogEntry:
    """The catalog's view of one of ``server``'s tools; a name the mesh cannot use is listed
    ``unavailable`` with the reason rather than dropped, so the operator sees it."""
    # The name and description are the server's text: made storable (a NUL, a lone surrogate
    # would fail the whole listing's write); a name so changed is unusable anyway.
    name = storable(mcp_tool_name(server.id, tool.name))
    reason = name_problem(name)
    return CatalogEntry(
        id=name,
        description=storable(tool.description or tool.title or ""),
        input_schema=tool.input_schema,
        source="mcp",
        origin=server.id,
        timeout_seconds=server.timeout_seconds,
        status="ready" if reason is None else "unavailable",
        reason=reason,
    )


def _mime(mime_type: str | None) -> str:
    return mime_type or "unknown type"


def content_text(block: types.ContentBlock) -> str:
    """One content block as text a model can read (the module docstring lists each kind)."""
    if isinstance(block, types.TextContent):
        return block.text
    if isinstance(block, types.ImageContent):
        return f"[image: {block.mime_type}, {len(block.data)} bytes of base64]"
    if isinstance(block, types.AudioContent):
        return f"[audio: {block.mime_type}, {len(block.data)} bytes of base64]"
    if isinstance(block, types.EmbeddedResource):
        resource = block.resource
        if isinstance(resource, types.TextResourceContents):
            return f"[resource: {resource.uri} ({_mime(resource.mime_type)})]\n{resource.text}"
        return (
            f"[resource: {resource.uri} ({_mime(resource.mime_type)}), "
            f"{len(resource.blob)} bytes of base64]"
        )
    if isinstance(block, types.ResourceLink):
        about = f": {block.description}" if block.description else ""
        return f"[resource link: {block.uri} ({_mime(block.mime_type)}) {block.name}{about}]"
    return f"[{getattr(block, 'type', type(block).__name__)} content]"


def result_text(result: types.CallToolResult) -> str:
    """A tool result as one text: its blocks, or its structured content when no block is text."""
    parts = [content_text(block) for block in result.content]
    has_text = any(
        isinstance(block, types.TextContent | types.EmbeddedResource) for block in result.content
    )
    if result.structured_content is not None and not has_text:
        parts.append(json.dumps(result.structured_content, ensure_ascii=False, default=str))
    # Outside text: a binary file read as text holds NULs the store cannot (yoke.core.text).
    return storable("\n\n".join(parts))


def describe(error: BaseException) -> str:
    """An exception as one line for a log or a model, through any exception groups."""
    while isinstance(error, BaseExceptionGroup) and error.exceptions:
        error = error.exceptions[0]
    if isinstance(error, _Broken):
        return str(error)
    if isinstance(error, MCPError):
        return f"{error.error.message} (MCP error {error.error.code})"
    if isinstance(error, TimeoutError):
        return "timed out"
    text = str(error)
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def _seconds(value: float) -> str:
    return f"{value:g}s"


class _Broken(Exception):
    """The session cannot go on (or never got going); the message says why."""


@dataclass(eq=False)
class _Attempt:
    """One connection attempt's state, so that news from an old session never touches a new one."""

    wake: asyncio.Event = field(default_factory=asyncio.Event)
    ready_at: float | None = None
    lost: str | None = None
    relist: bool = False
    session: ClientSession | None = None

    def lose(self, reason: str) -> None:
        if self.lost is None:
            self.lost = reason
        self.wake.set()


class McpConnection:
    """The mesh's connection to one MCP server: a long-lived :meth:`run` and calls from anywhere."""

    def __init__(
        self,
        server: McpServer,
        on_tools: OnTools,
        *,
        backoff_initial: float = BACKOFF_INITIAL_SECONDS,
        backoff_max: float = BACKOFF_MAX_SECONDS,
        ping_interval: float = PING_INTERVAL_SECONDS,
        max_calls_in_flight: int = MAX_CALLS_IN_FLIGHT,
    ) -> None:
        self.server = server
        self._on_tools = on_tools
        self._backoff_initial = backoff_initial
        self._backoff_max = backoff_max
        self._ping_interval = ping_interval
        self._max_calls_in_flight = max_calls_in_flight
        self._ready = asyncio.Event()
        self._attempt: _Attempt | None = None
        # Set once run() has returned: calls fail at once instead of waiting for a connection.
        self._stopped = asyncio.Event()
        self._stopping = False
        self._problem: str | None = server_problem(server)
        self._tools: list[CatalogEntry] = []
        # Calls under way; holding them also keeps asyncio from collecting a cancelled one early.
        self._calls: set[asyncio.Task[tuple[str, bool]]] = set()
        # Calls waiting for a session (while the server starts or reconnects): bounded too.
        self._waiting = 0

    @property
    def name(self) -> str:
        return self.server.id

    @property
    def ready(self) -> bool:
        """Whether a session is initialised and its tools listed, so calls go out at once."""
        return self._ready.is_set()

    @property
    def problem(self) -> str | None:
        """Why the last attempt to connect, or the last session, ended (None while all is well)."""
        return self._problem

    @property
    def tools(self) -> list[CatalogEntry]:
        """The last listing the server gave (kept while it is down)."""
        return list(self._tools)

    async def run(self, stopping: asyncio.Event) -> None:
        """Keep a session to the server until ``stopping`` is set; then close it and return."""
        self._stopped.clear()
        self._stopping = False
        try:
            async with anyio.create_task_group() as group:

                async def stop_when_set() -> None:
                    await stopping.wait()
                    self._stopping = True
                    group.cancel_scope.cancel()

                group.start_soon(stop_when_set)
                if self._problem is not None:
                    log.error("mcp server %s is not started: %s", self.name, self._problem)
                    await anyio.sleep_forever()
                # Runs in this very task (a task group's body is its host task), so the session
                # is entered and left here; cancelling the group on stopping unwinds it here.
                await self._keep_connected()
        finally:
            self._attempt = None
            self._ready.clear()
            self._stopped.set()

    async def _keep_connected(self) -> None:
        loop = asyncio.get_running_loop()
        delay = self._backoff_initial
        while True:
            attempt = _Attempt()
            self._attempt = attempt
            try:
                await self._connect_and_serve(attempt)
            except Exception as error:
                self._problem = describe(error)
            finally:
                self._ready.clear()
                attempt.session = None
            if attempt.ready_at is not None and loop.time() - attempt.ready_at >= STABLE_SESSION:
                delay = self._backoff_initial
            log.warning(
                "mcp server %s: %s; connecting again in %s",
                self.name,
                self._problem,
                _seconds(delay),
            )
            await anyio.sleep(delay)
            delay = min(delay * 2, self._backoff_max)

    def _transport(self) -> AbstractAsyncContextManager[Any]:
        server = self.server
        if server.command is not None:
            # As an unprivileged user when this process is root (yoke.tools.stdio_user).
            command = server_command(server.command)
            parameters = StdioServerParameters(
                command=command[0], args=command[1:], env=server_environment(server)
            )
            # errlog is read now, not at import: the server's stderr joins this process's own.
            return stdio_client(parameters, errlog=sys.stderr)
        assert server.url is not None
        return self._http_transport(server.url)

    @asynccontextmanager
    async def _http_transport(self, url: str) -> AsyncIterator[Any]:
        timeout = httpx2.Timeout(min(self.server.timeout_seconds, 30.0), read=300.0)
        async with (
            httpx2.AsyncClient(headers=self.server.headers, timeout=timeout) as client,
            streamable_http_client(url, http_client=client) as streams,
        ):
            yield streams

    async def _connect_and_serve(self, attempt: _Attempt) -> None:
        """One session, from opening the transport to the moment it breaks (which raises)."""
        async with AsyncExitStack() as stack:
            read, write = await stack.enter_async_context(self._transport())
            # The session reads through this relay, which marks the attempt lost when the
            # transport's stream ends (a stdio server exited, an HTTP connection dropped), so
            # the loss is noticed at once rather than at the next call or ping.
            relay_in, relay_out = anyio.create_memory_object_stream[SessionMessage | Exception](0)
            group = await stack.enter_async_context(anyio.create_task_group())
            stack.callback(group.cancel_scope.cancel)

            async def relay() -> None:
                async with relay_in:
                    try:
                        async for item in read:
                            await relay_in.send(item)
                    except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                        pass
                attempt.lose("the server closed the connection")

            group.start_soon(relay)

            async def on_message(message: IncomingMessage) -> None:
                self._on_message(attempt, message)

            session = await stack.enter_async_context(
                ClientSession(relay_out, write, message_handler=on_message, client_info=CLIENT_INFO)
            )
            # Starting is not a call: a server may take longer to start (npx fetching it, a
            # loaded machine) than its calls may take, and killing it at the call timeout
            # would start it again and again, never connecting.
            start_seconds = max(self.server.timeout_seconds, START_SECONDS)
            try:
                with anyio.fail_after(start_seconds):
                    await session.initialize()
                    tools = await self._list_tools(session)
            except TimeoutError as error:
                raise _Broken(
                    "the server did not initialise and list its tools within "
                    f"{_seconds(start_seconds)}"
                ) from error
            attempt.session = session
            attempt.ready_at = asyncio.get_running_loop().time()
            self._problem = None
            self._ready.set()
            log.info("mcp server %s connected with %d tools", self.name, len(tools))
            recorded = await self._publish(tools)
            while True:
                with anyio.move_on_after(self._ping_interval) as idle:
                    await attempt.wake.wait()
                attempt.wake.clear()
                if attempt.lost is not None:
                    raise _Broken(attempt.lost)
                if attempt.relist:
                    attempt.relist = False
                    try:
                        with anyio.fail_after(self.server.timeout_seconds):
                            tools = await self._list_tools(session)
                    except TimeoutError as error:
                        raise _Broken("listing the changed tools timed out") from error
                    log.info("mcp server %s now has %d tools", self.name, len(tools))
                    recorded = await self._publish(tools)
                if idle.cancelled_caught:
                    if not recorded:  # the store was away, or refused it: again now
                        recorded = await self._publish(tools)
                    await self._ping(session)

    def _on_message(self, attempt: _Attempt, message: IncomingMessage) -> None:
        if isinstance(message, types.ToolListChangedNotification):
            attempt.relist = True
            attempt.wake.set()
        elif isinstance(message, Exception):
            log.warning("mcp server %s sent something unreadable: %s", self.name, describe(message))

    async def _ping(self, session: ClientSession) -> None:
        """Proves an idle connection alive (an HTTP server may have restarted meanwhile)."""
        try:
            with anyio.fail_after(min(self.server.timeout_seconds, PING_TIMEOUT_SECONDS)):
                await session.send_ping()
        except MCPError as error:
            if error.error.code != types.METHOD_NOT_FOUND:
                raise _Broken(f"ping failed: {describe(error)}") from error
        except TimeoutError as error:
            raise _Broken("ping timed out") from error

    async def _list_tools(self, session: ClientSession) -> list[CatalogEntry]:
        tools: dict[str, types.Tool] = {}
        cursor: str | None = None
        for _ in range(MAX_LIST_PAGES):
            params = None if cursor is None else types.PaginatedRequestParams(cursor=cursor)
            page = await session.list_tools(params=params)
            for tool in page.tools:
                tools.setdefault(tool.name, tool)
            cursor = page.next_cursor
            if cursor is None or len(tools) >= MAX_TOOLS:
                break
        if cursor is not None:
            log.warning(
                "mcp server %s lists more than %d tools or %d pages; the rest are left out",
                self.name,
                MAX_TOOLS,
                MAX_LIST_PAGES,
            )
        return [catalog_entry(self.server, tool) for tool in list(tools.values())[:MAX_TOOLS]]

    async def _publish(self, tools: list[CatalogEntry]) -> bool:
        """Hand a listing to ``on_tools``; whether it was recorded (if not, the session's next
        idle moment tries again)."""
        self._tools = tools
        try:
            await self._on_tools(tools)
        except Exception as error:
            # The catalog is the caller's; failing to record it must not drop the session.
            log.warning(
                "recording the tools of mcp server %s failed (again in %s): %s",
                self.name,
                _seconds(self._ping_interval),
                describe(error),
            )
            return False
        return True

    # The timeout is the call's own contract (an answer, not an exception, when it runs out),
    # which a caller's cancel scope could not give.
    async def call(
        self,
        tool: str,
        arguments: dict[str, Any],
        timeout: float,  # noqa: ASYNC109
    ) -> tuple[str, bool]:
        """Run ``tool`` (its name on the server) and answer ``(text, is_error)``; never raises and
        never takes longer than ``timeout``, waiting within it for a connection if need be."""
        full_name = mcp_tool_name(self.name, tool)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        if self._stopped.is_set():
            return self._failed(tool, f"mcp server {self.name} is not connected ({self._why()})")
        under_way = len(self._calls) + self._waiting
        if under_way >= self._max_calls_in_flight:
            return self._failed(
                tool,
                f"mcp server {self.name} already has {under_way} calls under way; try again later",
            )
        self._waiting += 1
        try:
            connected = await self._wait_ready(timeout)
        finally:
            self._waiting -= 1
        if not connected:
            return self._failed(tool, f"mcp server {self.name} is not connected ({self._why()})")
        attempt = self._attempt
        if attempt is None or attempt.session is None:
            return self._failed(tool, f"mcp server {self.name} is not connected ({self._why()})")
        running = asyncio.create_task(
            self._call_in_session(attempt, attempt.session, tool, arguments)
        )
        self._calls.add(running)
        running.add_done_callback(self._calls.discard)
        try:
            done, _ = await asyncio.wait({running}, timeout=max(deadline - loop.time(), 0.0))
        except asyncio.CancelledError:
            running.cancel()
            raise
        if not done:
            running.cancel()
            return self._failed(tool, f"{full_name} timed out after {_seconds(timeout)}")
        if running.cancelled():
            return self._failed(tool, f"the call to {full_name} was cancelled")
        return running.result()

    async def _call_in_session(
        self, attempt: _Attempt, session: ClientSession, tool: str, arguments: dict[str, Any]
    ) -> tuple[str, bool]:
        full_name = mcp_tool_name(self.name, tool)
        try:
            result = await session.call_tool(tool, arguments)
        except MCPError as error:
            if error.error.code == types.CONNECTION_CLOSED and self._stopping:
                return self._failed(tool, f"mcp server {self.name} was stopped during the call")
            if error.error.code == types.CONNECTION_CLOSED:
                attempt.lose("the server closed the connection during a call")
                return self._failed(
                    tool, f"the mcp server {self.name} closed the connection during the call"
                )
            if error.error.message == "Session terminated":
                # An HTTP server that restarted no longer knows the session: open a new one.
                attempt.lose("the server ended the session")
                return self._failed(tool, f"the mcp server {self.name} ended the session")
            return self._failed(
                tool,
                f"mcp server {self.name} answered {full_name} with an error: {describe(error)}",
            )
        except ValidationError as error:
            problems = "; ".join(
                f"{'.'.join(str(p) for p in e['loc']) or 'result'}: {e['msg']}"
                for e in error.errors()[:3]
            )
            return self._failed(
                tool, f"mcp server {self.name} sent {full_name} an invalid result: {problems}"
            )
        except Exception as error:
            return self._failed(tool, f"calling {full_name} failed: {describe(error)}")
        text = result_text(result)
        if result.is_error:
            log.info("mcp server %s tool %s reported an error: %.200s", self.name, tool, text)
            return text or f"{full_name} reported an error without saying which", True
        return text, False

    async def _wait_ready(self, seconds: float) -> bool:
        """Whether a session is ready within ``seconds`` (False at once should run() end)."""
        if self._ready.is_set():
            return True
        waits = {asyncio.create_task(self._ready.wait()), asyncio.create_task(self._stopped.wait())}
        try:
            await asyncio.wait(waits, timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for wait in waits:
                wait.cancel()
        return self._ready.is_set()

    def _why(self) -> str:
        if self._stopped.is_set():
            return "stopped"
        return self._problem or "connecting"

    def _failed(self, tool: str, text: str) -> tuple[str, bool]:
        log.warning("mcp server %s tool %s: %s", self.name, tool, text)
        return text, True


def _config(server: McpServer) -> dict[str, Any]:
    """What a connection is built from: a change in any of it means a new connection."""
    return server.model_dump(include={"command", "url", "headers", "env", "timeout_seconds"})


@dataclass
class _Running:
    connection: McpConnection
    stopping: asyncio.Event
    task: asyncio.Task[None]


class McpHost:
    """The MCP servers this process is connected to, kept in step with the registered ones."""

    STOP_SECONDS = 10.0

    def __init__(self, on_tools: Callable[[str], OnTools], **connection_options: Any) -> None:
        """``on_tools(server_name)`` gives the callback that records that server's tools;
        ``connection_options`` go to every :class:`McpConnection` (backoff, ping interval)."""
        self._on_tools = on_tools
        self._options = connection_options
        self._running: dict[str, _Running] = {}

    @property
    def connections(self) -> dict[str, McpConnection]:
        return {name: running.connection for name, running in self._running.items()}

    async def sync(self, servers: list[McpServer]) -> None:
        """Connect to new servers, disconnect removed ones, reconnect those whose config changed."""
        wanted = {server.id: server for server in servers}
        stale = [
            name
            for name, running in self._running.items()
            if name not in wanted or _config(wanted[name]) != _config(running.connection.server)
        ]
        await asyncio.gather(*(self._stop(name) for name in stale))
        for name, server in wanted.items():
            if name not in self._running:
                self._start(server)

    def _start(self, server: McpServer) -> None:
        connection = McpConnection(server, self._on_tools(server.id), **self._options)
        stopping = asyncio.Event()
        task = asyncio.create_task(connection.run(stopping), name=f"mcp:{server.id}")
        self._running[server.id] = _Running(connection, stopping, task)

    async def _stop(self, name: str) -> None:
        running = self._running.pop(name)
        running.stopping.set()
        done, _ = await asyncio.wait({running.task}, timeout=self.STOP_SECONDS)
        if not done:
            log.warning("mcp server %s did not stop in %s; cancelling", name, self.STOP_SECONDS)
            running.task.cancel()
            await asyncio.wait({running.task}, timeout=self.STOP_SECONDS)
        elif not running.task.cancelled() and (error := running.task.exception()) is not None:
            log.warning("mcp server %s stopped with an error: %s", name, describe(error))

    async def call(
        self,
        full_name: str,
        arguments: dict[str, Any],
        timeout: float,  # noqa: ASYNC109 (as McpConnection.call)
    ) -> tuple[str, bool]:
        """Run the tool ``SERVER__TOOL``; an unknown server is an error result, not an exception."""
        server, separator, tool = full_name.partition(MCP_SEPARATOR)
        running = self._running.get(server) if separator else None
        if running is None or not tool:
            text = f"no mcp server offers {full_name}"
            log.warning("%s (connected: %s)", text, ", ".join(sorted(self._running)) or "none")
            return text, True
        return await running.connection.call(tool, arguments, timeout)

    async def close(self) -> None:
        """Stop every connection (their stdio servers exit with them)."""
        await asyncio.gather(*(self._stop(name) for name in list(self._running)))

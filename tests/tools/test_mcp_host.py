"""The MCP host against a real MCP server (tests/support/mcp_server.py), over stdio and over
streamable HTTP: listing, calls, and every way a server can let a call down."""

from __future__ import annotations

import asyncio
import base64
import os
import subprocess
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import mcp.types as types
import pytest

from tests.support.mcp_server import LONG_NAME, PIXEL_PNG, STDIO_COMMAND
from tests.support.processes import ROOT, eventually, free_port
from yoke.tools.catalog import CatalogEntry, McpServer
from yoke.tools.mcp import (
    INHERITED_ENV,
    McpConnection,
    McpHost,
    result_text,
    server_environment,
)

STDIO = STDIO_COMMAND
TOKEN = "Bearer not-a-real-token"


class Listings:
    """An ``on_tools`` callback that keeps every listing it is given."""

    def __init__(self) -> None:
        self.calls: list[list[CatalogEntry]] = []

    async def __call__(self, entries: list[CatalogEntry]) -> None:
        self.calls.append(entries)

    @property
    def names(self) -> set[str]:
        return {entry.id for entry in self.calls[-1]} if self.calls else set()

    def entry(self, name: str) -> CatalogEntry:
        return next(entry for entry in self.calls[-1] if entry.id == name)


def stdio_server(name: str = "files", **fields: Any) -> McpServer:
    return McpServer(id=name, command=STDIO, **fields)


class HttpServer:
    """The test server as its own process on a free port, started and stopped at will."""

    def __init__(self, require_header: str | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/mcp"
        self.args = [*STDIO[:3], "--transport", "http", "--port", str(self.port)]
        if require_header:
            self.args += ["--require-header", require_header]
        self.process: subprocess.Popen[bytes] | None = None

    async def start(self) -> None:
        self.process = subprocess.Popen(self.args, cwd=ROOT)

        async def answers() -> bool:
            assert self.process is not None and self.process.poll() is None
            try:
                async with httpx.AsyncClient(timeout=1) as client:
                    await client.get(self.url)
                return True
            except httpx.TransportError:
                return False

        await eventually(answers, timeout=15, what="the MCP test server to answer")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)
        self.process = None


@pytest.fixture(scope="module")
async def http_server() -> AsyncIterator[HttpServer]:
    server = HttpServer(require_header=f"Authorization: {TOKEN}")
    await server.start()
    yield server
    server.stop()


def http_config(server: HttpServer, name: str = "web", **fields: Any) -> McpServer:
    return McpServer(id=name, url=server.url, headers={"Authorization": TOKEN}, **fields)


@asynccontextmanager
async def connected(
    server: McpServer, *, wait_ready: bool = True, **options: Any
) -> AsyncIterator[tuple[McpConnection, Listings]]:
    """A running connection; on the way out it must stop promptly and cleanly."""
    listings = Listings()
    connection = McpConnection(server, listings, **options)
    stopping = asyncio.Event()
    task = asyncio.create_task(connection.run(stopping))
    try:
        if wait_ready:
            await ready(connection, task)
        yield connection, listings
    finally:
        stopping.set()
        async with asyncio.timeout(5):
            await task


async def ready(connection: McpConnection, task: asyncio.Task[None] | None = None) -> None:
    async def up() -> bool:
        assert task is None or not task.done(), task
        return connection.ready

    await eventually(up, timeout=15, what=f"mcp server {connection.name} to be ready")


@pytest.fixture(scope="module")
async def files() -> AsyncIterator[tuple[McpConnection, Listings]]:
    async with connected(stdio_server(timeout_seconds=7, env={"GREETING": "hello"})) as running:
        yield running


@pytest.fixture(scope="module")
async def web(http_server: HttpServer) -> AsyncIterator[tuple[McpConnection, Listings]]:
    async with connected(http_config(http_server)) as running:
        yield running


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, exited but not reaped, counts as gone only once reaped)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def stdio_children() -> list[int]:
    """This process's children that are stdio test servers."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cmdline = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            continue
        if int(fields[1]) == os.getpid() and b"--transport stdio" in cmdline:
            found.append(int(stat.parent.name))
    return found


async def test_stdio_tools_are_listed_with_full_names_schemas_and_config(
    files: tuple[McpConnection, Listings],
) -> None:
    _, listings = files
    assert {"files__echo", "files__add", "files__hang", "files__picture"} <= listings.names
    echo = listings.entry("files__echo")
    assert (echo.source, echo.origin, echo.status, echo.reason) == ("mcp", "files", "ready", None)
    assert echo.description == "Answers with its input."
    assert echo.input_schema["properties"]["text"]["type"] == "string"
    assert echo.input_schema["required"] == ["text"]
    assert echo.timeout_seconds == 7
    add = listings.entry("files__add")
    assert add.input_schema["properties"]["b"]["type"] == "integer"


async def test_names_the_mesh_cannot_use_are_listed_unavailable_with_the_reason(
    files: tuple[McpConnection, Listings],
) -> None:
    _, listings = files
    for name in (f"files__{LONG_NAME}", "files__dotted.name"):
        entry = listings.entry(name)
        assert entry.status == "unavailable"
        assert entry.reason is not None and "must match" in entry.reason


async def test_calls_answer_over_stdio_and_http(
    files: tuple[McpConnection, Listings], web: tuple[McpConnection, Listings]
) -> None:
    for connection, _ in (files, web):
        assert await connection.call("echo", {"text": "hello"}, 5) == ("hello", False)
        assert await connection.call("add", {"a": 2, "b": 3}, 5) == ("5", False)


async def test_http_tools_are_listed_under_the_servers_name(
    web: tuple[McpConnection, Listings],
) -> None:
    _, listings = web
    assert {"web__echo", "web__slow", "web__env"} <= listings.names
    assert listings.entry("web__echo").origin == "web"


async def test_a_tool_that_fails_gives_an_error_result_with_its_text(
    files: tuple[McpConnection, Listings],
) -> None:
    connection, _ = files
    text, is_error = await connection.call("fail", {"message": "the disk is full"}, 5)
    assert is_error
    assert "the disk is full" in text


async def test_an_unknown_tool_or_bad_arguments_give_an_error_result(
    files: tuple[McpConnection, Listings],
) -> None:
    connection, _ = files
    text, is_error = await connection.call("no-such-tool", {}, 5)
    assert is_error and "no-such-tool" in text
    text, is_error = await connection.call("add", {"a": "two"}, 5)
    assert is_error and text


async def test_non_text_content_becomes_a_description(
    files: tuple[McpConnection, Listings],
) -> None:
    connection, _ = files
    size = len(base64.b64encode(PIXEL_PNG))
    assert await connection.call("picture", {}, 5) == (
        f"[image: image/png, {size} bytes of base64]",
        False,
    )
    text, is_error = await connection.call("resources", {}, 5)
    assert not is_error
    assert text == (
        "two resources follow\n\n"
        "[resource: file:///notes.txt (text/plain)]\nthe notes\n\n"
        "[resource link: file:///big.csv (text/csv) big]"
    )
    assert await connection.call("structured", {}, 5) == ('{"answer": 42}', False)


def test_result_text_describes_audio_blobs_and_keeps_text_over_structured_content() -> None:
    result = types.CallToolResult(
        content=[
            types.AudioContent(data="AAAA", mime_type="audio/wav"),
            types.EmbeddedResource(
                resource=types.BlobResourceContents(uri="file:///a.bin", blob="QUJD")
            ),
            types.TextContent(text="said as text"),
        ],
        structured_content={"said": "as json"},
    )
    assert result_text(result) == (
        "[audio: audio/wav, 4 bytes of base64]\n\n"
        "[resource: file:///a.bin (unknown type), 4 bytes of base64]\n\n"
        "said as text"
    )


async def test_stdio_server_sees_none_of_the_mesh_secrets(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("YOKE_SECRET_PROBE", "s3cret-probe")
    monkeypatch.setenv("OPENAI_API_KEY", "sk-probe")
    monkeypatch.setenv("YOKE_AMQP_URL", "amqp://user:pass@127.0.0.1/")
    config = stdio_server("probe", env={"GREETING": "hello"})
    assert set(server_environment(config)) <= {*INHERITED_ENV, "GREETING"}
    async with connected(config) as (connection, _):
        for secret in ("YOKE_SECRET_PROBE", "OPENAI_API_KEY", "YOKE_AMQP_URL"):
            assert await connection.call("env", {"name": secret}, 5) == ("<unset>", False)
        assert await connection.call("env", {"name": "GREETING"}, 5) == ("hello", False)
        assert await connection.call("env", {"name": "PATH"}, 5) == (os.environ["PATH"], False)


async def test_a_crash_mid_call_is_an_error_and_the_server_is_started_again() -> None:
    async with connected(stdio_server("crashy")) as (connection, listings):
        first_pid, _ = await connection.call("pid", {}, 5)
        text, is_error = await connection.call("crash", {}, 5)
        assert is_error
        assert text == "the mcp server crashy closed the connection during the call"

        async def reaped() -> bool:
            return not alive(int(first_pid))

        await eventually(reaped, timeout=5, what="the crashed server to be reaped")
        answers: list[tuple[str, bool]] = []

        async def answers_again() -> bool:
            answers.append(await connection.call("pid", {}, 2))
            return not answers[-1][1]

        await eventually(answers_again, timeout=15, what="the restarted server to answer")
        assert answers[-1][0] != first_pid
        # Every listing came from the server: the crash never emptied the catalog.
        assert len(listings.calls) >= 2
        assert all("crashy__echo" in {entry.id for entry in call} for call in listings.calls)


async def test_a_hung_call_times_out_while_other_calls_answer(
    files: tuple[McpConnection, Listings], web: tuple[McpConnection, Listings]
) -> None:
    loop = asyncio.get_running_loop()
    started = loop.time()
    hung = asyncio.create_task(files[0].call("hang", {}, 1.5))
    assert await web[0].call("echo", {"text": "elsewhere"}, 5) == ("elsewhere", False)
    assert await files[0].call("echo", {"text": "same server"}, 5) == ("same server", False)
    assert not hung.done(), "other calls answered at once, while the hung one still waits"
    assert await hung == ("files__hang timed out after 1.5s", True)
    assert 1.5 <= loop.time() - started < 3.0
    # The connection is unharmed by the abandoned call.
    assert await files[0].call("echo", {"text": "after"}, 5) == ("after", False)


async def test_calls_beyond_the_bound_are_refused_at_once(http_server: HttpServer) -> None:
    config = http_config(http_server, "narrow")
    async with connected(config, max_calls_in_flight=1) as (connection, _):
        hung = asyncio.create_task(connection.call("hang", {}, 1))
        await asyncio.sleep(0.1)
        async with asyncio.timeout(0.5):
            refused = await connection.call("echo", {"text": "one too many"}, 5)
        assert refused == ("mcp server narrow already has 1 calls under way; try again later", True)
        assert (await hung)[1]

        # The abandoned call counts until the SDK has finished winding it down.
        async def room_again() -> bool:
            return await connection.call("echo", {"text": "room"}, 5) == ("room", False)

        await eventually(room_again, timeout=10, what="the bound to have room again")


async def test_calls_waiting_for_a_connection_count_against_the_bound() -> None:
    # Nothing listens there: every call waits for a connection that does not come.
    config = McpServer(id="waiting", url=f"http://127.0.0.1:{free_port()}/mcp")
    async with connected(config, wait_ready=False, max_calls_in_flight=2) as (connection, _):
        waiting = [asyncio.create_task(connection.call("echo", {"text": "hi"}, 3)) for _ in "ab"]
        await asyncio.sleep(0)  # both have started to wait
        async with asyncio.timeout(0.5):
            refused = await connection.call("echo", {"text": "one too many"}, 3)
        assert refused == (
            "mcp server waiting already has 2 calls under way; try again later",
            True,
        )
        for call in waiting:
            text, is_error = await call
            assert is_error and text.startswith("mcp server waiting is not connected ("), text


async def test_a_slow_call_within_its_timeout_answers(
    web: tuple[McpConnection, Listings],
) -> None:
    assert await web[0].call("slow", {"seconds": 0.3}, 5) == ("slept 0.3", False)


@pytest.mark.parametrize("transport", ["stdio", "http"])
async def test_tools_list_changed_reaches_on_tools(transport: str, http_server: HttpServer) -> None:
    config = stdio_server("grow") if transport == "stdio" else http_config(http_server, "grow")
    async with connected(config) as (connection, listings):
        assert "grow__late" not in listings.names
        assert await connection.call("add_tool", {}, 5) == ("added late", False)

        async def listed() -> bool:
            return "grow__late" in listings.names

        await eventually(listed, timeout=10, what="the new tool to reach on_tools")
        assert "grow__echo" in listings.names
        assert await connection.call("late", {"text": "x"}, 5) == ("late: x", False)


async def test_without_the_required_header_the_server_is_not_connected(
    http_server: HttpServer,
) -> None:
    config = McpServer(id="nohead", url=http_server.url)
    async with connected(config, wait_ready=False) as (connection, listings):
        text, is_error = await connection.call("echo", {"text": "hi"}, 1.5)
        assert is_error
        assert text.startswith("mcp server nohead is not connected (")
        assert not connection.ready
        assert listings.calls == []


async def test_a_server_that_is_down_fails_calls_keeps_its_tools_and_is_reconnected() -> None:
    server = HttpServer()
    config = McpServer(id="flaky", url=server.url)
    quick = {"backoff_initial": 0.1, "backoff_max": 0.5}
    async with connected(config, wait_ready=False, **quick) as (connection, listings):
        text, is_error = await connection.call("echo", {"text": "hi"}, 1)
        assert is_error and text.startswith("mcp server flaky is not connected (")
        assert listings.calls == []
        await server.start()
        try:
            await ready(connection)
            assert await connection.call("echo", {"text": "up"}, 5) == ("up", False)
            server.stop()
            text, is_error = await connection.call("echo", {"text": "down"}, 3)
            assert is_error, text
            assert all(call for call in listings.calls), "never an empty listing"
            await server.start()
            answers: list[tuple[str, bool]] = []

            async def answers_again() -> bool:
                answers.append(await connection.call("echo", {"text": "back"}, 2))
                return not answers[-1][1]

            await eventually(answers_again, timeout=20, what="the restarted server to answer")
            assert answers[-1] == ("back", False)
        finally:
            server.stop()


async def test_stopping_returns_promptly_and_leaves_no_child_process() -> None:
    listings = Listings()
    connection = McpConnection(stdio_server("brief"), listings)
    others = set(stdio_children())
    stopping = asyncio.Event()
    task = asyncio.create_task(connection.run(stopping))
    await ready(connection, task)
    pid, _ = await connection.call("pid", {}, 5)
    assert set(stdio_children()) == others | {int(pid)}
    loop = asyncio.get_running_loop()
    started = loop.time()
    stopping.set()
    async with asyncio.timeout(5):
        await task
    assert loop.time() - started < 3.0
    assert not alive(int(pid))
    assert set(stdio_children()) == others
    assert await connection.call("echo", {"text": "hi"}, 5) == (
        "mcp server brief is not connected (stopped)",
        True,
    )


async def test_stopping_while_a_call_hangs_ends_the_call_too() -> None:
    connection = McpConnection(stdio_server("stuck"), Listings())
    stopping = asyncio.Event()
    task = asyncio.create_task(connection.run(stopping))
    await ready(connection, task)
    hung = asyncio.create_task(connection.call("hang", {}, 30))
    await asyncio.sleep(0.2)  # let the call reach the server
    stopping.set()
    async with asyncio.timeout(5):
        await task
        text, is_error = await hung
    assert (text, is_error) == ("mcp server stuck was stopped during the call", True)


async def test_host_routes_full_names_and_follows_the_registered_servers(
    http_server: HttpServer,
) -> None:
    recorded: dict[str, Listings] = {}

    def on_tools(name: str) -> Listings:
        return recorded.setdefault(name, Listings())

    others = set(stdio_children())
    host = McpHost(on_tools)
    try:
        await host.sync([stdio_server("local"), http_config(http_server, "remote")])
        for connection in host.connections.values():
            await ready(connection)
        assert "local__echo" in recorded["local"].names
        assert "remote__echo" in recorded["remote"].names
        assert await host.call("local__echo", {"text": "a"}, 5) == ("a", False)
        assert await host.call("remote__echo", {"text": "b"}, 5) == ("b", False)
        assert await host.call("nowhere__echo", {}, 5) == (
            "no mcp server offers nowhere__echo",
            True,
        )
        assert await host.call("echo", {}, 5) == ("no mcp server offers echo", True)

        first_pid, _ = await host.call("local__pid", {}, 5)
        remote = host.connections["remote"]
        # A changed config restarts that server; an unchanged one is left alone.
        await host.sync(
            [stdio_server("local", env={"GREETING": "changed"}), http_config(http_server, "remote")]
        )
        assert host.connections["remote"] is remote
        await ready(host.connections["local"])
        assert await host.call("local__env", {"name": "GREETING"}, 5) == ("changed", False)
        assert (await host.call("local__pid", {}, 5))[0] != first_pid
        assert not alive(int(first_pid))

        await host.sync([stdio_server("local", env={"GREETING": "changed"})])
        assert set(host.connections) == {"local"}
        assert await host.call("remote__echo", {}, 5) == ("no mcp server offers remote__echo", True)
    finally:
        await host.close()
    assert host.connections == {}
    assert set(stdio_children()) == others

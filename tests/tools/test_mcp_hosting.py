"""The catalog's MCP side in one process (yoke.runtime.mcp_hosting) against the real store and
the real MCP test server: what it records, what it takes back, and what it survives.

Each test has a database of its own that no service watches: the hosting under test is the
only writer besides ``yoke tools`` (a separate process, as an operator runs it). A fault is a
subclass of the catalog made here, never a hook in the product.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from pymongo.errors import AutoReconnect, WriteError

from tests.support.cli import run_yoke
from tests.support.mcp_server import STDIO_COMMAND
from tests.support.processes import eventually
from yoke.runtime.catalog_store import LocalTools, ToolCatalog
from yoke.runtime.mcp_hosting import McpHosting
from yoke.store.database import Store
from yoke.tools.catalog import MCP_SERVERS, CatalogEntry, McpServer

WAIT = 60  # the most a test waits for anything (a loaded machine starts a server slowly)


@pytest.fixture
async def own_store(mongodb_url: str) -> AsyncIterator[Store]:
    store = Store(mongodb_url)
    await store.ensure_indexes()
    yield store
    await store.close()


async def register(store: Store, name: str, *args: str) -> McpServer:
    """What ``yoke tools add-mcp NAME --command ...`` writes."""
    server = McpServer(id=name, command=[*STDIO_COMMAND, *args])
    await store.db[MCP_SERVERS].insert_one(server.to_document())
    return server


async def entries(store: Store) -> dict[str, CatalogEntry]:
    return await ToolCatalog(store).entries(fresh=True)


async def ready(store: Store, name: str) -> None:
    async def holds() -> bool:
        entry = (await entries(store)).get(name)
        return entry is not None and entry.ready

    await eventually(holds, timeout=WAIT, what=f"{name} ready in the catalog", interval=0.2)


async def tools_list(mongodb_url: str) -> dict[str, dict[str, Any]]:
    """``yoke tools list --json`` on the test's database, by name."""
    code, out, err = await run_yoke({"YOKE_MONGODB_URL": mongodb_url}, "tools", "list", "--json")
    assert code == 0, err
    return {row["name"]: row for row in map(json.loads, out.splitlines())}


class Running:
    """``McpHosting.run`` as the processor runs it, stopped (and checked) on the way out."""

    def __init__(self, hosting: McpHosting) -> None:
        self.hosting = hosting
        self.stopping = asyncio.Event()
        self.task = asyncio.create_task(hosting.run(self.stopping))

    async def alive(self) -> bool:
        if self.task.done():
            raise AssertionError(f"the hosting ended: {self.task.exception()!r}")
        return True

    async def stop(self) -> None:
        self.stopping.set()
        async with asyncio.timeout(20):
            await self.task


# --- 13b: a store error at start ---------------------------------------------------------


class BlipAtStart(ToolCatalog):
    """The store goes away for the first publish of this process's own tools."""

    blips = 1

    async def publish_local(self) -> None:
        if self.blips:
            self.blips -= 1
            raise AutoReconnect("the store went away for a moment")
        await super().publish_local()


async def test_a_store_error_at_start_is_retried_and_hosting_goes_on(own_store: Store) -> None:
    await register(own_store, "early")
    running = Running(McpHosting(own_store, BlipAtStart(own_store, LocalTools.load())))
    try:
        await ready(own_store, "early__echo")
        await ready(own_store, "clock")  # the built-ins, published on the second round
        assert await running.alive()
    finally:
        await running.stop()


# --- 10: removal wins over a listing under way -------------------------------------------


async def test_a_server_removed_while_its_listing_is_under_way_leaves_no_tools(
    own_store: Store, mongodb_url: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="yoke.runtime.mcp_hosting")
    gate = tmp_path / "gate"
    server = await register(own_store, "ghost", "--list-gate", str(gate))
    hosting = McpHosting(own_store, ToolCatalog(own_store))
    # Connected as the processor's sync connects it; the sync that would notice the removal
    # comes too late: the listing (held by the server until the gate opens) ends first.
    await hosting.host.sync([server])
    try:
        code, _, err = await run_yoke({"YOKE_MONGODB_URL": mongodb_url}, "tools", "remove", "ghost")
        assert code == 0 and "removed MCP server ghost" in err, err
        gate.touch()

        async def recorded() -> bool:
            return any(
                record.name == "yoke.runtime.mcp_hosting" and "mcp server ghost " in record.message
                for record in caplog.records
            )

        await eventually(recorded, timeout=WAIT, what="the listing to be recorded")
        ghosts = {name: entry.status for name, entry in (await entries(own_store)).items()}
        assert ghosts == {}
    finally:
        await hosting.host.close()


class Held(ToolCatalog):
    """Holds each listing before it is written (until ``write``) and after (until ``release``)."""

    def __init__(self, store: Store) -> None:
        super().__init__(store)
        self.listed, self.write = asyncio.Event(), asyncio.Event()
        self.written, self.release = asyncio.Event(), asyncio.Event()

    async def replace_source(self, source: str, origin: str, found: list[CatalogEntry]) -> None:
        self.listed.set()
        await self.write.wait()
        await super().replace_source(source, origin, found)
        self.written.set()
        await self.release.wait()


async def test_a_connection_stopped_between_writing_and_checking_still_takes_its_tools_back(
    own_store: Store, mongodb_url: str
) -> None:
    server = await register(own_store, "cut")
    held = Held(own_store)
    hosting = McpHosting(own_store, held)
    await hosting.host.sync([server])
    try:
        async with asyncio.timeout(WAIT):
            await held.listed.wait()
        code, _, err = await run_yoke({"YOKE_MONGODB_URL": mongodb_url}, "tools", "remove", "cut")
        assert code == 0, err
        held.write.set()
        async with asyncio.timeout(WAIT):
            await held.written.wait()
        assert (await entries(own_store)).get("cut__echo") is not None  # written after remove
        # The processor's next sync sees the removal and stops the connection mid-recording.
        await hosting.host.sync([])
        held.release.set()

        async def taken_back() -> bool:
            return not any(name.startswith("cut__") for name in await entries(own_store))

        await eventually(taken_back, timeout=WAIT, what="the written tools to be taken back")
    finally:
        held.write.set()
        held.release.set()
        await hosting.host.close()


# --- 1: a listing the store does not take -----------------------------------------------


class RefusesUntilAllowed(ToolCatalog):
    """The store refuses every listing of the server ``refused`` until the test allows it, so
    the mark stays however long the test takes to look at it (a retry comes every ping)."""

    def __init__(self, store: Store) -> None:
        super().__init__(store)
        self.allowed = asyncio.Event()

    async def replace_source(self, source: str, origin: str, found: list[CatalogEntry]) -> None:
        if origin == "refused" and not self.allowed.is_set():
            raise WriteError("the document is not valid here", code=2)
        await super().replace_source(source, origin, found)


async def test_a_listing_that_cannot_be_recorded_shows_the_server_unavailable_with_why(
    own_store: Store, mongodb_url: str
) -> None:
    await register(own_store, "refused")
    catalog = RefusesUntilAllowed(own_store)
    hosting = McpHosting(own_store, catalog, ping_interval=2.0)
    running = Running(hosting)
    try:

        async def marked() -> bool:
            return (await running.alive()) and "refused__*" in await entries(own_store)

        await eventually(marked, timeout=WAIT, what="the server marked in the catalog")
        row = (await tools_list(mongodb_url))["refused__*"]
        assert (row["source"], row["origin"], row["status"]) == ("mcp", "refused", "unavailable")
        assert row["reason"] == (
            "its tools could not be recorded: WriteError: the document is not valid here"
        ), row
        # Recorded again at the next idle moment once the store takes it: ready, the mark gone.
        catalog.allowed.set()
        await ready(own_store, "refused__echo")

        async def unmarked() -> bool:
            return "refused__*" not in await entries(own_store)

        await eventually(unmarked, timeout=WAIT, what="the mark to go")
    finally:
        await running.stop()


async def test_a_tool_the_store_refuses_is_unavailable_and_its_servers_others_are_ready(
    own_store: Store,
) -> None:
    def tool(name: str, description: str) -> CatalogEntry:
        return CatalogEntry(id=f"big__{name}", description=description, source="mcp", origin="big")

    # Past the 16 MiB a document may hold: no store takes it, however often it is asked.
    huge = tool("huge", "x" * (17 * 1024 * 1024))
    await ToolCatalog(own_store).replace_source("mcp", "big", [huge, tool("small", "Small.")])

    found = await entries(own_store)
    assert found["big__small"].ready
    refused = found["big__huge"]
    assert (refused.status, refused.description, refused.origin) == ("unavailable", "", "big")
    assert refused.reason is not None
    assert refused.reason.startswith(
        "the store refused its entry: DocumentTooLarge: BSON document too large"
    )

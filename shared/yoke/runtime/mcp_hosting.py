"""Keeps this process's MCP connections in step with the servers registered in the store.

``yoke tools add-mcp`` / ``yoke tools remove`` write ``mcp_servers``; every process that runs
tool calls (the processor's replicas) connects to each registered server itself (one session
per server per process, owned by one task: :mod:`yoke.tools.mcp`) and writes the tools it
lists into the catalog. It also publishes the process's built-ins and plugins at start.

Why it is shaped this way:

- **Removal wins.** A listing under way when ``yoke tools remove`` runs (a reconnect, a
  ``list_changed``) finishes after the removal and would write its tools back, ``ready`` while
  every call to them fails. Updates are not atomic here (invariant 8), so the writer checks
  after its writes that the server is still registered, and takes them back if not: the
  remover deletes the registration before the entries, so either it sees the writes or the
  writer sees the registration gone. Recording runs shielded from the connection's stop (the
  removal stops it), so it is never cut off between the writes and the check.
- **A listing the store does not take is shown.** The catalog then holds ``SERVER__*``,
  ``unavailable`` with the reason (``yoke tools list`` shows it), and the connection records
  the listing again at its next idle moment; a listing that succeeds drops the mark.
- **Nothing at start is fatal.** Publishing the local tools and reading the registered
  servers are retried every round while the store is away.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from yoke.runtime.catalog_store import ToolCatalog, registered_servers
from yoke.store.database import Store
from yoke.tools.catalog import MCP_SEPARATOR, MCP_SERVERS, CatalogEntry
from yoke.tools.mcp import McpHost, OnTools, describe

log = logging.getLogger(__name__)

# How soon a server registered or removed elsewhere is connected or dropped here.
SYNC_SECONDS = 3.0
# The most stopping waits for recordings still under way (each is a few store operations).
RECORDING_STOP_SECONDS = 15.0


def unrecorded_mark(server: str, error: BaseException) -> CatalogEntry:
    """The catalog's note that ``server``'s listing could not be recorded, and why."""
    return CatalogEntry(
        id=f"{server}{MCP_SEPARATOR}*",
        input_schema={},
        source="mcp",
        origin=server,
        status="unavailable",
        reason=f"its tools could not be recorded: {describe(error)}",
    )


class McpHosting:
    """The catalog's MCP side for one process."""

    def __init__(self, store: Store, catalog: ToolCatalog, **connection_options: Any) -> None:
        """``connection_options`` go to every connection (:class:`yoke.tools.mcp.McpHost`)."""
        self.store = store
        self.catalog = catalog
        self.host = McpHost(self._on_tools, **connection_options)
        self._recording: set[asyncio.Task[None]] = set()

    def _on_tools(self, server: str) -> OnTools:
        async def listed(entries: list[CatalogEntry]) -> None:
            task = asyncio.create_task(self.record(server, entries))
            self._recording.add(task)
            task.add_done_callback(self._recording.discard)
            await asyncio.shield(task)

        return listed

    async def record(self, server: str, entries: list[CatalogEntry]) -> None:
        """Write ``server``'s listing, unless the server was removed meanwhile (then take back
        whatever this wrote); raises when the listing was not recorded."""
        failure: Exception | None = None
        try:
            await self.catalog.replace_source("mcp", server, entries)
        except Exception as error:
            failure = error
            with contextlib.suppress(Exception):  # the store away: the listing's retry tells
                await self.catalog.register(unrecorded_mark(server, error))
        if await self.store.db[MCP_SERVERS].find_one({"_id": server}, {"_id": 1}) is None:
            gone = await self.catalog.remove("mcp", server)
            log.info(
                "mcp server %s was removed while its tools were listed: %d entries taken back",
                server,
                len(gone),
            )
            return
        if failure is not None:
            raise failure
        log.info("mcp server %s lists %d tool(s)", server, len(entries))

    async def run(self, stopping: asyncio.Event) -> None:
        """Publish the local tools, then follow the registered servers until ``stopping``."""
        published = False
        try:
            while not stopping.is_set():
                if not published:
                    try:
                        await self.catalog.publish_local()
                        published = True
                    except Exception as error:  # the store away: next round
                        log.warning("could not publish this process's tools: %r", error)
                try:
                    await self.host.sync(await registered_servers(self.store))
                except Exception as error:  # the store away: next round
                    log.warning("could not read the registered MCP servers: %r", error)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stopping.wait(), SYNC_SECONDS)
        finally:
            await self.host.close()
            if self._recording:
                await asyncio.wait(set(self._recording), timeout=RECORDING_STOP_SECONDS)

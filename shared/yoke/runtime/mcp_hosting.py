"""Keeps this process's MCP connections in step with the servers registered in the store.

``yoke tools add-mcp`` / ``yoke tools remove`` write ``mcp_servers``; every process that runs
tool calls (the processor's replicas) connects to each registered server itself (one session
per server per process, owned by one task: :mod:`yoke.tools.mcp`) and writes the tools it
lists into the catalog. It also publishes the process's built-ins and plugins at start.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

from yoke.runtime.catalog import ToolCatalog, registered_servers
from yoke.store import Store
from yoke.tools.catalog import CatalogEntry
from yoke.tools.mcp import McpHost

log = logging.getLogger(__name__)

# How soon a server registered or removed elsewhere is connected or dropped here.
SYNC_SECONDS = 3.0


class McpHosting:
    """The catalog's MCP side for one process."""

    def __init__(self, store: Store, catalog: ToolCatalog) -> None:
        self.store = store
        self.catalog = catalog
        self.host = McpHost(self._on_tools)

    def _on_tools(self, server: str) -> Callable[[list[CatalogEntry]], Awaitable[None]]:
        async def listed(entries: list[CatalogEntry]) -> None:
            await self.catalog.replace_source("mcp", server, entries)
            log.info("mcp server %s lists %d tool(s)", server, len(entries))

        return listed

    async def run(self, stopping: asyncio.Event) -> None:
        """Publish the local tools, then follow the registered servers until ``stopping``."""
        await self.catalog.publish_local()
        try:
            while not stopping.is_set():
                try:
                    await self.host.sync(await registered_servers(self.store))
                except Exception as error:  # the store away: next round
                    log.warning("could not read the registered MCP servers: %r", error)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stopping.wait(), SYNC_SECONDS)
        finally:
            await self.host.close()

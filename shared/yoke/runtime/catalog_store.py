"""The tool catalog in the store: what agents may name, read by everyone, written by hosts.

Each process that can run the built-ins and the installed plugins writes their entries at
start (:meth:`ToolCatalog.publish_local`); the processes that connect to an MCP server write its
tools as they list them; ``yoke tools add-worker`` writes a worker's. A name is claimed by a
unique insert (docs/architecture.md, invariant 8): the first source to register it keeps it,
and a second source offering the same name is recorded under a derived id as ``unavailable``,
so ``yoke tools list`` shows the clash. An entry is refreshed in place (an upsert by ``_id``)
only by its own source. An entry no store would ever take (past the document size limit, a
value the store calls invalid) is recorded without its description and schema, ``unavailable``
with the store's reason, so one such tool does not keep its server's others out.
"""

from __future__ import annotations

import asyncio
import fnmatch
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from bson.errors import InvalidDocument
from pymongo.errors import DuplicateKeyError, OperationFailure

from yoke.core.ids import derive_id
from yoke.store.database import Store
from yoke.tools.base import Tool
from yoke.tools.catalog import CATALOG, MCP_SEPARATOR, MCP_SERVERS, CatalogEntry, McpServer
from yoke.tools.plugins import builtin_entries, load_plugins

log = logging.getLogger(__name__)

# How long a process trusts its copy of the catalog: a tool added or removed elsewhere is seen
# within this (the CLI and tests read it fresh).
CACHE_SECONDS = 5.0
# Clashes are kept under a derived id so the listing shows them; never offered to a model.
CLASH_PREFIX = "clash:"


@dataclass
class LocalTools:
    """The tools this process runs itself: the built-ins and the installed plugins."""

    runnable: dict[str, Tool] = field(default_factory=dict)
    entries: list[CatalogEntry] = field(default_factory=list)
    # Names another source held first (found when publishing): never offered from here.
    lost: set[str] = field(default_factory=set)

    def offered(self) -> dict[str, CatalogEntry]:
        return {
            entry.id: entry
            for entry in self.entries
            if entry.ready and entry.id in self.runnable and entry.id not in self.lost
        }

    @classmethod
    def load(cls) -> LocalTools:
        plugins, plugin_entries = load_plugins()
        from yoke.tools.builtin import BUILTIN_TOOLS

        return cls({**BUILTIN_TOOLS, **plugins}, [*builtin_entries(), *plugin_entries])


def same_source(a: CatalogEntry, b: CatalogEntry) -> bool:
    return a.source == b.source and a.origin == b.origin


def same_entry(a: CatalogEntry, b: CatalogEntry) -> bool:
    """Equal but for when they were written."""
    return a.model_dump(exclude={"updated_at"}) == b.model_dump(exclude={"updated_at"})


# What a store answers when it will never take a document, however often asked: BadValue
# (FerretDB's invalid key or value), BSONObjectTooLarge.
REFUSED_CODES = frozenset({2, 10334})


def refusal(error: Exception) -> str | None:
    """Why the store will never take an entry (None when ``error`` may pass: try again)."""
    if isinstance(error, InvalidDocument):  # found before sending (DocumentTooLarge too)
        return f"{type(error).__name__}: {error}"
    if (
        isinstance(error, OperationFailure)
        and not isinstance(error, DuplicateKeyError)
        and error.code in REFUSED_CODES
    ):
        return f"{type(error).__name__}: {(error.details or {}).get('errmsg', error)}"
    return None


def refused(entry: CatalogEntry, reason: str) -> CatalogEntry:
    """``entry`` as the store can hold it: its name, source and why it is not offered."""
    return entry.model_copy(
        update={
            "description": "",
            "input_schema": {"type": "object"},
            "status": "unavailable",
            "reason": f"the store refused its entry: {reason}",
        }
    )


def clash_id(entry: CatalogEntry) -> str:
    # The name it wanted stays readable (a tool name holds no ':'): the listing shows it.
    digest = derive_id("tool-clash", entry.id, entry.source, entry.origin)
    return f"{CLASH_PREFIX}{entry.id}:{digest}"


def listed_name(entry_id: str) -> str:
    """The tool name a catalog id stands for (a clash's id holds the name it wanted)."""
    if entry_id.startswith(CLASH_PREFIX):
        return entry_id.removeprefix(CLASH_PREFIX).partition(":")[0]
    return entry_id


def matches(pattern: str, name: str) -> bool:
    """A tool list names tools exactly, or every tool of an MCP server as ``SERVER__*``."""
    if pattern.endswith(MCP_SEPARATOR + "*"):
        return fnmatch.fnmatchcase(name, pattern) and name.startswith(pattern[:-1])
    return pattern == name


async def registered_servers(store: Store) -> list[McpServer]:
    """The MCP servers ``yoke tools add-mcp`` registered (``yoke tools remove`` drops them)."""
    servers = []
    async for document in store.db[MCP_SERVERS].find({}):
        try:
            servers.append(McpServer.from_document(document))
        except ValueError as error:
            log.error("ignoring MCP server %s: %s", document.get("_id"), error)
    return servers


class ToolCatalog:
    """The store's catalog, with a short-lived per-process copy for steps."""

    def __init__(self, store: Store, local: LocalTools | None = None) -> None:
        self.store = store
        # This process's own tools: offered without reading the store (a step that uses only
        # built-ins and plugins costs no catalog read).
        self.local = local or LocalTools()
        self.collection = store.db[CATALOG]
        self._cached: dict[str, CatalogEntry] | None = None
        self._cached_at = 0.0
        self._lock = asyncio.Lock()

    async def entries(self, *, fresh: bool = False) -> dict[str, CatalogEntry]:
        """Every entry by name, clashes included (their ids start with ``clash:``)."""
        async with self._lock:
            stale = time.monotonic() - self._cached_at > CACHE_SECONDS
            if fresh or stale or self._cached is None:
                found: dict[str, CatalogEntry] = {}
                async for document in self.collection.find({}):
                    try:
                        entry = CatalogEntry.from_document(document)
                    except ValueError as error:
                        log.warning("skipping a catalog entry it cannot read: %s", error)
                        continue
                    found[entry.id] = entry
                self._cached, self._cached_at = found, time.monotonic()
            return dict(self._cached)

    def forget(self) -> None:
        self._cached = None

    async def register(self, entry: CatalogEntry) -> CatalogEntry:
        """Claim ``entry.id`` for its source, or refresh it if the source holds it already.

        Returns what the catalog now says of that name for this source: the entry itself, or
        an ``unavailable`` copy when another source holds the name.
        """
        if await self.store.insert_if_absent(self.collection, entry.to_document()):
            self.forget()
            return entry
        document = await self.collection.find_one({"_id": entry.id})
        holder = CatalogEntry.from_document(document) if document is not None else None
        if holder is None or same_source(holder, entry):
            if holder is None or not same_entry(holder, entry):
                await self.collection.replace_one(
                    {"_id": entry.id}, entry.to_document(), upsert=True
                )
                self.forget()
            return entry
        clash = entry.model_copy(
            update={
                "status": "unavailable",
                "reason": f"the name {entry.id} is taken by {holder.source} {holder.origin}",
            }
        )
        document = clash.to_document()
        document["_id"] = clash_id(entry)
        await self.collection.replace_one({"_id": document["_id"]}, document, upsert=True)
        self.forget()
        return clash

    async def publish_local(self) -> None:
        """Write this process's built-ins and plugins; note the names others hold first."""
        current = await self.entries(fresh=True)
        for entry in self.local.entries:
            held = current.get(entry.id)
            if held is not None and same_entry(held, entry):
                continue
            if (await self.register(entry)).status != entry.status:
                self.local.lost.add(entry.id)  # another source held the name first

    async def remove(self, source: str, origin: str) -> list[str]:
        """Drop every entry (clashes included) of one source; returns the names dropped."""
        gone = [
            entry.id
            for entry in (await self.entries(fresh=True)).values()
            if entry.source == source and entry.origin == origin
        ]
        if gone:
            await self.collection.delete_many({"_id": {"$in": gone}})
        self.forget()
        return gone

    async def replace_source(self, source: str, origin: str, entries: list[CatalogEntry]) -> None:
        """A host's whole current list for one origin (an MCP server's tools after a listing)."""
        names = {entry.id for entry in entries}
        for entry in entries:
            try:
                await self.register(entry)
            except (InvalidDocument, OperationFailure) as error:
                if (reason := refusal(error)) is None:
                    raise
                log.warning("the store refused catalog entry %s: %s", entry.id, reason)
                await self.register(refused(entry, reason))
        stale = [
            entry.id
            for entry in (await self.entries(fresh=True)).values()
            if entry.source == source
            and entry.origin == origin
            and entry.id not in names
            and not entry.id.startswith(CLASH_PREFIX)
        ]
        if stale:
            await self.collection.delete_many({"_id": {"$in": stale}})
            self.forget()

    async def resolve(self, names: Iterable[str]) -> dict[str, CatalogEntry]:
        """The ready tools a tool list names (patterns expanded), in catalog order."""
        wanted = list(names)
        if not wanted:
            return {}
        local = self.local.offered()
        found = {name: local[name] for name in wanted if name in local}
        if len(found) == len(wanted):
            return found
        for name, entry in sorted((await self.entries()).items()):
            if name.startswith(CLASH_PREFIX) or not entry.ready:
                continue
            if any(matches(pattern, name) for pattern in wanted):
                found[name] = entry
        return found

    async def unknown(self, names: Iterable[str], servers: Iterable[str] = ()) -> list[str]:
        """Names (or ``SERVER__*`` patterns) in a tool list that the catalog does not know.

        Known: a catalog entry (ready or not: a tool down for now is still the operator's to
        name), one of this process's own tools, or, for a pattern and for ``SERVER__TOOL``, a
        registered MCP server (its tools may not be listed yet).
        """
        known = {
            name for name in (await self.entries(fresh=True)) if not name.startswith(CLASH_PREFIX)
        } | {entry.id for entry in self.local.entries}
        registered = set(servers)
        missing = []
        for pattern in names:
            server, separator, _ = pattern.partition(MCP_SEPARATOR)
            if separator and server in registered:
                continue
            if pattern.endswith(MCP_SEPARATOR + "*"):
                if not any(name.startswith(server + MCP_SEPARATOR) for name in known):
                    missing.append(pattern)
            elif pattern not in known:
                missing.append(pattern)
        return missing

    async def listing(self) -> list[CatalogEntry]:
        """Everything to show: the store's entries, then local ones it does not hold yet."""
        entries = await self.entries(fresh=True)
        shown = list(entries.values())
        shown += [entry for entry in self.local.entries if entry.id not in entries]
        return sorted(shown, key=lambda entry: (entry.id.startswith(CLASH_PREFIX), entry.id))

"""``yoke tools``: the catalog (``list``), and the tools an operator brings (``add-mcp``,
``add-worker``, ``remove``); plus the check ``yoke agent create`` / ``yoke join`` make of a
tool list (an unknown name exits 2, naming it).
"""

from __future__ import annotations

import argparse
import json
import logging
import shlex
import sys
from collections.abc import Iterable
from typing import Any

import aio_pika

from yoke.bus import topology
from yoke.cli.base import CommandError, UsageError, with_store
from yoke.cli.tool_users import (
    ToolUserRefused,
    create_tool_user,
    delete_tool_user,
    tool_user_name,
)
from yoke.core.settings import Settings
from yoke.core.text import printable
from yoke.runtime.catalog_store import LocalTools, ToolCatalog, listed_name, registered_servers
from yoke.store.database import Store
from yoke.tools import stdio_user
from yoke.tools.catalog import (
    DEFAULT_WORKER_TIMEOUT_SECONDS,
    MCP_SERVER_NAME,
    MCP_SERVERS,
    CatalogEntry,
    McpServer,
    ToolListing,
    name_problem,
)

# Longest an MCP call may run (it holds a session's slot and, past 2 s, waits in the store).
MAX_MCP_TIMEOUT_SECONDS = 3600.0
# Longest a worker's call may wait (the queue's messages expire then, the call ends in error).
MAX_WORKER_TIMEOUT_SECONDS = 7 * 24 * 3600.0


def catalog_of(store: Store) -> ToolCatalog:
    """The catalog as this installation sees it: the store's, plus the tools installed here."""
    # A broken plugin is `yoke tools list`'s to report (unavailable, with its error); its
    # warning and traceback on every verb that reads the catalog would read as that verb failing.
    plugins_log = logging.getLogger("yoke.tools.plugins")
    level = plugins_log.level
    plugins_log.setLevel(logging.ERROR)
    try:
        local = LocalTools.load()
    finally:
        plugins_log.setLevel(level)
    return ToolCatalog(store, local)


async def check_tool_names(store: Store, names: Iterable[str] | None) -> None:
    """Refuse a tool list naming a tool nobody offers (only here: a stored configuration is
    never checked again, and a tool gone later gives the model an error result)."""
    if not names:
        return
    servers = [server.id for server in await registered_servers(store)]
    unknown = await catalog_of(store).unknown(names, servers)
    if unknown:
        raise UsageError(f"unknown tools {', '.join(unknown)} (yoke tools list shows the catalog)")


def listing_of(entry: CatalogEntry) -> ToolListing:
    return ToolListing(
        name=listed_name(entry.id),
        description=entry.description,
        input_schema=entry.input_schema,
        source=entry.source,
        origin=entry.origin,
        status=entry.status,
        reason=entry.reason,
    )


async def tools_list(args: argparse.Namespace) -> None:
    async def action(store: Store) -> None:
        entries = await catalog_of(store).listing()
        rows = [listing_of(entry) for entry in entries]
        # A registered server whose tools no process has listed yet (the mesh not running).
        listed = {entry.origin for entry in entries if entry.source == "mcp"}
        for server in await registered_servers(store):
            if server.id not in listed:
                rows.append(
                    ToolListing(
                        name=f"{server.id}__*",
                        description="",
                        input_schema={},
                        source="mcp",
                        origin=server.id,
                        status="unavailable",
                        reason="not listed yet: the processor connects to it when it runs",
                    )
                )
        for row in rows:
            if args.json:
                print(json.dumps(row.to_wire(), separators=(",", ":")))
            else:
                state = row.status if row.reason is None else f"{row.status}: {row.reason}"
                # A plugin's or MCP server's text: its controls escaped (yoke.core.text).
                fields = (row.name, row.source, state, row.description)
                print("\t".join(printable(field) for field in fields))

    await with_store(action)


def parse_headers(values: list[str] | None) -> dict[str, str]:
    headers: dict[str, str] = {}
    for value in values or []:
        name, colon, content = value.partition(":")
        if not colon or not name.strip():
            raise UsageError(f"--header {value!r}: write it as 'Name: value'")
        headers[name.strip()] = content.strip()
    return headers


def parse_env(values: list[str] | None) -> dict[str, str]:
    env: dict[str, str] = {}
    for value in values or []:
        name, equals, content = value.partition("=")
        if not equals or not name:
            raise UsageError(f"--env {value!r}: write it as NAME=value")
        env[name] = content
    return env


async def add_mcp(args: argparse.Namespace) -> None:
    if MCP_SERVER_NAME.fullmatch(args.name) is None:
        raise UsageError(
            f"MCP server name {args.name!r} must match {MCP_SERVER_NAME.pattern} "
            "(its tools are NAME__TOOL)"
        )
    if (args.command is None) == (args.url is None):
        raise UsageError("give exactly one of --command (stdio) and --url (streamable HTTP)")
    command = shlex.split(args.command) if args.command is not None else None
    if command is not None and not command:
        raise UsageError("--command is empty")
    if args.url is not None and not args.url.startswith(("http://", "https://")):
        raise UsageError(f"--url {args.url!r}: an http:// or https:// URL")
    if args.header and args.url is None:
        raise UsageError("--header goes with --url (a stdio server takes --env)")
    if not 0 < args.timeout <= MAX_MCP_TIMEOUT_SECONDS:
        raise UsageError(f"--timeout must be above 0 and at most {MAX_MCP_TIMEOUT_SECONDS:g}")
    env = parse_env(args.env)
    if command is not None:
        # Run as the stdio user when the mesh is root: said now, not only in the processor's log.
        problem = stdio_user.unreachable(command, env.get("PATH"))
        if problem is not None:
            raise UsageError(problem)
    server = McpServer(
        id=args.name,
        command=command,
        url=args.url,
        headers=parse_headers(args.header),
        env=env,
        timeout_seconds=args.timeout,
    )

    async def action(store: Store) -> None:
        if not await store.insert_if_absent(store.db[MCP_SERVERS], server.to_document()):
            raise CommandError(f"an MCP server named {args.name} is registered already")
        print(args.name)

    await with_store(action)


def read_schema(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as file:
            schema = json.load(file)
    except OSError as error:
        raise UsageError(f"cannot read {path}: {error.strerror or error}") from error
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise UsageError(f"{path} is not JSON: {error}") from error
    if not isinstance(schema, dict) or schema.get("type", "object") != "object":
        raise UsageError(f"{path}: the input schema must be a JSON Schema object (type object)")
    return schema


async def declare_tool_queue(settings: Settings, tool: str) -> None:
    connection = await aio_pika.connect(settings.amqp_url.split(",")[0].strip())
    try:
        channel = await connection.channel()
        await channel.declare_queue(
            topology.tool_queue(tool), durable=True, arguments=topology.tool_queue_arguments()
        )
    finally:
        await connection.close()


async def delete_tool_queue(settings: Settings, tool: str) -> None:
    connection = await aio_pika.connect(settings.amqp_url.split(",")[0].strip())
    try:
        channel = await connection.channel()
        await channel.queue_delete(topology.tool_queue(tool))
    finally:
        await connection.close()


async def add_worker(args: argparse.Namespace) -> None:
    problem = name_problem(args.name)
    if problem is not None:
        raise UsageError(problem)
    if not 0 < args.timeout <= MAX_WORKER_TIMEOUT_SECONDS:
        raise UsageError(f"--timeout must be above 0 and at most {MAX_WORKER_TIMEOUT_SECONDS:g}")
    schema = read_schema(args.schema)
    settings = Settings()
    entry = CatalogEntry(
        id=args.name,
        description=args.description,
        input_schema=schema,
        source="worker",
        origin=args.name,
        timeout_seconds=args.timeout,
    )

    async def action(store: Store) -> None:
        catalog = catalog_of(store)
        if args.name in {tool.id for tool in catalog.local.entries}:
            raise CommandError(f"{args.name} is a built-in or plugin tool here; pick another name")
        if not await store.insert_if_absent(catalog.collection, entry.to_document()):
            raise CommandError(f"a tool named {args.name} is in the catalog already")
        try:
            password = await create_tool_user(settings, args.name)
            await declare_tool_queue(settings, args.name)
        except (ToolUserRefused, aio_pika.exceptions.AMQPError, OSError) as error:
            await catalog.collection.delete_one({"_id": args.name})
            raise CommandError(f"could not register worker tool {args.name}: {error}") from error
        print(f"registered worker tool {args.name}", file=sys.stderr)
        print(f"its calls arrive on {topology.tool_queue(args.name)}", file=sys.stderr)
        user = tool_user_name(settings, args.name)
        print(f"connect as RabbitMQ user {user} with the password:")
        print(password)

    await with_store(action)


async def remove(args: argparse.Namespace) -> None:
    settings = Settings()

    async def action(store: Store) -> None:
        catalog = catalog_of(store)
        server = await store.db[MCP_SERVERS].find_one_and_delete({"_id": args.name})
        if server is not None:
            gone = await catalog.remove("mcp", args.name)
            print(f"removed MCP server {args.name} and {len(gone)} tool(s)", file=sys.stderr)
            return
        entries = await catalog.entries(fresh=True)
        entry = entries.get(args.name)
        if entry is None or entry.source != "worker":
            what = f"a {entry.source} tool" if entry is not None else "not in the catalog"
            raise CommandError(
                f"{args.name} is {what}: remove takes an MCP server or a worker tool "
                "(a plugin goes when its package is uninstalled)"
            )
        await catalog.remove("worker", args.name)
        try:
            await delete_tool_user(settings, args.name)
        except ToolUserRefused as error:
            print(f"yoke: the RabbitMQ user was not deleted: {error}", file=sys.stderr)
        # Calls still waiting there end at their deadlines, in the store, all the same.
        await delete_tool_queue(settings, args.name)
        print(f"removed worker tool {args.name}", file=sys.stderr)

    await with_store(action)


def register(commands: Any) -> None:
    tools = commands.add_parser(
        "tools", help="the tool catalog, and the tools you bring"
    ).add_subparsers(dest="sub", required=True)

    def command(name: str, handler: Any, help: str) -> argparse.ArgumentParser:
        sub: argparse.ArgumentParser = tools.add_parser(name, help=help, description=help)
        sub.set_defaults(handler=handler)
        return sub

    listing = command("list", tools_list, "every tool: name, source, status, description")
    listing.add_argument("--json", action="store_true", help="one JSON object per tool")

    mcp = command(
        "add-mcp", add_mcp, "register an MCP server; its tools become NAME__TOOL (NAME__* all)"
    )
    mcp.add_argument("name", metavar="NAME")
    mcp.add_argument("--command", help='stdio: the command the mesh starts, e.g. "npx -y srv"')
    mcp.add_argument("--url", help="streamable HTTP: the server's URL")
    mcp.add_argument(
        "--header", action="append", metavar="'NAME: VALUE'", help="an HTTP header (repeatable)"
    )
    mcp.add_argument(
        "--env", action="append", metavar="NAME=VALUE", help="for a stdio server (repeatable)"
    )
    mcp.add_argument(
        "--timeout", type=float, default=30.0, help="seconds a call may take (default 30)"
    )

    worker = command(
        "add-worker",
        add_worker,
        "register a tool served by your worker over RabbitMQ; prints its user's password last",
    )
    worker.add_argument("name", metavar="NAME")
    worker.add_argument("--schema", required=True, metavar="FILE.json", help="input JSON Schema")
    worker.add_argument("--description", required=True, help="what the model is told it does")
    worker.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_WORKER_TIMEOUT_SECONDS,
        help=f"seconds before an unanswered call ends (default {DEFAULT_WORKER_TIMEOUT_SECONDS:g})",
    )

    command("remove", remove, "remove an MCP server or a worker tool").add_argument(
        "name", metavar="NAME"
    )

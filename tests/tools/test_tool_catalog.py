"""The tool catalog as operators and agents meet it: ``yoke tools`` as a separate process,
tool lists checked by ``yoke agent create`` / ``yoke join``, plugin tools in a turn of the running
mesh, and a second source offering a name a plugin holds.

The CLI tests that need no processor run on a database of their own (no service watches it, so
an MCP server stays "not listed yet"); the mesh's tests share the module's database. Worker
tools make RabbitMQ users, which are per broker: each test names its own and removes it.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote, urlsplit, urlunsplit

import aio_pika
import pytest

from tests.support.broker import Management
from tests.support.cli import run_yoke
from tests.support.mesh import JoinFactory, agent_lines, lines_until, say
from tests.support.processes import eventually
from yoke.bus import topology
from yoke.client import Client
from yoke.core.models import Message, ToolResultPart
from yoke.llm.base import ScriptedCall, ScriptedOutput
from yoke.runtime.catalog_store import CLASH_PREFIX, ToolCatalog
from yoke.runtime.join_config import JOIN_CONFIGS
from yoke.runtime.joins import create_agent, create_forum
from yoke.store.database import Store
from yoke.tools.builtin import BUILTIN_TOOLS
from yoke.tools.catalog import CATALOG, MCP_SERVERS, CatalogEntry

PLUGIN_TOOLS = {"lookup_order", "estimate_delivery", "slugify"}
BROKEN = {
    "broken_on_purpose": "failed to load: RuntimeError: this plugin is broken on purpose",
    "not_a_tool": "it is a dict, not a Tool or a list of Tools",
}
SLUGIFY_ORIGIN = "slugify = yoke_example_tools:slugify"


@dataclass
class Cli:
    """``yoke`` pointed at one database and the module's vhost."""

    env: dict[str, str]

    async def __call__(self, *args: str) -> tuple[int, str, str]:
        # Generous: a loaded machine takes seconds per start of a CLI process.
        return await run_yoke(self.env, *args, timeout=180)

    async def listing(self) -> dict[tuple[str, str], dict[str, Any]]:
        """``yoke tools list --json`` by (name, source): a clash shares its name."""
        code, out, err = await self("tools", "list", "--json")
        assert code == 0, err
        rows = [json.loads(line) for line in out.splitlines()]
        by_key = {(row["name"], row["source"]): row for row in rows}
        assert len(by_key) == len(rows), rows  # no tool listed twice by one source
        return by_key


def cli_env(amqp_url: str, mongodb_url: str, management_url: str) -> dict[str, str]:
    return {
        "YOKE_AMQP_URL": amqp_url,
        "YOKE_MONGODB_URL": mongodb_url,
        "YOKE_MANAGEMENT_URL": management_url,
    }


def no_crash(err: str) -> None:
    """A refusal is one sentence, never a traceback (ours or a broken plugin's)."""
    assert "Traceback" not in err, err


@pytest.fixture
async def own_store(mongodb_url: str) -> AsyncIterator[Store]:
    """A database no service runs on: only the CLI writes it."""
    store = Store(mongodb_url)
    await store.ensure_indexes()
    yield store
    await store.close()


@pytest.fixture
def own_cli(servers: tuple[str, str, str], amqp_url: str, mongodb_url: str) -> Cli:
    return Cli(cli_env(amqp_url, mongodb_url, servers[2]))


@pytest.fixture(scope="module")
def mesh_cli(servers: tuple[str, str, str], amqp_url: str, module_mongodb_url: str) -> Cli:
    return Cli(cli_env(amqp_url, module_mongodb_url, servers[2]))


async def user_exists(management: Management, user: str) -> bool:
    response = await management.get(f"/api/users/{quote(user, safe='')}")
    assert response.status_code in (200, 404), response.text
    return response.status_code == 200


async def published(store: Store, names: set[str]) -> None:
    """Wait until the processor has written its built-ins and plugins into the catalog."""

    async def written() -> bool:
        found = {document["_id"] async for document in store.db[CATALOG].find({})}
        return names <= found

    await eventually(written, timeout=60, what=f"catalog entries {sorted(names)}")


# --- 1. the listing ------------------------------------------------------------------------


@pytest.mark.slow
async def test_the_listing_shows_builtins_and_plugins_ready_and_broken_plugins_unavailable(
    mesh_cli: Cli, store: Store, mesh: object
) -> None:
    # The processor publishes what it can run; the listing then reads the store's catalog.
    await published(store, set(BUILTIN_TOOLS) | PLUGIN_TOOLS | set(BROKEN))

    rows = await mesh_cli.listing()

    for name, tool in BUILTIN_TOOLS.items():
        row = rows[(name, "builtin")]
        assert (row["status"], row["origin"]) == ("ready", "builtin"), row
        assert row["description"] == tool.description
        assert row["inputSchema"] == tool.json_schema()
        assert row["inputSchema"]["type"] == "object"
    assert rows[("calculator", "builtin")]["inputSchema"]["required"] == ["expression"]
    for name in PLUGIN_TOOLS:
        assert rows[(name, "plugin")]["status"] == "ready", rows[(name, "plugin")]
    lookup = rows[("lookup_order", "plugin")]
    assert lookup["origin"] == "orders = yoke_example_tools:ORDER_TOOLS"
    assert lookup["inputSchema"]["required"] == ["orderId"]
    assert rows[("slugify", "plugin")]["origin"] == SLUGIFY_ORIGIN
    for name, reason in BROKEN.items():
        row = rows[(name, "plugin")]
        assert (row["status"], row["reason"]) == ("unavailable", reason), row
    # Everything else is ready: one broken plugin hides nobody else's tools.
    others = {key: row for key, row in rows.items() if key[0] not in BROKEN}
    assert set(others) == {(name, "builtin") for name in BUILTIN_TOOLS} | {
        (name, "plugin") for name in PLUGIN_TOOLS
    }
    assert all(row["status"] == "ready" and "reason" not in row for row in others.values())


# --- 2. tool lists checked by agent create and join ------------------------------------------


async def test_agent_create_refuses_an_unknown_tool_naming_it_and_creates_nothing(
    own_cli: Cli, own_store: Store
) -> None:
    (code, out, err), (good_code, good_out, good_err) = await asyncio.gather(
        own_cli("agent", "create", "--name", "x", "--tools", "clock,nope"),
        own_cli("agent", "create", "--name", "y", "--tools", "clock,lookup_order"),
    )

    assert code == 2, err
    assert out == ""
    # Only the unknown one is named, and only that is said (no broken plugin's noise).
    assert err == "yoke: unknown tools nope (yoke tools list shows the catalog)\n", err
    assert await own_store.actors.count_documents({"name": "x"}) == 0
    assert good_code == 0, good_err
    no_crash(good_err)
    agent = await own_store.get_actor(good_out.strip())
    assert agent is not None
    assert (agent.name, agent.meta["tools"]) == ("y", ["clock", "lookup_order"])


async def test_join_refuses_an_unknown_tool_and_a_config_tool_that_is_not_a_name(
    own_cli: Cli, own_store: Store, tmp_path: Path
) -> None:
    agent = await create_agent(own_store, "joiner")
    forum = await create_forum(own_store, "checked forum")
    config = tmp_path / "join.json"
    config.write_text(json.dumps({"tools": ["not a name!"]}))

    (code, out, err), (bad_code, bad_out, bad_err) = await asyncio.gather(
        own_cli("join", "--agent", agent.id, "--forum", forum.id, "--tools", "clock,nope"),
        own_cli("join", "--agent", agent.id, "--forum", forum.id, "--config", str(config)),
    )

    assert code == 2, err
    assert out == ""
    assert err.splitlines()[-1] == (
        "yoke: unknown tools nope (yoke tools list shows the catalog)"
    ), err
    no_crash(err)
    assert bad_code == 2, bad_err
    assert bad_out == ""
    assert "invalid join configuration" in bad_err and "tools:" in bad_err, bad_err
    assert "not a name!" in bad_err, bad_err
    no_crash(bad_err)
    assert await own_store.db[JOIN_CONFIGS].count_documents({}) == 0
    assert await own_store.participants.count_documents({"actorId": agent.id}) == 0


# --- 3. MCP servers ------------------------------------------------------------------------


async def test_add_mcp_checks_its_arguments_registers_once_and_remove_drops_it(
    own_cli: Cli, own_store: Store
) -> None:
    name = f"srv-{uuid.uuid4().hex[:6]}"
    url = "http://127.0.0.1:9/mcp"  # nothing listens: no processor connects here anyway
    refusals = {
        "underscore": (("a_b", "--command", "srv"), "a_b"),
        "both": ((name, "--command", "srv", "--url", url), "exactly one of --command"),
        "neither": ((name,), "exactly one of --command"),
        "header without url": ((name, "--command", "srv", "--header", "A: b"), "--header"),
    }
    # Beside them, before the server is registered: its tools are nobody's.
    *answers, early = await asyncio.gather(
        *(own_cli("tools", "add-mcp", *args) for args, _ in refusals.values()),
        own_cli("agent", "create", "--name", "early", "--tools", f"{name}__*,{name}__search"),
    )
    for (case, (_, said)), (code, out, err) in zip(refusals.items(), answers, strict=True):
        assert code == 2, (case, err)
        assert out == "" and said in err, (case, err)
        no_crash(err)
    assert await own_store.db[MCP_SERVERS].count_documents({}) == 0
    code, _, err = early
    assert code == 2 and f"{name}__*" in err and f"{name}__search" in err, err

    code, out, err = await own_cli(
        "tools", "add-mcp", name, "--url", url, "--header", "Authorization: Bearer t0ken"
    )
    assert code == 0, err
    assert out == f"{name}\n"
    stored = await own_store.db[MCP_SERVERS].find_one({"_id": name})
    assert stored is not None
    assert (stored["url"], stored["headers"]) == (url, {"Authorization": "Bearer t0ken"})

    (again_code, _, again_err), rows, (code, out, err) = await asyncio.gather(
        own_cli("tools", "add-mcp", name, "--command", "other-server"),
        own_cli.listing(),
        own_cli("agent", "create", "--name", "searcher", "--tools", f"{name}__*,{name}__search"),
    )
    assert again_code == 1 and "registered already" in again_err, again_err
    assert (await own_store.db[MCP_SERVERS].find_one({"_id": name}) or {})["url"] == url
    row = rows[(f"{name}__*", "mcp")]
    assert row["status"] == "unavailable" and "not listed yet" in row["reason"], row
    assert code == 0, err
    agent = await own_store.get_actor(out.strip())
    assert agent is not None and agent.meta["tools"] == [f"{name}__*", f"{name}__search"]

    code, out, err = await own_cli("tools", "remove", name)
    assert code == 0, err
    assert await own_store.db[MCP_SERVERS].count_documents({}) == 0


# --- 4. worker tools -----------------------------------------------------------------------


@pytest.fixture
async def worker_name(management: Management) -> AsyncIterator[str]:
    """A tool name no other test uses; the users a test may have made go after it."""
    name = f"w{uuid.uuid4().hex[:10]}"
    yield name
    # With the users a refused add-worker must not make: a bug the test reports, never left.
    for tool in (name, f"{name}x", "lookup_order", "clock"):
        await management.delete_user(topology.tool_user(tool, management.vhost))


def as_tool_user(amqp_url: str, tool: str, password: str) -> str:
    parts = urlsplit(amqp_url)
    address = parts.netloc.rpartition("@")[2]
    name = topology.tool_user(tool, unquote(parts.path[1:]) or "/")
    user = f"{quote(name, safe='')}:{quote(password, safe='')}"
    return urlunsplit(parts._replace(netloc=f"{user}@{address}"))


async def test_add_worker_registers_a_tool_its_queue_and_user_and_remove_drops_them(
    own_cli: Cli,
    own_store: Store,
    management: Management,
    amqp_url: str,
    worker_name: str,
    tmp_path: Path,
) -> None:
    # As JSON Schema tools write it: keys no MongoDB-wire store takes as field names.
    schema = {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "type": "object",
        "properties": {"city": {"$ref": "#/$defs/city"}, "geo.lat": {"type": "number"}},
        "required": ["city"],
        "$defs": {"city": {"type": "string", "$comment": "a name"}},
    }
    schema_file = tmp_path / "schema.json"
    schema_file.write_text(json.dumps(schema))
    not_an_object = tmp_path / "list.json"
    not_an_object.write_text("[1, 2]")

    def add(name: str, schema_path: Path = schema_file) -> list[str]:
        return [
            "tools",
            "add-worker",
            name,
            "--schema",
            str(schema_path),
            "--description",
            "The weather in a city.",
            "--timeout",
            "5",
        ]

    code, out, err = await own_cli(*add(worker_name))
    assert code == 0, err
    password = out.splitlines()[-1]
    assert len(password) >= 16 and " " not in password, out
    queue = (await management.queues())[topology.tool_queue(worker_name)]
    assert queue["type"] == "quorum" and queue["durable"] is True
    # The printed password is the user's: the worker can log in with it.
    connection = await aio_pika.connect(as_tool_user(amqp_url, worker_name, password))
    await connection.close()

    # The listing; and refused: the name taken, a plugin's and a built-in's name, a schema
    # that is no object.
    rows, again, plugin, builtin, not_object = await asyncio.gather(
        own_cli.listing(),
        own_cli(*add(worker_name)),
        own_cli(*add("lookup_order")),
        own_cli(*add("clock")),
        own_cli(*add(f"{worker_name}x", not_an_object)),
    )
    row = rows[(worker_name, "worker")]
    assert row["status"] == "ready" and row["inputSchema"] == schema, row
    assert (row["origin"], row["description"]) == (worker_name, "The weather in a city.")
    document = await own_store.db[CATALOG].find_one({"_id": worker_name})
    assert document is not None
    stored = CatalogEntry.from_document(document)
    assert (stored.timeout_seconds, stored.input_schema) == (5, schema)
    assert again[0] == 1 and "in the catalog already" in again[2], again
    for taken, (code, out, err) in (("lookup_order", plugin), ("clock", builtin)):
        assert code == 1 and out == "", (taken, err)
        assert err == f"yoke: {taken} is a built-in or plugin tool here; pick another name\n"
    code, out, err = not_object
    assert code == 2 and "the input schema must be a JSON Schema object" in err, err
    no_crash(err)
    for refused in ("lookup_order", "clock", f"{worker_name}x"):
        assert not await user_exists(management, topology.tool_user(refused, management.vhost))
    assert await own_store.db[CATALOG].count_documents({}) == 1
    # The refused second registration left the first one's password alone.
    connection = await aio_pika.connect(as_tool_user(amqp_url, worker_name, password))
    await connection.close()

    code, _, err = await own_cli("tools", "remove", worker_name)
    assert code == 0, err
    assert await own_store.db[CATALOG].find_one({"_id": worker_name}) is None
    assert not await user_exists(management, topology.tool_user(worker_name, management.vhost))
    assert topology.tool_queue(worker_name) not in await management.queues()


async def test_a_catalog_entry_stored_in_the_old_shape_still_reads(own_store: Store) -> None:
    # Before schemas were stored as JSON text, they were stored as a document of their own.
    schema = {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}
    await own_store.db[CATALOG].insert_one(
        {
            "_id": "old_tool",
            "description": "Stored by an older mesh.",
            "inputSchema": schema,
            "source": "worker",
            "origin": "old_tool",
            "timeoutSeconds": 9.0,
            "status": "ready",
        }
    )
    entry = (await ToolCatalog(own_store).entries(fresh=True))["old_tool"]
    assert (entry.input_schema, entry.json_schema(), entry.timeout_seconds) == (schema, schema, 9)
    # Written again, it reads back the same.
    assert CatalogEntry.from_document(entry.to_document()) == entry


# --- 5. plugin tools in a turn -----------------------------------------------------------


def results_in(lines: list[Message]) -> list[ToolResultPart]:
    return [part for line in lines for part in line.parts if isinstance(part, ToolResultPart)]


@pytest.mark.slow
async def test_a_plugin_tool_answers_in_a_turn_and_the_agent_speaks_after_it(
    store: Store, client: Client, new_join: JoinFactory
) -> None:
    script = [
        ScriptedOutput(tool_calls=[ScriptedCall(name="lookup_order", input={"orderId": "A1"})]),
        ScriptedOutput(text="your order A1 has shipped"),
    ]
    forum_id, join = await new_join(model="fixture-script", tools=["lookup_order"], script=script)
    await say(client, forum_id, "where is my order A1?")

    forum = await lines_until(store, forum_id, lambda lines: len(agent_lines(lines)) == 1)
    assert agent_lines(forum)[0].text == "your order A1 has shipped"
    [result] = results_in(await store.history(join.monologue_id))
    assert (result.name, result.is_error) == ("lookup_order", False)
    assert json.loads(result.output) == {
        "orderId": "A1",
        "status": "shipped",
        "carrier": "PostNord",
    }


@pytest.mark.slow
async def test_a_tool_not_listed_and_a_name_nobody_offers_are_error_results_naming_them(
    store: Store, client: Client, new_join: JoinFactory
) -> None:
    script = [
        ScriptedOutput(
            tool_calls=[
                ScriptedCall(name="slugify", input={"text": "Not Mine"}),
                ScriptedCall(name="no_such_tool", input={}),
            ]
        ),
        ScriptedOutput(text="those tools are not mine"),
        ScriptedOutput(text="still here"),
    ]
    forum_id, join = await new_join(model="fixture-script", tools=["lookup_order"], script=script)
    await say(client, forum_id, "slugify this")
    await lines_until(store, forum_id, lambda lines: len(agent_lines(lines)) == 1)
    await say(client, forum_id, "are you there?")
    forum = await lines_until(store, forum_id, lambda lines: len(agent_lines(lines)) == 2)

    assert [line.text for line in agent_lines(forum)] == ["those tools are not mine", "still here"]
    monologue = await store.history(join.monologue_id)
    not_listed, unknown = results_in(monologue)
    assert (not_listed.name, not_listed.is_error) == ("slugify", True)
    assert "slugify is not one of this agent's tools" in not_listed.output
    assert "available: lookup_order" in not_listed.output
    assert (unknown.name, unknown.is_error) == ("no_such_tool", True)
    assert "unknown tool 'no_such_tool'" in unknown.output
    assert [line for line in monologue if line.type == "notice"] == []


# --- 6. a second source offering a taken name ----------------------------------------------


@pytest.mark.slow
async def test_a_worker_offering_a_plugins_name_is_listed_as_a_clash_and_the_plugin_keeps_it(
    mesh_cli: Cli, store: Store, mesh: object
) -> None:
    await published(store, PLUGIN_TOOLS)
    catalog = ToolCatalog(store)
    intruder = CatalogEntry(
        id="slugify",
        description="A worker's slugify.",
        source="worker",
        origin="slugify",
        timeout_seconds=5,
    )
    try:
        answer = await catalog.register(intruder)

        assert answer.status == "unavailable"
        assert answer.reason == f"the name slugify is taken by plugin {SLUGIFY_ORIGIN}"
        held = await store.db[CATALOG].find_one({"_id": "slugify"})
        assert held is not None and (held["source"], held["origin"]) == ("plugin", SLUGIFY_ORIGIN)
        assert (await catalog.resolve(["slugify"]))["slugify"].source == "plugin"
        # A second registration by the same source changes nothing.
        assert (await catalog.register(intruder)).status == "unavailable"

        rows = await mesh_cli.listing()
        assert rows[("slugify", "plugin")]["status"] == "ready"
        clash = rows[("slugify", "worker")]
        assert clash["status"] == "unavailable" and "taken by plugin" in clash["reason"], clash
    finally:
        await store.db[CATALOG].delete_many(
            {"_id": {"$regex": f"^{CLASH_PREFIX}"}, "source": "worker"}
        )

"""Secrets stay secret and the services run with least privilege (docs/security.md).

The services' RabbitMQ user is made by the code compose's ``rabbitmq-init`` runs
(``yoke.bus.provisioning`` importing ``deploy/rabbitmq/definitions.json`` with passwords from the
environment), renamed into a vhost of this module: no tag, only ``yoke.*``. The five services
run as that user through a turn with a tool call; then every service's output, every ``/healthz``
body and the CLI's output (answers and errors) are searched for its password, for a MongoDB
password and for an OpenAI key.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shlex
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlsplit, urlunsplit

import aio_pika
import httpx
import pytest
from aio_pika.abc import AbstractChannel
from aiormq.exceptions import ChannelAccessRefused

from services.gateway.stream import Hub
from services.gateway.webhooks import WebhookWorker
from tests.support.cli import run_yoke
from tests.support.mesh import JoinFactory, Mesh, agent_lines, lines_until, say
from tests.support.processes import ServiceProcess, eventually, free_port
from tests.support.unprivileged import python_for, readable_copies
from yoke.bus import topology
from yoke.bus.provisioning import (
    ProvisioningError,
    import_definitions,
    passwords_from_environment,
    with_passwords,
)
from yoke.client import Client
from yoke.core.ids import new_id
from yoke.core.models import Conversation, Message, MessagePosted, TextPart, ToolResultPart
from yoke.core.redact import redact
from yoke.core.settings import Settings
from yoke.llm.base import ScriptedCall, ScriptedOutput
from yoke.runtime.catalog_store import ToolCatalog
from yoke.runtime.health import HealthServer
from yoke.runtime.joins import create_forum
from yoke.runtime.posting import Poster
from yoke.store.database import Store

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
TAG = uuid.uuid4().hex[:10]
SERVICES_PASSWORD = f"svc{TAG}MustNeverBeShown"
PUBLISHER_PASSWORD = f"pub{TAG}MustNeverBeShown"
GATEWAY_PASSWORD = f"gw{TAG}MustNeverBeShown"
MONGODB_PASSWORD = f"mongo{TAG}MustNeverBeShown"
OPENAI_KEY = f"sk-{TAG}-must-never-be-shown"
SECRETS = (SERVICES_PASSWORD, PUBLISHER_PASSWORD, GATEWAY_PASSWORD, MONGODB_PASSWORD, OPENAI_KEY)


ChannelAction = Callable[[AbstractChannel], Awaitable[object]]


def assert_no_secret(text: str, where: str) -> None:
    for secret in SECRETS:
        assert secret not in text, f"a secret appears in {where}:\n{text[-3000:]}"


@dataclass
class Users:
    """The module's vhost and the users the definitions file declares, renamed into it."""

    vhost: str
    services: str
    publisher: str
    services_url: str
    publisher_url: str
    management: str  # the management API's base URL
    admin: tuple[str, str]
    gateway_url: str  # the HTTP gateway's own user (compose's yoke-gateway)


def into_vhost(definitions: dict[str, Any], names: dict[str, str], vhost: str) -> dict[str, Any]:
    """The definitions file as it would apply to ``vhost``, with its users renamed."""

    def moved(entry: dict[str, Any]) -> dict[str, Any]:
        entry = {**entry}
        if "vhost" in entry:
            entry["vhost"] = vhost
        for key in ("user", "name"):
            if key in entry and entry[key] in names and "type" not in entry:
                entry[key] = names[entry[key]]
        if "configure" in entry and entry.get("user") == names["publisher"]:
            # A bridge's queues are named by its user (bridge.NAME.*): they follow the rename.
            entry.update(topology.publisher_permissions(names["publisher"]))
        return entry

    result: dict[str, Any] = {
        key: [moved(item) for item in value] if isinstance(value, list) else value
        for key, value in definitions.items()
    }
    result["vhosts"] = [{"name": vhost}]
    return result


def url_for(base: str, user: str, password: str, vhost: str) -> str:
    parts = urlsplit(base)
    netloc = f"{quote(user, safe='')}:{quote(password, safe='')}@{parts.hostname}:{parts.port}"
    return urlunsplit(parts._replace(netloc=netloc, path="/" + quote(vhost, safe="")))


@pytest.fixture(scope="module")
async def users(servers: tuple[str, str, str]) -> AsyncIterator[Users]:
    base, _, management = servers
    parts = urlsplit(base)
    admin = (parts.username or "guest", parts.password or "guest")
    vhost = f"yoke-test-{TAG}"
    names = {
        "yoke": f"yoke-test-services-{TAG}",
        "publisher": f"yoke-test-publisher-{TAG}",
        "yoke-gateway": f"yoke-test-gateway-{TAG}",
    }
    definitions = json.loads((ROOT / "deploy/rabbitmq/definitions.json").read_text())
    assert {user["name"] for user in definitions["users"]} == set(names)
    filled = with_passwords(
        into_vhost(definitions, names, vhost),
        {
            names["yoke"]: SERVICES_PASSWORD,
            names["publisher"]: PUBLISHER_PASSWORD,
            names["yoke-gateway"]: GATEWAY_PASSWORD,
        },
    )
    mparts = urlsplit(management)
    with_admin = urlunsplit(mparts._replace(netloc=f"{admin[0]}:{admin[1]}@{mparts.netloc}"))
    await import_definitions(with_admin, filled)
    try:
        yield Users(
            vhost,
            names["yoke"],
            names["publisher"],
            url_for(base, names["yoke"], SERVICES_PASSWORD, vhost),
            url_for(base, names["publisher"], PUBLISHER_PASSWORD, vhost),
            management,
            admin,
            url_for(base, names["yoke-gateway"], GATEWAY_PASSWORD, vhost),
        )
    finally:
        async with httpx.AsyncClient(base_url=management, auth=admin, timeout=30) as api:
            for name in names.values():
                await api.delete(f"/api/users/{quote(name, safe='')}")
            await api.delete(f"/api/vhosts/{quote(vhost, safe='')}")


@pytest.fixture(scope="module")
def amqp_url(users: Users) -> str:
    """The mesh, the test's poster and the joins connect as the services' user."""
    return users.services_url


@pytest.fixture(scope="module")
def mesh_env() -> dict[str, str]:
    # Empty: stdio MCP servers run as the default user, whatever conftest keeps for others.
    return {
        "OPENAI_API_KEY": OPENAI_KEY,
        "OPENAI_BASE_URL": "http://127.0.0.1:9/v1",
        "YOKE_MCP_STDIO_USER": "",
    }


@pytest.fixture(scope="module")
async def client(users: Users, mesh: Mesh) -> AsyncIterator[Client]:
    """Lines come in as a bridge would send them: as the publisher user."""
    async with Client(users.publisher_url) as client:
        yield client


async def run_cli(env: dict[str, str], *args: str) -> tuple[int, str]:
    """``yoke ARGS`` as a process; its exit code and stdout + stderr."""
    code, out, err = await run_yoke(env, *args, timeout=90)
    return code, out + err


# --- least privilege -------------------------------------------------------------------------


async def test_the_services_user_has_no_tag_and_reaches_only_yoke_resources(users: Users) -> None:
    async with httpx.AsyncClient(base_url=users.management, auth=users.admin, timeout=30) as api:
        user = (await api.get(f"/api/users/{users.services}")).json()
        assert user["tags"] in ([], "")  # not an administrator, not even management
        vhost = quote(users.vhost, safe="")
        granted = (await api.get(f"/api/permissions/{vhost}/{users.services}")).json()
        assert {k: granted[k] for k in ("configure", "write", "read")} == (
            topology.SERVICE_PERMISSIONS
        )
    async with httpx.AsyncClient(
        base_url=users.management, auth=(users.services, SERVICES_PASSWORD), timeout=30
    ) as api:
        assert (await api.get("/api/overview")).status_code == 401  # no management access
    connection = await aio_pika.connect(users.services_url, timeout=10)
    try:
        for declare in (
            lambda channel: channel.declare_queue("bridge.not-ours", exclusive=True),
            lambda channel: channel.declare_exchange("other.exchange", "topic"),
        ):
            channel = await connection.channel()
            with pytest.raises(ChannelAccessRefused):
                await declare(channel)
    finally:
        await connection.close()


async def refused(connection: aio_pika.abc.AbstractConnection, action: ChannelAction) -> None:
    """``action`` on a channel of its own is refused by RabbitMQ (403 closes the channel)."""
    channel = await connection.channel(publisher_confirms=True)
    with pytest.raises(ChannelAccessRefused):
        await action(channel)


async def test_the_gateway_user_does_what_the_gateway_does_and_nothing_else(
    users: Users, store: Store, poster: Poster
) -> None:
    """compose's gateway runs as its own RabbitMQ user (invariant 13): its reply queue, its
    commands, its stream hub and its webhook worker work, bound to yoke.forum, so a monologue's
    line never reaches it; yoke.events, the dead letters and the services' queues are refused."""
    forum = await create_forum(store, "gateway user")
    monologue = await store.save_conversation(
        Conversation(id=new_id(), kind="monologue", title="gateway user's monologue")
    )
    hub = Hub(users.gateway_url)
    await hub.start()
    worker = WebhookWorker(Settings(amqp_url=users.gateway_url), store)
    try:
        await worker.start()
        assert worker.problems() == []
        async with (
            Client(users.gateway_url, queue_prefix="yoke.gateway.replies.") as client,
            hub.subscribe(forum.id) as forum_stream,
            hub.subscribe(monologue.id) as monologue_stream,
        ):
            assert client.connected
            # One publisher channel, so the monologue's event would reach the hub's queue first.
            for conversation in (monologue, forum):
                await poster.post(
                    Message(
                        id=new_id(),
                        conversation_id=conversation.id,
                        author_actor_id="someone",
                        parts=[TextPart(text=f"a line in {conversation.kind}")],
                    )
                )
            streamed = await asyncio.wait_for(forum_stream.take(), 20)
            assert isinstance(streamed, MessagePosted)
            assert streamed.message.text == "a line in forum"
            assert monologue_stream.inbox.empty()

        connection = await aio_pika.connect(users.gateway_url, timeout=10)
        try:
            channel = await connection.channel(publisher_confirms=True)
            commands = await channel.get_exchange(topology.COMMANDS_EXCHANGE)
            await commands.publish(aio_pika.Message(b"{}"), routing_key=topology.SUBMIT_COMMAND)

            async def publish_event(channel: AbstractChannel) -> None:
                events = await channel.get_exchange(topology.EVENTS_EXCHANGE)
                await events.publish(aio_pika.Message(b"{}"), routing_key="agent.activity.x")

            async def bind_to_events(channel: AbstractChannel) -> None:
                queue = await channel.declare_queue("yoke.gateway.sneaky", exclusive=True)
                await queue.bind(topology.EVENTS_EXCHANGE, routing_key="#")

            async def read_dead_letters(channel: AbstractChannel) -> None:
                queue = await channel.get_queue(topology.DEAD_LETTER_QUEUE)
                await queue.get(fail=False)

            async def into_a_queue_directly(channel: AbstractChannel) -> None:
                await channel.default_exchange.publish(
                    aio_pika.Message(b"{}"), routing_key=topology.DEAD_LETTER_QUEUE
                )

            for action in (
                publish_event,
                bind_to_events,
                read_dead_letters,
                into_a_queue_directly,
                lambda channel: channel.declare_exchange(topology.EVENTS_EXCHANGE, "topic"),
                lambda channel: channel.declare_queue(topology.shard_queue("processor", 0)),
                lambda channel: channel.declare_queue("bridge.someone.replies", exclusive=True),
            ):
                await refused(connection, action)
        finally:
            await connection.close()
    finally:
        await worker.stop()
        await hub.close()


async def test_a_turn_with_a_tool_call_runs_through_the_mesh_as_that_user(
    users: Users, store: Store, client: Client, new_join: JoinFactory, mesh: Mesh
) -> None:
    forum_id, _ = await new_join()
    await say(client, forum_id, "hello there")
    forum = await lines_until(
        store, forum_id, lambda lines: len(agent_lines(lines)) == 1, timeout=90
    )
    assert agent_lines(forum)[0].text.endswith("hello there")

    script = [
        ScriptedOutput(tool_calls=[ScriptedCall(name="clock")]),
        ScriptedOutput(text="it is late"),
    ]
    forum_id, join = await new_join(model="fixture-script", tools=["clock"], script=script)
    await say(client, forum_id, "what time is it?")
    forum = await lines_until(
        store, forum_id, lambda lines: len(agent_lines(lines)) == 1, timeout=90
    )
    assert agent_lines(forum)[0].text == "it is late"
    monologue = await store.history(join.monologue_id)
    assert any(isinstance(part, ToolResultPart) for line in monologue for part in line.parts)

    # The mesh really ran as the restricted user: every connection on the vhost is one of ours.
    # (The management API lists a connection only after its next stats emission: poll.)
    seen: set[str] = set()
    async with httpx.AsyncClient(base_url=users.management, auth=users.admin, timeout=30) as api:
        vhost = quote(users.vhost, safe="")

        async def services_connected() -> bool:
            connections = (await api.get(f"/api/vhosts/{vhost}/connections")).json()
            seen.clear()
            seen.update(connection["user"] for connection in connections)
            return users.services in seen

        await eventually(services_connected, timeout=30, what="the services' connections listed")
    assert seen <= {users.services, users.publisher}, seen


# --- secrets never printed -------------------------------------------------------------------


async def test_no_secret_in_any_service_output_or_health_body(mesh: Mesh) -> None:
    async with httpx.AsyncClient(timeout=5) as http:
        for name, process in mesh.processes.items():
            body = (await http.get(f"http://127.0.0.1:{process.port}/healthz")).text
            assert body == "ok\n", (name, body)
            assert_no_secret(process.output(), f"{name}'s output")


async def test_no_secret_in_cli_answers_or_errors(
    users: Users, store: Store, mesh: Mesh, module_mongodb_url: str
) -> None:
    forum = await create_forum(store, "cli")
    env = {"YOKE_AMQP_URL": users.publisher_url, "YOKE_MONGODB_URL": module_mongodb_url}
    code, out = await run_cli(env, "post", "--forum", forum.id, "--author", "ada", "hi")
    assert code == 0, out
    assert_no_secret(out, "yoke post")
    # A node list whose first node is down: the CLI warns about it and goes on to the next.
    dead = users.publisher_url.replace(f":{urlsplit(users.publisher_url).port}", f":{free_port()}")
    listed = {**env, "YOKE_AMQP_URL": f"{dead},{users.publisher_url}"}
    code, out = await run_cli(listed, "post", "--forum", forum.id, "--author", "ada", "hi")
    assert code == 0, out
    assert_no_secret(out, "yoke post through a node list")
    code, out = await run_cli(env, "history", forum.id)
    assert code == 0 and "ada: hi" in out, out
    assert_no_secret(out, "yoke history")

    # The services' user may not declare a bridge's reply queue: refused, with a traceback.
    refused = {**env, "YOKE_AMQP_URL": users.services_url}
    code, out = await run_cli(refused, "post", "--forum", forum.id, "--author", "ada", "hi")
    assert code != 0 and "ACCESS_REFUSED" in out, out
    assert_no_secret(out, "yoke post refused")

    # No broker there: a connection error and a traceback.
    nowhere = url_for(users.services_url, users.services, SERVICES_PASSWORD, users.vhost)
    nowhere = nowhere.replace(f":{urlsplit(nowhere).port}", f":{free_port()}")
    code, out = await run_cli({**env, "YOKE_AMQP_URL": nowhere}, "reshard", "2")
    assert code != 0 and "ConnectionError" in out, out
    assert_no_secret(out, "yoke reshard without a broker")

    # A MongoDB-wire server that refuses the credentials (FerretDB takes no SCRAM users).
    parts = urlsplit(module_mongodb_url)
    refused_store = urlunsplit(
        parts._replace(netloc=f"yoke:{MONGODB_PASSWORD}@{parts.hostname}:{parts.port}")
    )
    code, out = await run_cli({**env, "YOKE_MONGODB_URL": refused_store}, "history", forum.id)
    assert code != 0, out
    assert_no_secret(out, "yoke history refused by the store")


async def test_a_service_that_cannot_start_shows_no_secret(users: Users, tmp_path: Path) -> None:
    parts = urlsplit("mongodb://127.0.0.1:27017/yoke")
    store_url = urlunsplit(
        parts._replace(netloc=f"yoke:{MONGODB_PASSWORD}@127.0.0.1:{free_port()}")
    )
    env = {
        "YOKE_AMQP_URL": users.services_url,
        "YOKE_MONGODB_URL": store_url + "?serverSelectionTimeoutMS=500",
        "OPENAI_API_KEY": OPENAI_KEY,
    }
    process = ServiceProcess(["-m", "services.ingestion"], env, tmp_path / "ingestion.log")
    try:
        async with httpx.AsyncClient(timeout=2) as http:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 30
            bodies = []
            while process.popen.poll() is None and loop.time() < deadline:
                with contextlib.suppress(httpx.HTTPError):
                    bodies.append((await http.get(f"http://127.0.0.1:{process.port}/healthz")).text)
                await asyncio.sleep(0.3)
        output = process.output()
    finally:
        process.stop()
    assert "127.0.0.1" in output, output  # it did say what it could not reach
    assert_no_secret(output + "".join(bodies), "a failing service's output")


async def test_health_reasons_quoting_a_url_are_masked() -> None:
    reason = f"store unreachable: OperationFailure('mongodb://yoke:{MONGODB_PASSWORD}@db:27017')"

    async def problems() -> list[str]:
        return [reason]

    server = HealthServer(free_port(), problems, host="127.0.0.1")
    await server.start()
    try:
        async with httpx.AsyncClient(timeout=5) as http:
            response = await http.get(f"http://127.0.0.1:{server.port}/healthz")
    finally:
        await server.close()
    assert response.status_code == 503
    assert response.text == "store unreachable: OperationFailure('mongodb://yoke:***@db:27017')\n"


@pytest.mark.parametrize(
    ("shown", "expected"),
    [
        ("amqp://yoke:s3cret@rabbitmq:5672/", "amqp://yoke:***@rabbitmq:5672/"),
        ("amqps://a:p%40ss@h1/v,amqp://a:two@h2/v", "amqps://a:***@h1/v,amqp://a:***@h2/v"),
        ("mongodb://u:pw@h1,h2/yoke?tls=true", "mongodb://u:***@h1,h2/yoke?tls=true"),
        ("no node of 'http://op:pw@x:15672' answers", "no node of 'http://op:***@x:15672' answers"),
        ("amqp://guest@h/ and amqp://h:5672/v", "amqp://guest@h/ and amqp://h:5672/v"),
    ],
)
def test_redact_masks_every_url_password_and_nothing_else(shown: str, expected: str) -> None:
    assert redact(shown) == expected


def test_provisioning_names_the_variable_a_password_is_missing_from() -> None:
    with pytest.raises(ProvisioningError, match="YOKE_RABBITMQ_SERVICES_PASSWORD"):
        passwords_from_environment({"YOKE_RABBITMQ_PUBLISHER_PASSWORD": "x"})


async def test_provisioning_says_when_the_operator_is_refused(
    servers: tuple[str, str, str],
) -> None:
    parts = urlsplit(servers[2])
    wrong = urlunsplit(parts._replace(netloc=f"operator-{TAG}:{SERVICES_PASSWORD}@{parts.netloc}"))
    with pytest.raises(ProvisioningError) as refused:
        await import_definitions(wrong, {"users": [], "permissions": []}, deadline=5)
    assert "refused (401)" in str(refused.value)
    assert_no_secret(str(refused.value), "the provisioning error")


# --- secrets out of reach of the programs the mesh starts ------------------------------------


SNOOPING_SERVER = ROOT / "tests/support/snooping_mcp_server.py"


@pytest.fixture
def stack() -> Iterator[contextlib.ExitStack]:
    with contextlib.ExitStack() as stack:
        yield stack


async def test_a_stdio_mcp_server_can_read_none_of_the_mesh_secrets(
    store: Store, client: Client, new_join: JoinFactory, mesh: Mesh, stack: contextlib.ExitStack
) -> None:
    """The processor (as root here, with the services' password in its YOKE_AMQP_URL and an
    OpenAI key) starts a hostile server, which reads every ancestor's environ, cmdline and
    memory and every other /proc/*/environ of the test's processes: it finds no secret, and
    still does its work (a HOME of its own it can write)."""
    python = python_for()
    assert python is not None, "no Python the unprivileged stdio user can run"
    # A copy the stdio user can read: the checkout may be where it cannot (a mode-0700 home).
    server = stack.enter_context(readable_copies(SNOOPING_SERVER))[SNOOPING_SERVER]
    command = shlex.join([python, str(server)])
    code, _, err = await run_yoke(
        mesh.env, "tools", "add-mcp", "snooping", "--command", command, "--timeout", "60",
        "--env", f"SNOOP_NEEDLES={TAG}", "--env", f"SNOOP_TOP={os.getpid()}",
    )  # fmt: skip
    assert code == 0, err

    async def listed() -> bool:
        entry = (await ToolCatalog(store).entries(fresh=True)).get("snooping__snoop")
        return entry is not None and entry.ready

    await eventually(listed, timeout=90, what="snooping__snoop in the catalog", interval=0.3)
    script = [
        ScriptedOutput(tool_calls=[ScriptedCall(name="snooping__snoop")]),
        ScriptedOutput(text="snooped"),
    ]
    forum_id, join = await new_join(
        model="fixture-script", tools=["snooping__snoop"], script=script
    )
    await say(client, forum_id, "look around")
    await lines_until(store, forum_id, lambda lines: len(agent_lines(lines)) == 1, timeout=120)
    (answer,) = [
        part
        for line in await store.history(join.monologue_id)
        for part in line.parts
        if isinstance(part, ToolResultPart)
    ]
    assert not answer.is_error, answer.output
    assert_no_secret(answer.output, "what a stdio MCP server could read")
    seen = json.loads(answer.output)
    assert seen["found"] == [], seen["found"]
    assert seen["ancestors"][0] == mesh.processes["processor"].pid
    assert f"{seen['ancestors'][0]}/cmdline" in seen["read"]  # it did look
    assert seen["homeWritable"], seen
    if os.geteuid() == 0:
        assert seen["uid"] != 0

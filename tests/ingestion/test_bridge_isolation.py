"""A bridge reads forum lines and nothing of any agent's monologue (see docs/publishing.md).

The bridge's user is made by ``yoke publisher create``; it then binds the widest key it can on
every exchange of the vhost (the list comes from the management API, so an exchange added
later is tried too), and an OpenAI-model agent takes a turn with a tool call.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from urllib.parse import quote, urlsplit, urlunsplit

import aio_pika
import pytest
from aio_pika.abc import AbstractIncomingMessage, AbstractRobustConnection
from aiormq.exceptions import AMQPError
from pamqp.common import FieldTable

from tests.support import broker
from tests.support.cli import run_yoke
from tests.support.fake_openai import FakeOpenAI, completion, openai_env
from tests.support.mesh import JoinFactory, Mesh, agent_lines, lines_until
from tests.support.processes import eventually, free_port
from tests.support.worker_process import as_user
from yoke.bus import topology
from yoke.bus.amqp_nodes import amqp_vhost
from yoke.cli.asyncapi import asyncapi_document
from yoke.cli.publishers import Management, management_of
from yoke.client import Client
from yoke.core.models import Envelope, MessagePosted, ToolCallPart, ToolResultPart
from yoke.runtime.joins import create_forum
from yoke.store.database import Store

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def mesh_env(fake_openai: FakeOpenAI) -> dict[str, str]:
    return openai_env(fake_openai.base_url, give_up_seconds=5)


@dataclass
class Publisher:
    name: str
    url: str  # the AMQP URL of the module's vhost with this user's name and password


@pytest.fixture(scope="module")
async def publisher(
    mesh: Mesh, amqp_url: str, management: broker.Management
) -> AsyncIterator[Publisher]:
    name = f"bridge-{uuid.uuid4().hex[:8]}"
    code, out, err = await run_yoke(mesh.env, "publisher", "create", "--name", name)
    assert code == 0, err
    password = out.splitlines()[-1]
    try:
        yield Publisher(name, as_user(amqp_url, name, password))
    finally:
        await management.delete_user(name)


@dataclass
class Tap:
    """One queue of the bridge's, bound as widely as the broker lets it on every exchange."""

    bound: list[str] = field(default_factory=list)
    refused: dict[str, str] = field(default_factory=dict)
    deliveries: list[AbstractIncomingMessage] = field(default_factory=list)

    async def keep(self, delivery: AbstractIncomingMessage) -> None:
        self.deliveries.append(delivery)

    def envelopes(self) -> list[tuple[str, Envelope]]:
        return [
            (d.routing_key or "", Envelope.model_validate_json(d.body)) for d in self.deliveries
        ]


def widest_binding(kind: str) -> tuple[str, FieldTable]:
    """The binding that lets the most through an exchange of this type."""
    if kind == "headers":
        return "", {"x-match": "all"}  # no header to match: everything matches
    if kind == "x-consistent-hash":
        return "1", {}
    return "#", {}


async def tap_everything(
    connection: AbstractRobustConnection, management: broker.Management, vhost: str, user: str
) -> Tap:
    tap = Tap()
    channel = await connection.channel()
    queue = await channel.declare_queue(
        f"{topology.bridge_queue_prefix(user)}tap.{uuid.uuid4().hex}", exclusive=True
    )
    listing = await management.get(f"/api/exchanges/{quote(vhost, safe='')}")
    listing.raise_for_status()
    exchanges = [(x["name"], x["type"]) for x in listing.json()]
    assert (topology.EVENTS_EXCHANGE, "topic") in exchanges  # the mesh's topology is there
    for name, kind in exchanges:
        key, arguments = widest_binding(kind)
        attempt = await connection.channel()  # a refusal closes the channel it happens on
        try:
            await (await attempt.get_queue(queue.name, ensure=False)).bind(
                name, routing_key=key, arguments=arguments
            )
            tap.bound.append(name)
        except AMQPError as error:
            tap.refused[name or "(default)"] = str(error)
    await queue.consume(tap.keep, no_ack=True)
    return tap


def has_calls(line: object) -> bool:
    return any(isinstance(part, ToolCallPart) for part in getattr(line, "parts", []))


def has_results(line: object) -> bool:
    return any(isinstance(part, ToolResultPart) for part in getattr(line, "parts", []))


async def test_a_publisher_bound_to_everything_it_may_read_sees_forum_lines_and_no_monologue(
    store: Store,
    new_join: JoinFactory,
    fake_openai: FakeOpenAI,
    publisher: Publisher,
    management: broker.Management,
    amqp_url: str,
) -> None:
    fake_openai.script(
        completion(None, [("call-1", "calculator", '{"expression": "6 * 7"}')]),
        completion("six times seven is 42"),
    )
    forum_id, join = await new_join(model="gpt-test", tools=["calculator"])
    fence_forum = (await create_forum(store, "fence")).id
    connection = await aio_pika.connect_robust(publisher.url)
    try:
        tap = await tap_everything(connection, management, amqp_vhost(amqp_url), publisher.name)
        assert tap.bound, f"the publisher may bind nothing at all: {tap.refused}"

        async with Client(publisher.url) as bridge:
            reply = await bridge.submit(
                forum_id, "what is 6 * 7?", external_id="slack:U1", display_name="Ada"
            )
            assert reply.status == "accepted", reply.error
            forum = await lines_until(store, forum_id, lambda lines: len(agent_lines(lines)) >= 1)
            monologue = await store.history(join.monologue_id)
            assert any(map(has_calls, monologue)) and any(map(has_results, monologue))

            # Every monologue event of the turn was routed before the forum's answer (each was
            # acted on first); a line in another forum, submitted now and seen on the same
            # queue, fences anything routed later in the turn's wake.
            fence = await bridge.submit(
                fence_forum, "fence", external_id="slack:U1", display_name="Ada"
            )
            assert fence.status == "accepted", fence.error

            def seen_ids() -> set[str]:
                return {
                    payload.message.id
                    for _, envelope in tap.envelopes()
                    if isinstance(payload := envelope.parse(), MessagePosted)
                }

            async def fenced() -> bool:
                return fence.message_id in seen_ids()

            await eventually(fenced, timeout=30, what="the fence line on the bridge's queue")

        received = tap.envelopes()
        strays = [
            (key, envelope.type)
            for key, envelope in received
            if not key.endswith((f".{forum_id}", f".{fence_forum}"))
        ]
        monologue_ids = {line.id for line in monologue}
        leaked = [
            payload.message.text
            for _, envelope in received
            if isinstance(payload := envelope.parse(), MessagePosted)
            and (
                payload.message.conversation_id == join.monologue_id
                or payload.message.id in monologue_ids
            )
        ]
        assert leaked == [] and strays == [], (
            f"bound on {tap.bound}, the publisher received monologue lines {leaked} "
            f"and events not of a forum: {strays}"
        )
        assert {line.id for line in forum} <= seen_ids()
        assert tap.bound == [topology.FORUM_EXCHANGE], tap.refused
        assert await readable_queues(connection, management, amqp_vhost(amqp_url)) == []
    finally:
        await connection.close()


async def readable_queues(
    connection: AbstractRobustConnection, management: broker.Management, vhost: str
) -> list[str]:
    """The mesh's queues (none of them the bridge's own) that this connection may read from.

    A basic.get that is let through takes a message unacknowledged: it goes back to its queue
    when the channel closes.
    """
    listing = await management.get(f"/api/queues/{quote(vhost, safe='')}")
    listing.raise_for_status()
    names = [q["name"] for q in listing.json()]
    assert topology.DEAD_LETTER_QUEUE in names
    readable = []
    for name in names:
        if name.startswith(topology.BRIDGE_QUEUE_PREFIX):
            continue
        channel = await connection.channel()
        try:
            queue = await channel.get_queue(name, ensure=False)
            await queue.get(no_ack=False, fail=False)
            readable.append(name)
        except AMQPError:
            continue
        await channel.close()
    return readable


def test_the_publisher_may_read_the_forum_exchange_and_its_own_queues_only() -> None:
    read = re.compile(topology.publisher_permissions("b")["read"])
    assert read.search(topology.FORUM_EXCHANGE) and read.search("bridge.b.replies")
    assert not read.search("bridge.other.replies") and not read.search("bridge.b-x.replies")
    mesh_names = [
        topology.EVENTS_EXCHANGE,
        topology.COMMANDS_EXCHANGE,
        topology.DEAD_LETTER_EXCHANGE,
        topology.DEAD_LETTER_QUEUE,
        topology.FORUM_ROUTE_EXCHANGE,
        topology.route_exchange("processor"),
        topology.shard_exchange("processor"),
        topology.shard_queue("processor", 0),
        topology.intake_queue("ingestion"),
        "amq.rabbitmq.trace",
        "amq.topic",
    ]
    assert [name for name in mesh_names if read.search(name)] == []
    forum = asyncapi_document()["channels"]["forum"]
    assert forum["bindings"]["amqp"]["exchange"]["name"] == topology.FORUM_EXCHANGE


async def test_publisher_create_grants_exactly_the_bridge_permissions_and_never_overwrites(
    amqp_url: str, management: broker.Management
) -> None:
    name = f"bridge-{uuid.uuid4().hex[:8]}"
    env = {"YOKE_AMQP_URL": amqp_url}
    try:
        code, out, err = await run_yoke(env, "publisher", "create", "--name", name)
        assert code == 0, err
        password = out.splitlines()[-1]
        assert len(password) >= 24 and password.strip() == password
        user = (await management.get(f"/api/users/{name}")).json()
        assert user["tags"] in ([], "")
        granted = (await management.get(f"/api/users/{name}/permissions")).json()
        assert [
            {key: entry[key] for key in ("vhost", "configure", "write", "read")}
            for entry in granted
        ] == [{"vhost": amqp_vhost(amqp_url), **topology.publisher_permissions(name)}]
        assert (await management.get(f"/api/users/{name}/topic-permissions")).json() == []
        connection = await aio_pika.connect(as_user(amqp_url, name, password))
        await connection.close()

        code, out, err = await run_yoke(env, "publisher", "create", "--name", name)
        assert code != 0 and "exists already" in err and out == ""
        connection = await aio_pika.connect(as_user(amqp_url, name, password))  # unchanged
        await connection.close()
    finally:
        await management.delete(f"/api/users/{name}")


async def test_publisher_create_says_why_when_the_management_api_refuses(
    amqp_url: str, servers: tuple[str, str, str], management: broker.Management
) -> None:
    name = f"bridge-{uuid.uuid4().hex[:8]}"
    api = urlsplit(servers[2])
    wrong = urlunsplit(api._replace(netloc=f"nobody:not-the-password@{api.netloc}"))
    code, out, err = await run_yoke(
        {"YOKE_AMQP_URL": amqp_url, "YOKE_MANAGEMENT_URL": wrong},
        "publisher",
        "create",
        "--name",
        name,
    )
    assert code != 0 and out == ""
    assert "management API" in err and "401" in err, err
    assert "not-the-password" not in err
    assert (await management.get(f"/api/users/{name}")).status_code == 404

    closed = f"http://127.0.0.1:{free_port()}"
    env = {"YOKE_AMQP_URL": amqp_url, "YOKE_MANAGEMENT_URL": closed}
    code, out, err = await run_yoke(env, "publisher", "create", "--name", name)
    assert code != 0 and out == "" and f"cannot reach the management API at {closed}" in err


def test_the_management_api_is_found_from_the_amqp_url_unless_given() -> None:
    found = management_of("amqp://yoke:s%40cret@rabbit.example:5672/prod%2Fa,amqp://other/")
    assert found == Management("http://rabbit.example:15672", ("yoke", "s@cret"), "prod/a")
    assert management_of("amqp://h/").vhost == "/" and management_of("amqp://h").vhost == "/"
    assert management_of("amqp://h/").auth == ("guest", "guest")
    given = management_of("amqp://yoke:pw@h/v", "https://ops:key@admin.example:8443/rmq/")
    assert given == Management("https://admin.example:8443/rmq", ("ops", "key"), "v")
    plain = management_of("amqp://yoke:pw@h/v", "http://admin.example:15672")
    assert plain.auth == ("yoke", "pw") and plain.url == "http://admin.example:15672"

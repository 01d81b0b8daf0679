"""A worker tool's RabbitMQ user may read its own call queue and publish commands, nothing else.

``tool-NAME`` is made through the real management API (what ``yoke tools add-worker`` calls);
what it may do is tried by a worker written with pika alone, as a separate process. Users are
per broker, not per vhost: every test names its own tool.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from urllib.parse import quote

import aio_pika
import pytest
from aiormq.exceptions import ProbableAuthenticationError

from tests.support.broker import Management
from tests.support.cli import run_yoke
from tests.support.worker_process import WorkerProcess, as_user
from yoke.bus import topology
from yoke.bus.amqp_nodes import amqp_vhost
from yoke.cli.publishers import create_user, management_of
from yoke.cli.tool_users import ToolUserRefused, create_tool_user, delete_tool_user
from yoke.core.settings import Settings


@pytest.fixture(scope="module")
def settings(servers: tuple[str, str, str], amqp_url: str) -> Settings:
    return Settings(amqp_url=amqp_url, management_url=servers[2])


@pytest.fixture
async def tool_name(management: Management, amqp_url: str) -> AsyncIterator[str]:
    """A tool name no other test uses; its user is removed after the test whatever happened."""
    name = f"t{uuid.uuid4().hex[:10]}"
    yield name
    await management.delete_user(topology.tool_user(name, amqp_vhost(amqp_url)))


@pytest.fixture(scope="module")
async def mesh_topology(amqp_url: str) -> AsyncIterator[Callable[[str], Awaitable[None]]]:
    """The exchanges a worker's user must not reach, and a way to declare tool queues as the
    mesh does (the admin declares: a worker never does)."""
    connection = await aio_pika.connect(amqp_url)
    channel = await connection.channel()
    for name in (topology.EVENTS_EXCHANGE, topology.FORUM_EXCHANGE, topology.COMMANDS_EXCHANGE):
        await channel.declare_exchange(name, aio_pika.ExchangeType.TOPIC, durable=True)
    await channel.declare_queue(topology.DEAD_LETTER_QUEUE, durable=True)

    async def declare_tool_queue(tool: str) -> None:
        await channel.declare_queue(
            topology.tool_queue(tool), durable=True, arguments=topology.tool_queue_arguments()
        )

    yield declare_tool_queue
    await connection.close()


async def test_a_tool_user_gets_exactly_the_worker_permissions_and_no_tag(
    settings: Settings, management: Management, amqp_url: str, tool_name: str
) -> None:
    password = await create_tool_user(settings, tool_name)

    user = topology.tool_user(tool_name, amqp_vhost(amqp_url))
    found = await management.get(f"/api/users/{quote(user, safe='')}")
    assert found.status_code == 200, found.text
    assert found.json()["tags"] in ("", [])  # 3.10 says "", later versions []
    granted = await management.get(f"/api/users/{quote(user, safe='')}/permissions")
    granted.raise_for_status()
    assert [
        {key: entry[key] for key in ("vhost", "configure", "write", "read")}
        for entry in granted.json()
    ] == [{"vhost": amqp_vhost(amqp_url), **topology.tool_worker_permissions(tool_name)}]
    assert topology.tool_worker_permissions(tool_name)["read"] == (f"^yoke\\.tool\\.{tool_name}$")
    # The password it returned is the one that logs in.
    connection = await aio_pika.connect(as_user(amqp_url, user, password))
    await connection.close()


async def test_an_existing_tool_user_is_refused_and_keeps_its_password(
    settings: Settings, amqp_url: str, tool_name: str
) -> None:
    password = await create_tool_user(settings, tool_name)
    with pytest.raises(ToolUserRefused, match="exists already"):
        await create_tool_user(settings, tool_name)
    connection = await aio_pika.connect(
        as_user(amqp_url, topology.tool_user(tool_name, amqp_vhost(amqp_url)), password)
    )
    await connection.close()


async def test_a_name_that_is_not_a_tool_name_makes_no_user(
    settings: Settings, management: Management
) -> None:
    for bad in ("has space", "dotted.name", "", "x" * 65):
        with pytest.raises(ToolUserRefused, match="must match"):
            await create_tool_user(settings, bad)
        if bad:
            found = await management.get(f"/api/users/{quote('tool-' + bad, safe='')}")
            assert found.status_code == 404


async def test_deleting_a_tool_user_removes_it_and_its_login(
    settings: Settings, management: Management, amqp_url: str, tool_name: str
) -> None:
    password = await create_tool_user(settings, tool_name)
    user = topology.tool_user(tool_name, amqp_vhost(amqp_url))

    assert await delete_tool_user(settings, tool_name) is True

    found = await management.get(f"/api/users/{quote(user, safe='')}")
    assert found.status_code == 404
    with pytest.raises(ProbableAuthenticationError):
        await aio_pika.connect(as_user(amqp_url, user, password))
    assert await delete_tool_user(settings, tool_name) is False  # nothing left to delete


async def test_deleting_a_tool_user_takes_an_old_tool_name_users_rights_on_this_vhost(
    settings: Settings, management: Management, amqp_url: str, tool_name: str
) -> None:
    """Made before names carried the vhost, ``tool-NAME`` is still taken as the tool's worker
    here: removing the tool takes its permissions on this vhost (the user is the broker's)."""
    legacy = f"tool-{tool_name}"
    made = await create_user(
        management_of(amqp_url, settings.management_url),
        legacy,
        topology.tool_worker_permissions(tool_name),
    )
    try:
        vhost = quote(amqp_vhost(amqp_url), safe="")
        granted = f"/api/permissions/{vhost}/{quote(legacy, safe='')}"
        assert (await management.get(granted)).status_code == 200
        assert made

        assert await delete_tool_user(settings, tool_name) is True  # no new-style user

        assert (await management.get(granted)).status_code == 404
        assert (await management.get(f"/api/users/{quote(legacy, safe='')}")).status_code == 200
    finally:
        await management.delete_user(legacy)


async def test_a_worker_may_consume_its_own_queue_and_nothing_else(
    settings: Settings,
    amqp_url: str,
    tool_name: str,
    mesh_topology: Callable[[str], Awaitable[None]],
) -> None:
    other = f"{tool_name}-other"
    await mesh_topology(tool_name)
    await mesh_topology(other)
    password = await create_tool_user(settings, tool_name)
    url = as_user(amqp_url, topology.tool_user(tool_name, amqp_vhost(amqp_url)), password)

    worker = await WorkerProcess.start(
        url, tool_name, "probe", "--other-queue", topology.tool_queue(other)
    )
    assert await worker.exited() == 0, worker.stderr.decode()

    outcomes = {line["attempt"]: line for line in worker.lines if line["event"] == "probe"}
    own = topology.tool_queue(tool_name)
    assert outcomes.pop(f"consume {own}")["refused"] is False
    expected = {
        f"consume {topology.tool_queue(other)}",
        f"bind {own} to yoke.events",
        f"bind {own} to yoke.forum",
        f"bind {topology.tool_queue(other)} to yoke.events",
        "declare queue worker.own",
        "declare a server-named queue",
        f"declare {own}",
        "publish to yoke.events",
        f"publish to {own}",
        "publish as another user",
    }
    assert set(outcomes) == expected
    allowed = [name for name, line in outcomes.items() if not line["refused"]]
    assert allowed == []
    # Refused for the right reasons: permissions, and the broker's user_id check.
    assert "ACCESS_REFUSED" in outcomes[f"consume {topology.tool_queue(other)}"]["error"]
    assert "PRECONDITION_FAILED" in outcomes["publish as another user"]["error"]


async def test_a_publisher_may_not_take_a_tool_user_name(
    servers: tuple[str, str, str], amqp_url: str, management: Management
) -> None:
    name = f"tool-{uuid.uuid4().hex[:8]}"
    env = {"YOKE_AMQP_URL": amqp_url, "YOKE_MANAGEMENT_URL": servers[2]}

    code, out, err = await run_yoke(env, "publisher", "create", "--name", name)

    assert code != 0
    assert "tool-" in err and "tool workers" in err
    assert out == ""
    found = await management.get(f"/api/users/{quote(name, safe='')}")
    assert found.status_code == 404

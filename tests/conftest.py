"""Shared fixtures: real RabbitMQ and MongoDB-wire servers, isolated per test module and test.

Servers come from ``make services`` (or ``YOKE_AMQP_URL`` / ``YOKE_MONGODB_URL``). When neither
answers and a Docker engine does, ``rabbitmq:3.13-management`` and ``mongo:7`` are started with
testcontainers instead (a path for laptops with Docker). ``YOKE_TEST_RABBITMQ_IMAGE`` /
``YOKE_TEST_MONGODB_IMAGE`` name other images, and naming one takes that path even where local
servers answer (``make compose-check`` runs it so, on its stand-in images).
"""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import httpx
import pytest
from pymongo import AsyncMongoClient
from selenium.webdriver.remote.webdriver import WebDriver

from tests.support.broker import Management, fresh_vhost
from tests.support.browser import headless_chromium
from tests.support.fake_openai import FakeOpenAI
from tests.support.gateway_process import CLEAN_EXITS, running_gateway
from tests.support.jaeger import Jaeger, running_jaeger
from tests.support.mesh import JoinFactory, Launch, Mesh, running_mesh
from tests.support.unprivileged import stdio_servers_need_root
from tests.support.webhook_receiver import Receiver
from yoke.bus.broker import Bus
from yoke.client import Client
from yoke.runtime.joins import Join, create_agent, create_forum, join_conversation
from yoke.runtime.posting import Poster
from yoke.store.database import Store

DEFAULT_AMQP_URL = "amqp://guest:guest@127.0.0.1:5672/"
DEFAULT_MONGODB_URL = "mongodb://127.0.0.1:27017/yoke"

# Quorum queues cost disk syncs to create: the suite runs every service with two shards.
os.environ.setdefault("YOKE_SHARDS", "2")
# The test servers' interpreter may be one the unprivileged stdio user cannot run (this machine's
# lives in /root): then stdio MCP servers keep root, but for the tests that say otherwise.
if stdio_servers_need_root():
    os.environ.setdefault("YOKE_MCP_STDIO_USER", "root")


# The modules that take longest (make test's durations), started first when workers share the
# modules out (make test: pytest -n): a long one started last would leave the other workers idle
# at the end. Then the other end-to-end modules (marked slow), then the rest. Only the order
# changes, the same in every worker (xdist requires it).
LONGEST_MODULES = (
    "test_cluster.py",
    "test_turn_cost.py",
    "test_event_bus.py",
    "test_scale_out.py",
    "test_mesh.py",
    "test_bench.py",
    "test_egress_replicas.py",
    "test_agent_inference.py",
    "test_compaction_crash.py",
    "test_approvals_restart.py",
    "test_monitoring.py",
    "test_mcp_tools.py",
    "test_tls.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # By module, never by test: a module's tests stay together (its module fixtures, a mesh
    # among them, are made once) and in their order.
    rank: dict[Path, tuple[int, int]] = {}
    for item in items:
        name = item.path.name
        if name in LONGEST_MODULES:
            found = (0, LONGEST_MODULES.index(name))
        else:
            found = (1 if item.get_closest_marker("slow") else 2, 0)
        rank[item.path] = min(rank.get(item.path, found), found)
    items.sort(key=lambda item: rank[item.path])  # stable


def _answers(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1):
            return True
    except OSError:
        return False


def _docker_answers() -> bool:
    try:
        import docker  # type: ignore[import-untyped]

        docker.from_env().ping()
        return True
    except Exception:
        return False


@pytest.fixture(scope="session")
def servers() -> Iterator[tuple[str, str, str]]:
    """(AMQP URL, MongoDB URL, RabbitMQ management URL) of real servers."""
    amqp = os.environ.get("YOKE_AMQP_URL")
    mongo = os.environ.get("YOKE_MONGODB_URL")
    management = os.environ.get("YOKE_RABBITMQ_MANAGEMENT_URL")
    rabbitmq_image = os.environ.get("YOKE_TEST_RABBITMQ_IMAGE")
    mongodb_image = os.environ.get("YOKE_TEST_MONGODB_IMAGE")
    containers_asked = bool(rabbitmq_image or mongodb_image)
    local = _answers("127.0.0.1", 5672) and _answers("127.0.0.1", 27017)
    if amqp or mongo or (local and not containers_asked):
        amqp = amqp or DEFAULT_AMQP_URL
        host = urlsplit(amqp).hostname or "127.0.0.1"
        yield amqp, mongo or DEFAULT_MONGODB_URL, management or f"http://{host}:15672"
        return
    if not _docker_answers():
        pytest.exit(
            "no RabbitMQ on :5672 / MongoDB-wire server on :27017: run 'make services' "
            "(or 'docker compose up -d rabbitmq mongodb', or set YOKE_AMQP_URL/YOKE_MONGODB_URL)",
            returncode=2,
        )
    from testcontainers.mongodb import MongoDbContainer
    from testcontainers.rabbitmq import RabbitMqContainer

    with (
        RabbitMqContainer(rabbitmq_image or "rabbitmq:3.13-management").with_exposed_ports(
            15672
        ) as rabbit,
        MongoDbContainer(mongodb_image or "mongo:7") as mongodb,
    ):
        rabbit.exec(["rabbitmq-plugins", "enable", "rabbitmq_consistent_hash_exchange"])
        host = rabbit.get_container_host_ip()
        port = rabbit.get_exposed_port(5672)
        yield (
            f"amqp://guest:guest@{host}:{port}/",
            # The root user lives in admin: each test's database in the path must not become
            # the authentication database.
            mongodb.get_connection_url() + "/?authSource=admin",
            f"http://{host}:{rabbit.get_exposed_port(15672)}",
        )


@pytest.fixture(scope="session")
def mongodb_server_url(servers: tuple[str, str, str]) -> str:
    return servers[1]


@pytest.fixture(scope="module")
def amqp_url(servers: tuple[str, str, str]) -> Iterator[str]:
    """An AMQP URL on a fresh vhost of its own, removed after the test module."""
    base, _, management = servers
    with fresh_vhost(base, management, f"yoke-test-{uuid.uuid4().hex[:12]}") as url:
        yield url


@pytest.fixture(scope="module")
def management(servers: tuple[str, str, str], amqp_url: str) -> Management:
    """RabbitMQ's management API as the suite's user, scoped to the module's vhost."""
    return Management(servers[2], amqp_url)


async def _fresh_database(server_url: str) -> AsyncIterator[str]:
    parts = urlsplit(server_url)
    name = f"yoke_test_{uuid.uuid4().hex[:12]}"
    yield urlunsplit(parts._replace(path="/" + name))
    client: AsyncMongoClient[dict[str, object]] = AsyncMongoClient(server_url)
    try:
        await client.drop_database(name)
    finally:
        await client.close()


@pytest.fixture
async def mongodb_url(mongodb_server_url: str) -> AsyncIterator[str]:
    """A MongoDB URL naming a fresh database of its own, dropped after the test."""
    async for url in _fresh_database(mongodb_server_url):
        yield url


@pytest.fixture(scope="module")
async def module_mongodb_url(mongodb_server_url: str) -> AsyncIterator[str]:
    """A fresh database shared by one test module (services started once per module use it)."""
    async for url in _fresh_database(mongodb_server_url):
        yield url


# --- the mesh, for end-to-end test modules -------------------------------------------------


@pytest.fixture(scope="module")
def mesh_env() -> dict[str, str]:
    """Extra environment for the mesh's services; a test module may override it."""
    return {}


@pytest.fixture(scope="module")
def fake_openai() -> Iterator[FakeOpenAI]:
    """An OpenAI-compatible server of the module's own (``openai_env`` points the mesh at it)."""
    with FakeOpenAI() as server:
        yield server


@pytest.fixture(scope="module")
def mesh_launch() -> Launch:
    """Services the mesh starts another way (a test-support wrapper, extra environment); a
    test module may override it."""
    return {}


@pytest.fixture(scope="module")
def before_mesh() -> None:
    """What the services must find when they start (a tool in the catalog, records aged while
    the mesh was down): a test module overrides it with a fixture that requests those."""


@pytest.fixture(scope="module")
async def mesh(
    amqp_url: str,
    module_mongodb_url: str,
    mesh_env: dict[str, str],
    mesh_launch: Launch,
    before_mesh: None,
    tmp_path_factory: pytest.TempPathFactory,
) -> AsyncIterator[Mesh]:
    """The five services as real processes on the module's vhost and database."""
    log_dir = Path(tmp_path_factory.mktemp("mesh"))
    async with running_mesh(
        amqp_url, module_mongodb_url, log_dir, mesh_env, launch=mesh_launch
    ) as mesh:
        yield mesh


@pytest.fixture(scope="module")
async def store(module_mongodb_url: str) -> AsyncIterator[Store]:
    store = Store(module_mongodb_url)
    await store.ensure_indexes()
    yield store
    await store.close()


@pytest.fixture(scope="module")
async def poster(store: Store, amqp_url: str) -> AsyncIterator[Poster]:
    bus = Bus(amqp_url, name="test-bootstrap")
    await bus.connect()
    yield Poster(store, bus, "test")
    await bus.close()


@pytest.fixture(scope="module")
async def client(amqp_url: str, mesh: Mesh) -> AsyncIterator[Client]:
    async with Client(amqp_url) as client:
        yield client


@pytest.fixture
def new_join(store: Store, poster: Poster, mesh: Mesh) -> JoinFactory:
    async def make(
        forum_id: str | None = None, name: str = "echo", **options: object
    ) -> tuple[str, Join]:
        if forum_id is None:
            forum_id = (await create_forum(store, "test forum")).id
        agent = await create_agent(store, name)
        join = await join_conversation(store, poster, agent.id, forum_id, **options)  # type: ignore[arg-type]
        return forum_id, join

    return make


# --- the HTTP gateway beside the mesh -------------------------------------------------------


@pytest.fixture(scope="module")
def gateway_env() -> dict[str, str]:
    """Extra environment for the module's gateway; a test module may override it."""
    return {}


@pytest.fixture(scope="module")
def gateway_exits() -> tuple[int, ...]:
    """The exit codes the gateway's SIGTERM shutdown may end with; a test module may narrow
    them."""
    return CLEAN_EXITS


@pytest.fixture(scope="module")
async def gateway_url(
    amqp_url: str,
    module_mongodb_url: str,
    mesh: Mesh,
    gateway_env: dict[str, str],
    gateway_exits: tuple[int, ...],
    tmp_path_factory: pytest.TempPathFactory,
) -> AsyncIterator[str]:
    """A gateway process on the module's mesh; it must stop cleanly after the module."""
    log_dir = Path(tmp_path_factory.mktemp("gateway"))
    async with running_gateway(
        amqp_url, module_mongodb_url, log_dir, exits=gateway_exits, **gateway_env
    ) as url:
        yield url


@pytest.fixture(scope="module")
async def http(gateway_url: str) -> AsyncIterator[httpx.AsyncClient]:
    """A client of the module's gateway; each request brings its own token."""
    async with httpx.AsyncClient(base_url=gateway_url, timeout=30) as client:
        yield client


@pytest.fixture(scope="module")
def browser() -> Iterator[WebDriver]:
    """Headless Chromium for the module (tests/support/browser.py); a test requests it after
    ``gateway_url`` so that it closes before the gateway stops."""
    with headless_chromium() as driver:
        yield driver


@pytest.fixture(scope="module")
async def receiver() -> AsyncIterator[Receiver]:
    """A webhook receiver on a free local port (tests/support/webhook_receiver.py)."""
    server = Receiver()
    await server.start()
    yield server
    await server.close()


@pytest.fixture(scope="module")
async def jaeger(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Jaeger]:
    """A Jaeger of the module's own on free ports (tests/support/jaeger.py): point the mesh at
    it with ``mesh_env`` returning ``jaeger.env()``; read traces with ``await jaeger.trace(id)``."""
    async with running_jaeger(Path(tmp_path_factory.mktemp("jaeger"))) as server:
        yield server

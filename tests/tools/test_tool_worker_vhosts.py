"""Two meshes on one broker, a vhost each, each with a worker tool of the same name.

RabbitMQ's users are the broker's, not a vhost's: ``yoke tools add-worker`` names the user after
the mesh's vhost too (``tool-VHOST.NAME``; ``tool-NAME`` on the default vhost), so the second
mesh's registration is not refused, and each mesh's door takes an answer only from its own
worker user. Each mesh here is the door and the processor (ingestion, processor: all a worker
call needs) on a vhost and database of its own, with a pika worker (tests/support/pika_worker.py)
connected as the user ``add-worker`` named on the line before the password.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import pytest
from pymongo import AsyncMongoClient

from tests.support.broker import fresh_vhost
from tests.support.cli import run_yoke
from tests.support.mesh import Mesh, say
from tests.support.processes import eventually
from tests.support.worker_process import WorkerProcess, as_user
from yoke.bus import topology
from yoke.bus.amqp_nodes import amqp_vhost
from yoke.bus.broker import Bus
from yoke.cli.publishers import delete_user, management_of
from yoke.client import Client
from yoke.core.models import ToolResultPart
from yoke.llm.base import ScriptedCall, ScriptedOutput
from yoke.runtime.joins import create_agent, create_forum, join_conversation
from yoke.runtime.posting import Poster
from yoke.store.database import Store

pytestmark = pytest.mark.slow

TOOL = f"w{uuid.uuid4().hex[:10]}"  # one name, registered in both meshes
SCHEMA = {"type": "object", "properties": {"text": {"type": "string"}}}


@dataclass
class VhostMesh:
    vhost: str
    url: str
    store: Store
    poster: Poster
    client: Client
    user: str  # the worker's, as add-worker printed it
    worker: WorkerProcess


@asynccontextmanager
async def mesh_on_vhost(
    servers: tuple[str, str, str], log_dir: Path, schema: Path
) -> AsyncIterator[VhostMesh]:
    """A vhost and a database, TOOL registered there, the door and the processor running, and a
    worker of TOOL answering as the user add-worker made."""
    vhost = f"yoke-test-{uuid.uuid4().hex[:12]}"
    name = f"yoke_test_{uuid.uuid4().hex[:12]}"
    database = urlunsplit(urlsplit(servers[1])._replace(path="/" + name))
    async with AsyncExitStack() as stack:
        url = stack.enter_context(fresh_vhost(servers[0], servers[2], vhost))
        mesh = Mesh(url, database, log_dir)
        env = {**mesh.env, "YOKE_MANAGEMENT_URL": servers[2]}
        code, out, err = await run_yoke(
            env, "tools", "add-worker", TOOL, "--schema", str(schema), "--description", "a tool",
            timeout=240,
        )  # fmt: skip
        assert code == 0, err
        *_, user_line, password = out.splitlines()
        user = user_line.split("user ", 1)[1].split(" ", 1)[0]
        stack.push_async_callback(delete_user, management_of(url, servers[2]), user)

        store = Store(database)
        stack.push_async_callback(store.close)

        async def drop_database() -> None:
            client: AsyncMongoClient[dict[str, object]] = AsyncMongoClient(servers[1])
            await client.drop_database(name)
            await client.close()

        stack.push_async_callback(drop_database)
        stack.callback(mesh.stop_all)
        for service in ("ingestion", "processor"):
            mesh.start(service)
        for process in mesh.processes.values():
            await process.wait_healthy()
        bus = Bus(url, name="test-bootstrap")
        await bus.connect()
        stack.push_async_callback(bus.close)
        client = await stack.enter_async_context(Client(url))
        worker = await WorkerProcess.start(
            as_user(url, user, password), TOOL, "answer", "--marker", f"served in {vhost}"
        )
        stack.push_async_callback(worker.stop)
        yield VhostMesh(vhost, url, store, Poster(store, bus, "test"), client, user, worker)


@pytest.fixture(scope="module")
async def meshes(
    servers: tuple[str, str, str], tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[tuple[VhostMesh, VhostMesh]]:
    schema = tmp_path_factory.mktemp("tools") / "schema.json"
    schema.write_text(json.dumps(SCHEMA))
    async with (
        mesh_on_vhost(servers, tmp_path_factory.mktemp("first"), schema) as first,
        mesh_on_vhost(servers, tmp_path_factory.mktemp("second"), schema) as second,
    ):
        yield first, second


async def answer_in(mesh: VhostMesh) -> ToolResultPart:
    """An agent of ``mesh`` calls TOOL; the result its worker gave."""
    forum = await create_forum(mesh.store, "two meshes")
    agent = await create_agent(mesh.store, "caller")
    script = [
        ScriptedOutput(tool_calls=[ScriptedCall(name=TOOL, input={"text": "hi"})]),
        ScriptedOutput(text="done"),
    ]
    join = await join_conversation(
        mesh.store, mesh.poster, agent.id, forum.id, model="fixture-script", tools=[TOOL],
        script=script,
    )  # fmt: skip
    await say(mesh.client, forum.id, "call it")
    found: list[ToolResultPart] = []

    async def answered() -> bool:
        found[:] = [
            part
            for line in await mesh.store.history(join.monologue_id)
            for part in line.parts
            if isinstance(part, ToolResultPart)
        ]
        return bool(found)

    await eventually(answered, timeout=90, what=f"the result of {TOOL} in {mesh.vhost}")
    return found[0]


async def test_each_mesh_has_its_own_worker_user_and_its_worker_answers_its_calls(
    meshes: tuple[VhostMesh, VhostMesh],
) -> None:
    first, second = meshes
    for mesh in meshes:
        assert mesh.user == topology.tool_user(TOOL, amqp_vhost(mesh.url))
        assert mesh.user == f"tool-{mesh.vhost}.{TOOL}"
    for mesh in meshes:
        result = await answer_in(mesh)
        assert not result.is_error, result.output
        assert f"served in {mesh.vhost}" in result.output
    # Each door maps users to tools exactly: its own worker user, and no other mesh's.
    for mesh, other in ((first, second), (second, first)):
        vhost = amqp_vhost(mesh.url)
        assert topology.tool_of_user(mesh.user, vhost) == TOOL
        assert topology.tool_of_user(other.user, vhost) is None
        assert topology.tool_of_user(f"tool-{TOOL}", vhost) == TOOL  # made before names had it


@pytest.mark.parametrize(
    ("user", "vhost", "tool"),
    [
        ("tool-search", "/", "search"),
        ("tool-prod.search", "/", None),  # another vhost's
        ("tool-prod.search", "prod", "search"),
        ("tool-search", "prod", "search"),  # made on prod before names carried the vhost
        ("tool-staging.search", "prod", None),
        ("tool-a.b.search", "a.b", "search"),
        ("tool-a.b.search", "a", None),
        ("tool-prod.", "prod", None),
        ("publisher", "prod", None),
    ],
)
def test_a_tool_user_maps_to_exactly_one_tool(user: str, vhost: str, tool: str | None) -> None:
    assert topology.tool_of_user(user, vhost) == tool
    if tool is not None and "." in user:
        assert topology.tool_user(tool, vhost) == user

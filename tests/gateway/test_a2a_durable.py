"""An A2A task survives ``kill -9`` of every service and of the gateway
(docs/agents-as-tools.md, "Durable").

A task is sent to a slow agent, with a push config; then the five services and the gateway
are killed with SIGKILL mid-turn and started again (a new gateway process, on another port).
The new gateway, which never ran the task, resubscribes to it from the mesh, answers
``tasks/get`` with it completed with the reply (answered once), and its webhook worker pushes
the end, signed.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from a2a.client import A2ACardResolver, ClientConfig, ClientFactory
from a2a.types.a2a_pb2 import (
    GetTaskRequest,
    Message,
    Part,
    Role,
    SendMessageConfiguration,
    SendMessageRequest,
    SubscribeToTaskRequest,
    Task,
    TaskPushNotificationConfig,
    TaskState,
)

from services.gateway.calling import kept_forum_id
from tests.support.gateway_process import assert_stopped_cleanly, start_gateway
from tests.support.mesh import START_SECONDS, Mesh
from tests.support.processes import ServiceProcess, eventually
from tests.support.webhook_receiver import Receiver
from yoke.runtime.joins import create_agent
from yoke.store.database import Store
from yoke.store.publishing import publish_agent
from yoke.store.tokens import create_token, ensure_token_indexes
from yoke.store.webhooks import signature_matches

pytestmark = pytest.mark.slow

# Slow enough that the kill lands mid-turn, and that the turn redone after the restart is still
# running when the new gateway (up before the services) subscribes; short enough for a test.
SLOW_MODEL = "fixture-slow-8"
GATEWAY_ENV = {
    "YOKE_WEBHOOK_BACKOFF_SECONDS": "0.2",
    "YOKE_WEBHOOK_BACKOFF_CAP_SECONDS": "1",
    "YOKE_WEBHOOK_LEASE_SECONDS": "2",
    # The receiver listens on loopback: a push reaches it only when the operator allows it.
    "YOKE_PUSH_ALLOWED_HOSTS": "127.0.0.1",
}
TIMEOUT = httpx.Timeout(30.0, read=120.0)


class Gateways:
    """This module's gateway processes: one at a time, the test kills it and starts another."""

    def __init__(self, amqp_url: str, mongodb_url: str, log_dir: Path) -> None:
        self.amqp_url, self.mongodb_url, self.log_dir = amqp_url, mongodb_url, log_dir
        self.process: ServiceProcess | None = None
        self.url = ""

    async def start(self) -> str:
        self.process, self.url = start_gateway(
            self.amqp_url, self.mongodb_url, self.log_dir, **GATEWAY_ENV
        )
        await self.process.wait_healthy(START_SECONDS)
        return self.url

    def kill(self) -> None:
        assert self.process is not None
        self.process.kill()
        self.process = None


@pytest.fixture(scope="module")
async def gateways(
    amqp_url: str, module_mongodb_url: str, mesh: Mesh, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Gateways]:
    found = Gateways(amqp_url, module_mongodb_url, Path(tmp_path_factory.mktemp("gateway")))
    await found.start()
    try:
        yield found
    finally:
        process = found.process
        code = process.stop() if process is not None else None
    if process is not None and code is not None:
        assert_stopped_cleanly(process, code)


def kill_every_service(mesh: Mesh) -> None:
    for process in mesh.processes.values():
        process.kill()


async def start_every_service(mesh: Mesh) -> None:
    for name in list(mesh.processes):
        mesh.start(name)
    for process in mesh.processes.values():
        await process.wait_healthy(START_SECONDS)


async def test_a_task_survives_kill_9_of_every_service_and_the_gateway(
    store: Store, mesh: Mesh, gateways: Gateways, receiver: Receiver
) -> None:
    await ensure_token_indexes(store)
    agent = await create_agent(store, f"slow-{uuid.uuid4().hex[:6]}", model=SLOW_MODEL)
    published = await publish_agent(store, f"durable-{uuid.uuid4().hex[:6]}", agent.id)
    token, secret = await create_token(store, "durable", can_call=[published.id])
    headers = {"Authorization": f"Bearer {secret}"}
    path, push_secret = "/durable", "push-secret-" + uuid.uuid4().hex
    said = "will you still answer after all of this?"

    async with httpx.AsyncClient(headers=headers, timeout=TIMEOUT) as http:
        url = f"{gateways.url}/a2a/{published.id}"
        card = await A2ACardResolver(http, url).get_agent_card()
        client = ClientFactory(ClientConfig(streaming=False, httpx_client=http)).create(card)
        send = SendMessageRequest(
            message=Message(
                role=Role.ROLE_USER,
                message_id=uuid.uuid4().hex,
                context_id="survivor",
                parts=[Part(text=said)],
            ),
            configuration=SendMessageConfiguration(
                return_immediately=True,
                task_push_notification_config=TaskPushNotificationConfig(
                    url=receiver.url(path), token=push_secret
                ),
            ),
        )
        [response] = [r async for r in client.send_message(send)]
        task = response.task
        assert task.status.state == TaskState.TASK_STATE_WORKING, task

    # Mid-turn: every service and the gateway, SIGKILL; then all of them again.
    kill_every_service(mesh)
    gateways.kill()
    restarting = asyncio.create_task(start_every_service(mesh))
    new_url = await gateways.start()
    assert new_url != url.rsplit("/a2a/", 1)[0]

    async with httpx.AsyncClient(headers=headers, timeout=TIMEOUT) as http:
        url = f"{new_url}/a2a/{published.id}"
        card = await A2ACardResolver(http, url).get_agent_card()
        streaming = ClientFactory(ClientConfig(streaming=True, httpx_client=http)).create(card)
        client = ClientFactory(ClientConfig(streaming=False, httpx_client=http)).create(card)
        # The new gateway never ran the task: it follows it from the mesh (the services are
        # still starting, the turn is to be redone: it is working).
        events = [e async for e in streaming.subscribe(SubscribeToTaskRequest(id=task.id))]
        assert events[0].HasField("task") and events[0].task.id == task.id
        assert events[0].task.status.state == TaskState.TASK_STATE_WORKING
        last = events[-1]
        assert last.HasField("status_update"), events
        assert last.status_update.status.state == TaskState.TASK_STATE_COMPLETED, events
        assert "".join(p.text for p in last.status_update.status.message.parts) == said
        await restarting

        got: Task | None = None

        async def completed() -> bool:
            nonlocal got
            got = await client.get_task(GetTaskRequest(id=task.id))
            return got.status.state == TaskState.TASK_STATE_COMPLETED

        await eventually(completed, timeout=90, what="the task completed after the restarts")
        assert got is not None
        assert "".join(part.text for part in got.status.message.parts) == said
        assert "".join(p.text for a in got.artifacts for p in a.parts) == said

    # Answered once: one reply in the forum, whatever was redone after the kill.
    forum_id = kept_forum_id(token, "a2a", published, "survivor")
    lines = await store.history(forum_id, after_seq=0, up_to_seq=await store.last_seq(forum_id))
    assert [(line.role, line.type) for line in lines] == [
        ("user", "message"),
        ("agent", "message"),
    ], [(line.role, line.type, line.text) for line in lines]

    # The end is pushed by the new gateway's webhook worker, signed with the config's token.
    async def pushed() -> bool:
        return bool(receiver.delivered(path))

    await eventually(pushed, timeout=60, what="the end pushed")
    await asyncio.sleep(1.0)
    ends = {r.delivery_id: r for r in receiver.delivered(path)}
    [end] = ends.values()
    assert signature_matches(
        push_secret, end.body, end.headers["x-yoke-signature"], end.headers["x-yoke-timestamp"]
    )
    update = end.json["statusUpdate"]
    assert update["taskId"] == task.id and update["status"]["state"] == "TASK_STATE_COMPLETED"

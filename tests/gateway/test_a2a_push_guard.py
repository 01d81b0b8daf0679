"""A2A push notifications hold against their caller (docs/agents-as-tools.md, "Push
notifications"): the mesh and the gateway as real processes, a2a-sdk's own client.

A push URL is the caller's word: one that resolves into the operator's network (loopback,
private, link-local, unique-local, multicast, unspecified, reserved, cloud metadata) is refused
when it is set, and again when the gateway connects (a config stored before the rule, or a name
that resolves elsewhere by now), unless ``YOKE_PUSH_ALLOWED_HOSTS`` lets that host through
(here 127.0.0.2, where the allowed receiver listens; the usual receiver on 127.0.0.1 stands for
the operator's own services). A config is kept only with an accepted line, at most
``YOKE_A2A_PUSH_CONFIGS_PER_TOKEN`` per token, and goes with its task. A config's
``authentication`` is sent, beside the mesh's signature.
"""

from __future__ import annotations

import socket
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
import pytest
from a2a.client import A2ACardResolver, Client, ClientConfig, ClientFactory
from a2a.types.a2a_pb2 import (
    AuthenticationInfo,
    GetTaskPushNotificationConfigRequest,
    GetTaskRequest,
    Message,
    Part,
    Role,
    SendMessageConfiguration,
    SendMessageRequest,
    Task,
    TaskPushNotificationConfig,
    TaskState,
)
from a2a.utils.errors import InvalidParamsError

from services.gateway.a2a.push import CONFIGS, PushConfig, subscription_id
from services.gateway.a2a.task_store import COLLECTION, TaskRecord
from tests.support.processes import eventually
from tests.support.published import Agents, Caller
from tests.support.webhook_receiver import Receiver
from yoke.store.database import Store
from yoke.store.publishing import PublishedAgent
from yoke.store.webhooks import CURSORS, DEAD_LETTERS, Cursor, signature_matches

pytestmark = pytest.mark.slow

ALLOWED_HOST = "127.0.0.2"
LINES_PER_MINUTE = 2
TASKS_PER_TOKEN = 2
CONFIGS_PER_TOKEN = 3
GATEWAY_ENV = {
    "YOKE_WEBHOOK_BACKOFF_SECONDS": "0.2",
    "YOKE_WEBHOOK_BACKOFF_CAP_SECONDS": "1",
    "YOKE_PUSH_ALLOWED_HOSTS": ALLOWED_HOST,
    "YOKE_A2A_TASKS_PER_TOKEN": str(TASKS_PER_TOKEN),
    "YOKE_A2A_PUSH_CONFIGS_PER_TOKEN": str(CONFIGS_PER_TOKEN),
}
TIMEOUT = httpx.Timeout(30.0, read=120.0)


@pytest.fixture(scope="module")
def mesh_env() -> dict[str, str]:
    return {"YOKE_TOKEN_LINES_PER_MINUTE": str(LINES_PER_MINUTE)}


@pytest.fixture(scope="module")
def gateway_env() -> dict[str, str]:
    return GATEWAY_ENV


@pytest.fixture(scope="module")
async def allowed() -> AsyncIterator[Receiver]:
    """A receiver on the host the operator let through."""
    server = Receiver(ALLOWED_HOST)
    await server.start()
    yield server
    await server.close()


@asynccontextmanager
async def a2a_client(
    agents: Agents, agent: PublishedAgent, caller: Caller
) -> AsyncIterator[Client]:
    async with httpx.AsyncClient(headers=caller.headers, timeout=TIMEOUT) as http:
        card = await A2ACardResolver(http, agents.url(agent)).get_agent_card()
        client = ClientFactory(ClientConfig(streaming=False, httpx_client=http)).create(card)
        try:
            yield client
        finally:
            await client.close()


def request(
    text: str, *, push: TaskPushNotificationConfig | None = None, now: bool = True
) -> SendMessageRequest:
    message = Message(role=Role.ROLE_USER, message_id=uuid.uuid4().hex, parts=[Part(text=text)])
    configuration = SendMessageConfiguration(return_immediately=now)
    if push is not None:
        configuration.task_push_notification_config.CopyFrom(push)
    return SendMessageRequest(message=message, configuration=configuration)


async def sent(client: Client, send: SendMessageRequest) -> Task:
    responses = [response async for response in client.send_message(send)]
    assert len(responses) == 1 and responses[0].HasField("task"), responses
    return responses[0].task


async def completed(client: Client, task_id: str) -> None:
    async def ended() -> bool:
        task = await client.get_task(GetTaskRequest(id=task_id))
        return task.status.state == TaskState.TASK_STATE_COMPLETED

    await eventually(ended, timeout=60, what=f"task {task_id} completed")


def inside_addresses(port: int) -> list[tuple[str, str]]:
    """URLs into the operator's network, each with a word its refusal names."""
    urls = [
        (f"http://127.0.0.1:{port}/api/users", "loopback"),
        ("http://169.254.169.254/latest/meta-data/", "metadata"),
        ("http://[::1]:9101/metrics", "loopback"),
        ("http://[::ffff:127.0.0.1]:9101/metrics", "loopback"),
        ("http://[::ffff:a9fe:a9fe]/latest/meta-data/", "metadata"),
        ("http://100.100.100.200/latest/meta-data/", "metadata"),
        ("http://10.1.2.3/hook", "private"),
        ("http://192.168.0.10/hook", "private"),
        ("http://[fd00::1]/hook", "unique-local"),
        ("http://[fe80::1]/hook", "link-local"),
        ("http://[fec0::a9fe:a9fe]:8080/", "site-local"),
        ("http://0.0.0.0:8080/hook", "unspecified"),
        ("http://224.0.0.1/hook", "multicast"),
        ("http://240.0.0.1/hook", "reserved"),
        (f"http://localhost:{port}/api/", "loopback"),
        ("http://no-such-host.invalid/hook", "does not resolve"),
    ]
    # This machine's own name: a single-label host resolving inside (as a compose service's).
    name = socket.gethostname()
    if "." not in name:
        urls.append((f"http://{name}:15672/api/overview", "address"))
    return urls


async def test_push_urls_into_the_operators_network_are_refused_when_set(
    agents: Agents, store: Store, receiver: Receiver, allowed: Receiver
) -> None:
    echo = await agents.publish()
    caller = await agents.caller(echo.id)
    async with a2a_client(agents, echo, caller) as client:
        task = await sent(client, request("hold on"))
        for url, named in inside_addresses(receiver.port):
            with pytest.raises(InvalidParamsError) as refused:
                await client.create_task_push_notification_config(
                    TaskPushNotificationConfig(task_id=task.id, url=url)
                )
            assert named in str(refused.value), (url, str(refused.value))
        # With the send: refused before any line is posted.
        with pytest.raises(InvalidParamsError, match="loopback"):
            await sent(
                client,
                request(
                    "not a line",
                    push=TaskPushNotificationConfig(url=receiver.url("/with-the-send")),
                ),
            )
        # The host the operator let through is taken.
        config = await client.create_task_push_notification_config(
            TaskPushNotificationConfig(task_id=task.id, url=allowed.url("/fine"))
        )
        assert config.url == allowed.url("/fine")
    kept = await store.db[CONFIGS].find({"owner": caller.token.namespace}).to_list()
    assert [document["url"] for document in kept] == [allowed.url("/fine")]
    assert not receiver.requests


async def test_a_push_to_an_allowed_host_carries_the_callers_authentication(
    agents: Agents, store: Store, allowed: Receiver
) -> None:
    slow = await agents.publish(model="fixture-slow-1")
    caller = await agents.caller(slow.id)
    path = f"/auth/{uuid.uuid4().hex[:8]}"
    secret = "receiver-secret-" + uuid.uuid4().hex
    credentials = "receivers-own-bearer-" + uuid.uuid4().hex
    async with a2a_client(agents, slow, caller) as client:
        task = await sent(client, request("push me, with my credentials"))
        config = await client.create_task_push_notification_config(
            TaskPushNotificationConfig(
                task_id=task.id,
                url=allowed.url(path),
                token=secret,
                authentication=AuthenticationInfo(scheme="Bearer", credentials=credentials),
            )
        )
        # The credentials are the caller's secret for its receiver: not shown back.
        assert config.authentication.scheme == "Bearer"
        assert not config.authentication.credentials
        got = await client.get_task_push_notification_config(
            GetTaskPushNotificationConfigRequest(task_id=task.id, id=config.id)
        )
        assert got.authentication.scheme == "Bearer" and not got.authentication.credentials
        await completed(client, task.id)

        async def pushed() -> bool:
            return bool(allowed.delivered(path))

        await eventually(pushed, timeout=60, what="the push")
    [push] = allowed.at(path)
    assert push.headers["authorization"] == f"Bearer {credentials}"
    assert signature_matches(
        secret, push.body, push.headers["x-yoke-signature"], push.headers["x-yoke-timestamp"]
    )
    assert push.json["statusUpdate"]["status"]["state"] == "TASK_STATE_COMPLETED"
    # Sent as the receiver's header, as the caller gave it; the host header is the URL's.
    assert push.headers["host"] == f"{ALLOWED_HOST}:{allowed.port}"


async def test_a_forbidden_address_is_refused_when_the_gateway_connects(
    agents: Agents, store: Store, receiver: Receiver
) -> None:
    """A config stored before the rule (or whose name resolves inside by now): nothing is
    sent, and the push is dead-lettered at once, not retried."""
    slow = await agents.publish(model="fixture-slow-2")
    caller = await agents.caller(slow.id)
    path = f"/inside/{uuid.uuid4().hex[:8]}"
    async with a2a_client(agents, slow, caller) as client:
        task = await sent(client, request("push me inside"))
        record: TaskRecord | None = None

        async def recorded() -> bool:
            nonlocal record
            found = await store.db[COLLECTION].find_one({"_id": task.id})
            record = TaskRecord.from_document(found) if found else None
            return record is not None and record.line_id is not None

        await eventually(recorded, timeout=30, what="the task's record")
        assert record is not None and record.line_id is not None
        line = await store.get_message(record.line_id)
        assert line is not None
        push_id = subscription_id(task.id, "stored-before")
        cursor = Cursor(id=push_id, forum_id=line.conversation_id, seq=line.seq)
        await store.db[CURSORS].insert_one(cursor.to_document())
        stored = PushConfig(
            id=push_id,
            task_id=task.id,
            config_id="stored-before",
            owner=caller.token.namespace or caller.token.id,
            url=receiver.url(path),
            secret="whsec_" + uuid.uuid4().hex,
            forum_id=line.conversation_id,
            live=True,
        )
        await store.db[CONFIGS].insert_one(stored.to_document())
        await completed(client, task.id)

    async def settled() -> bool:
        letter = await store.db[DEAD_LETTERS].find_one({"subscriptionId": push_id})
        return letter is not None or bool(receiver.at(path))

    await eventually(settled, timeout=60, what="the push refused or sent")
    assert not receiver.at(path), "the gateway POSTed to a loopback address"
    letter = await store.db[DEAD_LETTERS].find_one({"subscriptionId": push_id})
    assert letter is not None and "loopback" in letter["reason"], letter
    assert letter["attempts"] == 1


async def test_a_send_refused_by_the_line_limit_keeps_no_push_config(
    agents: Agents, store: Store, allowed: Receiver
) -> None:
    echo = await agents.publish()
    caller = await agents.caller(echo.id)
    tasks = []
    async with a2a_client(agents, echo, caller) as client:
        for number in range(LINES_PER_MINUTE + 1):
            push = TaskPushNotificationConfig(url=allowed.url(f"/limit/{number}"))
            tasks.append(await sent(client, request(f"line {number}", push=push)))
    *accepted, refused = tasks
    assert refused.status.state == TaskState.TASK_STATE_REJECTED, refused
    assert all(task.status.state != TaskState.TASK_STATE_REJECTED for task in accepted)
    assert await store.db[CONFIGS].find_one({"taskId": refused.id}) is None
    for task in accepted[1:]:  # the first went with the trim (below); the others kept theirs
        assert await store.db[CONFIGS].find_one({"taskId": task.id}) is not None


async def test_a_tokens_push_configs_are_bounded(agents: Agents, allowed: Receiver) -> None:
    echo = await agents.publish(model="fixture-slow-1")
    caller = await agents.caller(echo.id)
    async with a2a_client(agents, echo, caller) as client:
        first = await sent(client, request("one"))
        second = await sent(client, request("two"))
        # Spread over its tasks (each holds fewer than YOKE_A2A_PUSH_CONFIGS_PER_TASK).
        for number, task in enumerate((first, second, first)):
            await client.create_task_push_notification_config(
                TaskPushNotificationConfig(
                    task_id=task.id, id=f"c{number}", url=allowed.url(f"/cap/{number}")
                )
            )
        with pytest.raises(InvalidParamsError, match=f"at most {CONFIGS_PER_TOKEN}"):
            await client.create_task_push_notification_config(
                TaskPushNotificationConfig(
                    task_id=second.id, id="one-too-many", url=allowed.url("/cap/x")
                )
            )
        # Set again under its id, a config is replaced, not another.
        await client.create_task_push_notification_config(
            TaskPushNotificationConfig(task_id=first.id, id="c0", url=allowed.url("/cap/again"))
        )


async def test_a_tasks_push_configs_go_with_it_when_the_tokens_cap_trims_it(
    agents: Agents, store: Store, allowed: Receiver
) -> None:
    echo = await agents.publish()
    caller = await agents.caller(echo.id)
    tasks = []
    async with a2a_client(agents, echo, caller) as client:
        for number in range(TASKS_PER_TOKEN + 1):  # the last is rejected, and trims the first
            push = TaskPushNotificationConfig(url=allowed.url(f"/trim/{number}"))
            tasks.append(await sent(client, request(f"trim {number}", push=push)))
    oldest = tasks[0]

    async def trimmed() -> bool:
        return await store.db[COLLECTION].find_one({"_id": oldest.id}) is None

    await eventually(trimmed, timeout=30, what="the oldest task trimmed")
    assert await store.db[CONFIGS].find_one({"taskId": oldest.id}) is None
    assert await store.db[CURSORS].find_one({"_id": subscription_id(oldest.id, oldest.id)}) is None

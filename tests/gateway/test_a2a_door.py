"""The gateway's A2A door (services/gateway/a2a) end to end, with a2a-sdk's own client: the mesh
and the gateway as real processes, agents answering with fixture models or the fake OpenAI
server.

A published agent has a card behind the token; a sent message is the caller's line in the forum
kept for its contextId and its task that line's turn (completed with the reply, streamed as
deltas and status changes, canceled by a /stop, waiting for an approver); a context goes on
over several messages; a second message to a working task is another line; push notifications
come through the webhook machinery, signed; another token's task does not exist for it; hostile
JSON-RPC gets the protocol's errors, never a 500.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import pytest
from a2a.client import A2ACardResolver, Client, ClientConfig, ClientFactory
from a2a.types.a2a_pb2 import (
    AgentCard,
    CancelTaskRequest,
    GetTaskRequest,
    ListTasksRequest,
    Message,
    Part,
    Role,
    SendMessageConfiguration,
    SendMessageRequest,
    StreamResponse,
    SubscribeToTaskRequest,
    Task,
    TaskPushNotificationConfig,
    TaskState,
)
from a2a.utils.errors import TaskNotCancelableError, TaskNotFoundError

from services.gateway.a2a.push import CONFIGS
from services.gateway.a2a.task_store import COLLECTION, TaskRecord
from services.gateway.calling import caller_id, kept_forum_id
from tests.support.fake_openai import FakeOpenAI, completion, openai_env, streamed
from tests.support.gateway_process import metric
from tests.support.mesh import Mesh
from tests.support.processes import eventually
from tests.support.published import Agents, Caller
from tests.support.store_operations import breakdown, http_turn, settled_operations, total
from tests.support.webhook_receiver import Receiver
from yoke.runtime.joins import create_agent, create_forum, join_conversation
from yoke.runtime.posting import Poster
from yoke.store.database import Store
from yoke.store.publishing import PublishedAgent, publish_agent
from yoke.store.tokens import create_token
from yoke.store.webhooks import signature_matches

pytestmark = pytest.mark.slow

# Lines a token may send a minute: more than any test but the one that passes it sends.
LINES_PER_MINUTE = 8
# Quick retries of a push; leases as by default (the worker looks at its subscriptions every
# 2 s: the store's counts settle between two looks). The receiver listens on loopback, which a
# push may reach only when the operator lets it through.
GATEWAY_ENV = {
    "YOKE_WEBHOOK_BACKOFF_SECONDS": "0.2",
    "YOKE_WEBHOOK_BACKOFF_CAP_SECONDS": "1",
    "YOKE_PUSH_ALLOWED_HOSTS": "127.0.0.1",
}
TIMEOUT = httpx.Timeout(30.0, read=120.0)


@pytest.fixture(scope="module")
def mesh_env(fake_openai: FakeOpenAI) -> dict[str, str]:
    return {
        **openai_env(fake_openai.base_url, give_up_seconds=10),
        "YOKE_TOKEN_LINES_PER_MINUTE": str(LINES_PER_MINUTE),
    }


@pytest.fixture(scope="module")
def gateway_env() -> dict[str, str]:
    return GATEWAY_ENV


@pytest.fixture(scope="module")
def gateway_exits() -> tuple[int, ...]:
    return (0,)


@asynccontextmanager
async def a2a_client(
    agents: Agents, agent: PublishedAgent, caller: Caller, *, streaming: bool = False
) -> AsyncIterator[tuple[Client, AgentCard]]:
    """a2a-sdk's client for ``agent``, made from its card (fetched with the caller's token)."""
    async with httpx.AsyncClient(headers=caller.headers, timeout=TIMEOUT) as http:
        card = await A2ACardResolver(http, agents.url(agent)).get_agent_card()
        factory = ClientFactory(ClientConfig(streaming=streaming, httpx_client=http))
        client = factory.create(card)
        try:
            yield client, card
        finally:
            await client.close()


def user_message(text: str, context_id: str = "", task_id: str = "") -> Message:
    return Message(
        role=Role.ROLE_USER,
        message_id=uuid.uuid4().hex,
        context_id=context_id,
        task_id=task_id,
        parts=[Part(text=text)],
    )


def request(
    text: str, context_id: str = "", *, task_id: str = "", now: bool = False
) -> SendMessageRequest:
    return SendMessageRequest(
        message=user_message(text, context_id, task_id),
        configuration=SendMessageConfiguration(return_immediately=now),
    )


async def sent(client: Client, send: SendMessageRequest) -> Task:
    """The task a (non-streaming) send answers."""
    responses = [response async for response in client.send_message(send)]
    assert len(responses) == 1 and responses[0].HasField("task"), responses
    return responses[0].task


def reply_of(task: Task) -> str:
    return "\n".join(part.text for part in task.status.message.parts)


def artifact_text(task: Task) -> str:
    return "".join(part.text for artifact in task.artifacts for part in artifact.parts)


async def tasks_counted(gateway_url: str, state: str) -> float:
    return await metric(gateway_url, "yoke_a2a_tasks_total", state=state)


async def task_state(
    client: Client, task_id: str, wanted: TaskState.ValueType, timeout: float = 60
) -> Task:
    found: Task | None = None

    async def reached() -> bool:
        nonlocal found
        found = await client.get_task(GetTaskRequest(id=task_id))
        return found.status.state == wanted

    await eventually(reached, timeout=timeout, what=f"task {task_id} {TaskState.Name(wanted)}")
    assert found is not None
    return found


# --- the card -----------------------------------------------------------------------------


async def test_the_card_describes_the_agent_to_a_token_that_may_call_it(
    agents: Agents, store: Store, gateway_url: str
) -> None:
    agent = await agents.publish(description="Answers questions about the weather.")
    caller = await agents.caller(agent.id)
    card_url = f"{agents.url(agent)}/.well-known/agent-card.json"
    async with (
        httpx.AsyncClient(timeout=TIMEOUT) as http,
        httpx.AsyncClient(headers=caller.headers, timeout=TIMEOUT) as authorized,
    ):
        card = await A2ACardResolver(authorized, agents.url(agent)).get_agent_card()
        assert card.name == agent.id
        assert card.description == "Answers questions about the weather."
        [skill] = card.skills
        assert skill.description == "Answers questions about the weather."
        assert card.capabilities.streaming and card.capabilities.push_notifications
        scheme = card.security_schemes["bearer"].http_auth_security_scheme
        assert scheme.scheme.lower() == "bearer"
        assert {i.url for i in card.supported_interfaces} == {agents.url(agent)}
        assert {i.protocol_version for i in card.supported_interfaces} == {"1.0", "0.3"}

        # Without a token: 401 naming the scheme; a token that may not call it, or a name
        # never published: not found, alike.
        anonymous = await http.get(card_url)
        assert anonymous.status_code == 401
        assert anonymous.headers["www-authenticate"] == "Bearer"
        stranger = await agents.caller()
        for url, headers in (
            (card_url, stranger.headers),
            (f"{gateway_url}/a2a/never-published/.well-known/agent-card.json", caller.headers),
        ):
            refused = await http.get(url, headers=headers)
            assert refused.status_code == 404, refused.text
            assert "for this token" in refused.json()["error"]

        # Published again with other words: the card says them at once (no restart).
        await publish_agent(store, agent.id, agent.agent_actor_id, "Now about tides.")
        again = (await http.get(card_url, headers=caller.headers)).json()
        assert again["description"] == "Now about tides."
        # An ETag to revalidate against (tests/gateway/test_a2a_conformance.py: the rest).
        fresh = await http.get(card_url, headers=caller.headers)
        etag = fresh.headers["etag"]
        unchanged = await http.get(card_url, headers={**caller.headers, "If-None-Match": etag})
        assert unchanged.status_code == 304


# --- sending ------------------------------------------------------------------------------


async def test_a_send_is_the_callers_line_and_its_task_completes_with_the_reply(
    agents: Agents, store: Store, gateway_url: str
) -> None:
    echo = await agents.publish()
    caller = await agents.caller(echo.id)
    completed = await tasks_counted(gateway_url, "completed")
    async with a2a_client(agents, echo, caller) as (client, _):
        started = time.perf_counter()
        task = await sent(client, request("hello from a2a", "ctx-1"))
        elapsed = time.perf_counter() - started
        assert task.status.state == TaskState.TASK_STATE_COMPLETED, task
        assert reply_of(task) == "hello from a2a"
        assert task.status.message.role == Role.ROLE_AGENT
        assert artifact_text(task) == "hello from a2a"
        assert task.context_id == "ctx-1"
        assert [part.text for part in task.history[0].parts] == ["hello from a2a"]

        # tasks/get answers the same, from the store.
        got = await client.get_task(GetTaskRequest(id=task.id))
        assert got.status.state == TaskState.TASK_STATE_COMPLETED
        assert reply_of(got) == "hello from a2a" and artifact_text(got) == "hello from a2a"
    print(f"A2A send -> completed: {elapsed * 1000:.0f} ms")
    assert await tasks_counted(gateway_url, "completed") == completed + 1

    # The line is the caller's, in the forum kept for its token and contextId, and the record
    # names it.
    forum_id = kept_forum_id(caller.token, "a2a", echo, "ctx-1")
    lines = await store.history(forum_id, after_seq=0, up_to_seq=await store.last_seq(forum_id))
    [line] = [line for line in lines if line.role == "user"]
    assert line.text == "hello from a2a"
    author = await store.get_actor(line.author_actor_id)
    assert author is not None and author.external_id == caller_id(caller.token, "a2a")
    document = await store.db[COLLECTION].find_one({"_id": task.id})
    assert document is not None
    record = TaskRecord.from_document(document)
    assert (record.forum_id, record.line_id, record.state) == (forum_id, line.id, "completed")
    assert record.owner == caller.token.namespace


async def test_a_context_goes_on_over_three_messages_and_the_agent_sees_the_earlier_lines(
    agents: Agents, fake_openai: FakeOpenAI
) -> None:
    agent = await agents.publish(model="gpt-test")
    caller = await agents.caller(agent.id)
    fake_openai.script()  # the default answer: "echo: <the newest line>"
    said = ["my name is Ada", "I live in Turin", "where do I live, and what is my name?"]
    async with a2a_client(agents, agent, caller) as (client, _):
        first = await sent(client, request(said[0]))
        context_id = first.context_id  # the door made one
        assert context_id
        tasks = [first]
        for text in said[1:]:
            tasks.append(await sent(client, request(text, context_id)))
        # The context's tasks, newest first.
        listed = await client.list_tasks(ListTasksRequest(context_id=context_id))
        assert [task.id for task in listed.tasks] == [task.id for task in reversed(tasks)]
    assert [task.status.state for task in tasks] == [TaskState.TASK_STATE_COMPLETED] * 3
    replies = [reply_of(task) for task in tasks]
    assert all(reply.startswith("echo: ") for reply in replies), replies
    assert all(reply.endswith(text) for reply, text in zip(replies, said, strict=True)), replies
    assert len({task.id for task in tasks}) == 3 and {t.context_id for t in tasks} == {context_id}
    # The third prompt holds the two lines before it, and the agent's answers to them.
    prompt = json.dumps(fake_openai.requests[-1]["messages"])
    for text in (*said, *replies[:2]):
        assert text in prompt, prompt


async def test_a_stream_sends_the_status_changes_and_the_replys_deltas(
    agents: Agents, fake_openai: FakeOpenAI
) -> None:
    answer = "The quick brown fox jumps over the lazy dog, twice over, for the stream."
    fake_openai.script(streamed(completion(answer), pieces=12, piece_delay=0.05))
    agent = await agents.publish(model="gpt-test")
    caller = await agents.caller(agent.id)
    events: list[StreamResponse] = []
    async with a2a_client(agents, agent, caller, streaming=True) as (client, _):
        async for event in client.send_message(request("tell me something")):
            events.append(event)
    first, *rest = events
    assert first.HasField("task") and first.task.status.state == TaskState.TASK_STATE_WORKING
    deltas = [e.artifact_update for e in rest if e.HasField("artifact_update")]
    drafts = [d for d in deltas if not d.last_chunk]
    assert len(drafts) >= 2, events  # the reply came in pieces, as the model wrote it
    assert "".join(p.text for d in drafts for p in d.artifact.parts) == answer
    assert all(part.text for d in drafts for part in d.artifact.parts), drafts  # no empty piece
    assert all(d.append for d in drafts[1:]) and not drafts[0].append
    final = deltas[-1]
    assert final.last_chunk and not final.append and final.artifact.parts[0].text == answer
    states = [e.status_update.status.state for e in rest if e.HasField("status_update")]
    assert states == [TaskState.TASK_STATE_COMPLETED], events
    assert reply_of_event(rest[-1]) == answer


def reply_of_event(event: StreamResponse) -> str:
    return "".join(part.text for part in event.status_update.status.message.parts)


async def test_a_task_waiting_for_an_approver_is_working_with_the_tools_name(
    agents: Agents, store: Store, fake_openai: FakeOpenAI, gateway_url: str
) -> None:
    gated, caller, approver = await agents.gated(fake_openai)
    async with a2a_client(agents, gated, caller) as (client, _):
        task = await sent(client, request("what is 6 * 7?", "sums", now=True))
        waiting = await eventually_task(
            client, task.id, lambda t: "calculator" in reply_of(t), "a wait for an approver"
        )
        assert waiting.status.state == TaskState.TASK_STATE_WORKING
        assert reply_of(waiting) == "waiting for a person to approve: calculator"
        forum_id = kept_forum_id(caller.token, "a2a", gated, "sums")
        async with httpx.AsyncClient(base_url=gateway_url, timeout=TIMEOUT) as http:
            auth = {"Authorization": f"Bearer {approver}"}
            [pending] = (await http.get(f"/v1/forums/{forum_id}/approvals", headers=auth)).json()[
                "approvals"
            ]
            decided = await http.post(
                f"/v1/forums/{forum_id}/approvals/{pending['callId']}",
                json={"decision": "approve"},
                headers=auth,
            )
            assert decided.status_code == 200, decided.text
        done = await task_state(client, task.id, TaskState.TASK_STATE_COMPLETED)
    assert reply_of(done) == "it is 42"


async def eventually_task(client: Client, task_id: str, check: object, what: str) -> Task:
    found: Task | None = None

    async def seen() -> bool:
        nonlocal found
        found = await client.get_task(GetTaskRequest(id=task_id))
        return bool(check(found))  # type: ignore[operator]

    await eventually(seen, timeout=60, what=what)
    assert found is not None
    return found


# --- canceling ----------------------------------------------------------------------------


async def test_a_cancel_during_a_slow_model_call_stops_the_forum_and_the_task_is_canceled(
    agents: Agents, store: Store, fake_openai: FakeOpenAI, gateway_url: str
) -> None:
    # The model holds its reply: a piece every 0.25 s, for 15 s.
    fake_openai.script(streamed(completion("slow " * 60), pieces=60, piece_delay=0.25))
    agent = await agents.publish(model="gpt-test")
    caller = await agents.caller(agent.id)
    canceled = await tasks_counted(gateway_url, "canceled")
    async with a2a_client(agents, agent, caller, streaming=True) as (client, _):
        stream = client.send_message(request("take your time", "to cancel"))
        first = await anext(stream)
        task_id = first.task.id
        async for event in stream:  # the model is writing: cancel now
            if event.HasField("artifact_update"):
                break
        await stream.aclose()
        task = await client.cancel_task(CancelTaskRequest(id=task_id))
        assert task.status.state == TaskState.TASK_STATE_CANCELED, task
        got = await client.get_task(GetTaskRequest(id=task_id))
        assert got.status.state == TaskState.TASK_STATE_CANCELED
        with pytest.raises(TaskNotCancelableError):  # once ended, it stays so
            await client.cancel_task(CancelTaskRequest(id=task_id))
    assert await tasks_counted(gateway_url, "canceled") == canceled + 1
    # A /stop of the caller's forum, as its caller: the agent says it stopped, never answers.
    forum_id = kept_forum_id(caller.token, "a2a", agent, "to cancel")

    async def stopped() -> bool:
        lines = await store.history(forum_id, after_seq=0, up_to_seq=await store.last_seq(forum_id))
        return any(line.role == "agent" and line.type == "notice" for line in lines)

    await eventually(stopped, timeout=30, what="the stop's notice")
    lines = await store.history(forum_id, after_seq=0, up_to_seq=await store.last_seq(forum_id))
    assert [line.text for line in lines if line.role == "user"] == ["take your time", "/stop"]
    assert not [line for line in lines if line.role == "agent" and line.type == "message"]


# --- a second message to a working task ----------------------------------------------------


async def test_a_second_message_to_a_working_task_is_another_line_and_the_task_ends_with_its_answer(
    agents: Agents, store: Store
) -> None:
    slow = await agents.publish(model="fixture-slow-2")
    caller = await agents.caller(slow.id)
    async with a2a_client(agents, slow, caller) as (client, _):
        task = await sent(client, request("first", "busy", now=True))
        assert task.status.state == TaskState.TASK_STATE_WORKING
        done = await sent(client, request("second", "busy", task_id=task.id))
        assert done.id == task.id
        assert done.status.state == TaskState.TASK_STATE_COMPLETED, done
        assert reply_of(done) == "second"
        # The second message is in the task's history.
        asked = [m for m in done.history if m.role == Role.ROLE_USER]
        assert [part.text for message in asked for part in message.parts] == ["first", "second"]
    # Under whileBusy queue (the default) each line is answered on its own, in order.
    forum_id = kept_forum_id(caller.token, "a2a", slow, "busy")

    async def both_answered() -> bool:
        lines = await store.history(forum_id, after_seq=0, up_to_seq=await store.last_seq(forum_id))
        return len([line for line in lines if line.role == "agent"]) >= 2

    await eventually(both_answered, timeout=30, what="both lines answered")
    lines = await store.history(forum_id, after_seq=0, up_to_seq=await store.last_seq(forum_id))
    assert [(line.role, line.text) for line in lines if line.type == "message"] == [
        ("user", "first"),
        ("user", "second"),
        ("agent", "first"),
        ("agent", "second"),
    ]


# --- push notifications -------------------------------------------------------------------


async def test_a_push_notification_comes_signed_with_the_tasks_end(
    agents: Agents, store: Store, receiver: Receiver
) -> None:
    slow = await agents.publish(model="fixture-slow-1")
    caller = await agents.caller(slow.id)
    path = f"/push/{uuid.uuid4().hex[:8]}"
    secret = "receiver-secret-" + uuid.uuid4().hex
    async with a2a_client(agents, slow, caller) as (client, _):
        task = await sent(client, request("push me", now=True))
        config = await client.create_task_push_notification_config(
            TaskPushNotificationConfig(task_id=task.id, url=receiver.url(path), token=secret)
        )
        assert config.token == secret and config.url == receiver.url(path)
        await task_state(client, task.id, TaskState.TASK_STATE_COMPLETED)

        async def pushed() -> bool:
            return bool(receiver.delivered(path))

        await eventually(pushed, timeout=60, what="the push")
    [push] = receiver.at(path)
    timestamp = push.headers["x-yoke-timestamp"]
    signature = push.headers["x-yoke-signature"]
    assert signature_matches(secret, push.body, signature, timestamp)
    assert not signature_matches("another secret!!", push.body, signature, timestamp)
    update = push.json["statusUpdate"]
    assert update["taskId"] == task.id and update["contextId"] == task.context_id
    assert update["status"]["state"] == "TASK_STATE_COMPLETED"
    assert update["status"]["message"]["parts"] == [{"text": "push me"}]

    # Delivered, its subscription ends (the config stays for get and list).
    async def ended() -> bool:
        found = await store.db[CONFIGS].find_one({"taskId": task.id})
        return found is not None and found.get("live") is False

    await eventually(ended, timeout=30, what="the push's subscription to end")
    await asyncio.sleep(0.5)
    assert len(receiver.at(path)) == 1


# --- scope and bounds ---------------------------------------------------------------------


async def test_another_tokens_task_is_not_found_for_it(agents: Agents) -> None:
    echo = await agents.publish()
    other_agent = await agents.publish()
    mine = await agents.caller(echo.id, other_agent.id)
    theirs = await agents.caller(echo.id)
    async with a2a_client(agents, echo, mine) as (client, _):
        task = await sent(client, request("mine only", now=True))
    async with a2a_client(agents, echo, theirs, streaming=True) as (client, _):
        for attempt in (
            client.get_task(GetTaskRequest(id=task.id)),
            client.cancel_task(CancelTaskRequest(id=task.id)),
            client.create_task_push_notification_config(
                TaskPushNotificationConfig(task_id=task.id, url="http://127.0.0.1:9/x")
            ),
            sent(client, request("into your task", task_id=task.id)),
        ):
            with pytest.raises(TaskNotFoundError):
                await attempt
        with pytest.raises(TaskNotFoundError):
            async for _ in client.subscribe(SubscribeToTaskRequest(id=task.id)):
                pass
        with pytest.raises(TaskNotFoundError):  # an id never made is the same
            await client.get_task(GetTaskRequest(id=uuid.uuid4().hex))
    # The same token, through another agent's URL: not that agent's task.
    async with a2a_client(agents, other_agent, mine) as (client, _):
        with pytest.raises(TaskNotFoundError):
            await client.get_task(GetTaskRequest(id=task.id))


async def test_a_refused_line_is_a_rejected_task_that_says_why(
    agents: Agents, gateway_url: str
) -> None:
    echo = await agents.publish()
    caller = await agents.caller(echo.id)
    rejected = await tasks_counted(gateway_url, "rejected")
    async with a2a_client(agents, echo, caller) as (client, _):
        states = []
        for number in range(LINES_PER_MINUTE + 1):
            task = await sent(client, request(f"line {number}", "limit", now=True))
            states.append(task.status.state)
    assert states[-1] == TaskState.TASK_STATE_REJECTED, states
    assert "too many lines" in reply_of(task) or "limit" in reply_of(task), task
    assert await tasks_counted(gateway_url, "rejected") == rejected + 1


async def test_json_rpc_calls_need_the_bearer_and_the_right_to_call(
    agents: Agents, gateway_url: str
) -> None:
    echo = await agents.publish()
    stranger = await agents.caller()
    body = {"jsonrpc": "2.0", "id": 1, "method": "GetTask", "params": {"id": "x"}}
    async with httpx.AsyncClient(timeout=TIMEOUT) as http:
        anonymous = await http.post(agents.url(echo), json=body)
        assert anonymous.status_code == 401
        refused = await http.post(agents.url(echo), json=body, headers=stranger.headers)
        assert refused.status_code == 404


def rpc(method: str, params: object, id_: object = 1) -> dict[str, object]:
    return {"jsonrpc": "2.0", "id": id_, "method": method, "params": params}


async def test_hostile_json_rpc_gets_the_protocols_errors_never_a_500(
    agents: Agents, gateway_url: str
) -> None:
    echo = await agents.publish()
    caller = await agents.caller(echo.id)
    headers = {**caller.headers, "A2A-Version": "1.0", "Content-Type": "application/json"}
    deep = ("[" * 200 + "]" * 200).encode()
    empty = {"message": {"role": "ROLE_USER", "parts": []}}
    long_number = (
        b'{"jsonrpc":"2.0","id":1,"method":"GetTask","params":{"id":' + b"9" * 5000 + b"}}"
    )
    cases: list[tuple[bytes, int]] = [
        (json.dumps(rpc("NoSuchMethod", {})).encode(), -32601),
        (json.dumps(rpc("GetTask", {"id": 5, "historyLength": "lots"})).encode(), -32602),
        (json.dumps(rpc("GetTask", [1, 2])).encode(), -32602),
        (json.dumps(rpc("SendMessage", {"message": "text"})).encode(), -32602),
        (json.dumps(rpc("SendMessage", empty)).encode(), -32602),
        (json.dumps(rpc("GetTask", {"id": uuid.uuid4().hex})).encode(), -32001),
        (json.dumps(rpc("CancelTask", {"id": "nope"})).encode(), -32001),
        (json.dumps([rpc("GetTask", {"id": "x"})]).encode(), -32600),  # a batch
        (json.dumps({"jsonrpc": "1.0", "id": 1, "method": "GetTask"}).encode(), -32600),
        (json.dumps(rpc(["GetTask"], {})).encode(), -32600),
        (b'{"jsonrpc": "2.0", "id": 1, "method": "GetTask", "params": {"id": NaN}}', -32700),
        (b"{not json", -32700),
        (b"\xff\xfe", -32700),
        (deep, -32700),
        (json.dumps(rpc("GetTask", {"id": "9" * 5000})).encode(), -32001),
        (long_number, -32700),
    ]
    async with httpx.AsyncClient(timeout=TIMEOUT) as http:
        for body, code in cases:
            response = await http.post(agents.url(echo), content=body, headers=headers)
            assert response.status_code == 200, (body[:80], response.text)
            assert response.json()["error"]["code"] == code, (body[:80], response.text)
        # 0.3's method names, as a 0.3 client sends them (no A2A-Version).
        old = {**caller.headers, "Content-Type": "application/json"}
        for method, params in (
            ("tasks/get", {"id": "nope"}),
            ("tasks/cancel", {"id": "nope"}),
            ("tasks/resubscribe", {"id": "nope"}),
        ):
            body = json.dumps(rpc(method, params)).encode()
            response = await http.post(agents.url(echo), content=body, headers=old)
            assert response.status_code == 200, (method, response.text)
            assert "-32001" in response.text, (method, response.text)
        huge = await http.post(
            agents.url(echo), content=b'{"a":"' + b"x" * 400_000 + b'"}', headers=headers
        )
        assert huge.status_code == 413
        # Still serving.
        task = await http.post(agents.url(echo), json=rpc("GetTask", {"id": "x"}), headers=headers)
        assert task.json()["error"]["code"] == -32001
    route = "/a2a/{name}"
    for status in ("500", "502", "503"):
        answered = await metric(
            gateway_url, "yoke_gateway_requests_total", route=route, status=status
        )
        assert answered == 0, status
    assert await metric(gateway_url, "yoke_gateway_requests_total", route=route, status="413") >= 1


# --- what a task costs --------------------------------------------------------------------


async def test_an_a2a_task_costs_an_http_turns_store_operations_and_a_few_more(
    agents: Agents, store: Store, mesh: Mesh, poster: Poster, gateway_url: str
) -> None:
    echo = await agents.publish()
    caller = await agents.caller(echo.id)
    forum = await create_forum(store, "cost")
    await join_conversation(store, poster, echo.agent_actor_id, forum.id)
    _, secret = await create_token(store, f"http-{uuid.uuid4().hex[:6]}", [forum.id])

    async def rest_turn(http: httpx.AsyncClient, text: str) -> None:
        await http_turn(http, store, forum.id, secret, text)

    seconds: list[float] = []

    async def a2a_task(client: Client, text: str) -> Task:
        started = time.perf_counter()
        task = await sent(client, request(text, "cost"))
        seconds.append(time.perf_counter() - started)
        assert task.status.state == TaskState.TASK_STATE_COMPLETED and reply_of(task) == text
        return task

    async with (
        httpx.AsyncClient(base_url=gateway_url, timeout=TIMEOUT) as http,
        a2a_client(agents, echo, caller) as (client, _),
    ):
        await rest_turn(http, "warm")  # caches warm, the kept forum made and joined
        await a2a_task(client, "warm")
        before = await settled_operations(mesh, gateway_url)
        await rest_turn(http, "what does a turn cost?")
        middle = await settled_operations(mesh, gateway_url)
        seconds.clear()
        await a2a_task(client, "what does a task cost?")
        after = await settled_operations(mesh, gateway_url)
        for number in range(LINES_PER_MINUTE - 2):
            await a2a_task(client, f"timed {number}")
    http_cost, a2a_cost = middle - before, after - middle
    print(f"HTTP turn: {breakdown(http_cost)}")
    print(f"A2A task: {breakdown(a2a_cost)}")
    print(
        f"A2A send -> completed, p50 of {len(seconds)}: {statistics.median(seconds) * 1000:.0f} ms"
    )
    # The mesh does the same for a line from either door; the door's own operations are few.
    assert total(a2a_cost, gateway=False) <= total(http_cost, gateway=False) + 2
    # The door's own: its task record, the forum's turn, and the claim that makes one message
    # one task however often it is sent (a lookup and a unique insert).
    assert total(a2a_cost, gateway=True) <= 13, breakdown(a2a_cost)


async def test_the_guides_a2a_client_runs_as_written(agents: Agents, store: Store) -> None:
    """docs/agents-as-tools.md's A2A client, run as a newcomer would run it (only the token and
    the gateway's address told)."""
    guide = (Path(__file__).parents[2] / "docs/agents-as-tools.md").read_text()
    code = guide.split("## 4.", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    agent = await create_agent(store, "Helpdesk")
    await publish_agent(store, "helpdesk", agent.id, "Answers questions about orders.")
    caller = await agents.caller("helpdesk")
    code = code.replace('TOKEN = "yoke_..."', f"TOKEN = {caller.secret!r}")
    code = code.replace("http://localhost:8080", agents.gateway_url)
    run = await asyncio.create_subprocess_exec(
        sys.executable, "-c", code, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    out, err = await asyncio.wait_for(run.communicate(), 120)
    assert run.returncode == 0, err.decode()[-3000:]
    assert out.decode().splitlines() == [
        "helpdesk True",
        "TASK_STATE_COMPLETED Where is order 1234?",
        "TASK_STATE_COMPLETED ticket-1234",
    ], out.decode()

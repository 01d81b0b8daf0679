"""Every caller's line has an end it can know, whatever ``whileBusy`` makes of it: an A2A task
whose line was answered together with others (``coalesce``, ``interrupt``, a line held through
a gated call under ``queue``) completes with that reply, and one whose line a ``/stop`` left
unanswered (a cancel through another task of its context, through another gateway) is
canceled. The mesh says which lines a reply or a notice settles (``meta.coversSeq``); the
followers end a turn by it.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import pytest
from a2a.client import A2ACardResolver, Client, ClientConfig, ClientFactory
from a2a.types.a2a_pb2 import (
    CancelTaskRequest,
    GetTaskRequest,
    Message,
    Part,
    Role,
    SendMessageConfiguration,
    SendMessageRequest,
    StreamResponse,
    SubscribeToTaskRequest,
    Task,
    TaskState,
)
from a2a.utils.errors import TaskNotCancelableError

from services.gateway.a2a.task_store import COLLECTION
from services.gateway.calling import kept_forum_id
from tests.support.fake_openai import FakeOpenAI, openai_env
from tests.support.gateway_process import metric, running_gateway
from tests.support.processes import eventually
from tests.support.published import Agents, Caller
from yoke.store.database import Store
from yoke.store.publishing import PublishedAgent

pytestmark = pytest.mark.slow

TIMEOUT = httpx.Timeout(30.0, read=120.0)
# Long enough for any step of this module on a loaded machine, far shorter than "for ever".
ENDS_WITHIN = 60.0
# A gateway that follows a task this long: long enough for a turn once approved on a loaded
# machine (a resubscriber's follow is bounded by it too), short for a test.
SHORT_FOLLOW = 10


@pytest.fixture(scope="module")
def mesh_env(fake_openai: FakeOpenAI) -> dict[str, str]:
    return openai_env(fake_openai.base_url, give_up_seconds=10)


@asynccontextmanager
async def a2a_client(url: str, agent: PublishedAgent, caller: Caller) -> AsyncIterator[Client]:
    async with httpx.AsyncClient(headers=caller.headers, timeout=TIMEOUT) as http:
        card = await A2ACardResolver(http, f"{url}/a2a/{agent.id}").get_agent_card()
        client = ClientFactory(ClientConfig(streaming=False, httpx_client=http)).create(card)
        try:
            yield client
        finally:
            await client.close()


def send(text: str, context_id: str) -> SendMessageRequest:
    """A send that answers at once with the working task (its end is polled)."""
    message = Message(
        role=Role.ROLE_USER,
        message_id=uuid.uuid4().hex,
        context_id=context_id,
        parts=[Part(text=text)],
    )
    return SendMessageRequest(
        message=message, configuration=SendMessageConfiguration(return_immediately=True)
    )


async def started(client: Client, text: str, context_id: str) -> Task:
    return await started_by(client, send(text, context_id))


async def started_by(client: Client, request: SendMessageRequest) -> Task:
    responses = [response async for response in client.send_message(request)]
    assert len(responses) == 1 and responses[0].HasField("task"), responses
    return responses[0].task


async def ended(client: Client, task_id: str) -> Task:
    """The task once it is no longer working (an assertion error names it if it never ends)."""
    found: Task | None = None

    async def done() -> bool:
        nonlocal found
        found = await client.get_task(GetTaskRequest(id=task_id))
        return found.status.state not in (
            TaskState.TASK_STATE_WORKING,
            TaskState.TASK_STATE_SUBMITTED,
        )

    await eventually(done, timeout=ENDS_WITHIN, what=f"task {task_id} to end")
    assert found is not None
    return found


async def asked_approval(url: str, approver: str, forum_id: str) -> str:
    """The call id of the forum's approval request, once it is there."""
    pending: list[dict[str, str]] = []
    auth = {"Authorization": f"Bearer {approver}"}
    async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as http:

        async def asked() -> bool:
            nonlocal pending
            answer = await http.get(f"/v1/forums/{forum_id}/approvals", headers=auth)
            pending = answer.json()["approvals"]
            return bool(pending)

        await eventually(asked, timeout=30, what="the approval request")
    return pending[0]["callId"]


async def approve(url: str, approver: str, forum_id: str, call_id: str) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as http:
        decided = await http.post(
            f"/v1/forums/{forum_id}/approvals/{call_id}",
            json={"decision": "approve"},
            headers={"Authorization": f"Bearer {approver}"},
        )
    assert decided.status_code == 200, decided.text


def reply_of(task: Task) -> str:
    return "\n".join(part.text for part in task.status.message.parts)


async def agent_lines(store: Store, forum_id: str) -> list[str]:
    lines = await store.history(forum_id, after_seq=0, up_to_seq=await store.last_seq(forum_id))
    return [line.text for line in lines if line.role == "agent" and line.type == "message"]


async def test_a_burst_under_coalesce_ends_every_task_with_the_one_reply(
    agents: Agents, store: Store, gateway_url: str
) -> None:
    agent = await agents.publish(model="fixture-slow-2", while_busy="coalesce")
    caller = await agents.caller(agent.id)
    async with a2a_client(gateway_url, agent, caller) as client:
        first = await started(client, "first", "burst")
        # While the first line's model call runs, two more come: the step after answers both.
        second = await started(client, "second", "burst")
        third = await started(client, "third", "burst")
        tasks = [await ended(client, task.id) for task in (first, second, third)]
    assert [task.status.state for task in tasks] == [TaskState.TASK_STATE_COMPLETED] * 3, tasks
    # Each task ends with the reply that answered its line: its own, or a burst's that answered
    # it with a newer one (how the three fall into steps depends on when the first step began).
    texts = ["first", "second", "third"]
    replies = [reply_of(task) for task in tasks]
    assert all(reply in texts[index:] for index, reply in enumerate(replies)), replies
    assert replies[-1] == "third"
    forum_id = kept_forum_id(caller.token, "a2a", agent, "burst")
    answered = await agent_lines(store, forum_id)
    assert answered[-1] == "third" and len(answered) < 3, answered


async def test_an_interrupted_line_ends_with_the_reply_that_answered_it(
    agents: Agents, store: Store, gateway_url: str
) -> None:
    agent = await agents.publish(model="fixture-slow-2", while_busy="interrupt")
    caller = await agents.caller(agent.id)
    async with a2a_client(gateway_url, agent, caller) as client:
        first = await started(client, "first", "cut")
        second = await started(client, "second", "cut")
        tasks = [await ended(client, task.id) for task in (first, second)]
    assert [task.status.state for task in tasks] == [TaskState.TASK_STATE_COMPLETED] * 2, tasks
    assert reply_of(tasks[0]) == reply_of(tasks[1]) == "second"
    forum_id = kept_forum_id(caller.token, "a2a", agent, "cut")
    assert await agent_lines(store, forum_id) == ["second"]


async def test_a_line_held_through_a_gated_call_ends_with_the_rounds_reply(
    agents: Agents, store: Store, fake_openai: FakeOpenAI, gateway_url: str
) -> None:
    gated, caller, approver = await agents.gated(fake_openai)
    async with a2a_client(gateway_url, gated, caller) as client:
        first = await started(client, "what is 6 * 7?", "held")
        forum_id = kept_forum_id(caller.token, "a2a", gated, "held")
        call_id = await asked_approval(gateway_url, approver, forum_id)
        # While the call waits, a second line (whileBusy queue): the round's reply answers it.
        second = await started(client, "and then?", "held")

        async def held() -> bool:  # its copy reached the monologue: the round will see it
            found = await client.get_task(GetTaskRequest(id=second.id))
            return found.status.state == TaskState.TASK_STATE_WORKING

        await eventually(held, timeout=30, what="the second task working")
        await approve(gateway_url, approver, forum_id, call_id)
        tasks = [await ended(client, task.id) for task in (first, second)]
    assert [task.status.state for task in tasks] == [TaskState.TASK_STATE_COMPLETED] * 2, tasks
    assert reply_of(tasks[0]) == reply_of(tasks[1]) == "it is 42"


async def test_a_cancel_through_another_task_of_the_context_cancels_both(
    agents: Agents, store: Store, gateway_url: str
) -> None:
    agent = await agents.publish(model="fixture-slow-5")  # still thinking at the cancel
    caller = await agents.caller(agent.id)
    async with a2a_client(gateway_url, agent, caller) as client:
        first = await started(client, "first", "stopped")
        second = await started(client, "second", "stopped")
        canceled = await client.cancel_task(CancelTaskRequest(id=second.id))
        assert canceled.status.state == TaskState.TASK_STATE_CANCELED, canceled
        # The /stop stopped the whole forum: the first line is not answered either.
        other = await ended(client, first.id)
    assert other.status.state == TaskState.TASK_STATE_CANCELED, other
    forum_id = kept_forum_id(caller.token, "a2a", agent, "stopped")
    assert await agent_lines(store, forum_id) == []


async def test_a_message_sent_again_is_the_same_task_not_another(
    agents: Agents, store: Store, gateway_url: str
) -> None:
    agent = await agents.publish(model="fixture-slow-2")
    caller = await agents.caller(agent.id)
    async with a2a_client(gateway_url, agent, caller) as client:
        request = send("only once", "again")
        first = await started_by(client, request)
        # A client retrying its send (the same messageId): the task it made, however often.
        again = [await started_by(client, request) for _ in range(3)]
        assert {task.id for task in again} == {first.id}, again
        done = await ended(client, first.id)
    # Streamed, once its task has ended: that task, as it ended.
    async with httpx.AsyncClient(headers=caller.headers, timeout=TIMEOUT) as http:
        card = await A2ACardResolver(http, f"{gateway_url}/a2a/{agent.id}").get_agent_card()
        streaming = ClientFactory(ClientConfig(streaming=True, httpx_client=http)).create(card)
        events = [event async for event in streaming.send_message(request)]
        await streaming.close()
    assert [event.task.id for event in events if event.HasField("task")] == [first.id], events
    assert done.status.state == TaskState.TASK_STATE_COMPLETED, done
    records = await store.db[COLLECTION].count_documents({"agent": agent.id})
    assert records == 1
    forum_id = kept_forum_id(caller.token, "a2a", agent, "again")
    assert await agent_lines(store, forum_id) == ["only once"]


async def test_a_message_sent_many_times_at_once_makes_one_task_to_follow(
    agents: Agents, store: Store, gateway_url: str
) -> None:
    agent = await agents.publish(model="fixture-slow-5")  # working at the second message
    caller = await agents.caller(agent.id)
    async with a2a_client(gateway_url, agent, caller) as client:
        request = send("at once", "burst of one")
        tasks = await asyncio.gather(*(started_by(client, request) for _ in range(8)))
        following = {t.id for t in tasks if t.status.state != TaskState.TASK_STATE_REJECTED}
        assert len(following) == 1, tasks
        (winner,) = following
        # The others say which task the message is.
        assert all(winner in reply_of(t) for t in tasks if t.id != winner), tasks
        # The task moves on to a newer message (blocking: it ends with its answer) ...
        more = send("and more", "burst of one").message
        more.task_id = winner
        [moved] = [r async for r in client.send_message(SendMessageRequest(message=more))]
        assert moved.task.status.state == TaskState.TASK_STATE_COMPLETED, moved
        # ... and the first message sent again is still that task.
        assert (await started_by(client, request)).id == winner


async def test_cancels_of_one_task_at_once_stop_its_forum_once(
    agents: Agents, store: Store, gateway_url: str
) -> None:
    agent = await agents.publish(model="fixture-slow-5")  # still thinking at the cancels
    caller = await agents.caller(agent.id)
    async with a2a_client(gateway_url, agent, caller) as client:
        task = await started(client, "first", "thrice")
        answers = await asyncio.gather(
            *(client.cancel_task(CancelTaskRequest(id=task.id)) for _ in range(3)),
            return_exceptions=True,
        )
        assert any(isinstance(a, Task) for a in answers), answers
        assert all(
            isinstance(a, TaskNotCancelableError)
            or (isinstance(a, Task) and a.status.state == TaskState.TASK_STATE_CANCELED)
            for a in answers
        ), answers
    forum_id = kept_forum_id(caller.token, "a2a", agent, "thrice")

    async def told() -> bool:
        lines = await store.history(forum_id)
        return any(line.role == "agent" and line.type == "notice" for line in lines)

    await eventually(told, timeout=30, what="the stop's notice")
    lines = await store.history(forum_id)
    assert [line.text for line in lines if line.role == "user"] == ["first", "/stop"], lines
    assert len([line for line in lines if line.type == "notice"]) == 1


async def test_a_cancel_through_another_gateway_ends_the_stream_of_the_first(
    agents: Agents,
    store: Store,
    amqp_url: str,
    module_mongodb_url: str,
    gateway_url: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    agent = await agents.publish(model="fixture-slow-5")  # still thinking at the cancel
    caller = await agents.caller(agent.id)
    log_dir = Path(tmp_path_factory.mktemp("second-gateway"))
    async with (
        running_gateway(amqp_url, module_mongodb_url, log_dir) as other_url,
        httpx.AsyncClient(headers=caller.headers, timeout=TIMEOUT) as http,
    ):
        card = await A2ACardResolver(http, f"{gateway_url}/a2a/{agent.id}").get_agent_card()
        streaming = ClientFactory(ClientConfig(streaming=True, httpx_client=http)).create(card)
        message = send("take your time", "elsewhere").message
        stream = streaming.send_message(SendMessageRequest(message=message))
        first = await anext(stream)
        task_id = first.task.id
        async with a2a_client(other_url, agent, caller) as other:
            canceled = await other.cancel_task(CancelTaskRequest(id=task_id))
            assert canceled.status.state == TaskState.TASK_STATE_CANCELED, canceled
        states = []
        async with asyncio.timeout(ENDS_WITHIN):
            async for event in stream:
                if event.HasField("status_update"):
                    states.append(event.status_update.status.state)
        await streaming.close()
    # The runner on the first gateway saw the stop and ended the task there too.
    assert states and states[-1] == TaskState.TASK_STATE_CANCELED, states


async def test_a_task_is_followed_for_a_bounded_time_and_its_end_still_comes_from_the_store(
    agents: Agents,
    store: Store,
    fake_openai: FakeOpenAI,
    amqp_url: str,
    module_mongodb_url: str,
    gateway_url: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    gated, caller, approver = await agents.gated(fake_openai)
    log_dir = Path(tmp_path_factory.mktemp("short-gateway"))
    async with (
        running_gateway(
            amqp_url, module_mongodb_url, log_dir, YOKE_A2A_FOLLOW_SECONDS=str(SHORT_FOLLOW)
        ) as url,
        httpx.AsyncClient(headers=caller.headers, timeout=TIMEOUT) as http,
    ):
        card = await A2ACardResolver(http, f"{url}/a2a/{gated.id}").get_agent_card()
        streaming = ClientFactory(ClientConfig(streaming=True, httpx_client=http)).create(card)
        message = send("what is 6 * 7?", "waits").message
        states = []
        task_id = ""
        # The approval never comes while the stream is open: the gateway lets the task go.
        async with asyncio.timeout(ENDS_WITHIN):
            async for event in streaming.send_message(SendMessageRequest(message=message)):
                if event.HasField("task"):
                    task_id = event.task.id
                if event.HasField("status_update"):
                    states.append(event.status_update.status.state)
        await streaming.close()
        assert task_id and TaskState.TASK_STATE_WORKING in states, states
        assert not any(state != TaskState.TASK_STATE_WORKING for state in states), states
        assert await metric(url, "yoke_a2a_tasks_followed") == 0
        # The turn goes on in the mesh: a resubscriber follows it there, and once a person
        # approves, it gets the end (the gateway let its own copy of the task go).
        resubscribing = ClientFactory(ClientConfig(streaming=True, httpx_client=http)).create(card)
        events: list[StreamResponse] = []

        async def resubscribed() -> None:
            async for event in resubscribing.subscribe(SubscribeToTaskRequest(id=task_id)):
                events.append(event)

        following = asyncio.create_task(resubscribed())

        async def snapshot() -> bool:
            return bool(events)

        await eventually(snapshot, timeout=30, what="the resubscribe's snapshot")
        forum_id = kept_forum_id(caller.token, "a2a", gated, "waits")
        # A second message to the task, blocking: this gateway runs the task anew.
        blocking = ClientFactory(ClientConfig(streaming=False, httpx_client=http)).create(card)
        more = send("and then?", "waits").message
        more.task_id = task_id
        second = asyncio.create_task(anext(blocking.send_message(SendMessageRequest(message=more))))

        async def both_said() -> bool:
            lines = await store.history(forum_id)
            return len([line for line in lines if line.role == "user"]) == 2

        await eventually(both_said, timeout=30, what="the second message in the forum")
        await approve(url, approver, forum_id, await asked_approval(url, approver, forum_id))
        async with asyncio.timeout(ENDS_WITHIN):
            await following
            answered = await second
        await resubscribing.close()
        await blocking.close()
        assert answered.task.status.state == TaskState.TASK_STATE_COMPLETED, answered
        last = events[-1]
        assert last.HasField("status_update"), events
        assert last.status_update.status.state == TaskState.TASK_STATE_COMPLETED, events
        async with a2a_client(url, gated, caller) as client:
            done = await ended(client, task_id)
    assert done.status.state == TaskState.TASK_STATE_COMPLETED, done
    assert reply_of(done) == "it is 42"

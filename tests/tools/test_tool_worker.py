"""Workers on the wire: ``yoke.tools.worker.serve`` and a pika worker, against a stand-in door.

The workers connect as real tool users (``tool-VHOST.NAME``, worker permissions only) to the
real broker.
The door here is the test's own: it reads ``tool.result.submit`` off ``yoke.commands`` and
answers on the answer's ``reply_to`` by the contract's rules (first answer accepted, a repeat
``duplicate``, an unknown call, another tool's user or no ``user_id`` rejected), so what is
pinned is the worker's side: who it says it is, what it sends, when it acks.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path

import aio_pika
import pytest
from aio_pika.abc import AbstractChannel, AbstractIncomingMessage

from tests.support.broker import Management
from tests.support.processes import eventually
from tests.support.worker_process import WorkerProcess, as_user
from yoke.bus import topology
from yoke.bus.amqp_nodes import amqp_vhost
from yoke.cli.tool_users import create_tool_user, tool_user_name
from yoke.core.models import SubmitReply, ToolCallRequest
from yoke.core.settings import Settings
from yoke.tools.worker import DIRECT_REPLY_TO, serve


@dataclass
class Answer:
    body: dict[str, object]
    user_id: str | None
    reply_to: str | None


@dataclass
class Door:
    """Reads answers as ingestion would and replies by the contract's rules."""

    channel: AbstractChannel
    vhost: str  # the mesh's, which its worker users' names carry
    calls: dict[str, str] = field(default_factory=dict)  # callId -> tool
    answered: set[str] = field(default_factory=set)
    answers: list[Answer] = field(default_factory=list)
    silent: bool = False  # record answers, reply to none

    async def on_answer(self, message: AbstractIncomingMessage) -> None:
        body = json.loads(message.body)
        self.answers.append(Answer(body, message.user_id, message.reply_to))
        if self.silent or not message.reply_to:
            return
        call_id = str(body.get("callId"))
        tool = self.calls.get(call_id)
        if message.user_id is None:
            reply = SubmitReply(status="rejected", code="missing_user_id", error="no user_id")
        elif tool is None:
            reply = SubmitReply(status="rejected", code="unknown_call", error="no such call")
        elif topology.tool_of_user(message.user_id, self.vhost) != tool:
            reply = SubmitReply(status="rejected", code="wrong_tool", error="not your call")
        elif call_id in self.answered:
            reply = SubmitReply(status="accepted", duplicate=True)
        else:
            self.answered.add(call_id)
            reply = SubmitReply(status="accepted")
        await self.channel.default_exchange.publish(
            aio_pika.Message(
                json.dumps(reply.to_wire()).encode(), correlation_id=message.correlation_id
            ),
            routing_key=message.reply_to,
        )

    def answers_to(self, call_id: str) -> list[Answer]:
        return [answer for answer in self.answers if answer.body.get("callId") == call_id]


@pytest.fixture(scope="module")
async def admin(amqp_url: str) -> AsyncIterator[AbstractChannel]:
    connection = await aio_pika.connect(amqp_url)
    channel = await connection.channel(publisher_confirms=True)
    await channel.declare_exchange(
        topology.COMMANDS_EXCHANGE, aio_pika.ExchangeType.TOPIC, durable=True
    )
    yield channel
    await connection.close()


@pytest.fixture
async def door(admin: AbstractChannel, amqp_url: str) -> AsyncIterator[Door]:
    door = Door(admin, amqp_vhost(amqp_url))
    queue = await admin.declare_queue(f"yoke.test-door.{uuid.uuid4().hex}", exclusive=True)
    await queue.bind(topology.COMMANDS_EXCHANGE, routing_key=topology.TOOL_RESULT_COMMAND)
    tag = await queue.consume(door.on_answer, no_ack=True)
    yield door
    await queue.cancel(tag)
    await queue.delete()


@dataclass
class WorkerTool:
    name: str
    url: str  # as its user
    user: str  # tool-VHOST.NAME (the module's vhost)


@pytest.fixture
async def new_tool(
    servers: tuple[str, str, str],
    amqp_url: str,
    admin: AbstractChannel,
    management: Management,
) -> AsyncIterator[Callable[[], Awaitable[WorkerTool]]]:
    """Make a tool queue as the mesh declares it, and its user; both removed after the test."""
    made: list[str] = []

    async def make() -> WorkerTool:
        name = f"w{uuid.uuid4().hex[:10]}"
        made.append(name)
        await admin.declare_queue(
            topology.tool_queue(name), durable=True, arguments=topology.tool_queue_arguments()
        )
        settings = Settings(amqp_url=amqp_url, management_url=servers[2])
        password = await create_tool_user(settings, name)
        user = tool_user_name(settings, name)
        return WorkerTool(name, as_user(amqp_url, user, password), user)

    yield make
    for name in made:
        await management.delete_user(topology.tool_user(name, amqp_vhost(amqp_url)))
        await admin.queue_delete(topology.tool_queue(name))


async def publish_call(
    admin: AbstractChannel,
    door: Door,
    tool: str,
    input: dict[str, object],
    *,
    seconds: float = 60,
) -> str:
    """Publish a call as the mesh would; returns its callId."""
    call_id = uuid.uuid4().hex
    deadline = datetime.now(UTC) + timedelta(seconds=seconds)
    door.calls[call_id] = tool
    body = {
        "callId": call_id,
        "tool": tool,
        "input": input,
        "idempotencyKey": f"key-{call_id}",
        "deadline": deadline.isoformat(),
    }
    await admin.default_exchange.publish(
        aio_pika.Message(
            json.dumps(body).encode(),
            message_id=call_id,
            content_type="application/json",
            delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
            expiration=seconds if seconds > 0 else None,
        ),
        routing_key=topology.tool_queue(tool),
    )
    return call_id


async def waiting_calls(admin: AbstractChannel, tool: str) -> int:
    """Calls in the queue not held by any consumer (the queue's own count, not the API's)."""
    queue = await admin.declare_queue(topology.tool_queue(tool), passive=True)
    count = queue.declaration_result.message_count
    assert count is not None
    return count


async def answers_seen(door: Door, call_id: str, count: int, timeout: float = 20) -> list[Answer]:
    async def enough() -> bool:
        return len(door.answers_to(call_id)) >= count

    await eventually(enough, timeout=timeout, what=f"{count} answer(s) to call {call_id}")
    return door.answers_to(call_id)


# --- yoke.tools.worker.serve -----------------------------------------------------------------


async def test_serve_answers_as_its_own_user_through_direct_reply_to_and_acks(
    admin: AbstractChannel, door: Door, new_tool: Callable[[], Awaitable[WorkerTool]]
) -> None:
    tool = await new_tool()
    seen: list[ToolCallRequest] = []

    async def greet(call: ToolCallRequest) -> str:
        seen.append(call)
        return f"hello {call.input['who']}"

    call_id = await publish_call(admin, door, tool.name, {"who": "Ada"})
    stopping = asyncio.Event()
    serving = asyncio.create_task(serve(tool.url, tool.name, greet, stopping=stopping))
    try:
        [answer] = await answers_seen(door, call_id, 1)
        assert answer.body == {"callId": call_id, "output": "hello Ada", "isError": False}
        assert answer.user_id == tool.user
        assert answer.reply_to is not None and answer.reply_to.startswith(DIRECT_REPLY_TO + ".")
        assert [call.idempotency_key for call in seen] == [f"key-{call_id}"]
    finally:
        stopping.set()
        await asyncio.wait_for(serving, 30)
    assert await waiting_calls(admin, tool.name) == 0  # acked: not back in the queue
    assert len(door.answers_to(call_id)) == 1


async def test_a_handler_that_raises_answers_with_an_error_result(
    admin: AbstractChannel, door: Door, new_tool: Callable[[], Awaitable[WorkerTool]]
) -> None:
    tool = await new_tool()

    async def broken(call: ToolCallRequest) -> str:
        raise ValueError(f"no such city: {call.input['city']}")

    call_id = await publish_call(admin, door, tool.name, {"city": "Atlantis"})
    stopping = asyncio.Event()
    serving = asyncio.create_task(serve(tool.url, tool.name, broken, stopping=stopping))
    try:
        [answer] = await answers_seen(door, call_id, 1)
    finally:
        stopping.set()
        await asyncio.wait_for(serving, 30)
    assert answer.body == {"callId": call_id, "output": "no such city: Atlantis", "isError": True}


async def test_a_call_is_acked_only_once_the_door_has_replied(
    admin: AbstractChannel, door: Door, new_tool: Callable[[], Awaitable[WorkerTool]]
) -> None:
    tool = await new_tool()
    runs: list[str] = []

    async def record(call: ToolCallRequest) -> str:
        runs.append(call.call_id)
        return "done"

    door.silent = True
    call_id = await publish_call(admin, door, tool.name, {})
    serving = asyncio.create_task(serve(tool.url, tool.name, record, reply_timeout=1))
    await answers_seen(door, call_id, 1)
    serving.cancel()  # the worker dies with the door's reply still to come
    with pytest.raises(asyncio.CancelledError):
        await serving

    async def back() -> bool:
        return await waiting_calls(admin, tool.name) == 1

    await eventually(back, timeout=20, what="the unreplied call back in the queue")

    door.silent = False
    stopping = asyncio.Event()
    serving = asyncio.create_task(serve(tool.url, tool.name, record, stopping=stopping))
    try:
        answers = await answers_seen(door, call_id, 2)
    finally:
        stopping.set()
        await asyncio.wait_for(serving, 30)
    assert runs[0] == runs[-1] == call_id and len(runs) == 2  # run again on the redelivery
    assert answers[-1].body["output"] == "done"
    assert await waiting_calls(admin, tool.name) == 0


async def test_a_call_past_its_deadline_is_not_run_and_a_rejection_is_logged(
    admin: AbstractChannel,
    door: Door,
    new_tool: Callable[[], Awaitable[WorkerTool]],
    caplog: pytest.LogCaptureFixture,
) -> None:
    tool = await new_tool()
    runs: list[str] = []

    async def record(call: ToolCallRequest) -> str:
        runs.append(call.call_id)
        return "done"

    late = await publish_call(admin, door, tool.name, {}, seconds=-5)  # no expiration set
    live = await publish_call(admin, door, tool.name, {})
    door.calls.pop(live)  # the door knows it no more: its answer is rejected unknown_call
    stopping = asyncio.Event()
    with caplog.at_level(logging.WARNING, logger="yoke.tools.worker"):
        serving = asyncio.create_task(serve(tool.url, tool.name, record, stopping=stopping))
        try:
            await answers_seen(door, live, 1)

            async def drained() -> bool:
                return await waiting_calls(admin, tool.name) == 0 and any(
                    "unknown_call" in record.getMessage() for record in caplog.records
                )

            await eventually(drained, timeout=20, what="both calls acked, the rejection logged")
        finally:
            stopping.set()
            await asyncio.wait_for(serving, 30)
    assert runs == [live]
    assert door.answers_to(late) == []


# --- a worker written with pika alone ---------------------------------------------------------


async def test_a_pika_worker_answers_and_a_second_answer_is_a_duplicate(
    admin: AbstractChannel, door: Door, new_tool: Callable[[], Awaitable[WorkerTool]]
) -> None:
    tool = await new_tool()
    call_id = await publish_call(admin, door, tool.name, {"n": 7})
    worker = await WorkerProcess.start(tool.url, tool.name, "twice", "--marker", "m1")
    try:
        first = await worker.line("reply", callId=call_id)
        second = await worker.line("reply", callId=call_id)
    finally:
        await worker.stop()
    assert first["reply"] == {"status": "accepted"}
    assert second["reply"] == {"status": "accepted", "duplicate": True}
    [answer, _] = door.answers_to(call_id)
    assert json.loads(str(answer.body["output"])) == {"input": {"n": 7}, "marker": "m1"}
    assert answer.user_id == tool.user
    assert await waiting_calls(admin, tool.name) == 0


async def test_a_pika_worker_without_user_id_or_answering_another_tool_is_rejected(
    admin: AbstractChannel, door: Door, new_tool: Callable[[], Awaitable[WorkerTool]]
) -> None:
    mine, other = await new_tool(), await new_tool()
    call_id = await publish_call(admin, door, mine.name, {})

    anonymous = await WorkerProcess.start(
        mine.url, mine.name, "no-user-id", "--target-call", call_id
    )
    assert await anonymous.exited() == 0, anonymous.stderr.decode()
    impostor = await WorkerProcess.start(
        other.url, other.name, "as-other", "--target-call", call_id
    )
    assert await impostor.exited() == 0, impostor.stderr.decode()

    assert (await anonymous.line("reply"))["reply"]["code"] == "missing_user_id"
    assert (await impostor.line("reply"))["reply"]["code"] == "wrong_tool"
    assert [answer.user_id for answer in door.answers_to(call_id)] == [
        None,
        other.user,
    ]


async def test_a_holding_pika_worker_keeps_the_call_until_released_and_a_killed_one_gives_it_back(
    admin: AbstractChannel,
    door: Door,
    new_tool: Callable[[], Awaitable[WorkerTool]],
    tmp_path: Path,
) -> None:
    tool = await new_tool()
    release = tmp_path / "release"
    call_id = await publish_call(admin, door, tool.name, {})
    holder = await WorkerProcess.start(tool.url, tool.name, "hold", "--release", str(release))
    await holder.line("call", callId=call_id)
    await holder.kill()  # unacked: the broker hands it out again

    holder = await WorkerProcess.start(tool.url, tool.name, "hold", "--release", str(release))
    try:
        again = await holder.line("call", callId=call_id)
        assert again["redelivered"] is True
        assert door.answers_to(call_id) == []
        release.touch()
        reply = await holder.line("reply", callId=call_id)
    finally:
        await holder.stop()
    assert reply["reply"] == {"status": "accepted"}
    assert await waiting_calls(admin, tool.name) == 0

"""Approvals (docs/approvals.md) in a mesh of real processes: a call of a gated tool waits in the
store for a person's decision, which comes through the one door (``tool.approval.submit``)
whether a bridge's publisher, the CLI or the HTTP gateway sends it.

Agents here mostly call the built-in ``calculator`` (so an approved call runs in the processor
that owns the conversation, in its lane); one calls a worker tool served by the pika worker and
one the test MCP server, each gated. The ``fixture-script`` model plays each join's steps, and
the fake OpenAI server is the model of the test that checks what the model is shown. A pending
approval across a restart of every service and of RabbitMQ: tests/tools/test_approvals_restart.py.
"""

from __future__ import annotations

import asyncio
import json
import shlex
import sys
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any

import aio_pika
import pytest

from tests.support.approvals import (
    DONE,
    WAIT,
    decide_as,
    ended_once,
    gated_join,
    results,
    still_pending,
    sums,
    texts,
)
from tests.support.broker import Management
from tests.support.cli import run_yoke, run_yoke_commands
from tests.support.fake_openai import FakeOpenAI, completion, openai_env
from tests.support.mesh import Mesh, lines_until, say
from tests.support.processes import eventually
from tests.support.worker_process import WorkerProcess, as_user
from yoke.bus import topology
from yoke.bus.amqp_nodes import amqp_vhost
from yoke.cli.base import UsageError
from yoke.cli.main import join_config_of, parser
from yoke.cli.publishers import create_publisher, management_of
from yoke.client import Client
from yoke.core.models import Message
from yoke.llm.base import ScriptedCall, ScriptedOutput
from yoke.runtime.calls.approvals import pending_approvals
from yoke.runtime.calls.records import (
    TOOL_CALL_DECISIONS_COLLECTION,
    TOOL_CALLS_COLLECTION,
)
from yoke.runtime.catalog_store import ToolCatalog
from yoke.runtime.join_config import ApprovalConfig, JoinConfig
from yoke.runtime.joins import create_agent, create_forum, join_conversation
from yoke.runtime.posting import Poster
from yoke.store.database import Store

pytestmark = pytest.mark.slow

WORKER_TIMEOUT = 120.0  # the worker tool's own timeout


@pytest.fixture(scope="module")
def mesh_env(fake_openai: FakeOpenAI) -> dict[str, str]:
    return openai_env(fake_openai.base_url)


@pytest.fixture(scope="module")
def before_mesh(registered: Registered) -> None:
    """The tools are registered before the mesh starts (a processor trusts its copy of the
    catalog for a few seconds, and starts the MCP server at once)."""


@pytest.fixture(scope="module")
def yoke_env(
    servers: tuple[str, str, str], amqp_url: str, module_mongodb_url: str
) -> dict[str, str]:
    return {
        "YOKE_AMQP_URL": amqp_url,
        "YOKE_MONGODB_URL": module_mongodb_url,
        "YOKE_MANAGEMENT_URL": servers[2],
    }


class Publisher:
    """A RabbitMQ user of the module's: a bridge's, or a worker tool's (its name the tool's)."""

    def __init__(self, name: str, url: str) -> None:
        self.name = name
        self.url = url


class Registered:
    """What an operator registered before the mesh started."""

    def __init__(self, approver: Publisher, worker: Publisher, mcp_server: str) -> None:
        self.approver = approver
        self.worker = worker
        self.mcp_server = mcp_server


@pytest.fixture(scope="module")
async def registered(
    servers: tuple[str, str, str],
    amqp_url: str,
    yoke_env: dict[str, str],
    tmp_path_factory: pytest.TempPathFactory,
) -> AsyncIterator[Registered]:
    """In one ``yoke`` process: a publisher made with ``yoke publisher create --can-approve``,
    a worker tool (``yoke tools add-worker``) and the test MCP server over stdio (``yoke tools
    add-mcp``). RabbitMQ users are per broker: each name is new, deleted after the module."""
    schema = tmp_path_factory.mktemp("tool") / "schema.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"q": {"type": "string"}}}))
    approver, worker, server = (f"{kind}{uuid.uuid4().hex[:10]}" for kind in "pwm")
    mcp = shlex.join([sys.executable, "-m", "tests.support.mcp_server", "--transport", "stdio"])
    users = [approver, topology.tool_user(worker, amqp_vhost(amqp_url))]
    try:
        code, outputs, err = await run_yoke_commands(
            yoke_env,
            [
                ["publisher", "create", "--name", approver, "--can-approve"],
                [
                    *("tools", "add-worker", worker, "--schema", str(schema)),
                    *("--description", "refunds", "--timeout", f"{WORKER_TIMEOUT:g}"),
                ],
                ["tools", "add-mcp", server, "--command", mcp],
            ],
        )
        assert code == 0 and len(outputs) == 3, err
        passwords = [output.strip().splitlines()[-1] for output in outputs[:2]]
        yield Registered(
            Publisher(approver, as_user(amqp_url, approver, passwords[0])),
            Publisher(
                worker,
                as_user(amqp_url, topology.tool_user(worker, amqp_vhost(amqp_url)), passwords[1]),
            ),
            server,
        )
    finally:
        await delete_users(servers[2], amqp_url, users)


async def delete_users(management: str, amqp_url: str, users: list[str]) -> None:
    api = Management(management, amqp_url)
    for user in users:
        await api.delete_user(user)


@pytest.fixture(scope="module")
async def publishers(
    servers: tuple[str, str, str], amqp_url: str, registered: Registered
) -> AsyncIterator[dict[str, Publisher]]:
    """``approver`` (made with --can-approve), and ``bridge``, made as ``yoke publisher
    create`` makes one without it."""
    name = f"p{uuid.uuid4().hex[:10]}"
    password = await create_publisher(management_of(amqp_url, servers[2]), name)
    try:
        yield {
            "approver": registered.approver,
            "bridge": Publisher(name, as_user(amqp_url, name, password)),
        }
    finally:
        await delete_users(servers[2], amqp_url, [name])


@pytest.fixture(scope="module")
def worker_tool(registered: Registered) -> Publisher:
    return registered.worker


@pytest.fixture(scope="module")
async def operator(amqp_url: str, mesh: Mesh) -> AsyncIterator[Client]:
    """The mesh's own user, as the CLI and the HTTP gateway speak to the door."""
    async with Client(amqp_url, queue_prefix=topology.CLI_REPLY_QUEUE_PREFIX) as client:
        yield client


@pytest.fixture(scope="module")
async def approver(publishers: dict[str, Publisher]) -> AsyncIterator[Client]:
    async with Client(publishers["approver"].url) as client:
        yield client


class ForumApprovals:
    """What a bridge bound to ``tool.approval.*.<forum>`` on yoke.forum receives."""

    def __init__(self, queue: aio_pika.abc.AbstractQueue) -> None:
        self.queue = queue
        self.events: list[dict[str, Any]] = []

    async def next(self, event_type: str, timeout: float = WAIT) -> dict[str, Any]:
        """The next event of ``event_type`` (its envelope), in arrival order."""
        async with asyncio.timeout(timeout):
            while True:
                for index, event in enumerate(self.events):
                    if event["type"] == event_type:
                        return self.events.pop(index)
                message = await self.queue.get(timeout=timeout, fail=False)
                if message is None:
                    await asyncio.sleep(0.05)
                    continue
                await message.ack()
                self.events.append(json.loads(message.body))


async def without_user_id(url: str, body: bytes) -> dict[str, Any]:
    """A decision published with no user_id; the door's answer, on direct reply-to (the one
    queue it answers a publisher it cannot name on)."""
    connection = await aio_pika.connect(url)
    try:
        channel = await connection.channel()
        replies = await channel.get_queue(topology.DIRECT_REPLY_PREFIX, ensure=False)
        answered: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()

        async def keep(delivery: aio_pika.abc.AbstractIncomingMessage) -> None:
            if not answered.done():
                answered.set_result(delivery.body)

        await replies.consume(keep, no_ack=True)
        exchange = await channel.get_exchange(topology.COMMANDS_EXCHANGE, ensure=False)
        await exchange.publish(
            aio_pika.Message(body, reply_to=replies.name, correlation_id="anonymous"),
            routing_key=topology.APPROVAL_COMMAND,
        )
        reply: dict[str, Any] = json.loads(await asyncio.wait_for(answered, WAIT))
        return reply
    finally:
        await connection.close()


@pytest.fixture
async def watch(
    publishers: dict[str, Publisher],
) -> AsyncIterator[Any]:
    """watch(forum_id) -> ForumApprovals, as the approving publisher reads them."""
    connection = await aio_pika.connect_robust(publishers["approver"].url)
    channel = await connection.channel()

    async def bind(forum_id: str) -> ForumApprovals:
        queue = await channel.declare_queue(
            topology.bridge_queue_prefix(publishers["approver"].name) + uuid.uuid4().hex,
            exclusive=True,
            auto_delete=True,
        )
        await queue.bind(topology.FORUM_EXCHANGE, routing_key=f"tool.approval.*.{forum_id}")
        return ForumApprovals(queue)

    try:
        yield bind
    finally:
        await connection.close()


async def test_a_can_approve_publisher_approves_over_amqp_and_others_are_refused(
    mesh: Mesh,
    store: Store,
    poster: Poster,
    client: Client,
    approver: Client,
    publishers: dict[str, Publisher],
    watch: Any,
) -> None:
    forum_id, agent_id, monologue_id = await gated_join(store, poster, script=sums("6*7"))
    approvals = await watch(forum_id)
    await say(client, forum_id, "what is six times seven?")
    requested = (await approvals.next("tool.approval.requested"))["payload"]
    call_id = requested["callId"]
    assert requested["forumId"] == forum_id and requested["agentActorId"] == agent_id
    assert requested["tool"] == "calculator" and requested["input"] == {"expression": "6*7"}
    assert datetime.fromisoformat(requested["deadline"]) > datetime.now(UTC)
    # Waiting: nothing ran, nothing answered.
    assert await still_pending(store, call_id)
    assert results(await store.history(monologue_id)) == []
    [listed] = await pending_approvals(store, forum_id)
    assert (listed.call_id, listed.tool, listed.input) == (
        call_id,
        "calculator",
        requested["input"],
    )

    # A bridge made without --can-approve, and a command without user_id, decide nothing.
    async with Client(publishers["bridge"].url) as bridge:
        refused = await bridge.decide(
            call_id,
            "approve",
            external_id="bridge:eve",
            display_name="Eve",
            user_id=publishers["bridge"].name,
        )
    assert (refused.status, refused.code) == ("rejected", "not_allowed"), refused
    body = json.dumps(
        {"callId": call_id, "decision": "approve", "by": {"externalId": "x", "displayName": "X"}}
    ).encode()
    anonymous = await without_user_id(publishers["approver"].url, body)
    assert (anonymous["status"], anonymous["code"]) == ("rejected", "missing_user_id"), anonymous
    assert await still_pending(store, call_id)
    assert await store.db[TOOL_CALL_DECISIONS_COLLECTION].count_documents({}) == 0

    by: dict[str, Any] = {"external_id": "slack:U1", "display_name": "Ada"}
    reply = await approver.decide(call_id, "approve", **by, user_id=publishers["approver"].name)
    assert (reply.status, reply.duplicate) == ("accepted", None), reply
    decided = (await approvals.next("tool.approval.decided"))["payload"]
    assert decided == {
        "forumId": forum_id,
        "callId": call_id,
        "decision": "approve",
        # A bridge's people are its own: the door keeps them in its namespace.
        "by": {"externalId": f"amqp:{publishers['approver'].name}:slack:U1", "displayName": "Ada"},
    }
    result = await ended_once(store, monologue_id, call_id)
    assert (result.output, result.is_error) == ("42", False)
    forum = await lines_until(store, forum_id, lambda lines: DONE in texts(lines), timeout=WAIT)
    assert texts(forum) == [DONE]

    # The same decision again is a duplicate; another is too late.
    again = await approver.decide(call_id, "approve", **by, user_id=publishers["approver"].name)
    assert (again.status, again.duplicate) == ("accepted", True), again
    late = await approver.decide(
        call_id, "reject", **by, reason="no", user_id=publishers["approver"].name
    )
    assert (late.status, late.code) == ("rejected", "already_decided"), late
    assert await pending_approvals(store, forum_id) == []
    assert results(await store.history(monologue_id)) == [result]


async def test_yoke_approve_lists_and_approves_as_the_operator(
    mesh: Mesh, store: Store, poster: Poster, client: Client, yoke_env: dict[str, str], watch: Any
) -> None:
    forum_id, _, monologue_id = await gated_join(store, poster, script=sums("2**10"))
    approvals = await watch(forum_id)
    await say(client, forum_id, "two to the tenth?")
    call_id = (await approvals.next("tool.approval.requested"))["payload"]["callId"]

    code, out, err = await run_yoke(yoke_env, "approvals", "--forum", forum_id, "--json")
    assert code == 0, err
    [listed] = [json.loads(line) for line in out.splitlines()]
    assert listed["callId"] == call_id and listed["input"] == {"expression": "2**10"}

    code, out, err = await run_yoke(yoke_env, "approve", call_id, "--as", "Grace")
    assert code == 0, err
    decided = (await approvals.next("tool.approval.decided"))["payload"]
    assert decided["by"] == {"externalId": "cli:Grace", "displayName": "Grace"}
    result = await ended_once(store, monologue_id, call_id)
    assert result.output == "1024"

    code, _, err = await run_yoke(yoke_env, "reject", call_id, "--reason", "late", "--as", "Bo")
    assert code == 1 and "already_decided" in err, err
    assert await pending_approvals(store, forum_id) == []


async def test_a_rejection_is_the_error_result_the_model_is_shown_and_a_waiting_line_is_told(
    mesh: Mesh,
    store: Store,
    poster: Poster,
    client: Client,
    yoke_env: dict[str, str],
    fake_openai: FakeOpenAI,
    watch: Any,
) -> None:
    fake_openai.script(
        completion(None, [("call-r", "calculator", '{"expression": "1/0"}')]),
        completion("understood, no sums then"),
    )
    forum_id, _, monologue_id = await gated_join(store, poster, model="gpt-test")
    approvals = await watch(forum_id)
    await say(client, forum_id, "divide one by zero", who="Ada")
    call_id = (await approvals.next("tool.approval.requested"))["payload"]["callId"]

    # A line while the call waits: one notice in reply to it, and no model call of its own.
    waiting = await say(client, forum_id, "are you there?", who="Ada")

    def told(lines: list[Message]) -> bool:
        return any(line.type == "notice" and line.meta.in_reply_to == waiting for line in lines)

    forum = await lines_until(store, forum_id, told, timeout=WAIT)
    [notice] = [line for line in forum if line.type == "notice"]
    assert notice.text == "I will answer once a person decides whether I may use calculator."
    assert len(fake_openai.requests) == 1

    code, _, err = await run_yoke(
        yoke_env, "reject", call_id, "--reason", "too risky", "--as", "Bo"
    )
    assert code == 0, err
    decided = (await approvals.next("tool.approval.decided"))["payload"]
    assert (decided["decision"], decided["reason"]) == ("reject", "too risky")
    result = await ended_once(store, monologue_id, call_id)
    assert (result.output, result.is_error) == ("rejected by Bo: too risky", True)

    forum = await lines_until(
        store, forum_id, lambda lines: "understood, no sums then" in texts(lines), timeout=WAIT
    )
    # One model call answered the result and the line that waited (invariant 10).
    assert texts(forum) == ["understood, no sums then"]
    assert len(fake_openai.requests) == 2 and not fake_openai.rejected
    messages = fake_openai.requests[1]["messages"]
    [tool_message] = [m for m in messages if m["role"] == "tool"]
    assert "rejected by Bo: too risky" in tool_message["content"]
    assert any("are you there?" in str(m.get("content")) for m in messages)
    assert [line.type for line in forum].count("notice") == 1


async def test_a_stop_in_the_forum_ends_a_pending_approval_and_says_so(
    mesh: Mesh,
    store: Store,
    poster: Poster,
    client: Client,
    operator: Client,
    watch: Any,
) -> None:
    forum_id, _, monologue_id = await gated_join(store, poster, script=sums("8*8"))
    approvals = await watch(forum_id)
    await say(client, forum_id, "eight squared?", who="Ada")
    call_id = (await approvals.next("tool.approval.requested"))["payload"]["callId"]

    await say(client, forum_id, "/stop", who="Ada")
    decided = (await approvals.next("tool.approval.decided"))["payload"]
    assert (decided["callId"], decided["decision"]) == (call_id, "stopped")
    assert decided["by"]["displayName"] == "Ada"
    result = await ended_once(store, monologue_id, call_id)
    assert (result.output, result.is_error) == ("stopped by Ada", True)
    assert await pending_approvals(store, forum_id) == []
    late = await decide_as(operator, call_id, "approve", "Bo")
    assert (late.status, late.code) == ("rejected", "already_decided"), late


async def test_no_decision_by_the_deadline_ends_the_call_and_a_late_decision_is_refused(
    mesh: Mesh,
    store: Store,
    poster: Poster,
    client: Client,
    approver: Client,
    publishers: dict[str, Publisher],
    watch: Any,
) -> None:
    forum_id, _, monologue_id = await gated_join(store, poster, script=sums("1+1"), timeout=2)
    approvals = await watch(forum_id)
    await say(client, forum_id, "one plus one?")
    call_id = (await approvals.next("tool.approval.requested"))["payload"]["callId"]

    decided = (await approvals.next("tool.approval.decided"))["payload"]
    assert decided == {"forumId": forum_id, "callId": call_id, "decision": "expired"}
    result = await ended_once(store, monologue_id, call_id)
    assert (result.output, result.is_error) == ("no decision within 2 s", True)
    await lines_until(store, forum_id, lambda lines: texts(lines) == [DONE], timeout=WAIT)

    late = await approver.decide(
        call_id,
        "approve",
        external_id="slack:U1",
        display_name="Ada",
        user_id=publishers["approver"].name,
    )
    assert (late.status, late.code) == ("rejected", "already_decided"), late
    assert "expired" in (late.error or "")


async def test_two_decisions_racing_one_wins_and_the_other_is_refused(
    mesh: Mesh,
    store: Store,
    poster: Poster,
    client: Client,
    operator: Client,
    amqp_url: str,
    watch: Any,
) -> None:
    forum_id, _, monologue_id = await gated_join(store, poster, script=sums("3*3"))
    approvals = await watch(forum_id)
    await say(client, forum_id, "three squared?")
    call_id = (await approvals.next("tool.approval.requested"))["payload"]["callId"]

    async with Client(amqp_url, queue_prefix=topology.CLI_REPLY_QUEUE_PREFIX) as other:
        # Two connections, two people, at once.
        approve, reject = await asyncio.gather(
            decide_as(operator, call_id, "approve", "A"),
            decide_as(other, call_id, "reject", "B", reason="no"),
        )
    replies = {"approve": approve, "reject": reject}
    winners = [name for name, reply in replies.items() if reply.status == "accepted"]
    assert len(winners) == 1, replies
    [loser] = [reply for reply in replies.values() if reply.status == "rejected"]
    assert loser.code == "already_decided", loser
    decided = (await approvals.next("tool.approval.decided"))["payload"]
    assert decided["decision"] == winners[0]
    result = await ended_once(store, monologue_id, call_id)
    expected = ("9", False) if winners[0] == "approve" else ("rejected by B: no", True)
    assert (result.output, result.is_error) == expected
    decision = await store.db[TOOL_CALL_DECISIONS_COLLECTION].find_one({"_id": call_id})
    assert decision is not None and decision["decision"] == winners[0]
    with pytest.raises(TimeoutError):
        await approvals.next("tool.approval.decided", timeout=1)  # one decision, announced once


async def test_two_gated_calls_of_one_round_are_decided_each_by_its_own_id(
    mesh: Mesh, store: Store, poster: Poster, client: Client, operator: Client, watch: Any
) -> None:
    forum_id, _, monologue_id = await gated_join(store, poster, script=sums("2+3", "4*5"))
    approvals = await watch(forum_id)
    await say(client, forum_id, "two sums please")
    first = (await approvals.next("tool.approval.requested"))["payload"]
    second = (await approvals.next("tool.approval.requested"))["payload"]
    by_input = {event["input"]["expression"]: event["callId"] for event in (first, second)}
    assert set(by_input) == {"2+3", "4*5"}

    # The second approved first: it runs with its own input; the first still waits.
    reply = await decide_as(operator, by_input["4*5"], "approve", "Ada")
    assert reply.status == "accepted", reply
    later = await ended_once(store, monologue_id, by_input["4*5"])
    assert later.output == "20"
    assert await still_pending(store, by_input["2+3"])
    [still] = await pending_approvals(store, forum_id)
    assert still.call_id == by_input["2+3"]
    assert texts(await store.history(forum_id)) == []  # the round is not complete

    reply = await decide_as(operator, by_input["2+3"], "approve", "Ada")
    assert reply.status == "accepted", reply
    earlier = await ended_once(store, monologue_id, by_input["2+3"])
    assert earlier.output == "5"
    forum = await lines_until(store, forum_id, lambda lines: DONE in texts(lines), timeout=WAIT)
    assert texts(forum) == [DONE]  # one answer for the round
    assert sorted(r.output for r in results(await store.history(monologue_id))) == ["20", "5"]


async def test_an_approved_worker_call_goes_to_its_worker_then_with_its_own_timeout(
    mesh: Mesh,
    store: Store,
    poster: Poster,
    client: Client,
    operator: Client,
    worker_tool: Publisher,
    watch: Any,
) -> None:
    script = [
        ScriptedOutput(tool_calls=[ScriptedCall(name=worker_tool.name, input={"q": "A1001"})]),
        ScriptedOutput(text=DONE),
    ]
    forum_id, _, monologue_id = await gated_join(
        store, poster, script=script, tool=worker_tool.name
    )
    approvals = await watch(forum_id)
    worker = await WorkerProcess.start(worker_tool.url, worker_tool.name, "answer")
    try:
        await worker.line("ready", timeout=WAIT)
        await say(client, forum_id, "refund order A1001")
        call_id = (await approvals.next("tool.approval.requested"))["payload"]["callId"]
        document = await store.db[TOOL_CALLS_COLLECTION].find_one({"_id": call_id})
        assert document is not None
        requested_at: datetime = document["openedAt"].replace(tzinfo=UTC)
        # Time passes before anyone decides: the tool's timeout must start at the approval.
        await asyncio.sleep(1.5)
        assert [line for line in worker.lines if line["event"] == "call"] == []
        approved_at = datetime.now(UTC)
        reply = await decide_as(operator, call_id, "approve", "Ada")
        assert reply.status == "accepted", reply

        call = await worker.line("call", timeout=WAIT, callId=call_id)
        deadline = datetime.fromisoformat(call["call"]["deadline"])
        assert (deadline - approved_at).total_seconds() >= WORKER_TIMEOUT - 0.5
        assert (deadline - requested_at).total_seconds() >= WORKER_TIMEOUT + 1
        assert call["call"]["input"] == {"q": "A1001"}
        result = await ended_once(store, monologue_id, call_id)
        assert json.loads(result.output)["input"] == {"q": "A1001"}
        await lines_until(store, forum_id, lambda lines: texts(lines) == [DONE], timeout=WAIT)
        assert len([line for line in worker.lines if line["event"] == "call"]) == 1
    finally:
        await worker.stop()


async def test_an_approved_mcp_call_runs_through_its_server_gated_by_server_star(
    mesh: Mesh,
    registered: Registered,
    store: Store,
    poster: Poster,
    client: Client,
    operator: Client,
    watch: Any,
) -> None:
    """``SERVER__*`` gates every tool of an MCP server; approved, the call goes to the server
    (the test server over stdio, which the processor starts) and its answer is the result."""
    server = registered.mcp_server

    async def listed() -> bool:
        entry = (await ToolCatalog(store).entries(fresh=True)).get(f"{server}__echo")
        return entry is not None and entry.ready

    await eventually(listed, timeout=60, what=f"{server}__echo in the catalog", interval=0.3)
    forum = await create_forum(store, "approvals")
    agent = await create_agent(store, "echoer")
    script = [
        ScriptedOutput(tool_calls=[ScriptedCall(name=f"{server}__echo", input={"text": "hi"})]),
        ScriptedOutput(text=DONE),
    ]
    config = JoinConfig(
        model="fixture-script",
        tools=[f"{server}__*"],
        script=script,
        approval=ApprovalConfig(tools=[f"{server}__*"]),
    )
    join = await join_conversation(store, poster, agent.id, forum.id, config)
    approvals = await watch(forum.id)
    await say(client, forum.id, "echo hi")
    requested = (await approvals.next("tool.approval.requested"))["payload"]
    assert requested["tool"] == f"{server}__echo"
    reply = await decide_as(operator, requested["callId"], "approve", "Ada")
    assert reply.status == "accepted", reply
    result = await ended_once(store, join.monologue_id, requested["callId"])
    assert (result.output, result.is_error) == ("hi", False)
    await lines_until(store, forum.id, lambda lines: texts(lines) == [DONE], timeout=WAIT)


@pytest.mark.parametrize(
    ("argv", "problem"),
    [
        (["--approve", "not a name"], "not a tool name: not a name"),
        (["--approval-timeout", "60"], "--approval-timeout needs --approve"),
        (["--approve", "refund", "--approval-timeout", "0"], "timeoutSeconds"),
    ],
)
def test_approval_options_are_checked_like_tools(argv: list[str], problem: str) -> None:
    args = parser().parse_args(["join", "--agent", "a", "--forum", "f", *argv])
    with pytest.raises(UsageError, match=problem):
        join_config_of(args)


def test_approval_options_go_over_the_configuration_file(tmp_path: Any) -> None:
    path = tmp_path / "join.json"
    path.write_text(json.dumps({"approval": {"tools": ["refund"], "timeoutSeconds": 60}}))
    args = parser().parse_args(
        ["join", "--agent", "a", "--forum", "f", "--config", str(path), "--approve", "files__*"]
    )
    approval = join_config_of(args).approval
    assert approval is not None
    assert (approval.tools, approval.timeout_seconds) == (["files__*"], 60)
    assert approval.gates("files__read") and not approval.gates("refund")
    assert JoinConfig().approval is None
    assert ApprovalConfig(tools=["refund"]).timeout_seconds == 86400

"""What each speaker at the door may do, end to end (invariants 12 and 13).

A real mesh, one worker tool registered with ``yoke tools add-worker`` before it starts (a
processor trusts its copy of the catalog for a few seconds), served by the pika worker
(tests/support/pika_worker.py, which knows only the contract). Its user answers its own
tool's calls and nothing else; an answer too large for the door ends its call at once; a
person's ``/stop`` is one command however it is typed; a publisher's right to decide
approvals is given, taken away, and not inherited by a user made again under its name.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from tests.support.cli import run_yoke, run_yoke_commands
from tests.support.mesh import JoinFactory, Mesh, agent_lines, lines_until, say
from tests.support.worker_process import as_user
from tests.support.worker_tools import (
    CLI_SECONDS,
    WorkerTool,
    ask_direct,
    registered_worker_tool,
    serving,
)
from yoke.bus import topology
from yoke.cli.publishers import delete_user, management_of
from yoke.client import Client
from yoke.core.models import Message, ToolResultPart
from yoke.llm.base import ScriptedCall, ScriptedOutput
from yoke.runtime.calls.records import TOOL_CALL_ENDS_COLLECTION, own_result_line_id
from yoke.runtime.joins import Join
from yoke.store.database import Store

pytestmark = pytest.mark.slow

MAX_TEXT_BYTES = 4096  # the mesh's YOKE_MAX_TEXT_BYTES here: small answers cross it
MAX_BODY_BYTES = MAX_TEXT_BYTES * 2 + 4096  # the door's command size limit that follows
TIMEOUT = 120  # the tool's own: a call ended before it was ended by something else
WAIT = 60  # the most a test waits for anything the mesh does (well within TIMEOUT)


@pytest.fixture(scope="module")
def mesh_env() -> dict[str, str]:
    return {"YOKE_MAX_TEXT_BYTES": str(MAX_TEXT_BYTES)}


@pytest.fixture(scope="module")
async def tool(
    amqp_url: str, module_mongodb_url: str, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[WorkerTool]:
    schema = {"type": "object", "properties": {"q": {"type": "string"}}}
    name = f"door{uuid.uuid4().hex[:8]}"
    folder = Path(tmp_path_factory.mktemp("tool"))
    async with registered_worker_tool(
        amqp_url, module_mongodb_url, name, schema, folder, timeout=TIMEOUT
    ) as made:
        yield made


@pytest.fixture(scope="module")
def before_mesh(tool: WorkerTool) -> None:
    """The worker tool is in the catalog when the services start."""


async def calling_join(new_join: JoinFactory, tool: WorkerTool, answer: str) -> tuple[str, Join]:
    """A ``fixture-script`` agent that calls ``tool`` once, then says ``answer``."""
    script = [
        ScriptedOutput(tool_calls=[ScriptedCall(name=tool.name, input={"q": "something"})]),
        ScriptedOutput(text=answer),
    ]
    return await new_join(model="fixture-script", tools=[tool.name], script=script)


def results(lines: list[Message]) -> list[tuple[Message, ToolResultPart]]:
    return [
        (line, part) for line in lines for part in line.parts if isinstance(part, ToolResultPart)
    ]


def kinds(lines: list[Message]) -> list[tuple[str, str]]:
    """(type, text) of the agents' lines in a forum."""
    return [(line.type, line.text) for line in agent_lines(lines)]


@pytest.mark.parametrize("typed", [" /stop", "/STOP  now"])
async def test_a_stop_typed_with_spaces_or_capitals_is_a_stop_and_nothing_else(
    store: Store, client: Client, new_join: JoinFactory, tool: WorkerTool, typed: str
) -> None:
    """One rule for what a command is: the arrival hook and the step agree, so the open call
    ends ``stopped by NAME``, the forum gets one notice and no chat answer."""
    forum_id, join = await calling_join(new_join, tool, "answered after the stop")
    async with serving(tool, "never") as worker:
        await say(client, forum_id, "look something up", who="Ada")
        call = await worker.line("call", timeout=WAIT)
        stop = await say(client, forum_id, typed, who="Ada")
        monologue = await lines_until(
            store, join.monologue_id, lambda lines: bool(results(lines)), WAIT
        )
    [(_, result)] = results(monologue)
    assert (result.output, result.is_error) == ("stopped by Ada", True)
    end = await store.db[TOOL_CALL_ENDS_COLLECTION].find_one({"_id": call["callId"]})
    assert end is not None and end["outcome"] == "stopped"

    # Steps run in seq order: once the next line is answered, the stop's step is long done.
    after = await say(client, forum_id, "what now?", who="Ada")
    forum = await lines_until(
        store, forum_id, lambda lines: any(line.type == "message" for line in agent_lines(lines))
    )
    [notice, answer] = agent_lines(forum)
    assert notice.type == "notice" and notice.meta.in_reply_to == stop and "Ada" in notice.text
    assert (answer.type, answer.text, answer.meta.in_reply_to) == (
        "message",
        "answered after the stop",
        after,
    )


async def test_a_workers_user_may_answer_its_calls_and_say_nothing_else(
    store: Store, client: Client, new_join: JoinFactory, tool: WorkerTool
) -> None:
    forum_id, _ = await new_join()
    line = {
        "conversationId": forum_id,
        "author": {"externalId": "mallory", "displayName": "Mallory"},
        "text": "a worker speaking in the forum",
        "idempotencyKey": f"k-{uuid.uuid4().hex}",
    }
    posted = await ask_direct(tool.url, topology.SUBMIT_COMMAND, line, user_id=tool.user)
    assert (posted["status"], posted.get("code")) == ("rejected", "not_allowed"), posted
    assert tool.user in posted["error"] and "tool.result.submit" in posted["error"], posted
    decision = {
        "callId": f"call-{uuid.uuid4().hex}",
        "decision": "approve",
        "by": {"externalId": "mallory", "displayName": "Mallory"},
    }
    decided = await ask_direct(tool.url, topology.APPROVAL_COMMAND, decision, user_id=tool.user)
    assert (decided["status"], decided.get("code")) == ("rejected", "not_allowed"), decided
    assert tool.user in decided["error"] and "tool.result.submit" in decided["error"], decided
    # Nothing was written: the forum holds only what the test said since.
    said = await say(client, forum_id, "only this")
    assert [line.id for line in await store.history(forum_id)] == [said]


@pytest.mark.parametrize(
    ("output_bytes", "limit"),
    [(MAX_TEXT_BYTES + 1, MAX_TEXT_BYTES), (MAX_BODY_BYTES + 1, MAX_BODY_BYTES)],
    ids=["output", "command"],
)
async def test_an_answer_too_large_ends_the_call_at_once_saying_the_limit(
    store: Store,
    client: Client,
    new_join: JoinFactory,
    tool: WorkerTool,
    output_bytes: int,
    limit: int,
) -> None:
    forum_id, join = await calling_join(new_join, tool, "the tool's answer was too large")
    async with serving(tool, "answer", "--output-bytes", str(output_bytes)) as worker:
        await say(client, forum_id, "look something up")
        call = await worker.line("call", timeout=WAIT)
        reply: dict[str, Any] = (await worker.line("reply", callId=call["callId"], timeout=WAIT))[
            "reply"
        ]
    assert (reply["status"], reply.get("code")) == ("rejected", "too_large"), reply
    assert str(limit) in reply["error"], reply

    monologue = await lines_until(store, join.monologue_id, lambda ls: bool(results(ls)), WAIT)
    [(line, result)] = results(monologue)
    assert line.id == own_result_line_id(call["callId"])
    assert result.is_error
    assert "too large" in result.output and str(limit) in result.output, result.output
    [call_line] = [m for m in monologue if m.role == "agent" and m.created_at <= line.created_at]
    assert line.created_at - call_line.created_at < timedelta(seconds=WAIT)  # not the deadline
    end = await store.db[TOOL_CALL_ENDS_COLLECTION].find_one({"_id": call["callId"]})
    assert end is not None and end["outcome"] == "failed"

    forum = await lines_until(store, forum_id, lambda ls: bool(agent_lines(ls)), WAIT)
    assert kinds(forum) == [("message", "the tool's answer was too large")]
    late = await ask_direct(
        tool.url,
        topology.TOOL_RESULT_COMMAND,
        {"callId": call["callId"], "output": "small now"},
        user_id=tool.user,
    )
    assert (late["status"], late.get("code")) == ("rejected", "call_closed"), late


async def may_decide(url: str, user: str) -> bool:
    """Whether the door lets ``user`` decide: on a call that does not exist, a user that may
    is told so (``unknown_call``), one that may not is refused first (``not_allowed``)."""
    decision = {
        "callId": f"call-{uuid.uuid4().hex}",
        "decision": "approve",
        "by": {"externalId": "ada", "displayName": "Ada"},
    }
    reply = await ask_direct(url, topology.APPROVAL_COMMAND, decision, user_id=user)
    assert reply["status"] == "rejected" and reply["code"] in ("unknown_call", "not_allowed")
    return bool(reply["code"] == "unknown_call")


async def test_a_publishers_approval_right_can_be_taken_away_and_is_not_inherited(
    mesh: Mesh, amqp_url: str
) -> None:
    name = f"approver-{uuid.uuid4().hex[:8]}"
    env = mesh.env

    async def yoke(*args: str) -> str:
        code, out, err = await run_yoke(env, "publisher", *args, timeout=CLI_SECONDS)
        assert code == 0, err
        return out.splitlines()[-1] if out else ""

    try:
        password = await yoke("create", "--name", name, "--can-approve")
        assert await may_decide(as_user(amqp_url, name, password), name)

        # Deleted behind the mesh's back and made again: a new user starts with no rights.
        assert await delete_user(management_of(amqp_url), name)
        password = await yoke("create", "--name", name)
        assert not await may_decide(as_user(amqp_url, name, password), name)

        # Deleted with its rights, made again with the right, then the right taken away: the
        # user stays. (Two commands in one process: a start-up less.)
        code, outputs, err = await run_yoke_commands(
            env,
            [
                ["publisher", "revoke", "--name", name],
                ["publisher", "create", "--name", name, "--can-approve"],
            ],
            timeout=CLI_SECONDS,
        )
        assert code == 0, err
        url = as_user(amqp_url, name, outputs[1].splitlines()[-1])
        assert await may_decide(url, name)
        await yoke("revoke", "--name", name, "--can-approve")
        assert not await may_decide(url, name)
    finally:
        await delete_user(management_of(amqp_url), name)

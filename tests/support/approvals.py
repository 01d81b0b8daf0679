"""What the approval tests share: agents whose calls wait for approval, and how a test decides
(tests/tools/test_approvals.py, tests/tools/test_approvals_restart.py)."""

from __future__ import annotations

from typing import Literal

from tests.support.mesh import agent_lines
from tests.support.processes import eventually
from yoke.bus.amqp_nodes import amqp_user
from yoke.client import Client
from yoke.core.models import Message, SubmitReply, ToolResultPart
from yoke.llm.base import ScriptedCall, ScriptedOutput
from yoke.runtime.calls.records import (
    TOOL_CALL_ENDS_COLLECTION,
    TOOL_CALLS_COLLECTION,
    own_result_line_id,
)
from yoke.runtime.join_config import ApprovalConfig, JoinConfig
from yoke.runtime.joins import create_agent, create_forum, join_conversation
from yoke.runtime.posting import Poster
from yoke.store.database import Store

WAIT = 30.0  # the most any step of a test may take on a loaded machine
DONE = "the sums are done"


async def decide_as(
    operator: Client,
    call_id: str,
    decision: Literal["approve", "reject"],
    name: str,
    reason: str | None = None,
) -> SubmitReply:
    """What ``yoke approve/reject CALL_ID --as NAME`` publishes, from this process."""
    return await operator.decide(
        call_id,
        decision,
        external_id=f"cli:{name}",
        display_name=name,
        reason=reason,
        user_id=amqp_user(operator.amqp_url),
    )


def sums(*expressions: str, then: str = DONE) -> list[ScriptedOutput]:
    """One round calling the calculator once per expression, then ``then``, then an echo."""
    calls = [ScriptedCall(name="calculator", input={"expression": e}) for e in expressions]
    return [ScriptedOutput(tool_calls=calls), ScriptedOutput(text=then), ScriptedOutput(text="ok")]


async def gated_join(
    store: Store,
    poster: Poster,
    *,
    model: str = "fixture-script",
    script: list[ScriptedOutput] | None = None,
    timeout: float = 3600,
    tool: str = "calculator",
) -> tuple[str, str, str]:
    """A forum whose agent's calls of ``tool`` wait for approval: (forum, agent, monologue)."""
    forum = await create_forum(store, "approvals")
    agent = await create_agent(store, "accountant")
    config = JoinConfig(
        model=model,
        tools=[tool],
        script=script,
        approval=ApprovalConfig(tools=[tool], timeout_seconds=timeout),
    )
    join = await join_conversation(store, poster, agent.id, forum.id, config)
    return forum.id, agent.id, join.monologue_id


def results(lines: list[Message]) -> list[ToolResultPart]:
    return [part for line in lines for part in line.parts if isinstance(part, ToolResultPart)]


def texts(lines: list[Message]) -> list[str]:
    return [line.text for line in agent_lines(lines) if line.type == "message" and line.text]


async def ended_once(store: Store, monologue_id: str, call_id: str) -> ToolResultPart:
    """The call's one result line (the id derived from it), once its end is recorded."""
    line = await wait_for_message(store, own_result_line_id(call_id))
    assert line.conversation_id == monologue_id
    assert await store.db[TOOL_CALL_ENDS_COLLECTION].count_documents({"_id": call_id}) == 1
    [result] = results([line])
    return result


async def wait_for_message(store: Store, message_id: str) -> Message:
    found: Message | None = None

    async def written() -> bool:
        nonlocal found
        found = await store.get_message(message_id)
        return found is not None

    await eventually(written, timeout=WAIT, what=f"message {message_id}")
    assert found is not None
    return found


async def still_pending(store: Store, call_id: str) -> bool:
    call = await store.db[TOOL_CALLS_COLLECTION].find_one({"_id": call_id})
    return call is not None and call["state"] == "awaiting_approval"

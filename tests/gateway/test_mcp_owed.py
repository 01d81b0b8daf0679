"""The answers the MCP door owes (services/gateway/owed_answers.py), through the public surface:
the official ``mcp`` client, and raw HTTP for a caller that goes, against real processes.

An owed answer is handed back to one call only, however many come at once (the others send
their own messages); only a turn that has ended is handed back, so while an owed turn still
runs (waiting for an approver) a ``/stop`` or a new message gets through; and a caller that
goes while its line is being posted is owed its answer as one that goes later is.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any, get_args

import httpx
import pytest
from mcp.types import CallToolResult, TextContent

from services.gateway import owed_answers
from services.gateway.calling import kept_forum_id, turn_outcome
from services.gateway.mcp_door import DEFAULT_CONVERSATION, Outcome
from tests.support.fake_openai import FakeOpenAI, openai_env
from tests.support.gateway_process import metric
from tests.support.mcp_client import mcp_session
from tests.support.mesh import lines_until
from tests.support.processes import eventually
from tests.support.published import Agents
from yoke.core.models import Message
from yoke.store.database import Store

pytestmark = pytest.mark.slow

# Short, so that a slow turn runs out of time soon; the slow model answers after it.
CALL_TIMEOUT_SECONDS = 4.0
# Time enough on a loaded machine for what must happen and has no event to wait on.
WITHIN = 60.0


@pytest.fixture(scope="module")
def mesh_env(fake_openai: FakeOpenAI) -> dict[str, str]:
    # The fake OpenAI server for the agent whose tool call waits for an approver.
    return openai_env(fake_openai.base_url, give_up_seconds=10)


@pytest.fixture(scope="module")
def gateway_env() -> dict[str, str]:
    return {"YOKE_MCP_CALL_TIMEOUT_SECONDS": str(CALL_TIMEOUT_SECONDS)}


@pytest.fixture(scope="module")
def gateway_exits() -> tuple[int, ...]:
    return (0,)


def text_of(result: CallToolResult) -> list[str]:
    return [part.text for part in result.content if isinstance(part, TextContent)]


async def user_texts(store: Store, forum_id: str) -> list[str]:
    lines = await store.history(forum_id)
    return [line.text for line in lines if line.role == "user" and line.type == "message"]


async def owed_in(store: Store, forum_id: str) -> list[dict[str, Any]]:
    found = store.db[owed_answers.COLLECTION].find({"forumId": forum_id})
    return sorted(await found.to_list(), key=lambda owed: owed["lineSeq"])


async def ended(store: Store, forum_id: str, line: Message) -> None:
    """Once ``line``'s turn has ended in the store (its answer, or its end)."""

    async def check() -> bool:
        return await turn_outcome(store, forum_id, line) is not None

    await eventually(check, timeout=WITHIN, what=f"the end of {line.text!r}'s turn")


async def the_line(store: Store, forum_id: str, text: str) -> Message:
    lines = await lines_until(store, forum_id, lambda found: any(m.text == text for m in found))
    return next(line for line in lines if line.text == text and line.role == "user")


async def test_an_owed_answer_is_handed_back_to_one_of_several_calls_and_the_others_are_sent(
    gateway_url: str, agents: Agents, store: Store
) -> None:
    slow = await agents.publish(model="fixture-slow-6")
    caller = await agents.caller(slow.id)
    forum_id = kept_forum_id(caller.token, "mcp", slow, "k")
    async with mcp_session(gateway_url, caller.secret) as session:
        first = await session.call_tool(slow.id, {"message": "original", "conversation": "k"})
        assert "still working" in text_of(first)[0], first
        await ended(store, forum_id, await the_line(store, forum_id, "original"))

        results = await asyncio.gather(
            *(
                session.call_tool(slow.id, {"message": f"new {index}", "conversation": "k"})
                for index in range(4)
            )
        )
    collected = [index for index, result in enumerate(results) if "original" in text_of(result)]
    assert len(collected) == 1, [text_of(result) for result in results]
    [winner] = collected
    answer, note = text_of(results[winner])
    assert answer == "original" and "not sent" in note
    # Every other call sent its own message (and followed its own turn).
    for index, result in enumerate(results):
        if index != winner:
            assert not result.is_error and "not sent" not in " ".join(text_of(result)), result
    sent = sorted(f"new {index}" for index in range(4) if index != winner)
    assert sorted(await user_texts(store, forum_id)) == sorted(["original", *sent])
    assert all(owed["lineId"] != "original" for owed in await owed_in(store, forum_id))


async def test_while_an_owed_turn_still_runs_a_stop_and_new_messages_get_through(
    gateway_url: str, agents: Agents, store: Store, fake_openai: FakeOpenAI
) -> None:
    gated, caller, _ = await agents.gated(fake_openai)  # its calculator waits for an approver
    forum_id = kept_forum_id(caller.token, "mcp", gated, DEFAULT_CONVERSATION)
    async with mcp_session(gateway_url, caller.secret) as session:
        waiting = await session.call_tool(gated.id, {"message": "what is 6*7"})
        assert "still working" in text_of(waiting)[0], waiting
        asked = await the_line(store, forum_id, "what is 6*7")

        # The owed turn still waits for its approver: the /stop is sent, not held back.
        stopped = await session.call_tool(gated.id, {"message": "/stop"})
        assert "not sent" not in " ".join(text_of(stopped)), stopped
        assert await user_texts(store, forum_id) == ["what is 6*7", "/stop"]

        # The stop ended the owed turn too: the next call hands back how it ended, and says
        # that its own message was not sent.
        await ended(store, forum_id, asked)
        collected = await session.call_tool(gated.id, {"message": "hello?"})
        assert collected.is_error, collected
        said, note = text_of(collected)
        assert said.startswith("Stopped") and "not sent" in note, collected
        # (The /stop's own turn ended with the same notice: owed only if it ran out of time.)
        assert asked.id not in [owed["lineId"] for owed in await owed_in(store, forum_id)]
    assert await user_texts(store, forum_id) == ["what is 6*7", "/stop"]


async def calls_counted(gateway_url: str) -> float:
    """The MCP calls the gateway is done with, whatever their outcome."""
    counted = [
        await metric(gateway_url, "yoke_mcp_calls_total", outcome=outcome)
        for outcome in get_args(Outcome)
    ]
    return sum(counted)


ACCEPT = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json"}


async def test_a_caller_that_goes_while_its_line_is_posted_is_owed_its_answer(
    gateway_url: str, agents: Agents, store: Store
) -> None:
    # Slower than the deadline: a caller whose going the door missed is owed it as well.
    slow = await agents.publish(model="fixture-slow-6")
    caller = await agents.caller(slow.id)
    forum_id = kept_forum_id(caller.token, "mcp", slow, "c0")
    body = {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "tools/call",
        "params": {"name": slow.id, "arguments": {"message": "m0", "conversation": "c0"}},
    }
    calls_before = await calls_counted(gateway_url)
    async with httpx.AsyncClient(timeout=30, headers={**ACCEPT, **caller.headers}) as http:
        posting = asyncio.create_task(http.post(f"{gateway_url}/mcp", content=json.dumps(body)))

        # The caller goes while its line is being posted: as soon as the forum kept for it
        # exists (the mesh makes it for the first line, before the line itself).
        async def forum_made() -> bool:
            return posting.done() or await store.get_conversation(forum_id) is not None

        await eventually(forum_made, timeout=WITHIN, what="the kept forum")
        assert not posting.done(), posting
        posting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await posting

    # Once the gateway is done with the call, the answer is owed to the conversation.
    async def call_over() -> bool:
        return await calls_counted(gateway_url) > calls_before

    await eventually(call_over, timeout=WITHIN, what="the call's end")
    line = await the_line(store, forum_id, "m0")
    assert [owed["lineId"] for owed in await owed_in(store, forum_id)] == [line.id]

    # And the next call in the conversation collects it, once it is there.
    await ended(store, forum_id, line)
    started = time.monotonic()
    async with mcp_session(gateway_url, caller.secret) as session:
        result = await session.call_tool(slow.id, {"message": "m1", "conversation": "c0"})
    answer, note = text_of(result)
    assert answer == "m0" and "not sent" in note, result
    assert time.monotonic() - started < CALL_TIMEOUT_SECONDS * 10


def tool_call(name: str, message: str, conversation: str) -> str:
    arguments = {"message": message, "conversation": conversation}
    body = {"jsonrpc": "2.0", "id": 1, "method": "tools/call"}
    return json.dumps({**body, "params": {"name": name, "arguments": arguments}})


async def test_a_debt_claimed_by_a_caller_that_goes_before_its_answer_is_sent_stays_owed(
    gateway_url: str, agents: Agents, store: Store
) -> None:
    # Shorter than the deadline: its debts are left by callers that go while their turns run.
    slow = await agents.publish(model="fixture-slow-2")
    caller = await agents.caller(slow.id)
    forum_id = kept_forum_id(caller.token, "mcp", slow, "c")
    debts = store.db[owed_answers.COLLECTION]
    sent = [f"m{index}" for index in range(4)]
    async with httpx.AsyncClient(timeout=30, headers={**ACCEPT, **caller.headers}) as http:
        url = f"{gateway_url}/mcp"
        lines = []
        for text in sent:
            posting = asyncio.create_task(http.post(url, content=tool_call(slow.id, text, "c")))
            lines.append(await the_line(store, forum_id, text))
            assert not posting.done(), posting
            posting.cancel()  # while its turn runs: its answer is owed

            async def owed_now(line: Message = lines[-1]) -> bool:
                return line.id in [owed["lineId"] for owed in await owed_in(store, forum_id)]

            await eventually(owed_now, timeout=WITHIN, what=f"the debt of {text!r}")
        for line in lines:
            await ended(store, forum_id, line)
        first_ages = {owed["_id"]: owed["at"] for owed in await owed_in(store, forum_id)}
        assert len(first_ages) == len(sent), first_ages
        claims = [owed_answers.CLAIM_PREFIX + debt for debt in first_ages]

        # Collecting calls, each cancelled as soon as its claim is in the store (a call that
        # is answered before its claim is seen collected its debt: the next one tries again).
        went: str | None = None
        for attempt in range(len(sent)):
            collecting = tool_call(slow.id, f"x{attempt}", "c")
            posting = asyncio.create_task(http.post(url, content=collecting))
            deadline = time.monotonic() + WITHIN
            while not posting.done() and time.monotonic() < deadline:
                claim = await debts.find_one({"_id": {"$in": claims}})
                if claim is not None:
                    went = str(claim["_id"]).removeprefix(owed_answers.CLAIM_PREFIX)
                    break
            if went is not None:
                posting.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await posting
                break
            assert posting.done(), "the collecting call neither claimed nor ended in time"
            posting.result().raise_for_status()
        assert went is not None, "no collecting call's claim was seen before it was answered"

    # Once the gateway is done with the call that went, its claim is gone, and its debt is owed
    # still, at its first age: not paid to a caller that had gone.
    async def claims_gone() -> bool:
        return await debts.find_one({"_id": {"$in": claims}}) is None

    await eventually(claims_gone, timeout=WITHIN, what="the claim of the call that went")
    owed_now = {owed["_id"]: owed["at"] for owed in await owed_in(store, forum_id)}
    assert went in owed_now, f"{went} was paid to a caller that had gone: {owed_now}"
    assert owed_now[went] == first_ages[went]

    # And the next call collects it (the oldest debt left).
    line_id = went.rsplit("/", 1)[1]
    text = next(line.text for line in lines if line.id == line_id)
    async with mcp_session(gateway_url, caller.secret) as session:
        result = await session.call_tool(slow.id, {"message": "again", "conversation": "c"})
    answer, note = text_of(result)
    assert answer == text and "not sent" in note, result

    # Handed over this time, it is paid (once the gateway is done with the request).
    async def paid() -> bool:
        left = [owed["_id"] for owed in await owed_in(store, forum_id)]
        return went not in left and await claims_gone()

    await eventually(paid, timeout=WITHIN, what="the debt paid once its answer went out")

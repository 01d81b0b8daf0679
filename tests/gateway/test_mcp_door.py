"""The gateway's MCP door (services/gateway/mcp_door.py) end to end, with the official ``mcp``
client: the mesh and the gateway as real processes, agents answering with fixture models.

Tools are the published agents a token may call (and follow publishing without a restart); a
call is answered with the agent's reply, its deltas as progress notifications; past the
deadline the answer names the conversation, and calling there again collects it; unpublished
names, names without ``--can-call``, failed steps, bad arguments and hostile JSON-RPC bodies
are each answered in the protocol's words, never with a 500.
"""

from __future__ import annotations

import asyncio
import json
import re
import sys
import time
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
from mcp import ClientSession, MCPError
from mcp.types import INVALID_PARAMS, METHOD_NOT_FOUND, CallToolResult, TextContent

from services.gateway import owed_answers
from services.gateway.calling import caller_id, kept_forum_id, turn_outcome
from services.gateway.mcp_door import DEFAULT_CONVERSATION
from tests.support.fake_openai import FakeOpenAI, openai_env
from tests.support.gateway_process import metric, running_gateway
from tests.support.mcp_client import mcp_client, mcp_session
from tests.support.mesh import Mesh, lines_until
from tests.support.processes import eventually
from tests.support.published import Agents
from tests.support.store_operations import breakdown, http_turn, settled_operations, total
from yoke.core.models import Message
from yoke.runtime.joins import create_agent, create_forum, join_conversation
from yoke.runtime.posting import Poster
from yoke.store.database import Store
from yoke.store.publishing import PublishedAgent, publish_agent, unpublish_agent
from yoke.store.tokens import create_token, revoke_token

pytestmark = pytest.mark.slow

MAX_TEXT_BYTES = 2048
# Long enough for any echo turn on a loaded machine, short enough to wait out in a test; the
# slow model answers after it, and before a second call's deadline.
CALL_TIMEOUT_SECONDS = 8.0
SLOW_MODEL = "fixture-slow-12"
TEXT_LIMIT = {"YOKE_MAX_TEXT_BYTES": str(MAX_TEXT_BYTES)}
# Lines a token may send a minute: more than any test but the one that passes it sends.
LINES_PER_MINUTE = 8
# Streams (MCP calls waiting for their answer among them) one token holds at once, and the
# answers owed to one token at most: small, so that a test reaches them.
STREAMS_PER_TOKEN = 3
OWED_PER_TOKEN = 2


@pytest.fixture(scope="module")
def mesh_env(fake_openai: FakeOpenAI) -> dict[str, str]:
    # The fake OpenAI server for the agent whose tool call waits for an approver.
    return {
        **openai_env(fake_openai.base_url, give_up_seconds=10),
        **TEXT_LIMIT,
        "YOKE_TOKEN_LINES_PER_MINUTE": str(LINES_PER_MINUTE),
    }


@pytest.fixture(scope="module")
def gateway_env() -> dict[str, str]:
    return {
        **TEXT_LIMIT,
        "YOKE_MCP_CALL_TIMEOUT_SECONDS": str(CALL_TIMEOUT_SECONDS),
        "YOKE_TOKEN_LINES_PER_MINUTE": str(LINES_PER_MINUTE),
        "YOKE_GATEWAY_STREAMS_PER_TOKEN": str(STREAMS_PER_TOKEN),
        "YOKE_MCP_OWED_ANSWERS_PER_TOKEN": str(OWED_PER_TOKEN),
    }


@pytest.fixture(scope="module")
def gateway_exits() -> tuple[int, ...]:
    return (0,)


def text_of(result: CallToolResult) -> list[str]:
    return [part.text for part in result.content if isinstance(part, TextContent)]


async def calls_counted(gateway_url: str, outcome: str) -> float:
    return await metric(gateway_url, "yoke_mcp_calls_total", outcome=outcome)


# --- listing ------------------------------------------------------------------------------


async def test_the_tools_are_the_published_agents_the_token_may_call(
    gateway_url: str, agents: Agents, store: Store
) -> None:
    mine = await agents.publish(description="Answers questions about the weather.")
    others = await agents.publish()  # published, but not for this token
    later = f"a-{uuid.uuid4().hex[:8]}"  # may be called once it is published
    caller = await agents.caller(mine.id, later)
    async with mcp_session(gateway_url, caller.secret) as session:
        listed = (await session.list_tools()).tools
        assert [tool.name for tool in listed] == [mine.id]
        (tool,) = listed
        assert tool.description == "Answers questions about the weather."
        schema = tool.input_schema
        assert schema["required"] == ["message"]
        assert set(schema["properties"]) == {"message", "conversation"}
        assert schema["properties"]["message"]["type"] == "string"

        # Publishing shows at the next listing, without a restart.
        await publish_agent(store, later, mine.agent_actor_id, "Published later.")
        assert sorted(tool.name for tool in (await session.list_tools()).tools) == sorted(
            [mine.id, later]
        )
        assert await unpublish_agent(store, mine.id)
        assert [tool.name for tool in (await session.list_tools()).tools] == [later]
    assert others.id not in {mine.id, later}

    nobody = await agents.caller()
    async with mcp_session(gateway_url, nobody.secret) as session:
        assert (await session.list_tools()).tools == []


# --- calling ------------------------------------------------------------------------------


async def test_a_call_is_answered_with_the_agents_reply_in_the_callers_kept_forum(
    gateway_url: str, agents: Agents, store: Store
) -> None:
    echo = await agents.publish()
    caller = await agents.caller(echo.id)
    answered = await calls_counted(gateway_url, "answered")
    async with mcp_session(gateway_url, caller.secret) as session:
        result = await session.call_tool(echo.id, {"message": "hello from mcp"})
        assert not result.is_error and text_of(result) == ["hello from mcp"]
        result = await session.call_tool(
            echo.id, {"message": "in a conversation", "conversation": "project alpha"}
        )
        assert not result.is_error and text_of(result) == ["in a conversation"]
    assert await calls_counted(gateway_url, "answered") == answered + 2

    # Each line is the caller's, in the forum kept for its token and key.
    for key, said in (
        (DEFAULT_CONVERSATION, "hello from mcp"),
        ("project alpha", "in a conversation"),
    ):
        forum_id = kept_forum_id(caller.token, "mcp", echo, key)
        lines = await store.history(forum_id, after_seq=0, up_to_seq=await store.last_seq(forum_id))
        people = [line for line in lines if line.role == "user"]
        assert [line.text for line in people] == [said]
        author = await store.get_actor(people[0].author_actor_id)
        assert author is not None and author.external_id == caller_id(caller.token, "mcp")
        assert [line.text for line in lines if line.role == "agent"] == [said]


async def test_progress_notifications_carry_the_deltas_in_order(
    gateway_url: str, agents: Agents
) -> None:
    streamer = await agents.publish(model="fixture-stream-4-0.4")
    caller = await agents.caller(streamer.id)
    received: list[tuple[float, str | None]] = []

    async def on_progress(progress: float, total: float | None, message: str | None) -> None:
        received.append((progress, message))

    said = "one two three four five six seven eight"
    async with mcp_session(gateway_url, caller.secret) as session:
        result = await session.call_tool(
            streamer.id, {"message": said}, progress_callback=on_progress
        )
    assert not result.is_error and text_of(result) == [said]
    assert len(received) >= 2, received
    progress = [value for value, _ in received]
    assert progress == sorted(progress) and len(set(progress)) == len(progress), received
    assert "".join(message or "" for _, message in received) == said
    assert all(message for _, message in received), received  # no empty end marker


async def test_past_the_deadline_the_answer_names_the_conversation_and_a_call_there_collects_it(
    gateway_url: str, agents: Agents, store: Store
) -> None:
    slow = await agents.publish(model=SLOW_MODEL)
    caller = await agents.caller(slow.id)
    timed_out = await calls_counted(gateway_url, "timeout")
    async with mcp_session(gateway_url, caller.secret) as session:
        result = await session.call_tool(
            slow.id, {"message": "take your time", "conversation": "slow one"}
        )
        assert not result.is_error, result
        (said,) = text_of(result)
        assert "still working" in said and "conversation='slow one'" in said
        assert await calls_counted(gateway_url, "timeout") == timed_out + 1

        # Once the answer is in, a call there collects it and sends nothing of its own.
        forum_id = kept_forum_id(caller.token, "mcp", slow, "slow one")
        [line] = await user_lines(store, forum_id, 1)
        await turn_ended(store, forum_id, line)
        again = await session.call_tool(slow.id, {"message": "well?", "conversation": "slow one"})
        assert not again.is_error, again
        answer, note = text_of(again)
        assert answer == "take your time" and "not sent" in note
    lines = await store.history(forum_id, after_seq=0, up_to_seq=await store.last_seq(forum_id))
    assert [line.text for line in lines if line.role == "user"] == ["take your time"]
    # Collected, it is owed no more: the conversation's next call sends its message.
    assert await owed_in(store, forum_id) == []


async def test_a_call_whose_token_is_revoked_ends_at_once_and_leaves_nothing_owed(
    gateway_url: str, agents: Agents, store: Store
) -> None:
    """``yoke token revoke`` ends a waiting call as it ends the token's streams: refused, not
    answered "still working" at its deadline with the answer owed to a token that is gone."""
    slow = await agents.publish(model=SLOW_MODEL)
    caller = await agents.caller(slow.id)
    forum_id = kept_forum_id(caller.token, "mcp", slow, "revoked")
    async with mcp_session(gateway_url, caller.secret) as session:
        calling = asyncio.create_task(
            session.call_tool(slow.id, {"message": "wait for me", "conversation": "revoked"})
        )
        await user_lines(store, forum_id, 1)
        assert await revoke_token(store, caller.token.id)
        result = await calling
    assert result.is_error, result
    assert "revoked" in " ".join(text_of(result))
    assert await owed_in(store, forum_id) == []


async def owed_in(store: Store, forum_id: str) -> list[dict[str, Any]]:
    """The answers owed in a forum as the door keeps them, oldest line first (and a debt of the
    one-per-forum shape of before, ``_id`` the forum's id, which retention sweeps)."""
    found = store.db[owed_answers.COLLECTION].find(
        {"$or": [{"forumId": forum_id}, {"_id": forum_id}]}
    )
    return sorted(await found.to_list(), key=lambda owed: owed.get("lineSeq", 0))


async def user_lines(store: Store, forum_id: str, count: int) -> list[Message]:
    """The caller's lines in its kept forum, once there are ``count`` of them."""
    lines = await lines_until(
        store, forum_id, lambda found: sum(line.role == "user" for line in found) >= count
    )
    return [line for line in lines if line.role == "user"]


async def answered(store: Store, forum_id: str) -> None:
    """Once the agent has answered in ``forum_id``: a test leaves no slow turn running into the
    next (whose store operations it would count)."""
    await lines_until(store, forum_id, lambda found: any(line.role == "agent" for line in found))


async def turn_ended(store: Store, forum_id: str, line: Message) -> None:
    """Once ``line``'s turn has ended in the store (the slow model answers within a few
    calls' deadlines, even on a loaded machine)."""

    async def check() -> bool:
        return await turn_outcome(store, forum_id, line) is not None

    await eventually(check, timeout=180, what=f"the end of {line.text!r}'s turn")


async def collect(
    session: ClientSession, store: Store, agent: PublishedAgent, forum_id: str, key: str
) -> list[str]:
    """What a call in conversation ``key`` returns once the oldest answer owed there is in (a
    call before would send its own message)."""
    [oldest, *_] = await owed_in(store, forum_id)
    line = await store.get_message(oldest["lineId"])
    assert line is not None
    await turn_ended(store, forum_id, line)
    result = await session.call_tool(agent.id, {"message": "well?", "conversation": key})
    assert not result.is_error, result
    return text_of(result)


async def test_calls_that_ran_out_of_time_together_are_each_collected_oldest_first(
    gateway_url: str, agents: Agents, store: Store
) -> None:
    slow = await agents.publish(model=SLOW_MODEL)
    caller = await agents.caller(slow.id)
    forum_id = kept_forum_id(caller.token, "mcp", slow, "pair")
    async with mcp_session(gateway_url, caller.secret) as session:
        first = asyncio.create_task(
            session.call_tool(slow.id, {"message": "first", "conversation": "pair"})
        )
        await user_lines(store, forum_id, 1)  # so that "first" is the older line
        second = asyncio.create_task(
            session.call_tool(slow.id, {"message": "second", "conversation": "pair"})
        )
        for result in await asyncio.gather(first, second):
            assert "still working" in text_of(result)[0], result
        line_first, line_second = await user_lines(store, forum_id, 2)

        # Each caller was told to call again: each answer is handed back, the oldest first.
        answer, note = await collect(session, store, slow, forum_id, "pair")
        assert answer == "first" and "not sent" in note
        # Only what was handed back is paid: the second answer is still owed.
        assert [owed["lineId"] for owed in await owed_in(store, forum_id)] == [line_second.id]
        answer, note = await collect(session, store, slow, forum_id, "pair")
        assert answer == "second" and "not sent" in note
    assert await owed_in(store, forum_id) == []
    assert [line.id for line in await user_lines(store, forum_id, 2)] == [
        line_first.id,
        line_second.id,
    ]


async def test_a_call_while_the_owed_turn_runs_sends_its_message_and_the_debt_keeps_its_age(
    gateway_url: str, agents: Agents, store: Store
) -> None:
    slow = await agents.publish(model=SLOW_MODEL)
    caller = await agents.caller(slow.id)
    forum_id = kept_forum_id(caller.token, "mcp", slow, "aging")
    async with mcp_session(gateway_url, caller.secret) as session:
        result = await session.call_tool(slow.id, {"message": "age me", "conversation": "aging"})
        assert "still working" in text_of(result)[0], result
        [owed] = await owed_in(store, forum_id)
        # The owed turn still runs: this call's message is sent (not held back for it).
        again = await session.call_tool(slow.id, {"message": "well?", "conversation": "aging"})
        assert not again.is_error and "not sent" not in " ".join(text_of(again)), again
        assert [line.text for line in await user_lines(store, forum_id, 2)] == ["age me", "well?"]
        # The debt is as it was: retention ages it from when it was first owed.
        assert (await owed_in(store, forum_id))[0] == owed
        answer, note = await collect(session, store, slow, forum_id, "aging")
        assert answer == "age me" and "not sent" in note
        if await owed_in(store, forum_id):  # "well?" ran out of time too
            answer, _ = await collect(session, store, slow, forum_id, "aging")
            assert answer == "well?"
    assert await owed_in(store, forum_id) == []


async def test_a_waiting_call_holds_one_of_the_tokens_streams_and_its_debts_are_bounded(
    gateway_url: str, agents: Agents, store: Store
) -> None:
    slow = await agents.publish(model=SLOW_MODEL)
    caller = await agents.caller(slow.id)
    keys = [f"held {index}" for index in range(STREAMS_PER_TOKEN)]
    async with mcp_session(gateway_url, caller.secret) as session:
        calls = []
        for key in keys:
            calls.append(
                asyncio.create_task(
                    session.call_tool(slow.id, {"message": key, "conversation": key})
                )
            )
            # Sent, so waiting (and in this order: the first is the oldest debt below).
            await user_lines(store, kept_forum_id(caller.token, "mcp", slow, key), 1)
        limited = await calls_counted(gateway_url, "rate_limited")
        refused = await session.call_tool(slow.id, {"message": "one more", "conversation": "x"})
        assert refused.is_error, refused
        assert "streams" in text_of(refused)[0] and "retry after" in text_of(refused)[0]
        assert await calls_counted(gateway_url, "rate_limited") == limited + 1
        assert await store.history(kept_forum_id(caller.token, "mcp", slow, "x")) == []
        for result in await asyncio.gather(*calls):
            assert "still working" in text_of(result)[0], result

        # Three answers owed to a token that is owed two at most: the oldest debt is dropped
        # (its answer stays in its forum).
        owing = [
            key
            for key in keys
            if await owed_in(store, kept_forum_id(caller.token, "mcp", slow, key))
        ]
        assert owing == keys[1:]
        # Its streams released, the token calls again.
        held = kept_forum_id(caller.token, "mcp", slow, keys[1])
        answer, _ = await collect(session, store, slow, held, keys[1])
    assert answer == keys[1]
    for key in keys:
        await answered(store, kept_forum_id(caller.token, "mcp", slow, key))


async def test_a_collecting_call_counts_against_the_tokens_lines_per_minute(
    gateway_url: str, agents: Agents, store: Store
) -> None:
    slow = await agents.publish(model=SLOW_MODEL)
    echo = await agents.publish()
    caller = await agents.caller(slow.id, echo.id)
    forum_id = kept_forum_id(caller.token, "mcp", slow, "late")
    async with mcp_session(gateway_url, caller.secret) as session:
        result = await session.call_tool(slow.id, {"message": "late", "conversation": "late"})
        assert "still working" in text_of(result)[0], result
        for index in range(LINES_PER_MINUTE - 1):  # the token's minute used up
            said = await session.call_tool(echo.id, {"message": f"line {index}"})
            assert text_of(said) == [f"line {index}"], said
        [line] = await user_lines(store, forum_id, 1)
        await turn_ended(store, forum_id, line)  # so that the next call would collect it
        refused = await session.call_tool(slow.id, {"message": "well?", "conversation": "late"})
    assert refused.is_error, refused
    assert re.search(r"retry after [0-9]+ s", text_of(refused)[0]), refused
    assert len(await owed_in(store, forum_id)) == 1  # still owed, for when the minute is over
    assert [line.text for line in await user_lines(store, forum_id, 1)] == ["late"]


async def test_a_call_waiting_for_an_approver_says_so_and_is_answered_once_approved(
    gateway_url: str, agents: Agents, store: Store, fake_openai: FakeOpenAI
) -> None:
    gated, caller, approver = await agents.gated(fake_openai)
    forum_id = kept_forum_id(caller.token, "mcp", gated, DEFAULT_CONVERSATION)
    waiting = asyncio.Event()
    received: list[str | None] = []

    async def on_progress(progress: float, total: float | None, message: str | None) -> None:
        received.append(message)
        if message and "approve" in message:
            waiting.set()

    async def approve() -> None:
        await asyncio.wait_for(waiting.wait(), 60)
        async with httpx.AsyncClient(base_url=gateway_url, timeout=30) as http:
            auth = {"Authorization": f"Bearer {approver}"}
            listed = await http.get(f"/v1/forums/{forum_id}/approvals", headers=auth)
            [pending] = listed.json()["approvals"]
            decided = await http.post(
                f"/v1/forums/{forum_id}/approvals/{pending['callId']}",
                json={"decision": "approve"},
                headers=auth,
            )
            assert decided.status_code == 200, decided.text

    async with mcp_session(gateway_url, caller.secret) as session:
        approving = asyncio.create_task(approve())
        result = await session.call_tool(
            gated.id, {"message": "what is 6 * 7?"}, progress_callback=on_progress
        )
        await approving
    assert not result.is_error and text_of(result) == ["it is 42"], result
    assert "waiting for a person to approve: calculator" in received, received


async def test_an_unpublished_name_and_one_without_can_call_are_refused_alike(
    gateway_url: str, agents: Agents
) -> None:
    mine = await agents.publish()
    theirs = await agents.publish()
    caller = await agents.caller(mine.id, "never-published")
    refused = await calls_counted(gateway_url, "refused")
    async with mcp_session(gateway_url, caller.secret) as session:
        words = []
        for name in ("never-published", theirs.id, "no such tool"):
            with pytest.raises(MCPError) as raised:
                await session.call_tool(name, {"message": "hi"})
            assert raised.value.error.code == INVALID_PARAMS
            assert f"unknown tool {name!r}" in raised.value.error.message
            words.append(raised.value.error.message.replace(repr(name), "NAME"))
        # Nothing tells a name that exists from one that does not.
        assert len(set(words)) == 1, words
    assert await calls_counted(gateway_url, "refused") == refused + 3


async def test_a_failed_step_is_an_error_result_with_the_notices_words(
    gateway_url: str, agents: Agents
) -> None:
    broken = await agents.publish(model="fixture-no-such-model")
    caller = await agents.caller(broken.id)
    failed = await calls_counted(gateway_url, "failed")
    async with mcp_session(gateway_url, caller.secret) as session:
        result = await session.call_tool(broken.id, {"message": "hello?"})
    assert result.is_error, result
    (said,) = text_of(result)
    assert said.startswith("I could not answer") and "Traceback" not in said
    assert await calls_counted(gateway_url, "failed") == failed + 1


async def test_bad_arguments_are_error_results_that_say_what_is_wrong(
    gateway_url: str, agents: Agents
) -> None:
    echo = await agents.publish()
    caller = await agents.caller(echo.id)
    invalid = await calls_counted(gateway_url, "invalid")
    cases = [
        ({}, "message: Field required"),
        ({"message": ""}, "message: String should have at least 1 character"),
        ({"message": 7}, "message: Input should be a valid string"),
        ({"message": "a\u0000b"}, "NUL"),
        ({"message": "x" * (MAX_TEXT_BYTES + 1)}, f"the limit is {MAX_TEXT_BYTES}"),
        ({"message": "hi", "conversation": ""}, "conversation: Value error, use 1-128"),
        ({"message": "hi", "conversation": "k" * 129}, "conversation: Value error, use 1-128"),
        ({"message": "hi", "conversation": " padded"}, "conversation: Value error, use 1-128"),
        ({"message": "hi", "conversation": 3}, "conversation: Input should be a valid string"),
        ({"message": "hi", "mood": "good"}, "mood: Extra inputs are not permitted"),
    ]
    async with mcp_session(gateway_url, caller.secret) as session:
        for arguments, words in cases:
            result = await session.call_tool(echo.id, arguments)
            assert result.is_error, arguments
            assert words in text_of(result)[0], (arguments, text_of(result))
    assert await calls_counted(gateway_url, "invalid") == invalid + len(cases)


async def test_past_its_lines_per_minute_a_token_is_told_when_to_retry(
    gateway_url: str, agents: Agents
) -> None:
    echo = await agents.publish()
    caller = await agents.caller(echo.id)
    limited = await calls_counted(gateway_url, "rate_limited")
    async with mcp_session(gateway_url, caller.secret) as session:
        for index in range(LINES_PER_MINUTE):
            result = await session.call_tool(echo.id, {"message": f"line {index}"})
            assert text_of(result) == [f"line {index}"], result
        refused = await session.call_tool(echo.id, {"message": "one too many"})
    assert refused.is_error, refused
    (said,) = text_of(refused)
    assert re.search(r"retry after [0-9]+ s", said), said
    assert await calls_counted(gateway_url, "rate_limited") == limited + 1


# --- the HTTP around it ---------------------------------------------------------------------


async def test_every_request_needs_a_known_token(gateway_url: str, agents: Agents) -> None:
    for secret in (None, "yoke_" + "x" * 43, "not a token"):
        async with mcp_client(gateway_url, secret) as session:
            with pytest.raises(MCPError) as raised:
                await session.initialize()
        assert "token" in raised.value.error.message, raised.value.error
    ping = {"jsonrpc": "2.0", "id": 1, "method": "ping"}
    async with httpx.AsyncClient(timeout=30) as client:
        response = await client.post(f"{gateway_url}/mcp", json=ping, headers=ACCEPT)
    assert response.status_code == 401 and response.headers["www-authenticate"] == "Bearer"
    assert response.json()["error"]["message"].startswith("missing token")


ACCEPT = {"Accept": "application/json, text/event-stream"}


def rpc(method: str, params: object = None, id: object = 1) -> bytes:
    body: dict[str, object] = {"jsonrpc": "2.0", "id": id, "method": method}
    if params is not None:
        body["params"] = params
    return json.dumps(body).encode()


def rpc_error(response: httpx.Response) -> dict[str, object]:
    """The JSON-RPC error of a response, whether a JSON body or one event of a stream."""
    text = response.text
    if response.headers.get("content-type", "").startswith("text/event-stream"):
        text = next(line[5:] for line in text.splitlines() if line.startswith("data:"))
    error = json.loads(text)["error"]
    assert isinstance(error, dict)
    return error


async def test_hostile_json_rpc_gets_protocol_errors_never_a_500(
    gateway_url: str, agents: Agents
) -> None:
    echo = await agents.publish()
    caller = await agents.caller(echo.id)
    headers = {**ACCEPT, "Authorization": f"Bearer {caller.secret}"}
    json_headers = {**headers, "Content-Type": "application/json"}
    deep = (
        b'{"jsonrpc":"2.0","id":1,"method":"ping","params":{"_meta":'
        + b"[" * 64
        + b"]" * 64
        + b"}}"
    )
    cases: list[tuple[str, bytes, int, int | None]] = [
        # (what, body, HTTP status, JSON-RPC error code)
        ("not JSON", b"{nope", 400, -32700),
        ("not UTF-8", b'{"jsonrpc":"2.0","id":1,"method":"\xff"}', 400, -32700),
        ("nested deep", deep, 400, -32700),
        ("too large", b'{"x":"' + b"y" * (MAX_TEXT_BYTES * 3 + 4096) + b'"}', 413, None),
        ("a batch", b"[" + rpc("ping") + b"]", 400, None),
        ("no method", b'{"jsonrpc":"2.0","id":1}', 400, None),
        ("unknown method", rpc("agents/summon"), 200, METHOD_NOT_FOUND),
        (
            "name of a wrong type",
            rpc("tools/call", {"name": 5, "arguments": {}}),
            200,
            INVALID_PARAMS,
        ),
        (
            "arguments a list",
            rpc("tools/call", {"name": echo.id, "arguments": ["hi"]}),
            200,
            INVALID_PARAMS,
        ),
        ("params a string", rpc("tools/list", "all"), 400, INVALID_PARAMS),
        # Not a request (its id is no id): taken as a notification, and nothing is answered.
        ("an id of a wrong type", rpc("ping", id={"an": "object"}), 202, None),
    ]
    async with httpx.AsyncClient(timeout=30) as client:
        for what, body, status, code in cases:
            response = await client.post(f"{gateway_url}/mcp", content=body, headers=json_headers)
            assert response.status_code == status, (what, response.status_code, response.text)
            if code is not None:
                assert rpc_error(response)["code"] == code, (what, response.text)
        for method in ("GET", "DELETE", "PUT"):
            response = await client.request(method, f"{gateway_url}/mcp", headers=headers)
            assert response.status_code == 405 and response.headers["allow"] == "POST", method
        plain = {**headers, "Content-Type": "text/plain"}
        response = await client.post(f"{gateway_url}/mcp", content=rpc("ping"), headers=plain)
        assert response.status_code == 400 and "Content-Type" in response.text
        no_accept = {**json_headers, "Accept": "text/html"}
        response = await client.post(f"{gateway_url}/mcp", content=rpc("ping"), headers=no_accept)
        assert response.status_code == 406, response.text
        # Still serving, and counted as the gateway's /mcp route.
        response = await client.post(
            f"{gateway_url}/mcp", content=rpc("ping"), headers=json_headers
        )
        assert response.status_code == 200 and '"result":{}' in response.text
    assert await metric(gateway_url, "yoke_gateway_requests_total", route="/mcp", status="500") == 0
    assert await metric(gateway_url, "yoke_gateway_requests_total", route="/mcp", status="413") >= 1


async def test_a_request_naming_another_host_or_origin_is_refused(
    gateway_url: str,
    agents: Agents,
    amqp_url: str,
    module_mongodb_url: str,
    tmp_path: Path,
) -> None:
    """DNS rebinding: a page of another origin, or a name that resolves to the gateway, is
    refused (403); a client that sends no Origin (no browser) is not."""
    caller = await agents.caller()
    port = urlsplit(gateway_url).port
    headers = {**ACCEPT, **caller.headers, "Content-Type": "application/json"}
    async with httpx.AsyncClient(timeout=30) as client:

        async def ping(url: str, **extra: str) -> httpx.Response:
            return await client.post(f"{url}/mcp", content=rpc("ping"), headers=headers | extra)

        for extra in (
            {"Origin": "http://evil.example.com"},
            {"Host": "evil.example.com"},
            {"Host": "evil.example.com", "Origin": "http://evil.example.com"},
            {"Origin": "null"},
            {"Origin": f"http://127.0.0.1:{port + 1}"},
            {"Origin": f"https://127.0.0.1:{port}"},
        ):
            response = await ping(gateway_url, **extra)
            assert response.status_code == 403, (extra, response.status_code, response.text)
            assert "origin" in str(rpc_error(response)["message"]).lower(), response.text
        for extra in (
            {},
            {"Origin": gateway_url},
            {"Host": f"localhost:{port}", "Origin": f"http://localhost:{port}"},
        ):
            response = await ping(gateway_url, **extra)
            assert response.status_code == 200, (extra, response.text)

        # Behind a proxy: the origins the operator names, and no other.
        origins = "https://mesh.example.com, http://127.0.0.1:1234"
        async with running_gateway(
            amqp_url, module_mongodb_url, tmp_path, YOKE_GATEWAY_PUBLIC_ORIGINS=origins
        ) as other:
            named = {"Host": "mesh.example.com", "Origin": "https://mesh.example.com"}
            assert (await ping(other, **named)).status_code == 200
            assert (await ping(other, Host="127.0.0.1:1234")).status_code == 200
            assert (await ping(other)).status_code == 403  # its listening address is not named


# --- what a call costs ------------------------------------------------------------------------


async def test_an_mcp_turn_costs_an_http_turns_store_operations_and_a_few_more(
    gateway_url: str, agents: Agents, store: Store, mesh: Mesh, poster: Poster
) -> None:
    echo = await agents.publish()
    caller = await agents.caller(echo.id)
    forum = await create_forum(store, "cost")
    await join_conversation(store, poster, echo.agent_actor_id, forum.id)
    _, secret = await create_token(store, f"http-{uuid.uuid4().hex[:6]}", [forum.id])

    async def rest_turn(http: httpx.AsyncClient, text: str) -> None:
        await http_turn(http, store, forum.id, secret, text)

    async with (
        httpx.AsyncClient(base_url=gateway_url, timeout=30) as http,
        mcp_session(gateway_url, caller.secret) as session,
    ):
        for warm in range(2):  # caches warm, the kept forum made and joined
            await rest_turn(http, f"warm {warm}")
            await session.call_tool(echo.id, {"message": f"warm {warm}"})
        before = await settled_operations(mesh, gateway_url)
        await rest_turn(http, "what does a turn cost?")
        middle = await settled_operations(mesh, gateway_url)
        seconds = []
        started = time.perf_counter()
        result = await session.call_tool(echo.id, {"message": "what does a call cost?"})
        seconds.append(time.perf_counter() - started)
        after = await settled_operations(mesh, gateway_url)
    assert text_of(result) == ["what does a call cost?"]
    http_cost, mcp_cost = middle - before, after - middle

    print(f"HTTP turn: {breakdown(http_cost)}")
    print(f"MCP turn: {breakdown(mcp_cost)}")
    print(f"MCP call to answer: {seconds[0] * 1000:.0f} ms")
    # The mesh does the same for a line from either door; the MCP door's own reads are few.
    assert total(mcp_cost, gateway=False) <= total(http_cost, gateway=False) + 2
    assert total(mcp_cost, gateway=True) <= 10, breakdown(mcp_cost)


async def test_the_guides_mcp_client_runs_as_written(
    gateway_url: str, agents: Agents, store: Store
) -> None:
    """docs/agents-as-tools.md's client, run as a newcomer would run it (only the token and the
    gateway's address told)."""
    guide = (Path(__file__).parents[2] / "docs/agents-as-tools.md").read_text()
    code = guide.split("## 3.", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    agent = await create_agent(store, "Helpdesk")
    await publish_agent(store, "helpdesk", agent.id, "Answers questions about orders.")
    caller = await agents.caller("helpdesk")
    code = code.replace('TOKEN = "yoke_..."', f"TOKEN = {caller.secret!r}")
    code = code.replace("http://localhost:8080", gateway_url)
    run = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        code,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(run.communicate(), 120)
    assert run.returncode == 0, err.decode()[-3000:]
    printed = out.decode().splitlines()
    assert printed[0] == "['helpdesk']" and printed[-1] == "False Where is order 1234?", printed

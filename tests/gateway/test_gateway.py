"""The HTTP gateway end to end: the mesh's services and the gateway as real processes.

Every endpoint with its error cases (no token, wrong or revoked token, out-of-scope forum,
unknown forum, oversize and invalid bodies, duplicate idempotency keys, a mesh that does not
answer), the live stream (a client's own line, the agent's answer and the activity around the
step, gaps filled from the store, Last-Event-ID), tokens through ``yoke token``, and the
``code`` the AMQP door's rejections carry.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.chaos.up import PORTS_VARIABLE, format_ports
from tests.support.broker import fresh_vhost
from tests.support.cli import run_yoke
from tests.support.gateway_process import running_gateway, start_gateway
from tests.support.mesh import JoinFactory, Mesh, lines_until
from tests.support.processes import ROOT, eventually, free_port
from tests.support.sse import EventReader
from yoke.bus.broker import Bus
from yoke.cli.supervisor import GATEWAY, SERVICES
from yoke.client import Client
from yoke.core.ids import new_id
from yoke.core.models import Message, MessageMeta, TextPart
from yoke.llm.base import ScriptedCall, ScriptedOutput
from yoke.runtime.joins import create_agent, create_forum, join_conversation
from yoke.runtime.posting import Poster
from yoke.store.database import Store
from yoke.store.tokens import create_token, ensure_token_indexes

pytestmark = pytest.mark.slow

MAX_TEXT_BYTES = 2048
# A small text limit, shared by the door and the gateway, makes "too large" cheap to send.
TEXT_LIMIT = {"YOKE_MAX_TEXT_BYTES": str(MAX_TEXT_BYTES)}


@pytest.fixture(scope="module")
def mesh_env() -> dict[str, str]:
    return dict(TEXT_LIMIT)


@pytest.fixture(scope="module")
def gateway_env() -> dict[str, str]:
    return dict(TEXT_LIMIT)


@pytest.fixture(scope="module")
def gateway_exits() -> tuple[int, ...]:
    return (0,)


@dataclass
class Tokens:
    """An all-forums token, and a factory of more."""

    store: Store
    everything: str

    async def make(self, forums: list[str] | None = None) -> tuple[str, str]:
        name = f"t{new_id()[:10]}"
        _, secret = await create_token(self.store, name, forums)
        return name, secret


@pytest.fixture(scope="module")
async def tokens(store: Store) -> Tokens:
    await ensure_token_indexes(store)
    _, secret = await create_token(store, "all-forums")
    return Tokens(store, secret)


def bearer(secret: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}"}


def post_body(text: str, who: str = "ada") -> dict[str, Any]:
    return {"author": {"externalId": who, "displayName": who.title()}, "text": text}


def assert_error(response: httpx.Response, status: int, code: str) -> None:
    assert response.status_code == status, response.text
    body = response.json()
    assert body["code"] == code and body["error"], body


# --- health, metrics, OpenAPI -----------------------------------------------------------


# What a forum line says of the monologue it was forwarded from: never shown outside the mesh.
MONOLOGUE_KEYS = {"sourceConversationId", "sourceSeq", "causationId"}


async def test_healthz_metrics_and_openapi_need_no_token(http: httpx.AsyncClient) -> None:
    health = await http.get("/healthz")
    assert health.status_code == 200 and health.text == "ok\n"
    await http.get("/v1/forums/nothing/messages")  # a 401, counted
    metrics = await http.get("/metrics")
    assert metrics.status_code == 200
    assert 'yoke_gateway_requests_total{route="/v1/forums/{forumId}/messages",status="401"}' in (
        metrics.text
    )
    spec = (await http.get("/openapi.json")).json()
    paths = spec["paths"]
    assert set(paths["/v1/forums/{forumId}/messages"]) == {"get", "post"}
    assert "get" in paths["/v1/forums/{forumId}/stream"]
    assert "HTTPBearer" in spec["components"]["securitySchemes"]
    post = paths["/v1/forums/{forumId}/messages"]["post"]
    assert {"202", "400", "401", "403", "404", "413", "503"} <= set(post["responses"])
    assert any(p["name"] == "Idempotency-Key" for p in post["parameters"])


# --- tokens and scope -------------------------------------------------------------------

ENDPOINTS = [
    ("POST", "/v1/forums/{forum}/messages"),
    ("GET", "/v1/forums/{forum}/messages"),
    ("GET", "/v1/forums/{forum}/stream"),
]


async def call(
    http: httpx.AsyncClient, method: str, path: str, headers: dict[str, str]
) -> httpx.Response:
    if method == "POST":
        return await http.post(path, json=post_body("hi"), headers=headers)
    if path.endswith("/stream"):
        async with http.stream("GET", path, headers=headers) as response:
            await response.aread()
            return response
    return await http.get(path, headers=headers)


async def test_every_endpoint_refuses_a_missing_wrong_or_revoked_token(
    http: httpx.AsyncClient, store: Store, tokens: Tokens
) -> None:
    forum = await create_forum(store, "locked")
    name, secret = await tokens.make()
    code, _, err = await run_yoke(cli_env_of(store), "token", "revoke", name)
    assert code == 0, err
    for method, template in ENDPOINTS:
        path = template.format(forum=forum.id)
        for headers in (
            {},
            bearer("yoke_not-a-token"),
            {"Authorization": f"Basic {tokens.everything}"},
            bearer(secret),  # revoked just now
        ):
            response = await call(http, method, path, headers)
            assert_error(response, 401, "unauthorized")
            assert response.headers["www-authenticate"] == "Bearer"
    assert await store.history(forum.id) == []


async def test_scope_is_checked_before_the_forum_exists(
    http: httpx.AsyncClient, store: Store, tokens: Tokens, new_join: JoinFactory
) -> None:
    mine = await create_forum(store, "mine")
    other = await create_forum(store, "other")
    _, scoped = await tokens.make([mine.id])
    _, join = await new_join()
    for method, template in ENDPOINTS:
        for forum_id in (other.id, "no-such-forum"):
            response = await call(http, method, template.format(forum=forum_id), bearer(scoped))
            assert_error(response, 403, "forbidden")
        # An all-forums token learns that a forum does not exist, and a monologue is no forum.
        for forum_id in ("no-such-forum", join.monologue_id):
            path = template.format(forum=forum_id)
            response = await call(http, method, path, bearer(tokens.everything))
            assert_error(response, 404, "unknown_forum")
    listed = await http.get(f"/v1/forums/{mine.id}/messages", headers=bearer(scoped))
    assert listed.status_code == 200 and listed.json() == {"messages": []}
    assert await store.history(other.id) == []


async def test_a_token_made_to_call_agents_reaches_no_forum_it_was_not_given(
    http: httpx.AsyncClient, store: Store, tokens: Tokens, new_join: JoinFactory
) -> None:
    forum_id, _ = await new_join()
    named = await create_forum(store, "given")
    # As docs/agents-as-tools.md makes a caller's token: --can-call, no --forum.
    env = cli_env_of(store)
    name = f"caller-{new_id()[:8]}"
    code, out, err = await run_yoke(env, "token", "create", "--name", name, "--can-call", "x")
    assert code == 0, err
    assert "all forums" not in out, out
    caller = out.strip().splitlines()[-1]
    for method, template in ENDPOINTS:
        response = await call(http, method, template.format(forum=forum_id), bearer(caller))
        assert_error(response, 403, "forbidden")
    listed = await http.get("/console/api/forums", headers=bearer(caller))
    assert listed.status_code == 200 and listed.json()["forums"] == [], listed.text
    letters = await http.get("/console/api/dead-letters", headers=bearer(caller))
    assert letters.status_code == 200 and letters.json()["mesh"] is None, letters.text
    # Forums named with --forum it does reach, as any token's.
    _, both = await create_token(store, f"both-{new_id()[:8]}", [named.id], can_call=["x"])
    response = await http.get(f"/v1/forums/{named.id}/messages", headers=bearer(both))
    assert response.status_code == 200, response.text
    response = await http.get(f"/v1/forums/{forum_id}/messages", headers=bearer(both))
    assert_error(response, 403, "forbidden")


def cli_env_of(store: Store) -> dict[str, str]:
    """``yoke`` pointed at the store's database."""
    host, port = next(iter(store.client.topology_description.server_descriptions()))
    return {"YOKE_MONGODB_URL": f"mongodb://{host}:{port}/{store.db.name}"}


async def test_yoke_token_commands(http: httpx.AsyncClient, store: Store, tokens: Tokens) -> None:
    env = cli_env_of(store)
    forum = await create_forum(store, "cli")
    name = f"cli-{new_id()[:8]}"
    code, out, err = await run_yoke(env, "token", "create", "--name", name, "--forum", forum.id)
    assert code == 0, err
    secret = out.strip().splitlines()[-1]
    assert secret.startswith("yoke_") and " " not in secret
    # Only the hash is stored.
    stored = await store.db["tokens"].find_one({"_id": name})
    assert stored is not None and secret not in json.dumps(stored, default=str)
    assert stored["forums"] == [forum.id]
    _, listed, _ = await run_yoke(env, "token", "list")
    entries = [json.loads(line) for line in listed.splitlines()]
    assert {"name": name, "forums": [forum.id]}.items() <= next(
        e for e in entries if e["name"] == name
    ).items()
    assert secret not in listed and stored["hash"] not in listed

    response = await http.get(f"/v1/forums/{forum.id}/messages", headers=bearer(secret))
    assert response.status_code == 200
    code, _, err = await run_yoke(env, "token", "create", "--name", name)
    assert code == 1 and "exists" in err
    code, _, err = await run_yoke(env, "token", "create", "--name", "x", "--forum", "nope")
    assert code == 1 and "unknown forum 'nope'" in err
    code, _, err = await run_yoke(env, "token", "create", "--name", "a:b")
    assert code == 1 and "invalid token name" in err

    code, out, _ = await run_yoke(env, "token", "revoke", name)
    assert code == 0 and out.strip() == name
    response = await http.get(f"/v1/forums/{forum.id}/messages", headers=bearer(secret))
    assert_error(response, 401, "unauthorized")
    code, _, err = await run_yoke(env, "token", "revoke", name)
    assert code == 1 and "no token named" in err


# --- POST and GET messages --------------------------------------------------------------


async def test_post_is_answered_and_read_back_in_seq_order(
    http: httpx.AsyncClient, store: Store, tokens: Tokens, new_join: JoinFactory
) -> None:
    forum_id, join = await new_join()
    headers = bearer(tokens.everything)
    posted = await http.post(
        f"/v1/forums/{forum_id}/messages", json=post_body("hello"), headers=headers
    )
    assert posted.status_code == 202, posted.text
    accepted = posted.json()
    assert accepted["duplicate"] is False and accepted["messageId"]
    lines = await lines_until(store, forum_id, lambda lines: len(lines) == 2)
    assert lines[0].id == accepted["messageId"]
    assert lines[1].text == "hello" and lines[1].author_actor_id == join.agent_actor_id

    page = (await http.get(f"/v1/forums/{forum_id}/messages", headers=headers)).json()
    assert [m["seq"] for m in page["messages"]] == [1, 2]
    assert page["messages"][0] == lines[0].to_wire()
    assert page["messages"][1]["meta"]["inReplyTo"] == accepted["messageId"]
    # What an outsider reads of a forum says nothing of the agent's monologue.
    assert not set(page["messages"][1]["meta"]) & MONOLOGUE_KEYS, page["messages"][1]
    assert join.monologue_id not in json.dumps(page)
    for _ in range(3):
        response = await http.post(
            f"/v1/forums/{forum_id}/messages", json=post_body("more"), headers=headers
        )
        assert response.status_code == 202
    await lines_until(store, forum_id, lambda lines: len(lines) == 8)
    page = (
        await http.get(f"/v1/forums/{forum_id}/messages?after=2&limit=3", headers=headers)
    ).json()
    assert [m["seq"] for m in page["messages"]] == [3, 4, 5]
    tail = (await http.get(f"/v1/forums/{forum_id}/messages?after=6", headers=headers)).json()
    assert [m["seq"] for m in tail["messages"]] == [7, 8]
    past = (await http.get(f"/v1/forums/{forum_id}/messages?after=99", headers=headers)).json()
    assert past == {"messages": []}
    for query in ("limit=0", "limit=1001", "after=-1", "after=x"):
        response = await http.get(f"/v1/forums/{forum_id}/messages?{query}", headers=headers)
        assert_error(response, 400, "invalid_request")
    full = await http.get(f"/v1/forums/{forum_id}/messages?limit=1000", headers=headers)
    assert len(full.json()["messages"]) == 8


async def test_invalid_and_oversize_posts_are_refused_and_nothing_is_written(
    http: httpx.AsyncClient, store: Store, tokens: Tokens
) -> None:
    forum = await create_forum(store, "strict")
    path = f"/v1/forums/{forum.id}/messages"
    headers = bearer(tokens.everything)
    invalid: list[tuple[bytes | dict[str, Any], str]] = [
        (b"{not json", "invalid_body"),
        (b"\xff\xfe", "invalid_body"),
        (b"[1, 2]", "invalid_body"),
        ({"text": "no author"}, "invalid_body"),
        ({"author": {"externalId": "a"}, "text": "no display name"}, "invalid_body"),
        (post_body(""), "invalid_body"),
        (post_body("nul \x00 inside"), "invalid_body"),
        (post_body("hi", who="x" * 129), "invalid_body"),
    ]
    for body, code in invalid:
        if isinstance(body, bytes):
            response = await http.post(
                path, content=body, headers={**headers, "Content-Type": "application/json"}
            )
        else:
            response = await http.post(path, json=body, headers=headers)
        assert_error(response, 400, code)
    assert (
        "author.displayName"
        in (
            await http.post(
                path, json={"author": {"externalId": "a"}, "text": "t"}, headers=headers
            )
        ).json()["error"]
    )
    # Too large: the text (counted in UTF-8 bytes), and a body past any text's size.
    response = await http.post(path, json=post_body("é" * MAX_TEXT_BYTES), headers=headers)
    assert_error(response, 413, "too_large")
    assert f"the limit is {MAX_TEXT_BYTES}" in response.json()["error"]
    huge = b'{"text": "' + b"a" * (MAX_TEXT_BYTES * 3 + 8192) + b'"}'
    response = await http.post(path, content=huge, headers=headers)
    assert_error(response, 413, "too_large")

    async def chunks() -> AsyncIterator[bytes]:  # no Content-Length: counted as it comes
        for _ in range(8):
            yield b" " * MAX_TEXT_BYTES

    response = await http.post(path, content=chunks(), headers=headers)
    assert_error(response, 413, "too_large")
    response = await http.post(
        path, json=post_body("ok"), headers={**headers, "Idempotency-Key": "k" * 129}
    )
    assert_error(response, 400, "invalid_idempotency_key")
    # Just under the limit is fine.
    response = await http.post(path, json=post_body("a" * MAX_TEXT_BYTES), headers=headers)
    assert response.status_code == 202, response.text
    lines = await store.history(forum.id)
    assert [len(line.text) for line in lines] == [MAX_TEXT_BYTES]


async def test_idempotency_keys_and_people_are_per_token(
    http: httpx.AsyncClient, store: Store, tokens: Tokens
) -> None:
    forum = await create_forum(store, "keys")
    path = f"/v1/forums/{forum.id}/messages"
    first_name, first = await tokens.make()
    second_name, second = await tokens.make([forum.id])

    async def post(secret: str, key: str | None, text: str) -> dict[str, Any]:
        extra = {"Idempotency-Key": key} if key else {}
        response = await http.post(path, json=post_body(text), headers={**bearer(secret), **extra})
        assert response.status_code == 202, response.text
        result: dict[str, Any] = response.json()
        return result

    original = await post(first, "key-1", "once")
    repeat = await post(first, "key-1", "once, again")
    assert repeat == {"messageId": original["messageId"], "duplicate": True}
    # The same key from another token is that token's own: a line of its own.
    other = await post(second, "key-1", "from the other token")
    assert other["duplicate"] is False and other["messageId"] != original["messageId"]
    # Without a key, each POST is a new line.
    unkeyed = [await post(first, None, "same text") for _ in range(2)]
    assert unkeyed[0]["messageId"] != unkeyed[1]["messageId"]

    lines = await store.history(forum.id)
    assert [line.text for line in lines] == [
        "once",
        "from the other token",
        "same text",
        "same text",
    ]
    # "ada" of one token is not "ada" of the other.
    first_ada = await store.get_actor(lines[0].author_actor_id)
    second_ada = await store.get_actor(lines[1].author_actor_id)
    assert first_ada is not None and second_ada is not None
    # Each token's namespace is its own, made with it (its name and 64 random bits).
    assert re.fullmatch(rf"http:{first_name}~[0-9a-f]{{16}}:ada", first_ada.external_id or "")
    assert re.fullmatch(rf"http:{second_name}~[0-9a-f]{{16}}:ada", second_ada.external_id or "")
    assert first_ada.name == "Ada"
    assert first_ada.id != second_ada.id


@pytest.fixture
def own_vhost(servers: tuple[str, str, str]) -> Iterator[str]:
    """An AMQP URL on a fresh vhost of the test's own (no door listens there unless the test
    starts one)."""
    base, _, management = servers
    with fresh_vhost(base, management, f"yoke-test-own-{uuid.uuid4().hex[:8]}") as url:
        yield url


async def test_a_mesh_that_does_not_answer_is_a_503_with_retry_after(
    own_vhost: str, module_mongodb_url: str, store: Store, tokens: Tokens, tmp_path: Path
) -> None:
    forum = await create_forum(store, "nobody home")
    # A mesh deployed but not answering: its exchanges exist (definitions.json, or services
    # that ran once) and take the command, and nothing consumes it. (With no exchange at all
    # the gateway, which declares none, says the mesh cannot be reached: also a 503.)
    bus = Bus(own_vhost, name="test-exchanges-only")
    await bus.connect()
    await bus.close()
    async with (
        running_gateway(
            own_vhost,
            module_mongodb_url,
            tmp_path,
            exits=(0,),
            YOKE_GATEWAY_SUBMIT_TIMEOUT_SECONDS="1",
            **TEXT_LIMIT,
        ) as url,
        httpx.AsyncClient(base_url=url, timeout=30) as http,
    ):
        response = await http.post(
            f"/v1/forums/{forum.id}/messages",
            json=post_body("anyone?"),
            headers=bearer(tokens.everything),
        )
    assert_error(response, 503, "unavailable")
    assert "within 1 s" in response.json()["error"]
    assert int(response.headers["retry-after"]) > 0


# ``yoke up`` with a metrics port of its own per mesh service (tests.chaos.up), and otherwise
# exactly as an operator runs it: the supervisor's default services.
YOKE_UP = (
    "import asyncio, os\n"
    "from tests.chaos.up import PORTS_VARIABLE, install, parse_ports\n"
    "from yoke.cli import supervisor\n"
    "install(parse_ports(os.environ[PORTS_VARIABLE]))\n"
    "raise SystemExit(asyncio.run(supervisor.run()))\n"
)


async def test_yoke_up_runs_the_gateway_beside_the_mesh(
    own_vhost: str, mongodb_url: str, tmp_path: Path
) -> None:
    gateway_port = free_port()
    # (The gateway's YOKE_METRICS_PORT goes unused: it serves /healthz on its API port.)
    ports = {**{name: free_port() for name in SERVICES}, GATEWAY: gateway_port}
    env = {
        **os.environ,
        "YOKE_AMQP_URL": own_vhost,
        "YOKE_MONGODB_URL": mongodb_url,
        "YOKE_GATEWAY_PORT": str(gateway_port),
        "YOKE_GATEWAY_HOST": "127.0.0.1",
        "YOKE_SHARDS": "2",
        "YOKE_LOG_FORMAT": "json",
        PORTS_VARIABLE: format_ports(ports),
    }
    env.pop("YOKE_METRICS_PORT", None)
    log_path = tmp_path / "yoke-up.log"
    with log_path.open("ab") as log:
        up = subprocess.Popen(
            [sys.executable, "-c", YOKE_UP], env=env, cwd=ROOT, stdout=log, stderr=log
        )
    store = Store(mongodb_url)
    bus = Bus(own_vhost, name="test-bootstrap")
    try:
        async with httpx.AsyncClient(timeout=5) as probe:

            async def all_healthy() -> bool:
                assert up.poll() is None, log_path.read_text(errors="replace")[-3000:]
                urls = [f"http://127.0.0.1:{port}/healthz" for port in ports.values()]
                try:
                    answers = [await probe.get(url) for url in urls]
                except httpx.HTTPError:
                    return False
                return all(answer.status_code == 200 for answer in answers)

            await eventually(all_healthy, timeout=90, what="yoke up's six services")
        await store.ensure_indexes()
        await ensure_token_indexes(store)
        await bus.connect()
        forum = await create_forum(store, "up")
        agent = await create_agent(store, "echo")
        await join_conversation(store, Poster(store, bus, "test"), agent.id, forum.id)
        _, secret = await create_token(store, "up", [forum.id])
        base = f"http://127.0.0.1:{gateway_port}/v1/forums/{forum.id}/messages"
        async with httpx.AsyncClient(timeout=30, headers=bearer(secret)) as http:
            posted = await http.post(base, json=post_body("are you up?"))
            assert posted.status_code == 202, posted.text

            async def answered() -> bool:
                lines = (await http.get(base)).json()["messages"]
                return [line["role"] for line in lines] == ["user", "agent"]

            await eventually(answered, timeout=30, what="the agent's answer over HTTP")
    finally:
        await bus.close()
        await store.close()
        if up.poll() is None:
            up.send_signal(signal.SIGTERM)
        try:
            code = await asyncio.to_thread(up.wait, 60)
        except subprocess.TimeoutExpired:
            up.kill()
            raise
    assert code == 0, log_path.read_text(errors="replace")[-3000:]
    assert "started gateway" in log_path.read_text(errors="replace")


async def test_the_amqp_doors_rejections_carry_a_code(
    client: Client, store: Store, new_join: JoinFactory
) -> None:
    forum_id, join = await new_join()

    def command(**fields: Any) -> bytes:
        base = {
            "conversationId": forum_id,
            "author": {"externalId": "amqp:ada", "displayName": "Ada"},
            "text": "hi",
            "idempotencyKey": new_id(),
        }
        return json.dumps({**base, **fields}).encode()

    cases = [
        (b"{oops", "invalid_body"),
        (b"[]", "invalid_body"),
        (command(author={"externalId": "x"}), "invalid_command"),
        (command(text="a" * (MAX_TEXT_BYTES + 1)), "too_large"),
        (command(conversationId="no-such-forum"), "unknown_conversation"),
        (command(conversationId=join.monologue_id), "not_a_forum"),
    ]
    for body, code in cases:
        reply = await client.submit_raw(body)
        assert reply.status == "rejected" and reply.code == code, (body[:60], reply)
        assert reply.error
    accepted = await client.submit_raw(command())
    assert accepted.status == "accepted" and accepted.code is None


# --- the stream -------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def open_stream(
    http: httpx.AsyncClient, forum_id: str, secret: str, last_event_id: int | None = None
) -> AsyncIterator[EventReader]:
    headers = bearer(secret)
    if last_event_id is not None:
        headers["Last-Event-ID"] = str(last_event_id)
    async with http.stream("GET", f"/v1/forums/{forum_id}/stream", headers=headers) as response:
        assert response.status_code == 200, await response.aread()
        assert response.headers["content-type"].startswith("text/event-stream")
        yield EventReader(response)


async def test_stream_shows_the_line_the_answer_and_the_activity_in_between(
    http: httpx.AsyncClient, store: Store, tokens: Tokens, new_join: JoinFactory
) -> None:
    script = [
        ScriptedOutput(tool_calls=[ScriptedCall(name="clock", input={})]),
        ScriptedOutput(text="it is late"),
    ]
    forum_id, join = await new_join(model="fixture-script", tools=["clock"], script=script)
    _, scoped = await tokens.make([forum_id])
    async with open_stream(http, forum_id, scoped) as stream:
        posted = await http.post(
            f"/v1/forums/{forum_id}/messages",
            json=post_body("what time is it?"),
            headers=bearer(scoped),
        )
        assert posted.status_code == 202
        (mine, answer), activity = await stream.messages(2)
        # The last step ends after its answer is posted: read until the agent is idle again.
        while len(activity) < 6:
            activity.append(await stream.next())
    assert mine.id == "1" and mine.data["id"] == posted.json()["messageId"]
    assert mine.data["parts"][0]["text"] == "what time is it?"
    assert answer.id == "2" and answer.data["authorActorId"] == join.agent_actor_id
    assert answer.data["parts"] == [{"type": "text", "text": "it is late", "format": "plain"}]
    # Nothing of the monologue (the tool call, its result, its id) is on the forum's stream.
    assert {mine.data["conversationId"], answer.data["conversationId"]} == {forum_id}
    assert not set(answer.data["meta"]) & MONOLOGUE_KEYS, answer.data
    # Three steps: infer (the call), run the tool, infer (the answer).
    assert [event.data for event in activity] == [
        {"agentActorId": join.agent_actor_id, "state": state}
        for state in ("thinking", "idle", "tool", "idle", "thinking", "idle")
    ]
    assert all(event.id is None for event in activity)  # Last-Event-ID stays a seq


async def test_a_client_reconnecting_with_last_event_id_misses_nothing(
    http: httpx.AsyncClient, store: Store, tokens: Tokens, new_join: JoinFactory
) -> None:
    forum_id, _ = await new_join()
    path = f"/v1/forums/{forum_id}/messages"
    headers = bearer(tokens.everything)
    async with open_stream(http, forum_id, tokens.everything) as stream:
        assert (await http.post(path, json=post_body("one"), headers=headers)).status_code == 202
        seen, _ = await stream.messages(2)
    last = int(seen[-1].id or 0)
    # While the client is away: two more lines and their answers.
    for text in ("two", "three"):
        assert (await http.post(path, json=post_body(text), headers=headers)).status_code == 202
    await lines_until(store, forum_id, lambda lines: len(lines) == 6)
    async with open_stream(http, forum_id, tokens.everything, last_event_id=last) as stream:
        caught_up, _ = await stream.messages(4)
        assert (await http.post(path, json=post_body("four"), headers=headers)).status_code == 202
        live, _ = await stream.messages(2)
    seqs = [int(event.id or 0) for event in [*seen, *caught_up, *live]]
    assert seqs == [1, 2, 3, 4, 5, 6, 7, 8]
    stored = await store.history(forum_id)
    assert [event.data for event in [*seen, *caught_up, *live]] == [
        line.seen_outside().to_wire() for line in stored
    ]
    # A stream opened without Last-Event-ID starts at the head: only what comes next.
    async with open_stream(http, forum_id, tokens.everything) as stream:
        assert (await http.post(path, json=post_body("five"), headers=headers)).status_code == 202
        fresh, _ = await stream.messages(1)
    assert fresh[0].id == "9"

    # A Last-Event-ID past the head resumes at the head: nothing new is held back.
    await lines_until(store, forum_id, lambda lines: len(lines) == 10)
    async with open_stream(http, forum_id, tokens.everything, last_event_id=1000) as stream:
        assert (await http.post(path, json=post_body("six"), headers=headers)).status_code == 202
        ahead, _ = await stream.messages(1)
    assert ahead[0].id == "11" and ahead[0].data["parts"][0]["text"] == "six"

    async def all_streams_closed() -> bool:  # a client that goes leaves nothing behind
        metrics = (await http.get("/metrics")).text
        return "\nyoke_gateway_streams 0.0\n" in metrics

    await eventually(all_streams_closed, timeout=10, what="the gateway's streams to end")
    response = await http.get(
        f"/v1/forums/{forum_id}/stream", headers={**headers, "Last-Event-ID": "seven"}
    )
    assert_error(response, 400, "invalid_last_event_id")


async def test_lines_whose_events_never_came_are_filled_in_from_the_store(
    http: httpx.AsyncClient, store: Store, tokens: Tokens
) -> None:
    forum = await create_forum(store, "gaps")
    async with open_stream(http, forum.id, tokens.everything) as stream:
        # Written straight into the store, no event published: a writer that died before its
        # publish, or events still on their way.
        for text in ("quiet one", "quiet two"):
            await store.insert_message(
                Message(
                    id=new_id(),
                    conversation_id=forum.id,
                    author_actor_id="system",
                    parts=[TextPart(text=text)],
                    meta=MessageMeta(agent_hops=0),
                )
            )
        response = await http.post(
            f"/v1/forums/{forum.id}/messages",
            json=post_body("loud"),
            headers=bearer(tokens.everything),
        )
        assert response.status_code == 202
        events, _ = await stream.messages(3)
    assert [(event.id, event.data["parts"][0]["text"]) for event in events] == [
        ("1", "quiet one"),
        ("2", "quiet two"),
        ("3", "loud"),
    ]


async def test_sigterm_with_a_stream_open_ends_the_gateway_promptly(
    amqp_url: str,
    module_mongodb_url: str,
    mesh: Mesh,
    tokens: Tokens,
    new_join: JoinFactory,
    tmp_path: Path,
) -> None:
    """An open stream must not keep a stopping gateway alive (its generator is closed too)."""
    forum_id, _ = await new_join()
    process, url = start_gateway(amqp_url, module_mongodb_url, tmp_path, **TEXT_LIMIT)
    try:
        await process.wait_healthy()
        async with (
            httpx.AsyncClient(base_url=url, timeout=30) as client,
            open_stream(client, forum_id, tokens.everything),
        ):
            process.popen.send_signal(signal.SIGTERM)
            # uvicorn gives open streams 3 s of grace; a stream that held the gateway up would
            # keep it alive past any deadline (the wait raises), not merely make it slow.
            code = await asyncio.to_thread(process.popen.wait, 30)
    finally:
        process.stop(timeout=1)
    assert code == 0, process.log_path.read_text(errors="replace")[-3000:]

"""The A2A door against what the A2A 1.0 specification and its compatibility kit
(a2aproject/a2a-tck, branch 1.0-dev) require of a JSON-RPC agent, through the public surface only
(raw JSON-RPC over HTTP, as the kit sends it): the gateway and the mesh as real processes.

Each test names the kit's checks it pins. The checks the door cannot meet (an agent the kit's
own scenarios script: ``input-required`` tasks, extensions, signed cards) are listed with their
reasons in docs/agents-as-tools.md.
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
import uuid
from collections.abc import AsyncIterator
from datetime import datetime
from email.utils import format_datetime, parsedate_to_datetime
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest
from a2a.client import A2ACardResolver
from a2a.types.a2a_pb2 import Task, TaskState, TaskStatus

from services.gateway.a2a.task_store import COLLECTION, TaskRecord
from tests.support.fake_openai import FakeOpenAI, openai_env
from tests.support.gateway_process import gateway_process, metric
from tests.support.mesh import Mesh
from tests.support.processes import ServiceProcess, eventually
from tests.support.published import Agents, Caller
from tests.support.store_operations import breakdown, store_operations, total
from tests.support.webhook_receiver import Receiver
from yoke.store.database import Store
from yoke.store.publishing import PublishedAgent, publish_agent
from yoke.store.tokens import ensure_token_indexes, revoke_token

pytestmark = pytest.mark.slow

TIMEOUT = httpx.Timeout(30.0, read=60.0)
SCHEMA = Path(__file__).parents[1] / "data/a2a/agent-card-1.0.schema.json"
V1 = {"A2A-Version": "1.0"}
# How long after a revocation an idle stream may stay open: the door's token re-check interval
# (1 s) and room for a loaded machine, well short of the SSE keep-alive (15 s).
REVOKED_STREAM_ENDS_SECONDS = 6.0


@pytest.fixture(scope="module")
def mesh_env(fake_openai: FakeOpenAI) -> dict[str, str]:
    return openai_env(fake_openai.base_url, give_up_seconds=10)


@pytest.fixture(scope="module")
async def gateway(
    amqp_url: str,
    module_mongodb_url: str,
    mesh: Mesh,
    tmp_path_factory: pytest.TempPathFactory,
) -> AsyncIterator[tuple[ServiceProcess, str]]:
    """The module's gateway, with its process (its log is read)."""
    log_dir = Path(tmp_path_factory.mktemp("gateway"))
    # Pushes may reach the test's receiver on this machine.
    env = {"YOKE_PUSH_ALLOWED_HOSTS": "127.0.0.1"}
    async with gateway_process(amqp_url, module_mongodb_url, log_dir, **env) as found:
        yield found


@pytest.fixture(scope="module")
def gateway_url(gateway: tuple[ServiceProcess, str]) -> str:
    return gateway[1]


@pytest.fixture(scope="module")
async def agents(store: Store, gateway_url: str) -> Agents:
    await ensure_token_indexes(store)
    return Agents(store, gateway_url)


@pytest.fixture(scope="module")
async def echo(agents: Agents) -> tuple[PublishedAgent, Caller]:
    """One echo agent and a caller of it, for the checks that change neither."""
    agent = await agents.publish()
    return agent, await agents.caller(agent.id)


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=TIMEOUT) as client:
        yield client


def rpc(method: str, params: object, id_: object = 1) -> dict[str, object]:
    return {"jsonrpc": "2.0", "id": id_, "method": method, "params": params}


def message(*parts: dict[str, Any], **fields: str) -> dict[str, Any]:
    return {"role": "ROLE_USER", "messageId": uuid.uuid4().hex, "parts": list(parts), **fields}


def text(words: str, **fields: str) -> dict[str, Any]:
    return {"text": words, **fields}


PNG = {"raw": base64.b64encode(b"\x89PNG\r\n\x1a\n").decode(), "mediaType": "image/png"}
PDF = {"url": "https://example.com/report.pdf", "mediaType": "application/pdf"}
DATA = {"data": {"order": 1234}}


async def call(
    http: httpx.AsyncClient, url: str, caller: Caller, body: object, **headers: str
) -> dict[str, Any]:
    response = await http.post(url, json=body, headers={**caller.headers, **V1, **headers})
    assert response.status_code == 200, response.text
    answer: dict[str, Any] = response.json()
    return answer


# --- what a message may carry (CORE-SEND-002, JSONRPC-SSE-002) -----------------------------


async def test_a_part_of_a_media_type_the_agent_cannot_take_is_content_type_not_supported(
    agents: Agents, echo: tuple[PublishedAgent, Caller], http: httpx.AsyncClient
) -> None:
    """A Media Type in the message's parts that the agent does not support MUST be
    ContentTypeNotSupportedError (-32005): alone or beside text (never dropped silently), in
    1.0's and 0.3's shapes; the error says what the agent takes."""
    agent, caller = echo
    url = agents.url(agent)
    for parts in ((PNG,), (text("look at this"), PDF), (DATA,), (text("hi"), DATA)):
        answer = await call(http, url, caller, rpc("SendMessage", {"message": message(*parts)}))
        assert answer.get("error", {}).get("code") == -32005, (parts, answer)
        assert "text/plain" in answer["error"]["message"], answer
    # 0.3's shape of a file part, as a 0.3 client sends it (no A2A-Version).
    old = {
        "role": "user",
        "messageId": uuid.uuid4().hex,
        "parts": [{"kind": "file", "file": {"bytes": PNG["raw"], "mimeType": "image/png"}}],
    }
    response = await http.post(
        url, json=rpc("message/send", {"message": old}), headers=caller.headers
    )
    assert response.json()["error"]["code"] == -32005, response.text
    assert "image/png" in response.json()["error"]["message"]
    # Text, with or without its media type, is what the agent reads.
    for part in (text("plain"), text("plain too", mediaType="text/plain; charset=utf-8")):
        answer = await call(http, url, caller, rpc("SendMessage", {"message": message(part)}))
        task = answer["result"]["task"]
        assert task["status"]["state"] == "TASK_STATE_COMPLETED", answer
        assert task["status"]["message"]["parts"] == [{"text": part["text"]}]

    # The card says what it takes and gives.
    card = (await http.get(f"{url}/.well-known/agent-card.json", headers=caller.headers)).json()
    assert card["defaultInputModes"] == ["text/plain"] == card["defaultOutputModes"]
    [skill] = card["skills"]
    assert skill["inputModes"] == ["text/plain"] == skill["outputModes"]


# --- the card (CARD-STRUCT-001, CARD-PROTO-001/002, CARD-CACHE-001/002/003) ----------------


def schema_errors(card: dict[str, Any]) -> list[str]:
    validator = jsonschema.Draft202012Validator(json.loads(SCHEMA.read_text()))
    return [
        f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(card)
    ]


async def test_the_card_validates_against_the_a2a_1_0_schema(
    agents: Agents, echo: tuple[PublishedAgent, Caller], http: httpx.AsyncClient
) -> None:
    agent, caller = echo
    card_url = f"{agents.url(agent)}/.well-known/agent-card.json"
    for headers in ({}, V1):  # the kit asks with no version: the card is 1.0's
        card = (await http.get(card_url, headers={**caller.headers, **headers})).json()
        assert schema_errors(card) == [], card
        assert [
            (i["protocolBinding"], i["protocolVersion"]) for i in card["supportedInterfaces"]
        ] == [
            ("JSONRPC", "1.0"),
            ("JSONRPC", "0.3"),
        ]
        assert {i["url"] for i in card["supportedInterfaces"]} == {agents.url(agent)}
    # A 0.3 client that says so gets 0.3's fields beside (its url, preferredTransport).
    old = (await http.get(card_url, headers={**caller.headers, "A2A-Version": "0.3"})).json()
    assert old["url"] == agents.url(agent) and old["preferredTransport"] == "JSONRPC", old
    assert old["protocolVersion"] == "0.3" and old["supportedInterfaces"]
    # a2a-sdk's 1.0 client reads the 1.0 card.
    async with httpx.AsyncClient(headers=caller.headers, timeout=TIMEOUT) as authorized:
        parsed = await A2ACardResolver(authorized, agents.url(agent)).get_agent_card()
    assert parsed.name == agent.id and parsed.capabilities.streaming


async def test_the_card_can_be_cached_and_revalidated(
    agents: Agents, store: Store, http: httpx.AsyncClient
) -> None:
    agent = await agents.publish(description="Cached.")
    caller = await agents.caller(agent.id)
    card_url = f"{agents.url(agent)}/.well-known/agent-card.json"
    fresh = await http.get(card_url, headers=caller.headers)
    assert fresh.status_code == 200
    cache_control = fresh.headers["cache-control"]
    # Behind the token: for the caller's own cache only, and for a while.
    assert "private" in cache_control and "max-age=" in cache_control, cache_control
    modified = fresh.headers["last-modified"]
    assert parsedate_to_datetime(modified) == agent.published_at.replace(microsecond=0)
    etag = fresh.headers["etag"]

    async def status(**headers: str) -> int:
        response = await http.get(card_url, headers={**caller.headers, **headers})
        if response.status_code == 304:
            assert response.headers["etag"] == etag and not response.content
            assert response.headers["last-modified"] == modified
        return response.status_code

    assert await status(**{"If-Modified-Since": modified}) == 304
    earlier = format_datetime(parsedate_to_datetime(modified).replace(year=2001), usegmt=True)
    assert await status(**{"If-Modified-Since": earlier}) == 200
    assert await status(**{"If-Modified-Since": "not a date"}) == 200
    assert await status(**{"If-None-Match": etag}) == 304
    # If-None-Match decides when both are sent (RFC 9110 13.2.2).
    assert await status(**{"If-None-Match": '"other"', "If-Modified-Since": modified}) == 200

    # Published again: a new card, modified then.
    again = await publish_agent(store, agent.id, agent.agent_actor_id, "Changed.")
    changed = await http.get(
        card_url, headers={**caller.headers, "If-Modified-Since": modified, "If-None-Match": etag}
    )
    assert changed.status_code == 200 and changed.json()["description"] == "Changed."
    assert parsedate_to_datetime(changed.headers["last-modified"]) == again.published_at.replace(
        microsecond=0
    )


# --- where clients post (the kit posts to the base URL with a trailing slash) ---------------


async def test_a_post_to_the_base_url_with_a_trailing_slash_is_served_as_without(
    agents: Agents, echo: tuple[PublishedAgent, Caller], http: httpx.AsyncClient
) -> None:
    agent, caller = echo
    slash = agents.url(agent) + "/"
    answer = await call(http, slash, caller, rpc("GetTask", {"id": "no-such-task"}))
    assert answer["error"]["code"] == -32001, answer
    sent = await call(http, slash, caller, rpc("SendMessage", {"message": message(text("hi /"))}))
    assert sent["result"]["task"]["status"]["state"] == "TASK_STATE_COMPLETED", sent
    anonymous = await http.post(slash, json=rpc("GetTask", {"id": "x"}))
    assert anonymous.status_code == 401


# --- requests the SDK cannot parse: one line each, counted ---------------------------------


async def test_an_unparsable_request_is_one_log_line_and_counted(
    agents: Agents,
    echo: tuple[PublishedAgent, Caller],
    http: httpx.AsyncClient,
    gateway: tuple[ServiceProcess, str],
) -> None:
    process, gateway_url = gateway
    agent, caller = echo
    url = agents.url(agent)
    marker = uuid.uuid4().hex
    cases = [
        # The SDK's params parse (protobuf) fails: invalid params.
        (rpc("GetTask", {"id": "x", "historyLength": f"lots-{marker}"}), -32602, "invalid_params"),
        # 0.3's request model refuses it: an invalid request.
        (rpc("message/send", {"message": f"just-{marker}"}), -32600, "invalid_request"),
        (rpc("NoSuchMethod", {}), -32601, "method_not_found"),
    ]
    before = {
        reason: await metric(gateway_url, "yoke_a2a_bad_requests_total", reason=reason)
        for _, _, reason in cases
    }
    start = process.log_path.stat().st_size
    for body, code, _ in cases:
        headers = V1 if body["method"] != "message/send" else {}
        response = await http.post(url, json=body, headers={**caller.headers, **headers})
        assert response.json()["error"]["code"] == code, response.text
    for _, _, reason in cases:
        assert (
            await metric(gateway_url, "yoke_a2a_bad_requests_total", reason=reason)
            == before[reason] + 1
        ), reason

    def logged() -> list[dict[str, Any]]:
        with process.log_path.open("rb") as log:
            log.seek(start)
            lines = log.read().decode(errors="replace").splitlines()
        return [json.loads(line) for line in lines if marker in line]

    async def both_logged() -> bool:
        return len(logged()) >= 2

    await eventually(both_logged, timeout=20, what="the refusals' log lines")
    for record in logged():
        assert "error" not in record, record  # no traceback
        assert record["level"] == "warning" and "\n" not in record["message"], record
        assert record["message"].startswith("A2A request refused"), record


# --- streams end with their token ----------------------------------------------------------


async def test_an_idle_stream_ends_soon_after_its_token_is_revoked(
    agents: Agents, store: Store, fake_openai: FakeOpenAI
) -> None:
    """A stream with nothing to send (its task waits for an approver) ends within the token
    re-check interval once its token is revoked, not at its next event."""
    gated, caller, _ = await agents.gated(fake_openai)
    body = rpc("SendStreamingMessage", {"message": message(text("what is 6 * 7?"))})
    revoked_at: float | None = None
    async with (
        httpx.AsyncClient(timeout=httpx.Timeout(30.0, read=None)) as http,
        http.stream(
            "POST", agents.url(gated), json=body, headers={**caller.headers, **V1}
        ) as response,
    ):
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = response.aiter_lines()

        async def until_waiting() -> None:
            async for line in lines:
                if "waiting for a person to approve" in line:
                    return

        await asyncio.wait_for(until_waiting(), 60)
        assert await revoke_token(store, caller.token.id)
        revoked_at = time.monotonic()

        async def rest() -> list[str]:
            return [line async for line in lines]

        after = await asyncio.wait_for(rest(), REVOKED_STREAM_ENDS_SECONDS + 10)
        ended_in = time.monotonic() - revoked_at
    assert ended_in <= REVOKED_STREAM_ENDS_SECONDS, f"the stream ended {ended_in:.1f} s after"
    assert not [line for line in after if line.startswith("data:")], after


# --- the JSON-RPC binding's other MUSTs the door meets --------------------------------------

ERROR_INFO = "type.googleapis.com/google.rpc.ErrorInfo"


def error_of(answer: dict[str, Any], id_: object = 1) -> dict[str, Any]:
    """A JSON-RPC 2.0 error object as the binding shapes it (JSONRPC-ERR-001/002/003): its
    request's id, a numeric code, a message, and for an A2A error (-32001..-32099) a data
    array holding a google.rpc.ErrorInfo of the protocol's domain."""
    assert answer["jsonrpc"] == "2.0" and answer["id"] == id_ and "result" not in answer, answer
    error: dict[str, Any] = answer["error"]
    assert isinstance(error["code"], int) and isinstance(error["message"], str), error
    if -32099 <= error["code"] <= -32001:
        [info] = [item for item in error["data"] if item.get("@type") == ERROR_INFO]
        assert info["domain"] == "a2a-protocol.org" and info["reason"], error
    return error


async def test_errors_carry_the_bindings_codes_and_error_info(
    agents: Agents, echo: tuple[PublishedAgent, Caller], http: httpx.AsyncClient
) -> None:
    """JSONRPC-ERR-001/002/003, JSONRPC-SSE-002 (each A2A error's code), CORE-GET-002,
    CORE-CANCEL-003, CORE-MULTI-004, STREAM-SUB-004, PUSH-GET-002, CORE-CAP-003,
    VER-SERVER-002/003, CORE-ERR-001/002."""
    agent, caller = echo
    url = agents.url(agent)
    unknown = uuid.uuid4().hex
    cases: list[tuple[str, dict[str, Any], dict[str, str], int, str | None]] = [
        ("GetTask", {"id": unknown}, {}, -32001, "TASK_NOT_FOUND"),
        ("CancelTask", {"id": unknown}, {}, -32001, "TASK_NOT_FOUND"),
        (
            "SendMessage",
            {"message": message(text("into nothing"), taskId=unknown)},
            {},
            -32001,
            "TASK_NOT_FOUND",
        ),
        ("SubscribeToTask", {"id": unknown}, {}, -32001, "TASK_NOT_FOUND"),
        ("GetTaskPushNotificationConfig", {"taskId": unknown, "id": "x"}, {}, -32001, None),
        # No extendedAgentCard capability: UnsupportedOperationError (3.3.4).
        ("GetExtendedAgentCard", {}, {}, -32004, "UNSUPPORTED_OPERATION"),
        ("SendMessage", {"message": message(text("v99"))}, {"A2A-Version": "99.0"}, -32009, None),
        ("GetTask", {"id": unknown, "historyLength": "lots"}, {}, -32602, None),
        ("SendMessage", {"message": message(PNG)}, {}, -32005, "CONTENT_TYPE_NOT_SUPPORTED"),
    ]
    for number, (method, params, headers, code, reason) in enumerate(cases, start=10):
        answer = await call(http, url, caller, rpc(method, params, number), **headers)
        error = error_of(answer, number)
        assert error["code"] == code, (method, answer)
        if reason is not None:
            [info] = error["data"]
            assert info["reason"] == reason, (method, answer)
    # A body that is not said to be JSON (JSONRPC-FMT-002): ContentTypeNotSupportedError.
    wrong = await http.post(
        url,
        content=str(rpc("GetTask", {"id": unknown})).encode(),
        headers={**caller.headers, **V1, "Content-Type": "text/plain"},
    )
    assert wrong.status_code == 200 and error_of(wrong.json(), None)["code"] == -32005
    # No A2A-Version is 0.3 (VER-SERVER-003): 0.3's names are served, and answered.
    old = await http.post(url, json=rpc("tasks/get", {"id": unknown}), headers=caller.headers)
    assert old.json()["error"]["code"] == -32001, old.text


def camel_case_keys(value: object, where: str = "") -> list[str]:
    """Keys that are not camelCase (DM-SERIAL-001), but inside metadata, which is the caller's."""
    found: list[str] = []
    if isinstance(value, dict):
        for key, item in value.items():
            if "_" in key.lstrip("@"):
                found.append(f"{where}/{key}")
            if key not in ("metadata", "data"):
                found += camel_case_keys(item, f"{where}/{key}")
    elif isinstance(value, list):
        for index, item in enumerate(value):
            found += camel_case_keys(item, f"{where}/{index}")
    return found


def check_task(task: dict[str, Any]) -> None:
    """DM-TASK-001/002, DM-STATUS-001, DM-MSG-002, DM-PART-001, DM-SERIAL-001/002/003."""
    assert task["id"] and task["contextId"] and task["status"]["state"].startswith("TASK_STATE_")
    stamp = task["status"].get("timestamp")
    if stamp is not None:
        assert stamp.endswith("Z") and datetime.fromisoformat(stamp.replace("Z", "+00:00"))
    messages = [*task.get("history", []), task["status"].get("message", {"role": "ROLE_AGENT"})]
    for said in messages:
        assert said["role"] in ("ROLE_USER", "ROLE_AGENT"), said
        for part in said.get("parts", []):
            assert len({"text", "raw", "url", "data"} & part.keys()) == 1, part
    assert camel_case_keys(task) == [], task


async def test_a_task_answers_in_the_bindings_shape_and_keeps_its_rules(
    agents: Agents, echo: tuple[PublishedAgent, Caller], http: httpx.AsyncClient
) -> None:
    """CORE-SEND-001, CORE-MULTI-001a/003, CORE-GET-001, DM-*, JSONRPC-FMT-002 (the answer's
    Content-Type); a terminal task takes no message (CORE-SEND-002), no cancel
    (CORE-CANCEL-002), no subscription (STREAM-SUB-003); a contextId not the task's
    (CORE-MULTI-006) or one the door cannot keep (CORE-MULTI-002a) is refused."""
    agent, caller = echo
    url = agents.url(agent)
    response = await http.post(
        url,
        json=rpc("SendMessage", {"message": message(text("shape"))}),
        headers={**caller.headers, **V1},
    )
    assert response.headers["content-type"].startswith("application/json")
    task = response.json()["result"]["task"]
    check_task(task)
    assert task["status"]["state"] == "TASK_STATE_COMPLETED" and task["status"]["timestamp"]
    got = (await call(http, url, caller, rpc("GetTask", {"id": task["id"]})))["result"]
    check_task(got)
    assert (got["id"], got["status"]["state"]) == (task["id"], "TASK_STATE_COMPLETED")
    other = await call(http, url, caller, rpc("SendMessage", {"message": message(text("2"))}))
    assert other["result"]["task"]["id"] != task["id"]
    assert other["result"]["task"]["contextId"] != task["contextId"]

    terminal = [
        ("SendMessage", {"message": message(text("more"), taskId=task["id"])}, -32004),
        ("CancelTask", {"id": task["id"]}, -32002),
        ("SubscribeToTask", {"id": task["id"]}, -32004),
        (
            "SendMessage",
            {"message": message(text("x"), taskId=task["id"], contextId="another")},
            -32602,
        ),
        ("SendMessage", {"message": message(text("x"), contextId="c" * 200)}, -32602),
    ]
    for method, params, code in terminal:
        answer = await call(http, url, caller, rpc(method, params))
        assert error_of(answer)["code"] == code, (method, answer)


async def test_a_stream_is_server_sent_events_of_json_rpc_responses(
    agents: Agents, echo: tuple[PublishedAgent, Caller], http: httpx.AsyncClient
) -> None:
    """JSONRPC-SSE-001, CORE-STREAM-001/003, STREAM-ORDER-001: text/event-stream, each event a
    JSON-RPC response to the request's id, the task first, its terminal status last, then the
    stream closes."""
    agent, caller = echo
    body = rpc("SendStreamingMessage", {"message": message(text("streamed"))}, "s-1")
    results: list[dict[str, Any]] = []
    async with http.stream(
        "POST", agents.url(agent), json=body, headers={**caller.headers, **V1}
    ) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        async for line in response.aiter_lines():
            if line.startswith("data:"):
                event = json.loads(line.removeprefix("data:"))
                assert event["jsonrpc"] == "2.0" and event["id"] == "s-1", event
                results.append(event["result"])
    first, *_, last = results
    check_task(first["task"])
    assert last["statusUpdate"]["status"]["state"] == "TASK_STATE_COMPLETED", results
    assert {
        r.get("statusUpdate", r.get("task", {})).get("taskId", first["task"]["id"]) for r in results
    } == {first["task"]["id"]}


async def test_list_tasks_pages_by_cursor_newest_first_and_only_the_callers(
    agents: Agents, http: httpx.AsyncClient
) -> None:
    """CORE-LIST-001..005."""
    agent = await agents.publish()
    caller, stranger = await agents.caller(agent.id), await agents.caller(agent.id)
    url = agents.url(agent)
    context = f"list-{uuid.uuid4().hex[:6]}"
    sent = [
        (
            await call(
                http,
                url,
                caller,
                rpc("SendMessage", {"message": message(text(w), contextId=context)}),
            )
        )["result"]["task"]["id"]
        for w in ("one", "two", "three")
    ]
    seen: list[str] = []
    token = ""
    for _ in range(3):
        params = {"contextId": context, "pageSize": 2, "includeArtifacts": False}
        page = (await call(http, url, caller, rpc("ListTasks", {**params, "pageToken": token})))[
            "result"
        ]
        assert all("artifacts" not in task for task in page["tasks"]), page
        seen += [task["id"] for task in page["tasks"]]
        token = page["nextPageToken"]
        if not token:
            break
    assert token == "" and seen == list(reversed(sent)), (seen, sent)
    theirs = (await call(http, url, stranger, rpc("ListTasks", {"contextId": context})))["result"]
    assert theirs.get("tasks", []) == []


async def test_a_page_of_tasks_costs_that_page_not_every_task_of_the_token(
    agents: Agents, store: Store, mesh: Mesh, http: httpx.AsyncClient
) -> None:
    """ListTasks reads the owner's records once and the turns of the tasks it returns only."""
    agent = await agents.publish()
    caller = await agents.caller(agent.id)
    owner = caller.token.namespace or caller.token.id
    # Many working tasks of the caller's, as the door writes their records.
    for number in range(30):
        task_id = f"t-{uuid.uuid4().hex}"
        status = TaskStatus(state=TaskState.TASK_STATE_WORKING)
        record = TaskRecord(
            id=task_id,
            owner=owner,
            agent=agent.id,
            context_id="many",
            state="working",
            task=Task(id=task_id, context_id="many", status=status).SerializeToString(),
            forum_id=f"forum-{number}",
            line_id=f"line-{number}",
        )
        await store.db[COLLECTION].insert_one(record.to_document())
    url = agents.url(agent)
    before = await store_operations(mesh, agents.gateway_url)
    page = await call(http, url, caller, rpc("ListTasks", {"pageSize": 2}))
    after = await store_operations(mesh, agents.gateway_url)
    assert len(page["result"]["tasks"]) == 2 and page["result"]["totalSize"] == 30, page
    spent = total(after - before, gateway=True)
    assert spent <= 8, breakdown(after - before)


async def test_a_tasks_push_configs_are_created_read_listed_and_deleted(
    agents: Agents, echo: tuple[PublishedAgent, Caller], http: httpx.AsyncClient, receiver: Receiver
) -> None:
    """PUSH-CREATE-001/002, PUSH-GET-001/002, PUSH-LIST-001, PUSH-DEL-001/002, as the kit
    asks them (a config with the caller's own id, on a completed task)."""
    agent, caller = echo
    url = agents.url(agent)
    sent = await call(http, url, caller, rpc("SendMessage", {"message": message(text("push"))}))
    task_id = sent["result"]["task"]["id"]
    config_id = f"push-{uuid.uuid4().hex[:8]}"
    push_url = receiver.url(f"/conformance/{config_id}")
    config = {"taskId": task_id, "id": config_id, "url": push_url}
    created = await call(http, url, caller, rpc("CreateTaskPushNotificationConfig", config))
    assert created["result"]["id"] == config_id and created["result"]["url"] == push_url, created
    key = {"taskId": task_id, "id": config_id}
    got = await call(http, url, caller, rpc("GetTaskPushNotificationConfig", key))
    assert got["result"]["id"] == config_id and got["result"]["url"] == push_url, got
    listed = await call(
        http, url, caller, rpc("ListTaskPushNotificationConfigs", {"taskId": task_id})
    )
    assert config_id in [found["id"] for found in listed["result"]["configs"]], listed
    deleted = await call(http, url, caller, rpc("DeleteTaskPushNotificationConfig", key))
    assert "result" in deleted, deleted
    for params in (key, {"taskId": task_id, "id": "never-made"}):
        gone = await call(http, url, caller, rpc("GetTaskPushNotificationConfig", params))
        error_of(gone)


# --- ids the store cannot hold: not found, as any unknown id --------------------------------


async def test_a_task_or_push_config_id_the_store_cannot_hold_is_not_found(
    agents: Agents,
    echo: tuple[PublishedAgent, Caller],
    http: httpx.AsyncClient,
    receiver: Receiver,
    gateway: tuple[ServiceProcess, str],
) -> None:
    """A task id with U+0000 (FerretDB cannot hold it) is TaskNotFoundError (-32001) at every
    method that takes one, as an id never made is, and a push config id the same at get; one
    with a lone surrogate is the SDK's parse error (-32602: protobuf takes no such string). None
    reaches the store: no -32603, no traceback in the gateway's log."""
    process, _ = gateway
    agent, caller = echo
    url = agents.url(agent)
    sent = await call(http, url, caller, rpc("SendMessage", {"message": message(text("ids"))}))
    assert "result" in sent, sent
    task_id = sent["result"]["task"]["id"]
    push_url = receiver.url("/unstorable")
    start = process.log_path.stat().st_size
    cases: list[tuple[str, dict[str, Any], int]] = []
    for bad, code in (("\u0000", -32001), (f"{task_id}\u0000", -32001), ("task-\ud800", -32602)):
        cases += [
            (method, params, code)
            for method, params in [
                ("GetTask", {"id": bad}),
                ("CancelTask", {"id": bad}),
                ("SubscribeToTask", {"id": bad}),
                ("SendMessage", {"message": message(text("into nothing"), taskId=bad)}),
                ("GetTaskPushNotificationConfig", {"taskId": bad, "id": "x"}),
                ("ListTaskPushNotificationConfigs", {"taskId": bad}),
                ("DeleteTaskPushNotificationConfig", {"taskId": bad, "id": "x"}),
                ("CreateTaskPushNotificationConfig", {"taskId": bad, "url": push_url}),
                ("GetTaskPushNotificationConfig", {"taskId": task_id, "id": bad}),
            ]
        ]
    wrong = []
    for number, (method, params, code) in enumerate(cases, start=1):
        # As bytes: JSON's escapes carry the lone surrogate (UTF-8 cannot).
        response = await http.post(
            url,
            content=json.dumps(rpc(method, params, number)).encode(),
            headers={**caller.headers, **V1, "Content-Type": "application/json"},
        )
        answer = response.json()
        if answer.get("error", {}).get("code") != code:
            wrong.append(f"{method} {params!r}: {response.status_code} {response.text[:300]}")
        else:
            error_of(answer, number)
    assert not wrong, "\n".join(wrong)

    # Deleted, it is as one never made: nothing to delete.
    for config_id in ("never-made", "push-\u0000"):
        key = {"taskId": task_id, "id": config_id}
        deleted = await call(http, url, caller, rpc("DeleteTaskPushNotificationConfig", key))
        assert "result" in deleted, (config_id, deleted)
    # A config id the store cannot hold is refused when it would be made.
    config = {"taskId": task_id, "id": "push-\u0000", "url": push_url}
    made = await call(http, url, caller, rpc("CreateTaskPushNotificationConfig", config))
    assert error_of(made)["code"] == -32602, made

    # What the gateway logged meanwhile, up to a warning this test causes last (so all of it).
    marker = uuid.uuid4().hex
    fence = rpc("GetTask", {"id": "x", "historyLength": f"lots-{marker}"})
    assert error_of(await call(http, url, caller, fence))["code"] == -32602

    def logged() -> list[dict[str, Any]]:
        with process.log_path.open("rb") as log:
            log.seek(start)
            lines = log.read().decode(errors="replace").splitlines()
        return [json.loads(line) for line in lines if line.startswith("{")]

    async def fenced() -> bool:
        return any(marker in record["message"] for record in logged())

    await eventually(fenced, timeout=20, what="the gateway's log up to the test's last request")
    failed = [
        f"{record['logger']} {record['level']}: {record['message'][:200]!r} "
        f"{record.get('error', '').strip().splitlines()[-1:]}"
        for record in logged()
        if record["level"] in ("error", "critical") or "error" in record
    ]
    assert not failed, "\n".join(failed)

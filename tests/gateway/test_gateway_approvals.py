"""The gateway's and the CLI's doors for stopping agents and deciding approvals, end to end.

The mesh and the gateway run as real processes. ``POST /v1/forums/{id}/stop`` and ``yoke stop``
submit the line ``/stop`` for the person named (namespaced as any of the door's people); only a
token made with ``yoke token create --can-approve`` and scoped to the forum may list or decide
its approvals; the stream tells of each request and decision; and in Debian's headless
Chromium the console lists a pending approval with its tool and input, rejects it with a
reason, and shows the decision, who and why, in the forum and in the monologue.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from collections.abc import AsyncIterator
from datetime import datetime, timedelta

import httpx
import pytest
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver

from tests.support.browser import texts, wait_for
from tests.support.cli import run_yoke
from tests.support.mesh import JoinFactory, Mesh, agent_lines, lines_until, say
from tests.support.sse import Event, EventReader
from yoke.client import Client
from yoke.core.ids import new_id
from yoke.core.models import Message, ToolResultPart
from yoke.llm.base import ScriptedCall, ScriptedOutput
from yoke.runtime.join_config import ApprovalConfig, JoinConfig
from yoke.runtime.joins import Join, create_forum
from yoke.store.database import Store
from yoke.store.tokens import create_token, ensure_token_indexes

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cli_env(amqp_url: str, module_mongodb_url: str) -> dict[str, str]:
    return {"YOKE_AMQP_URL": amqp_url, "YOKE_MONGODB_URL": module_mongodb_url}


async def token(
    store: Store,
    forums: list[str] | None,
    *,
    can_approve: bool = False,
    can_read_monologues: bool = False,
) -> tuple[str, str]:
    """A new token's name and secret."""
    await ensure_token_indexes(store)
    name = f"t{new_id()[:10]}"
    _, secret = await create_token(
        store, name, forums, can_approve=can_approve, can_read_monologues=can_read_monologues
    )
    return name, secret


def bearer(secret: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}"}


async def author_of(store: Store, line: Message) -> tuple[str | None, str]:
    actor = await store.get_actor(line.author_actor_id)
    assert actor is not None
    return actor.external_id, actor.name


# --- stop -------------------------------------------------------------------------------


async def test_stop_over_http_submits_the_stop_line_for_the_person_named(
    http: httpx.AsyncClient, store: Store
) -> None:
    forum = await create_forum(store, "stop over http")
    name, secret = await token(store, [forum.id])
    answer = await http.post(
        f"/v1/forums/{forum.id}/stop",
        json={"author": {"externalId": "ada", "displayName": "Ada"}},
        headers=bearer(secret),
    )
    assert answer.status_code == 202, answer.text
    accepted = answer.json()
    assert accepted["duplicate"] is False
    lines = await lines_until(store, forum.id, lambda lines: len(lines) >= 1)
    line = next(line for line in lines if line.id == accepted["messageId"])
    assert (line.role, line.type, line.text) == ("user", "message", "/stop")
    external_id, display_name = await author_of(store, line)
    assert re.fullmatch(rf"http:{name}~[0-9a-f]{{16}}:ada", external_id or "")
    assert display_name == "Ada"

    # A body without an author, or with an empty one, is refused and writes nothing.
    for body in ({}, {"author": {"externalId": "", "displayName": "x"}}, {"text": "/stop"}):
        refused = await http.post(f"/v1/forums/{forum.id}/stop", json=body, headers=bearer(secret))
        assert refused.status_code == 400 and refused.json()["code"] == "invalid_body", body
    other = await create_forum(store, "someone else's")
    outside = await http.post(
        f"/v1/forums/{other.id}/stop",
        json={"author": {"externalId": "ada", "displayName": "Ada"}},
        headers=bearer(secret),
    )
    assert outside.status_code == 403
    assert [line.text for line in await store.history(forum.id)] == ["/stop"]
    assert await store.history(other.id) == []


async def test_yoke_stop_submits_the_stop_line_as_the_cli_person(
    store: Store, mesh: Mesh, cli_env: dict[str, str]
) -> None:
    forum = await create_forum(store, "stop from the cli")
    code, out, err = await run_yoke(cli_env, "stop", "--forum", forum.id, "--as", "grace")
    assert code == 0, err
    message_id = out.strip()
    lines = await lines_until(store, forum.id, lambda lines: len(lines) >= 1)
    line = next(line for line in lines if line.id == message_id)
    assert line.text == "/stop" and line.role == "user"
    assert await author_of(store, line) == ("cli:grace", "grace")
    code, _, err = await run_yoke(cli_env, "stop", "--forum", "no-such-forum", "--as", "grace")
    assert code == 1 and "no-such-forum" in err, err


# --- tokens that may decide -------------------------------------------------------------


async def test_yoke_token_create_can_approve_is_stored_and_listed(
    store: Store, cli_env: dict[str, str]
) -> None:
    forum = await create_forum(store, "approvers")
    approver, plain = f"a{new_id()[:10]}", f"p{new_id()[:10]}"
    code, out, err = await run_yoke(
        cli_env, "token", "create", "--name", approver, "--forum", forum.id, "--can-approve"
    )
    assert code == 0, err
    assert "may decide approvals" in out and out.strip().splitlines()[-1].startswith("yoke_")
    code, out, err = await run_yoke(cli_env, "token", "create", "--name", plain)
    assert code == 0 and "approvals" not in out, err
    code, out, err = await run_yoke(cli_env, "token", "list")
    assert code == 0, err
    listed = {entry["name"]: entry for entry in map(json.loads, out.splitlines())}
    assert listed[approver]["canApprove"] is True and listed[approver]["forums"] == [forum.id]
    assert listed[plain]["canApprove"] is False and listed[plain]["forums"] is None


async def test_approvals_need_a_can_approve_token_of_that_forum(
    http: httpx.AsyncClient, store: Store
) -> None:
    forum = await create_forum(store, "guarded")
    other = await create_forum(store, "elsewhere")
    _, plain = await token(store, [forum.id])
    _, elsewhere = await token(store, [other.id], can_approve=True)
    _, everywhere = await token(store, None, can_approve=True)
    _, approver = await token(store, [forum.id], can_approve=True)
    decide = f"/v1/forums/{forum.id}/approvals/some-call"
    listing = f"/v1/forums/{forum.id}/approvals"
    for secret in (plain, elsewhere):
        refused = await http.post(decide, json={"decision": "approve"}, headers=bearer(secret))
        assert refused.status_code == 403 and refused.json()["code"] == "forbidden", refused.text
        refused = await http.get(listing, headers=bearer(secret))
        assert refused.status_code == 403 and refused.json()["code"] == "forbidden", refused.text
    assert "--can-approve" in (await http.get(listing, headers=bearer(plain))).json()["error"]
    unauthorized = await http.get(listing)
    assert unauthorized.status_code == 401
    gone = await http.get("/v1/forums/no-such-forum/approvals", headers=bearer(everywhere))
    assert gone.status_code == 404 and gone.json()["code"] == "unknown_forum"

    assert (await http.get(listing, headers=bearer(approver))).json() == {"approvals": []}
    unknown = await http.post(decide, json={"decision": "approve"}, headers=bearer(approver))
    assert unknown.status_code == 404 and unknown.json()["code"] == "unknown_call", unknown.text
    for body in ({}, {"decision": "maybe"}, {"decision": "reject", "reason": ""}):
        invalid = await http.post(decide, json=body, headers=bearer(approver))
        assert invalid.status_code == 400 and invalid.json()["code"] == "invalid_body", body


# --- deciding ---------------------------------------------------------------------------

SUM = {"expression": "6 * 7"}


async def gated_join(new_join: JoinFactory, answer: str) -> tuple[str, Join]:
    """An agent whose one calculator call waits for a decision, then answers ``answer``."""
    script = [
        ScriptedOutput(tool_calls=[ScriptedCall(name="calculator", input=SUM)]),
        ScriptedOutput(text=answer),
    ]
    config = JoinConfig(
        model="fixture-script",
        tools=["calculator"],
        script=script,
        approval=ApprovalConfig(tools=["calculator"], timeout_seconds=600),
    )
    return await new_join(config=config)


@contextlib.asynccontextmanager
async def open_stream(
    http: httpx.AsyncClient, forum_id: str, secret: str
) -> AsyncIterator[EventReader]:
    async with http.stream(
        "GET", f"/v1/forums/{forum_id}/stream", headers=bearer(secret)
    ) as response:
        assert response.status_code == 200
        yield EventReader(response)


async def next_approval(reader: EventReader, kind: str) -> Event:
    """The next ``approval`` event of type ``tool.approval.<kind>`` (lines and activity skipped)."""
    while True:
        event = await reader.next(timeout=30)
        if event.event == "approval" and event.data["type"] == f"tool.approval.{kind}":
            return event


def results_of(lines: list[Message]) -> list[ToolResultPart]:
    return [part for line in lines for part in line.parts if isinstance(part, ToolResultPart)]


async def test_an_approval_over_http_runs_the_tool_and_the_first_decision_stands(
    http: httpx.AsyncClient, store: Store, client: Client, new_join: JoinFactory
) -> None:
    forum_id, join = await gated_join(new_join, "the sum is in")
    other_id, _ = await gated_join(new_join, "elsewhere")
    name, approver = await token(store, [forum_id], can_approve=True)
    _, reader = await token(store, [forum_id])
    _, other_approver = await token(store, [other_id], can_approve=True)
    async with (
        open_stream(http, forum_id, approver) as stream,
        open_stream(http, forum_id, reader) as plain_stream,
    ):
        await say(client, forum_id, "what is six times seven?")
        requested = (await next_approval(stream, "requested")).data
        assert requested["forumId"] == forum_id and requested["tool"] == "calculator"
        assert requested["input"] == SUM and requested["agentActorId"] == join.agent_actor_id
        call_id = requested["callId"]
        # A token that may not decide hears of it, but not what the tool would be given.
        plain = (await next_approval(plain_stream, "requested")).data
        assert plain["callId"] == call_id and "input" not in plain

        listed = await http.get(f"/v1/forums/{forum_id}/approvals", headers=bearer(approver))
        [pending] = listed.json()["approvals"]
        assert (pending["callId"], pending["tool"], pending["input"]) == (
            call_id,
            "calculator",
            SUM,
        )
        deadline = datetime.fromisoformat(pending["deadline"])
        # The store keeps milliseconds; the event has the processor's own clock reading.
        assert abs(deadline - datetime.fromisoformat(requested["deadline"])) < timedelta(
            milliseconds=1
        )
        # Not run before a decision; another forum's approver can name neither forum nor call.
        assert results_of(await store.history(join.monologue_id)) == []
        path = f"/v1/forums/{forum_id}/approvals/{call_id}"
        refused = await http.post(
            path, json={"decision": "approve"}, headers=bearer(other_approver)
        )
        assert refused.status_code == 403
        crossed = await http.post(
            f"/v1/forums/{other_id}/approvals/{call_id}",
            json={"decision": "reject"},
            headers=bearer(other_approver),
        )
        assert crossed.status_code == 404 and crossed.json()["code"] == "unknown_call"

        ada = {"externalId": "ada", "displayName": "Ada"}
        approved = await http.post(
            path, json={"decision": "approve", "by": ada}, headers=bearer(approver)
        )
        assert approved.status_code == 200, approved.text
        assert approved.json() == {"callId": call_id, "decision": "approve", "duplicate": False}
        decided = (await next_approval(stream, "decided")).data
        assert decided["callId"] == call_id and decided["decision"] == "approve"
        assert re.fullmatch(rf"http:{name}~[0-9a-f]{{16}}:ada", decided["by"]["externalId"])
        assert decided["by"]["displayName"] == "Ada"
        assert (await next_approval(plain_stream, "decided")).data["decision"] == "approve"

    lines = await lines_until(store, forum_id, lambda lines: len(agent_lines(lines)) == 1)
    assert agent_lines(lines)[0].text == "the sum is in"
    [result] = results_of(await store.history(join.monologue_id))
    assert result.is_error is False and result.output.startswith("42"), result

    # The first decision stands: the same again is a duplicate, any other a conflict.
    again = await http.post(path, json={"decision": "approve", "by": ada}, headers=bearer(approver))
    assert again.status_code == 200 and again.json()["duplicate"] is True, again.text
    late = await http.post(
        path, json={"decision": "reject", "reason": "too late"}, headers=bearer(approver)
    )
    assert late.status_code == 409, late.text
    assert late.json()["code"] in ("already_decided", "not_awaiting_approval")
    listed = await http.get(f"/v1/forums/{forum_id}/approvals", headers=bearer(approver))
    assert listed.json() == {"approvals": []}
    assert len(results_of(await store.history(join.monologue_id))) == 1


# --- the console ------------------------------------------------------------------------


def reject_in_the_console(driver: WebDriver, url: str, secret: str, forum_id: str) -> None:
    """Waits for the pending approval (posted by the test meanwhile), rejects it as Ada."""
    driver.get(url + "/")
    driver.execute_script("sessionStorage.setItem('yoke.token', arguments[0])", secret)
    driver.execute_script("sessionStorage.setItem('yoke.name', 'Ada')")
    driver.get(f"{url}/forums/{forum_id}")
    pending = "#approvals li.approval[data-state=pending]"
    wait_for(driver, "a pending approval", lambda d: d.find_elements(By.CSS_SELECTOR, pending))
    item = driver.find_element(By.CSS_SELECTOR, pending)
    assert item.find_element(By.CSS_SELECTOR, ".approval-tool").text == "calculator"
    assert json.loads(item.find_element(By.CSS_SELECTOR, ".approval-input").text) == SUM
    assert item.find_element(By.CSS_SELECTOR, ".approve-button").text == "Approve"
    item.find_element(By.CSS_SELECTOR, ".approval-reason").send_keys("not today")
    item.find_element(By.CSS_SELECTOR, ".reject-button").click()
    wait_for(
        driver,
        "the rejection, who and why",
        lambda d: "rejected by Ada: not today" in texts(d, "#approvals .approval-decision"),
    )
    assert not driver.find_elements(By.CSS_SELECTOR, "#approvals .approve-button")
    driver.find_element(By.CSS_SELECTOR, "button.agent-link").click()
    wait_for(
        driver,
        "the decision in the monologue",
        lambda d: "rejected by Ada: not today" in texts(d, "#monologue-lines .call-approval"),
    )


async def test_the_console_rejects_an_approval_and_shows_who_and_why(
    gateway_url: str,
    browser: WebDriver,  # after the gateway: closed before it stops
    store: Store,
    client: Client,
    new_join: JoinFactory,
) -> None:
    forum_id, join = await gated_join(new_join, "never said")
    name, secret = await token(store, [forum_id], can_approve=True, can_read_monologues=True)
    await say(client, forum_id, "add these up")
    await asyncio.to_thread(reject_in_the_console, browser, gateway_url, secret, forum_id)

    [result] = results_of(
        await lines_until(store, join.monologue_id, lambda lines: bool(results_of(lines)))
    )
    assert result.is_error and result.output == "rejected by Ada: not today", result
    async with httpx.AsyncClient(base_url=gateway_url, headers=bearer(secret)) as http:
        page = await http.get(f"/console/api/monologues/{join.monologue_id}/messages")
        [call] = page.json()["toolCalls"]
    assert call["state"] == "rejected" and call["name"] == "calculator"
    approval = call["approval"]
    assert (approval["decision"], approval["reason"]) == ("reject", "not today")
    assert re.fullmatch(rf"http:{name}~[0-9a-f]{{16}}:Ada", approval["by"]["externalId"])
    assert approval["by"]["displayName"] == "Ada"

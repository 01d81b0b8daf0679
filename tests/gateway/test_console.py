"""The web console in a real browser: Debian's headless Chromium driven by selenium.

The mesh and the gateway run as real processes; the browser asks for a token once (kept in
the tab's session storage), opens a forum, posts a line as a named person, sees the agent's
answer arrive over the stream without a reload, and opens the agent's monologue beside it,
tool call and result included, each call with its source, state and duration (a built-in
answered in the step; worker calls nobody serves: one waiting in the store, one its deadline
ended); an answer streamed by the model is drawn as it is written, then replaced by its line.
``make browser`` (a prerequisite of ``make test``) installs ``chromium`` and
``chromium-driver``.
"""

from __future__ import annotations

import asyncio
import re
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver

from services.gateway.tool_calls import ToolCallStates
from tests.support.browser import page_text, texts, wait_for
from tests.support.mesh import JoinFactory, agent_lines, lines_until, say
from yoke.client import Client
from yoke.core.models import Message, MessageMeta, ToolCallPart, ToolResultPart
from yoke.llm.base import ScriptedCall, ScriptedOutput
from yoke.runtime.calls.records import (
    TOOL_CALL_ENDS_COLLECTION,
    open_call_id,
    own_result_line_id,
    round_results_line_id,
)
from yoke.runtime.catalog_store import ToolCatalog
from yoke.runtime.joins import Join, create_agent, create_forum, join_id
from yoke.store.database import Store
from yoke.store.tokens import create_token, ensure_token_indexes
from yoke.store.webhooks import (
    DEAD_LETTERS,
    DeadLetter,
    add_webhook,
    collection,
    ensure_webhook_indexes,
    remove_webhook,
)
from yoke.tools.catalog import CatalogEntry

pytestmark = pytest.mark.slow

# Worker tools nobody serves: one whose call stays open through the module, one whose call
# passes its deadline at once (the processors' reaper ends it). Broker-wide names: unique.
WAITING_TOOL = f"waiting-{uuid.uuid4().hex[:8]}"
LATE_TOOL = f"late-{uuid.uuid4().hex[:8]}"
LATE_SECONDS = 1.0


@pytest.fixture(scope="module")
async def before_mesh(store: Store) -> None:
    """The worker tools are in the catalog when the mesh starts, so the processor's copy of
    it, read at its start, offers them."""
    catalog = ToolCatalog(store)
    for name, timeout in ((WAITING_TOOL, 3600.0), (LATE_TOOL, LATE_SECONDS)):
        entry = CatalogEntry(id=name, source="worker", origin=name, timeout_seconds=timeout)
        await catalog.register(entry)


def call_status(driver: WebDriver, tool: str) -> tuple[str, str, str]:
    """(data-source, data-state, status text) of the monologue view's call of ``tool``."""
    for call in driver.find_elements(By.CSS_SELECTOR, "#monologue-lines .tool-call"):
        if call.find_element(By.TAG_NAME, "code").text.startswith(tool + " "):
            status = call.find_element(By.CSS_SELECTOR, ".call-status").text
            return (
                call.get_attribute("data-source") or "",
                call.get_attribute("data-state") or "",
                status,
            )
    return "", "", ""


def use_the_console(
    driver: WebDriver,
    url: str,
    secret: str,
    forum_id: str,
    title: str,
    workers_forum_id: str,
    shots: Path,
) -> None:
    """What a person does, step by step; each wait fails naming what never appeared."""
    driver.get(url + "/")
    token_input = (By.ID, "token-input")
    wait_for(driver, "the token form", lambda d: d.find_element(*token_input).is_displayed())
    driver.find_element(By.ID, "token-input").send_keys(secret)
    driver.find_element(By.CSS_SELECTOR, "#token-form button").click()
    wait_for(driver, f"the forum {title!r}", lambda d: title in texts(d, "a.forum-link"))
    driver.find_element(By.LINK_TEXT, title).click()

    wait_for(driver, "the forum view", lambda d: d.find_element(By.ID, "forum-title").text == title)
    assert forum_id in driver.current_url and secret not in driver.current_url
    assert driver.execute_script("return sessionStorage.getItem('yoke.token')") == secret
    # A mark on this page's window: a reload would wipe it.
    driver.execute_script("window.consoleMark = 'still the same page'")
    state = (By.ID, "stream-state")
    wait_for(driver, "the live stream", lambda d: d.find_element(*state).text == "live")
    driver.find_element(By.ID, "post-name").send_keys("Ada")
    driver.find_element(By.ID, "post-text").send_keys("what time is it?")
    driver.find_element(By.ID, "post-send").click()

    wait_for(
        driver,
        "Ada's line",
        lambda d: any("what time is it?" in t for t in texts(d, "#lines li.person")),
    )
    wait_for(
        driver,
        "the agent's answer",
        lambda d: any("it is late" in t for t in texts(d, "#lines li.agent:not(.draft)")),
    )
    assert driver.execute_script("return window.consoleMark") == "still the same page"
    person = driver.find_element(By.CSS_SELECTOR, "#lines li.person")
    assert "Ada" in person.find_element(By.CSS_SELECTOR, ".author").text
    driver.save_screenshot(str(shots / "forum.png"))

    driver.find_element(By.CSS_SELECTOR, "button.agent-link").click()
    wait_for(
        driver,
        "the monologue's tool call, tool result and answer",
        lambda d: (
            d.find_elements(By.CSS_SELECTOR, "#monologue-lines .tool-call")
            and d.find_elements(By.CSS_SELECTOR, "#monologue-lines .tool-result")
            and any("it is late" in t for t in texts(d, "#monologue-lines li.agent"))
        ),
    )
    monologue = texts(driver, "#monologue-lines li")
    assert any("what time is it?" in line for line in monologue)  # the copied forum line
    assert any("clock" in line for line in monologue)
    wait_for(driver, "the clock call answered", lambda d: call_status(d, "clock")[1] == "answered")
    source, _, status = call_status(driver, "clock")
    assert source == "builtin" and status.startswith("builtin\nanswered\n"), status
    assert re.fullmatch(r"\d+(\.\d\d)? s", status.split("\n")[2]), status  # its duration
    assert driver.execute_script("return window.consoleMark") == "still the same page"
    driver.save_screenshot(str(shots / "monologue.png"))

    # The worker calls: one waiting in the store past its deadline's reach, one timed out.
    driver.get(f"{url}/forums/{workers_forum_id}")
    wait_for(
        driver,
        "the workers' agent",
        lambda d: d.find_elements(By.CSS_SELECTOR, "button.agent-link"),
    )
    driver.find_element(By.CSS_SELECTOR, "button.agent-link").click()
    wait_for(
        driver,
        "an open worker call and a timed-out one",
        lambda d: (
            call_status(d, WAITING_TOOL)[1] == "open" and call_status(d, LATE_TOOL)[1] == "timeout"
        ),
    )
    source, _, status = call_status(driver, WAITING_TOOL)
    assert source == "worker" and status.startswith("worker\nopen\nopen for "), status
    assert "deadline " in status
    source, _, status = call_status(driver, LATE_TOOL)
    assert source == "worker" and status.startswith("worker\ntimed out\n"), status
    results = texts(driver, "#monologue-lines .tool-result")
    assert any(f"{LATE_TOOL} gave no answer within 1 s" in text for text in results), results
    driver.save_screenshot(str(shots / "worker-calls.png"))

    driver.get(url + "/dead-letters")  # same tab: the token is still there
    wait_for(
        driver,
        "the dead letters",
        lambda d: d.find_element(By.ID, "letters-section").is_displayed(),
    )
    assert not driver.find_element(By.ID, "token-form").is_displayed()


# Records, in the page, each text a draft shows as it changes: {at (ms since the epoch), id, text}.
WATCH_DRAFTS = """
window.draftLog = [];
const lines = document.getElementById("lines");
new MutationObserver(() => {
  for (const node of lines.querySelectorAll("li.draft")) {
    const text = node.querySelector(".text").textContent;
    const last = window.draftLog[window.draftLog.length - 1];
    if (text && (!last || last.text !== text || last.id !== node.dataset.draftId)) {
      window.draftLog.push({ at: Date.now(), id: node.dataset.draftId, text });
    }
  }
}).observe(lines, { childList: true, subtree: true, characterData: true });
"""


def watch_a_draft(
    driver: WebDriver, url: str, secret: str, forum_id: str, text: str
) -> tuple[list[dict[str, Any]], list[str]]:
    """Posts ``text`` in the forum's page and waits for the agent's line; (what the draft
    showed as it was written, the agent lines' message ids the page ends with)."""
    driver.get(url + "/")
    driver.execute_script("sessionStorage.setItem('yoke.token', arguments[0])", secret)
    driver.get(f"{url}/forums/{forum_id}")
    state = (By.ID, "stream-state")
    wait_for(driver, "the live stream", lambda d: d.find_element(*state).text == "live")
    driver.execute_script(WATCH_DRAFTS)
    driver.find_element(By.ID, "post-name").send_keys("Ada")
    driver.find_element(By.ID, "post-text").send_keys(text)
    driver.find_element(By.ID, "post-send").click()
    wait_for(
        driver,
        "the streamed answer's line",
        lambda d: text in texts(d, "#lines li.agent:not(.draft) .text"),
    )
    assert not driver.find_elements(By.CSS_SELECTOR, "#lines li.draft"), page_text(driver)
    answers = driver.find_elements(By.CSS_SELECTOR, "#lines li.agent:not(.draft)")
    ids = [str(node.get_attribute("data-message-id")) for node in answers]
    log: list[dict[str, Any]] = driver.execute_script("return window.draftLog")
    return log, ids


async def worker_calls(store: Store, client: Client, new_join: JoinFactory) -> tuple[str, Join]:
    """A join whose agent calls both worker tools in one round; returns once the late call's
    deadline has ended it (the other one waits on)."""
    calls = [ScriptedCall(name=WAITING_TOOL), ScriptedCall(name=LATE_TOOL)]
    forum = await create_forum(store, "the workers' forum")  # not the other forums' title
    forum_id, join = await new_join(
        forum.id,
        model="fixture-script",
        tools=[WAITING_TOOL, LATE_TOOL],
        script=[ScriptedOutput(tool_calls=calls)],
    )
    await say(client, forum_id, "ask the workers")
    await lines_until(
        store,
        join.monologue_id,
        lambda lines: any(isinstance(part, ToolResultPart) for m in lines for part in m.parts),
    )
    return forum_id, join


async def test_the_console_shows_a_forum_live_and_the_agents_monologue(
    gateway_url: str,
    browser: WebDriver,  # after the gateway: closed before it stops
    store: Store,
    client: Client,
    new_join: JoinFactory,
    tmp_path: Path,
) -> None:
    script = [
        ScriptedOutput(tool_calls=[ScriptedCall(name="clock", input={})]),
        ScriptedOutput(text="it is late"),
    ]
    forum_id, _ = await new_join(model="fixture-script", tools=["clock"], script=script)
    workers_forum_id, _ = await worker_calls(store, client, new_join)
    title = (await store.get_conversation(forum_id)).title  # type: ignore[union-attr]
    await ensure_token_indexes(store)
    _, secret = await create_token(
        store, "console", [forum_id, workers_forum_id], can_read_monologues=True
    )
    await asyncio.to_thread(
        use_the_console,
        browser,
        gateway_url,
        secret,
        forum_id,
        title,
        workers_forum_id,
        tmp_path,
    )


async def test_the_console_draws_an_answer_as_it_is_written_then_shows_its_line(
    gateway_url: str, browser: WebDriver, store: Store, new_join: JoinFactory
) -> None:
    """A model streaming 20 pieces over 2 s: the draft grows in the page, each text it shows a
    prefix of the answer, from before the line is stored; the line then takes its place."""
    text = "an answer that the model writes slowly, in twenty pieces, for the console to draw"
    forum_id, _ = await new_join(model="fixture-stream-20-2")
    await ensure_token_indexes(store)
    _, secret = await create_token(store, "drafts-console", [forum_id])
    log, ids = await asyncio.to_thread(watch_a_draft, browser, gateway_url, secret, forum_id, text)
    [line] = [m for m in await store.history(forum_id) if m.role == "agent"]
    assert ids == [line.id] and line.text == text
    assert log, "no draft was drawn"
    assert {entry["id"] for entry in log} == {line.id}
    assert all(text.startswith(entry["text"]) for entry in log), log
    assert len(log) >= 2 and len(log[0]["text"]) < len(text), log  # drawn as it grew
    stored_at = line.created_at.replace(tzinfo=UTC).timestamp() * 1000
    assert log[0]["at"] < stored_at, (log[0], line.created_at)


def seconds_between(start: str, end: str) -> float:
    return (datetime.fromisoformat(end) - datetime.fromisoformat(start)).total_seconds()


async def test_the_monologue_data_says_where_each_tool_call_stands(
    gateway_url: str, store: Store, client: Client, new_join: JoinFactory
) -> None:
    """Each call's source (from the catalog, or the open call's own), its state (answered in
    the step, waiting in the store, ended by its deadline) and how long it took or has waited;
    a page of lines carries the calls it answers and every call still waiting, so a call shown
    before is redrawn when it ends."""
    script = [ScriptedOutput(tool_calls=[ScriptedCall(name="clock")]), ScriptedOutput(text="ok")]
    clock_forum, clock_join = await new_join(model="fixture-script", tools=["clock"], script=script)
    await say(client, clock_forum, "what time is it?")
    await lines_until(store, clock_forum, lambda lines: len(agent_lines(lines)) == 1)
    workers_forum, workers_join = await worker_calls(store, client, new_join)
    await ensure_token_indexes(store)
    _, secret = await create_token(
        store, "tool-calls-console", [clock_forum, workers_forum], can_read_monologues=True
    )

    async with httpx.AsyncClient(
        base_url=gateway_url, timeout=30, headers={"Authorization": f"Bearer {secret}"}
    ) as http:

        async def page(monologue_id: str, after: int | None = None) -> dict[str, Any]:
            query = "" if after is None else f"?after={after}"
            answer = await http.get(f"/console/api/monologues/{monologue_id}/messages{query}")
            assert answer.status_code == 200, answer.text
            body: dict[str, Any] = answer.json()
            return body

        def call_line(body: dict[str, Any]) -> Message:
            lines = [Message.model_validate(m) for m in body["messages"]]
            return next(m for m in lines if any(isinstance(p, ToolCallPart) for p in m.parts))

        # A built-in call, answered in the step: its result is in the round's results line.
        body = await page(clock_join.monologue_id)
        line = call_line(body)
        (clock,) = body["toolCalls"]
        results_id = round_results_line_id(join_id(clock_join.agent_actor_id, clock_forum), line.id)
        results = await store.get_message(results_id)
        assert results is not None  # the id the processor gave it
        assert clock["callLineId"] == line.id and clock["callId"] == line.parts[0].call_id  # type: ignore[union-attr]
        assert (clock["name"], clock["source"], clock["state"]) == ("clock", "builtin", "answered")
        assert clock["resultLineId"] == results_id and "openCallId" not in clock
        started, ended = clock["startedAt"], clock["endedAt"]
        assert datetime.fromisoformat(started) == line.created_at.replace(tzinfo=UTC)
        assert datetime.fromisoformat(ended) == results.created_at.replace(tzinfo=UTC)
        assert clock["seconds"] == pytest.approx(seconds_between(started, ended), abs=1e-3)

        # Worker calls: one waiting in the store, one its deadline ended.
        instance = join_id(workers_join.agent_actor_id, workers_forum)
        body = await page(workers_join.monologue_id)
        line = call_line(body)
        calls = {call["name"]: call for call in body["toolCalls"]}
        waiting, late = calls[WAITING_TOOL], calls[LATE_TOOL]
        waiting_id = open_call_id(instance, line.id, waiting["callId"])
        assert (waiting["source"], waiting["state"]) == ("worker", "open")
        assert waiting["openCallId"] == waiting_id and "endedAt" not in waiting
        assert 0 <= waiting["seconds"] < 3600
        opened_for = seconds_between(waiting["startedAt"], waiting["deadline"])
        assert 3600 <= opened_for < 3600 + 30  # the tool's timeout, from about the call line

        late_id = open_call_id(instance, line.id, late["callId"])
        end = await store.db[TOOL_CALL_ENDS_COLLECTION].find_one({"_id": late_id})
        assert end is not None and end["outcome"] == "timeout"
        late_line = await store.get_message(own_result_line_id(late_id))
        assert late_line is not None
        assert (late["source"], late["state"]) == ("worker", "timeout")
        assert late["openCallId"] == late_id and late["resultLineId"] == late_line.id
        assert datetime.fromisoformat(late["endedAt"]) == late_line.created_at.replace(tzinfo=UTC)
        assert LATE_SECONDS <= late["seconds"] < LATE_SECONDS + 30
        assert late["seconds"] == pytest.approx(
            seconds_between(late["startedAt"], late["endedAt"]), abs=1e-3
        )

        # Polling on: nothing new still brings the waiting call (its "open for" grows); a page
        # holding only the late call's result brings that call, drawn lines earlier.
        later = await page(workers_join.monologue_id, after=body["head"])
        assert later["messages"] == []
        assert [(c["name"], c["state"]) for c in later["toolCalls"]] == [(WAITING_TOOL, "open")]
        assert later["toolCalls"][0]["seconds"] >= waiting["seconds"]
        only_result = await page(workers_join.monologue_id, after=late_line.seq - 1)
        assert [m["id"] for m in only_result["messages"]][:1] == [late_line.id]
        assert {(c["name"], c["state"]) for c in only_result["toolCalls"]} == {
            (WAITING_TOOL, "open"),
            (LATE_TOOL, "timeout"),
        }


async def test_the_consoles_data_keeps_to_the_tokens_scope(
    gateway_url: str, store: Store, new_join: JoinFactory
) -> None:
    """Monologues through their join's forum, webhook dead letters through their forum, the
    mesh's dead letters to all-forums tokens only; pages need no token but carry a CSP."""
    mine, my_join = await new_join()
    theirs, their_join = await new_join()
    await ensure_token_indexes(store)
    _, scoped = await create_token(store, "scoped-console", [mine], can_read_monologues=True)
    _, everything = await create_token(store, "all-console", can_read_monologues=True)
    await ensure_webhook_indexes(store)
    for forum_id in (mine, theirs):
        subscription = await add_webhook(store, forum_id, "http://127.0.0.1:9/unused")
        letter = DeadLetter(
            id=f"letter-{forum_id}",
            subscription_id=subscription.id,
            forum_id=forum_id,
            message_id="m",
            seq=1,
            url=subscription.url,
            reason="refused: HTTP 400",
            status=400,
            attempts=1,
        )
        await collection(store, DEAD_LETTERS).insert_one(letter.to_document())
        await remove_webhook(store, subscription.id)  # the letters stay

    async with httpx.AsyncClient(base_url=gateway_url, timeout=30) as http:

        async def get(path: str, secret: str | None) -> httpx.Response:
            headers = {"Authorization": f"Bearer {secret}"} if secret else {}
            return await http.get(path, headers=headers)

        page = await get(f"/forums/{mine}", None)
        assert page.status_code == 200 and f'data-forum-id="{mine}"' in page.text
        assert "script-src 'self'" in page.headers["content-security-policy"]
        assert (await get("/console/static/console.js", None)).status_code == 200
        assert (await get("/console/static/../app.py", None)).status_code == 404
        assert (await get("/console/api/forums", None)).status_code == 401

        listed = (await get("/console/api/forums", scoped)).json()["forums"]
        assert [forum["id"] for forum in listed] == [mine]
        info = (await get(f"/console/api/forums/{mine}", scoped)).json()
        assert [a["monologueId"] for a in info["agents"]] == [my_join.monologue_id]
        assert (await get(f"/console/api/forums/{theirs}", scoped)).status_code == 403

        own = await get(f"/console/api/monologues/{my_join.monologue_id}/messages", scoped)
        assert own.status_code == 200 and own.json()["forumId"] == mine
        other = f"/console/api/monologues/{their_join.monologue_id}/messages"
        assert (await get(other, scoped)).status_code == 403
        assert (await get(other, everything)).status_code == 200
        # A forum is not a monologue: nothing is shown, whatever the scope.
        not_a_monologue = await get(f"/console/api/monologues/{mine}/messages", everything)
        assert not_a_monologue.status_code == 403

        letters = (await get("/console/api/dead-letters", scoped)).json()
        assert [letter["forumId"] for letter in letters["webhooks"]] == [mine]
        assert letters["mesh"] is None
        letters = (await get("/console/api/dead-letters", everything)).json()
        assert {letter["forumId"] for letter in letters["webhooks"]} >= {mine, theirs}
        assert isinstance(letters["mesh"], list)


async def test_the_console_follows_an_agent_across_compactions(
    gateway_url: str, store: Store, client: Client, new_join: JoinFactory
) -> None:
    """The monologue panel lists the monologues before each compaction; the scope of the
    forum covers them all, and the new one opens with the summary (an instruction line)."""
    forum_id, join = await new_join(compaction_threshold_tokens=40, compaction_keep=2)
    await ensure_token_indexes(store)
    _, secret = await create_token(store, "compacted-console", [forum_id], can_read_monologues=True)
    for n in range(8):
        await say(client, forum_id, f"a line long enough to fill the monologue, number {n}")
    await lines_until(store, forum_id, lambda lines: len(agent_lines(lines)) >= 8, timeout=90)

    async with httpx.AsyncClient(
        base_url=gateway_url, timeout=30, headers={"Authorization": f"Bearer {secret}"}
    ) as http:
        info = (await http.get(f"/console/api/forums/{forum_id}")).json()
        (agent,) = info["agents"]
        monologues = agent["monologues"]
        assert len(monologues) >= 2 and monologues[0] == join.monologue_id
        assert monologues[-1] == agent["monologueId"] != join.monologue_id
        for monologue_id in monologues:
            answer = await http.get(f"/console/api/monologues/{monologue_id}/messages")
            assert answer.status_code == 200 and answer.json()["forumId"] == forum_id
        newest = await http.get(f"/console/api/monologues/{monologues[-1]}/messages?after=0")
        first = newest.json()["messages"][0]
        assert first["meta"]["instruction"] == "summary"


async def test_a_call_carried_into_a_new_monologue_shows_how_its_original_ended(
    store: Store,
) -> None:
    """Compaction copies the context (a call and its results) into the next monologue under new
    ids; the copy's state, start and end are the original's, found by ``carriedFrom``."""
    forum = await create_forum(store, "carried calls")
    agent = await create_agent(store, "carrier")
    instance = join_id(agent.id, forum.id)
    old, new = uuid.uuid4().hex, uuid.uuid4().hex
    call = ToolCallPart(call_id="c-0", name="clock")
    now = datetime.now(UTC).replace(microsecond=0)  # what the store keeps of it (ms) is exact
    original, _ = await store.insert_message(
        Message(
            id=uuid.uuid4().hex,
            conversation_id=old,
            author_actor_id=agent.id,
            role="agent",
            parts=[call],
            created_at=now - timedelta(seconds=90),
        )
    )
    answered, _ = await store.insert_message(
        Message(
            id=round_results_line_id(instance, original.id),
            conversation_id=old,
            author_actor_id="system",
            parts=[ToolResultPart(call_id="c-0", name="clock", output="now", is_error=True)],
            meta=MessageMeta(causation_id=original.id),
            created_at=now - timedelta(seconds=60),
        )
    )
    copies = []
    for line in (original, answered):
        copy = line.model_copy(
            update={
                "id": uuid.uuid4().hex,
                "conversation_id": new,
                "meta": line.meta.model_copy(update={"carried_from": line.id}),
                "created_at": now,
            }
        )
        copies.append((await store.insert_message(copy))[0])
    states = ToolCallStates(store, ToolCatalog(store))

    (view,) = await states.views(new, forum.id, agent.id, copies)
    assert view.call_line_id == copies[0].id and view.call_id == "c-0"
    assert (view.state, view.result_line_id) == ("error", answered.id)
    assert view.started_at == original.created_at
    assert view.ended_at == answered.created_at and view.seconds == 30
    # The old monologue's own lines, as a page before the compaction showed them.
    (view,) = await states.views(old, forum.id, agent.id, [original, answered])
    assert (view.call_line_id, view.state, view.seconds) == (original.id, "error", 30)

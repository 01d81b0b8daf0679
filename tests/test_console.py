"""The web console in a real browser: Debian's headless Chromium driven by selenium.

The mesh and the gateway run as real processes; the browser asks for a token once (kept in
the tab's session storage), opens a forum, posts a line as a named person, sees the agent's
answer arrive over the stream without a reload, and opens the agent's monologue beside it,
tool call and result included. ``make browser`` (a prerequisite of ``make test``) installs
``chromium`` and ``chromium-driver``.
"""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import httpx
import pytest
from selenium import webdriver
from selenium.common.exceptions import StaleElementReferenceException
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support.ui import WebDriverWait

from tests.support.gateway_process import running_gateway
from tests.support.mesh import JoinFactory, Mesh, agent_lines, lines_until, say
from yoke.client import Client
from yoke.llm.base import ScriptedCall, ScriptedOutput
from yoke.store import Store
from yoke.tokens import create_token, ensure_token_indexes
from yoke.webhooks import (
    DEAD_LETTERS,
    DeadLetter,
    add_webhook,
    collection,
    ensure_webhook_indexes,
    remove_webhook,
)

pytestmark = pytest.mark.slow

CHROMIUM = "/usr/bin/chromium"
WAIT_SECONDS = 60


@pytest.fixture(scope="module")
async def gateway_url(
    amqp_url: str, module_mongodb_url: str, mesh: Mesh, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[str]:
    log_dir = Path(tmp_path_factory.mktemp("gateway"))
    async with running_gateway(amqp_url, module_mongodb_url, log_dir) as url:
        yield url


@pytest.fixture(scope="module")
def browser() -> Iterator[WebDriver]:
    driver_path = shutil.which("chromedriver")
    assert driver_path and Path(CHROMIUM).exists(), (
        "Debian's chromium and chromium-driver are needed: make browser"
    )
    options = Options()
    options.binary_location = CHROMIUM
    for argument in (
        "--headless=new",
        "--no-sandbox",  # root in CI
        "--disable-dev-shm-usage",
        "--disable-gpu",
        "--window-size=1280,900",
    ):
        options.add_argument(argument)
    driver = webdriver.Chrome(options=options, service=Service(executable_path=driver_path))
    try:
        yield driver
    finally:
        driver.quit()


def wait_for(driver: WebDriver, what: str, check: Callable[[WebDriver], object]) -> None:
    def safely(d: WebDriver) -> object:
        try:
            return check(d)
        except StaleElementReferenceException:  # re-rendered under us: look again
            return False

    try:
        WebDriverWait(driver, WAIT_SECONDS, poll_frequency=0.2).until(safely)
    except Exception as error:
        raise AssertionError(f"the console never showed {what}:\n{page_text(driver)}") from error


def page_text(driver: WebDriver) -> str:
    return str(driver.execute_script("return document.body.innerText"))[-3000:]


def texts(driver: WebDriver, selector: str) -> list[str]:
    return [item.text for item in driver.find_elements(By.CSS_SELECTOR, selector)]


def use_the_console(
    driver: WebDriver, url: str, secret: str, forum_id: str, title: str, shots: Path
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
        lambda d: any("it is late" in t for t in texts(d, "#lines li.agent")),
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
    assert driver.execute_script("return window.consoleMark") == "still the same page"
    driver.save_screenshot(str(shots / "monologue.png"))

    driver.get(url + "/dead-letters")  # same tab: the token is still there
    wait_for(
        driver,
        "the dead letters",
        lambda d: d.find_element(By.ID, "letters-section").is_displayed(),
    )
    assert not driver.find_element(By.ID, "token-form").is_displayed()


async def test_the_console_shows_a_forum_live_and_the_agents_monologue(
    gateway_url: str,
    browser: WebDriver,  # after the gateway: closed before it stops
    store: Store,
    new_join: JoinFactory,
    tmp_path: Path,
) -> None:
    script = [
        ScriptedOutput(tool_calls=[ScriptedCall(name="clock", input={})]),
        ScriptedOutput(text="it is late"),
    ]
    forum_id, _ = await new_join(model="fixture-script", tools=["clock"], script=script)
    title = (await store.get_conversation(forum_id)).title  # type: ignore[union-attr]
    await ensure_token_indexes(store)
    _, secret = await create_token(store, "console", [forum_id])
    await asyncio.to_thread(
        use_the_console, browser, gateway_url, secret, forum_id, title, tmp_path
    )


async def test_the_consoles_data_keeps_to_the_tokens_scope(
    gateway_url: str, store: Store, new_join: JoinFactory
) -> None:
    """Monologues through their join's forum, webhook dead letters through their forum, the
    mesh's dead letters to all-forums tokens only; pages need no token but carry a CSP."""
    mine, my_join = await new_join()
    theirs, their_join = await new_join()
    await ensure_token_indexes(store)
    _, scoped = await create_token(store, "scoped-console", [mine])
    _, everything = await create_token(store, "all-console")
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
    _, secret = await create_token(store, "compacted-console", [forum_id])
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

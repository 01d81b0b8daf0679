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
import signal
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest
from selenium import webdriver
from selenium.common.exceptions import StaleElementReferenceException
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support.ui import WebDriverWait

from tests.support.gateway_process import start_gateway
from tests.support.mesh import JoinFactory, Mesh
from yoke.joins import ScriptedCall, ScriptedOutput
from yoke.store import Store
from yoke.tokens import create_token, ensure_token_indexes

pytestmark = pytest.mark.slow

CHROMIUM = "/usr/bin/chromium"
WAIT_SECONDS = 60


@pytest.fixture(scope="module")
async def gateway_url(
    amqp_url: str, module_mongodb_url: str, mesh: Mesh, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[str]:
    process, url = start_gateway(
        amqp_url, module_mongodb_url, Path(tmp_path_factory.mktemp("gateway"))
    )
    try:
        await process.wait_healthy()
        yield url
    finally:
        code = process.stop()
    log = process.log_path.read_text(errors="replace")
    assert code in (0, -signal.SIGTERM) and "Application shutdown complete" in log, log[-3000:]


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

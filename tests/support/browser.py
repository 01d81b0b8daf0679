"""The web console in a real browser: Debian's headless Chromium, driven by selenium.

``make browser`` (a prerequisite of ``make test``) installs ``chromium`` and
``chromium-driver``.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from selenium import webdriver
from selenium.common.exceptions import StaleElementReferenceException
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support.ui import WebDriverWait

CHROMIUM = "/usr/bin/chromium"
WAIT_SECONDS = 60  # the most the console may take to show what a test waits for
ARGUMENTS = (
    "--headless=new",
    "--no-sandbox",  # root in CI
    "--disable-dev-shm-usage",
    "--disable-gpu",
    "--window-size=1280,900",
)


@contextmanager
def headless_chromium() -> Iterator[WebDriver]:
    """A browser for the test module; quit after."""
    driver_path = shutil.which("chromedriver")
    assert driver_path and Path(CHROMIUM).exists(), (
        "Debian's chromium and chromium-driver are needed: make browser"
    )
    options = Options()
    options.binary_location = CHROMIUM
    for argument in ARGUMENTS:
        options.add_argument(argument)
    driver = webdriver.Chrome(options=options, service=Service(executable_path=driver_path))
    try:
        yield driver
    finally:
        driver.quit()


def wait_for(driver: WebDriver, what: str, check: Callable[[WebDriver], object]) -> None:
    """Poll ``check`` until it holds; at the deadline fail naming ``what``, with the page's
    text."""

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
    """The end of what the page shows (for a failure's message)."""
    return str(driver.execute_script("return document.body.innerText"))[-3000:]


def texts(driver: WebDriver, selector: str) -> list[str]:
    return [item.text for item in driver.find_elements(By.CSS_SELECTOR, selector)]

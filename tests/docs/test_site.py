"""The documentation site builds with ``mkdocs build --strict``, every page of docs/ is in its nav,
and the build fails on what a reader would trip over: a link to a missing page or anchor, a page
left out of the nav."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support.processes import ROOT

CONFIG = ROOT / "mkdocs.yml"
DOCS = ROOT / "docs"
# A build takes about 5 s on a loaded 2-CPU machine; far past that, something went wrong.
BUILD_SECONDS = 120


def build(config: Path, site: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config), "-d", str(site)],
        cwd=config.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=BUILD_SECONDS,
    )


def nav_pages(nav: Any) -> Iterator[str]:
    """Every page path a nav names, however deep its sections go."""
    if isinstance(nav, str):
        yield nav
    elif isinstance(nav, list):
        for item in nav:
            yield from nav_pages(item)
    elif isinstance(nav, dict):
        for value in nav.values():
            yield from nav_pages(value)


def settings() -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load(CONFIG.read_text())
    return loaded


def test_the_site_builds_strictly(tmp_path: Path) -> None:
    started = time.monotonic()
    done = build(CONFIG, tmp_path / "site")
    took = time.monotonic() - started

    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "site" / "index.html").is_file()
    reference = (tmp_path / "site" / "reference" / "yoke.html").read_text()
    for name in ("yoke.Client", "yoke.Tool", "yoke.create_agent", "yoke.signature_matches"):
        assert f'id="{name}"' in reference, name  # mkdocstrings rendered the public surface
    print(f"mkdocs build --strict: {took:.1f} s")


def test_every_page_under_docs_is_in_the_nav() -> None:
    listed = set(nav_pages(settings()["nav"]))
    pages = {path.relative_to(DOCS).as_posix() for path in DOCS.rglob("*.md")}

    assert pages - listed == set(), "pages left out of mkdocs.yml's nav"
    assert listed - pages == set(), "nav entries with no page"


def small_site(tmp_path: Path, nav: list[str], pages: dict[str, str]) -> Path:
    """A site with the project's strictness and theme but only ``pages`` (no API reference, so
    it builds in a second or two)."""
    config = settings()
    config["plugins"] = ["search"]
    config["nav"] = nav
    config["docs_dir"] = "docs"
    (tmp_path / "docs").mkdir()
    for name, text in pages.items():
        (tmp_path / "docs" / name).write_text(text)
    path = tmp_path / "mkdocs.yml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.mark.parametrize(
    ("nav", "pages", "named"),
    [
        pytest.param(
            ["index.md", "other.md"],
            {"index.md": "# Home\n\n[gone](missing.md), [there](other.md)\n", "other.md": "# O\n"},
            "missing.md",
            id="a broken link",
        ),
        pytest.param(
            ["index.md", "other.md"],
            {"index.md": "# Home\n\n[there](other.md#nowhere)\n", "other.md": "# Other\n"},
            "nowhere",
            id="a broken anchor",
        ),
        pytest.param(
            ["index.md"],
            {"index.md": "# Home\n", "forgotten.md": "# Forgotten\n"},
            "forgotten.md",
            id="a page left out of the nav",
        ),
    ],
)
def test_a_fault_in_the_site_fails_the_build_naming_it(
    tmp_path: Path, nav: list[str], pages: dict[str, str], named: str
) -> None:
    done = build(small_site(tmp_path, nav, pages), tmp_path / "site")

    assert done.returncode != 0
    assert named in done.stderr


def test_the_small_site_builds_when_nothing_is_wrong(tmp_path: Path) -> None:
    """The three failures above are the faults they plant, not a small site that never builds."""
    config = small_site(
        tmp_path,
        ["index.md", "other.md"],
        {"index.md": "# Home\n\n[there](other.md#other)\n", "other.md": "# Other\n"},
    )

    done = build(config, tmp_path / "site")

    assert done.returncode == 0, done.stdout + done.stderr

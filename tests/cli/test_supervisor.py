"""``yoke up`` restarts a crashed service, but not one that cannot run as configured."""

from __future__ import annotations

import asyncio
import signal
import sys

import pytest

from yoke.cli import supervisor
from yoke.cli.supervisor import Child, watch
from yoke.core.errors import EXIT_MISCONFIGURED


async def test_a_misconfigured_service_is_not_restarted() -> None:
    child = Child("processor")
    child.process = await asyncio.create_subprocess_exec(
        sys.executable, "-c", f"raise SystemExit({EXIT_MISCONFIGURED})"
    )
    # watch() returns instead of restarting; a restart would start a real service.
    await asyncio.wait_for(watch(child, asyncio.Event()), timeout=30)
    assert child.restarts == 0
    assert child.process.returncode == EXIT_MISCONFIGURED


async def test_a_restart_racing_the_stop_is_stopped_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """``yoke up`` stops the children it knows of when told to stop; a child being restarted
    at that moment is not among them yet, so its watcher stops it once it has started."""
    stopping = asyncio.Event()
    child = Child("processor")
    child.process = await asyncio.create_subprocess_exec(
        sys.executable, "-c", "raise SystemExit(1)"
    )

    async def start_while_stopping(restarted: Child) -> None:
        restarted.process = await asyncio.create_subprocess_exec(
            sys.executable, "-c", "import time; time.sleep(60)"
        )
        stopping.set()  # SIGTERM arrives while the restart is under way

    monkeypatch.setattr(supervisor, "start", start_while_stopping)
    await asyncio.wait_for(watch(child, stopping), timeout=30)
    assert child.restarts == 1
    assert child.process is not None
    code = await asyncio.wait_for(child.process.wait(), timeout=10)
    assert code == -signal.SIGTERM

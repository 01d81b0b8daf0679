"""``yoke up`` restarts a crashed service, but not one that cannot run as configured."""

from __future__ import annotations

import asyncio
import sys

from yoke.errors import EXIT_MISCONFIGURED
from yoke.supervisor import Child, watch


async def test_a_misconfigured_service_is_not_restarted() -> None:
    child = Child("processor")
    child.process = await asyncio.create_subprocess_exec(
        sys.executable, "-c", f"raise SystemExit({EXIT_MISCONFIGURED})"
    )
    # watch() returns instead of restarting; a restart would start a real service.
    await asyncio.wait_for(watch(child, asyncio.Event()), timeout=30)
    assert child.restarts == 0
    assert child.process.returncode == EXIT_MISCONFIGURED

"""``yoke`` as a separate process, the way an operator runs it."""

from __future__ import annotations

import asyncio
import os
import sys


async def run_yoke(env: dict[str, str], *args: str, timeout: float = 60) -> tuple[int, str, str]:
    """``yoke ARGS`` with ``env`` over this process's environment: exit code, stdout, stderr."""
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "yoke.cli",
        *args,
        env={**os.environ, **env},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        out, err = await asyncio.wait_for(process.communicate(), timeout)
    except TimeoutError:
        process.kill()  # a verb left running goes on changing the servers after the test
        await process.wait()
        raise
    assert process.returncode is not None
    return process.returncode, out.decode(errors="replace"), err.decode(errors="replace")

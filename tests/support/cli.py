"""``yoke`` as a separate process, the way an operator runs it."""

from __future__ import annotations

import asyncio
import json
import os
import sys


def cli_env(amqp_url: str, mongodb_url: str) -> dict[str, str]:
    """The two servers a ``yoke`` command is pointed at."""
    return {"YOKE_AMQP_URL": amqp_url, "YOKE_MONGODB_URL": mongodb_url}


async def run_yoke(env: dict[str, str], *args: str, timeout: float = 60) -> tuple[int, str, str]:
    """``yoke ARGS`` with ``env`` over this process's environment: exit code, stdout, stderr.

    Killed past ``timeout``: a verb left running would go on changing the servers after the
    test."""
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
        process.kill()
        await process.wait()
        raise TimeoutError(f"yoke {' '.join(args)} still running after {timeout:g} s") from None
    assert process.returncode is not None
    return process.returncode, out.decode(errors="replace"), err.decode(errors="replace")


# ``yoke`` commands one after the other in one process, each through the CLI's entry point, its
# output followed by END: what ``yoke ARGS`` would do and print, without a start-up per command.
END = "--- end of command ---"
RUN_COMMANDS = f"""
import json, sys
from yoke.cli.main import main
for argv in json.loads(sys.argv[1]):
    main(argv)
    print({END!r}, flush=True)
"""


async def run_yoke_commands(
    env: dict[str, str], commands: list[list[str]], timeout: float = 180
) -> tuple[int, list[str], str]:
    """Exit code, each command's standard output, and the standard error of them all (a
    command that fails ends the run: its exit code is the run's)."""
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        RUN_COMMANDS,
        json.dumps(commands),
        env={**os.environ, **env},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        out, err = await asyncio.wait_for(process.communicate(), timeout)
    except TimeoutError:
        process.kill()
        await process.wait()
        raise
    assert process.returncode is not None
    outputs = out.decode(errors="replace").split(END + "\n")
    return process.returncode, outputs[: len(commands)], err.decode(errors="replace")

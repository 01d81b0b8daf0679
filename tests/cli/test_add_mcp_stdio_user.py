"""``yoke tools add-mcp`` says at once when the stdio user cannot reach a server's command.

Run as root, the processor starts a stdio MCP server as ``YOKE_MCP_STDIO_USER`` (default
``nobody``; yoke.tools.stdio_user): a server in a checkout that user cannot enter (a clone under
a mode-0700 directory) would only fail at each start, in the processor's log. The CLI checks as
that user what root reaches of the command (the program, absolute paths among its arguments)
and refuses with a sentence (exit 2) before anything is stored.
"""

from __future__ import annotations

import os
import shlex
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.support.cli import run_yoke
from tests.support.unprivileged import python_for, readable_copies
from yoke.store.database import Store
from yoke.tools.catalog import MCP_SERVERS

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0, reason="only a root mesh starts stdio servers as another user"
)

SERVER = "import sys\nsys.stdin.read()\n"


@pytest.fixture
async def store(mongodb_url: str) -> AsyncIterator[Store]:
    store = Store(mongodb_url)
    yield store
    await store.close()


async def test_a_server_the_stdio_user_cannot_reach_is_refused_at_once(
    amqp_url: str, mongodb_url: str, store: Store, tmp_path: Path
) -> None:
    python = python_for()
    assert python is not None, "no Python the unprivileged stdio user can run"
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    server = private / "server.py"
    server.write_text(SERVER)
    script = private / "server.sh"
    script.write_text("#!/bin/sh\nexec cat\n")
    script.chmod(0o755)
    env = {"YOKE_AMQP_URL": amqp_url, "YOKE_MONGODB_URL": mongodb_url}
    nobody = {**env, "YOKE_MCP_STDIO_USER": "nobody"}
    name = f"srv-{uuid.uuid4().hex[:6]}"

    for argv, verb, path in (
        ([python, str(server)], "read", server),
        ([str(script)], "run", script),
    ):
        code, out, err = await run_yoke(
            nobody, "tools", "add-mcp", name, "--command", shlex.join(argv)
        )
        assert code == 2 and out == "", (code, out, err)
        assert "Traceback" not in err, err
        said = err.strip()
        assert said.endswith("YOKE_MCP_STDIO_USER=root to keep root"), said
        assert f"user 'nobody' (YOKE_MCP_STDIO_USER) cannot {verb} {path}:" in said, said
    assert await store.db[MCP_SERVERS].count_documents({}) == 0

    # The same server where every user may read it is registered; so is the hidden one when
    # servers keep root (nothing to check), and a program nobody has yet (no user reaches it:
    # the processor says so when it starts it).
    with readable_copies(server) as copies:
        command = shlex.join([python, str(copies[server])])
        code, out, err = await run_yoke(nobody, "tools", "add-mcp", name, "--command", command)
        assert (code, out) == (0, f"{name}\n"), err
    rooted = {**env, "YOKE_MCP_STDIO_USER": "root"}
    command = shlex.join([python, str(server)])
    code, _, err = await run_yoke(rooted, "tools", "add-mcp", f"{name}-r", "--command", command)
    assert code == 0, err
    code, _, err = await run_yoke(
        nobody, "tools", "add-mcp", f"{name}-n", "--command", "no-such-server-yet --stdio"
    )
    assert code == 0, err
    assert await store.db[MCP_SERVERS].count_documents({}) == 3

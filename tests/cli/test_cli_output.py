"""The CLI shows outside text with its control characters escaped, never as they are.

A person's line and display name, an agent's answer (the echo model repeats the line), a tool's
description and a gated call's input reach an operator's terminal through ``yoke history``,
``yoke chat``, ``yoke tools list`` and ``yoke approvals``; an ESC sequence among them must
show as ``\\x1b``, not clear the screen, and a BEL must not ring. ``--json`` stays exact JSON.
The CLI runs as a real process against the module's mesh and store.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import uuid

import pytest

from tests.support.approvals import gated_join, sums
from tests.support.cli import run_yoke
from tests.support.mesh import JoinFactory, Mesh, agent_lines, lines_until
from tests.support.processes import eventually
from yoke.client import Client
from yoke.runtime.calls.approvals import pending_approvals
from yoke.runtime.catalog_store import ToolCatalog
from yoke.runtime.posting import Poster
from yoke.store.database import Store
from yoke.tools.catalog import CatalogEntry

pytestmark = pytest.mark.slow

# Clear the screen, ring the bell, and a one-byte CSI (C1) some terminals honour.
HOSTILE = "look \x1b[2J\x07here\x9b2J"
SHOWN = "look \\x1b[2J\\x07here\\x9b2J"
# A name that would retitle the terminal window.
NAME = "Eve\x1b]0;owned\x07"
NAME_SHOWN = "Eve\\x1b]0;owned\\x07"
RAW = ("\x1b", "\x07", "\x9b")


@pytest.fixture(scope="module")
def env(amqp_url: str, module_mongodb_url: str) -> dict[str, str]:
    return {"YOKE_AMQP_URL": amqp_url, "YOKE_MONGODB_URL": module_mongodb_url}


def assert_no_raw_controls(out: str) -> None:
    assert not any(char in out for char in RAW), repr(out)


async def chat(env: dict[str, str], forum_id: str, name: str, line: str, answer: str) -> str:
    """``yoke chat``: type ``line``, read until the agent's answer shows, then end the chat."""
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "yoke.cli",
        "chat",
        "--forum",
        forum_id,
        "--as",
        name,
        env={**os.environ, **env},
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    assert process.stdin is not None and process.stdout is not None
    shown: list[str] = []
    try:
        greeting = await asyncio.wait_for(process.stdout.readline(), 30)
        shown.append(greeting.decode())
        process.stdin.write(line.encode() + b"\n")
        await process.stdin.drain()
        async with asyncio.timeout(60):
            while answer not in shown[-1]:
                read = await process.stdout.readline()
                assert read, f"chat ended before the answer: {shown}"
                shown.append(read.decode())
        process.stdin.write(b"\n")  # an empty line ends the chat
        await process.stdin.drain()
        rest, _ = await asyncio.wait_for(process.communicate(), 30)
        shown.append(rest.decode())
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    assert process.returncode == 0
    return "".join(shown)


async def test_history_and_chat_show_control_characters_escaped(
    env: dict[str, str], store: Store, client: Client, new_join: JoinFactory
) -> None:
    forum_id, _ = await new_join()
    out = await chat(env, forum_id, NAME, HOSTILE, answer="here")
    assert_no_raw_controls(out)
    assert f"echo: {SHOWN}\n" in out  # the agent's answer, escaped

    # A line of several paragraphs keeps its line breaks and tabs; its controls are escaped.
    multi = "first\n\tsecond \x1b[31mred\x1b[0m"
    reply = await client.submit(forum_id, multi, external_id="cli:ops", display_name="ops")
    assert reply.status == "accepted"
    await lines_until(store, forum_id, lambda lines: len(agent_lines(lines)) >= 2)

    code, out, err = await run_yoke(env, "history", forum_id)
    assert code == 0, err
    assert_no_raw_controls(out)
    assert f"] {NAME_SHOWN}: {SHOWN}\n" in out
    assert f"] echo: {SHOWN}\n" in out
    assert "] ops: first\n\tsecond \\x1b[31mred\\x1b[0m\n" in out

    # --json stays exact JSON: the text comes back as it was written.
    code, out, err = await run_yoke(env, "history", forum_id, "--json")
    assert code == 0, err
    assert_no_raw_controls(out)
    texts = [json.loads(line)["parts"][0]["text"] for line in out.splitlines()]
    assert HOSTILE in texts and multi in texts


async def test_tools_and_approvals_lists_show_control_characters_escaped(
    env: dict[str, str], store: Store, poster: Poster, client: Client, mesh: Mesh
) -> None:
    name = f"hostile-{uuid.uuid4().hex[:8]}"
    await ToolCatalog(store).register(
        CatalogEntry(id=name, source="worker", origin=name, description=f"does {HOSTILE}")
    )
    code, out, err = await run_yoke(env, "tools", "list")
    assert code == 0, err
    assert_no_raw_controls(out)
    [row] = [line for line in out.splitlines() if line.startswith(name + "\t")]
    assert row.endswith(f"\tdoes {SHOWN}")

    forum_id, _, _ = await gated_join(store, poster, script=sums(HOSTILE))
    reply = await client.submit(forum_id, "sum it", external_id="cli:ops", display_name="ops")
    assert reply.status == "accepted"

    async def pending() -> bool:
        return bool(await pending_approvals(store, forum_id))

    await eventually(pending, timeout=60, what="the gated call to await approval")
    code, out, err = await run_yoke(env, "approvals", "--forum", forum_id)
    assert code == 0, err
    assert_no_raw_controls(out)
    assert "\\x9b2J" in out and "calculator" in out

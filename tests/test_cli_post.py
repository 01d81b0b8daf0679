"""``yoke post`` when nobody answers: a one-line error and exit 1, never a traceback."""

from __future__ import annotations

import asyncio
import os
import sys

from yoke.bus import Bus


async def test_post_without_an_answer_says_so_and_exits_1(amqp_url: str, mongodb_url: str) -> None:
    bus = Bus(amqp_url, name="test-post")
    await bus.connect()  # the topology exists, but no ingestion consumes the commands
    await bus.close()
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "yoke.cli",
        "post",
        "--forum",
        "f-nowhere",
        "--author",
        "ada",
        "--timeout",
        "1",
        "hello?",
        env={**os.environ, "YOKE_AMQP_URL": amqp_url, "YOKE_MONGODB_URL": mongodb_url},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(), timeout=30)
    assert process.returncode == 1, err.decode()
    assert err.decode() == "yoke: no answer within 1 s\n"
    assert out == b""

"""``yoke post`` when nobody answers: a one-line error and exit 1, never a traceback."""

from __future__ import annotations

from tests.support.cli import cli_env, run_yoke
from yoke.bus.broker import Bus


async def test_post_without_an_answer_says_so_and_exits_1(amqp_url: str, mongodb_url: str) -> None:
    bus = Bus(amqp_url, name="test-post")
    await bus.connect()  # the topology exists, but no ingestion consumes the commands
    await bus.close()
    code, out, err = await run_yoke(
        cli_env(amqp_url, mongodb_url),
        *("post", "--forum", "f-nowhere", "--author", "ada", "--timeout", "1", "hello?"),
        timeout=30,
    )
    assert code == 1, err
    assert err == "yoke: no answer within 1 s\n"
    assert out == ""

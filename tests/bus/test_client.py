"""The client outside systems submit through (:class:`yoke.client.Client`).

The HTTP gateway submits every POST through one client, so a submit whose publish raises (the
broker away, ``yoke.commands`` not declared yet) must leave no reply future registered: one
more with every POST answered 503 would grow without a bound.
"""

from __future__ import annotations

import pytest

from yoke.client import Client


async def test_a_failed_publish_leaves_no_reply_waiting(amqp_url: str) -> None:
    # The module's vhost is fresh: nothing has declared yoke.commands there.
    async with Client(amqp_url) as client:
        for _ in range(3):
            with pytest.raises(Exception):  # noqa: B017 - whichever the broker's refusal is
                await client.submit_raw(b"{}", reply_timeout=5)
        assert client._waiting == {}

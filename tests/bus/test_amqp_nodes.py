"""``YOKE_AMQP_URL`` as a comma-separated node list: tried in turn on connect and reconnect.

Two TCP proxies in front of the shared broker stand for two cluster nodes (the real 3-node
cluster is tests/e2e/test_cluster.py): killing the proxy a bus is connected through is what a
stopped node looks like to it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import aio_pika
import pytest

from tests.support.processes import eventually, free_port
from tests.support.tcp_proxy import ProxyProcess
from yoke.bus import amqp_nodes, dead_letters, topology
from yoke.bus.broker import Bus
from yoke.client import Client


def through(amqp_url: str, port: int) -> str:
    """``amqp_url`` (user, vhost) with 127.0.0.1:``port`` as its host."""
    parts = urlsplit(amqp_url)
    auth = parts.netloc.rsplit("@", 1)[0]
    return urlunsplit(parts._replace(netloc=f"{auth}@127.0.0.1:{port}"))


@pytest.fixture
def proxies(amqp_url: str, tmp_path: Path) -> Iterator[list[ProxyProcess]]:
    """Two proxies to the shared broker: two "nodes" of one broker."""
    target = urlsplit(amqp_url)
    started = []
    for index in range(2):
        proxy = ProxyProcess(
            target.hostname or "127.0.0.1", target.port or 5672, free_port(), tmp_path / f"p{index}"
        )
        proxy.start()
        started.append(proxy)
    yield started
    for proxy in started:
        proxy.kill()


def test_node_urls_split_and_trim() -> None:
    assert amqp_nodes.node_urls(" amqp://a:1/ , amqp://b:2/,") == ["amqp://a:1/", "amqp://b:2/"]
    assert amqp_nodes.node_urls("amqp://a/") == ["amqp://a/"]
    with pytest.raises(ValueError):
        amqp_nodes.node_urls(" , ")


async def test_a_node_that_does_not_answer_is_passed_over(amqp_url: str) -> None:
    nodes = f"{through(amqp_url, free_port())},{amqp_url}"
    bus = Bus(nodes, name="test-nodes-first-down")
    await bus.connect()
    try:
        assert bus.is_connected
        connection = bus.connection
        assert isinstance(connection, amqp_nodes.NodeListConnection)
        assert connection.node_index == 1
    finally:
        await bus.close()
    async with Client(nodes):  # the client, too
        pass
    assert isinstance(await dead_letters.list_dead_letters(nodes), list)  # and plain connects


async def test_no_node_answers_fails_fast() -> None:
    dead = ",".join(f"amqp://guest:guest@127.0.0.1:{free_port()}/" for _ in range(3))
    with pytest.raises((ConnectionError, OSError)):
        await asyncio.wait_for(amqp_nodes.connect_robust(dead, connect_timeout=2), 20)
    with pytest.raises(ConnectionError):
        await amqp_nodes.connect(dead, connect_timeout=2)


async def test_a_lost_node_is_replaced_by_the_next_with_its_consumers(
    amqp_url: str, proxies: list[ProxyProcess]
) -> None:
    """The bus's node goes away for good: it reconnects through the other and consumes again."""
    nodes = ",".join(through(amqp_url, proxy.port) for proxy in proxies)
    bus = Bus(nodes, name="test-nodes-failover")
    await bus.connect()
    received: list[bytes] = []
    queue_name = "yoke.test-nodes.failover"

    async def on_message(message: aio_pika.abc.AbstractIncomingMessage) -> None:
        received.append(message.body)
        await message.ack()

    try:
        channel = bus._channel()
        queue = await channel.declare_queue(queue_name, **topology.QUORUM_QUEUE)
        await queue.bind(topology.EVENTS_EXCHANGE, routing_key="test.nodes.failover")
        await bus.consume(queue_name, on_message, prefetch=4)
        connection = bus.connection
        assert isinstance(connection, amqp_nodes.NodeListConnection)
        assert connection.node_index == 0

        async def publish(body: bytes) -> None:
            await bus.publish(
                topology.EVENTS_EXCHANGE, "test.nodes.failover", body, message_id=body.decode()
            )

        await publish(b"before")
        await eventually(lambda: _has(received, b"before"), timeout=15, what="the first line")

        proxies[0].kill()  # node 0 is gone and stays gone

        async def back_on_node_1() -> bool:
            return bus.is_connected and connection.node_index == 1 and not bus.problems()

        await eventually(back_on_node_1, timeout=30, what="the bus back on node 1")
        await publish(b"after")
        await eventually(lambda: _has(received, b"after"), timeout=15, what="a line after")
    finally:
        if bus.is_connected:
            await bus._channel().queue_delete(queue_name)
        await bus.close()


async def _has(received: list[bytes], body: bytes) -> bool:
    return body in received

"""A pending approval survives a restart of every service and of RabbitMQ (docs/approvals.md).

The shared broker is never restarted: this module runs its mesh on a RabbitMQ node of its own
(tests/support/rabbit_node.py), stopped and started again while every service is stopped. The
call waits in the store meanwhile; approved afterwards, it runs once, in the restarted
processor.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator

import pytest

from tests.support import rabbit_node
from tests.support.approvals import (
    DONE,
    WAIT,
    decide_as,
    ended_once,
    gated_join,
    results,
    still_pending,
    sums,
    texts,
)
from tests.support.mesh import START_SECONDS, Mesh, lines_until, say
from tests.support.processes import eventually
from tests.support.rabbit_node import RabbitNode
from yoke.bus import topology
from yoke.cli.supervisor import SERVICES
from yoke.client import Client
from yoke.runtime.calls.approvals import pending_approvals
from yoke.runtime.posting import Poster
from yoke.store.database import Store

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def rabbit() -> Iterator[RabbitNode]:
    rabbit_node.require()
    with RabbitNode.temporary() as node:
        yield node


@pytest.fixture(scope="module")
def amqp_url(rabbit: RabbitNode) -> str:
    """The module's own broker (its default vhost) instead of a vhost on the shared one."""
    return rabbit.amqp_url


async def pending_call(store: Store, forum_id: str) -> str:
    found: list[str] = []

    async def listed() -> bool:
        found[:] = [pending.call_id for pending in await pending_approvals(store, forum_id)]
        return bool(found)

    await eventually(listed, timeout=WAIT, what="a pending approval")
    [call_id] = found
    return call_id


async def test_a_pending_approval_survives_every_service_and_rabbitmq_restarting(
    mesh: Mesh, rabbit: RabbitNode, amqp_url: str, store: Store, poster: Poster
) -> None:
    async def stop_everything() -> None:
        processes = list(mesh.processes.values())
        codes = await asyncio.gather(*(asyncio.to_thread(process.stop) for process in processes))
        assert codes == [0] * len(processes)
        await asyncio.to_thread(rabbit.stop)

    await approved_after(stop_everything, mesh, rabbit, amqp_url, store, poster)


async def test_a_pending_approval_survives_kill_9_of_every_service_and_rabbitmq(
    mesh: Mesh, rabbit: RabbitNode, amqp_url: str, store: Store, poster: Poster
) -> None:
    async def kill_everything() -> None:
        for process in mesh.processes.values():
            await asyncio.to_thread(process.kill)
        await asyncio.to_thread(rabbit.kill)

    await approved_after(kill_everything, mesh, rabbit, amqp_url, store, poster)


async def approved_after(
    fault: Callable[[], Awaitable[None]],
    mesh: Mesh,
    rabbit: RabbitNode,
    amqp_url: str,
    store: Store,
    poster: Poster,
) -> None:
    """A call waits for approval, ``fault`` takes every service and RabbitMQ away, they start
    again, the call is approved: it runs once and the agent answers."""
    forum_id, _, monologue_id = await gated_join(store, poster, script=sums("7*6+1"))
    async with Client(amqp_url) as client:
        await say(client, forum_id, "seven times six plus one?")
        call_id = await pending_call(store, forum_id)

    await fault()
    await asyncio.to_thread(rabbit.start)
    started = [mesh.start(name) for name in SERVICES]
    for process in started:
        await process.wait_healthy(timeout=START_SECONDS)
    assert await still_pending(store, call_id)
    assert [pending.call_id for pending in await pending_approvals(store, forum_id)] == [call_id]

    async with (
        Client(amqp_url) as client,
        Client(amqp_url, queue_prefix=topology.CLI_REPLY_QUEUE_PREFIX) as operator,
    ):
        reply = await decide_as(operator, call_id, "approve", "Ada")
        assert reply.status == "accepted", reply
        result = await ended_once(store, monologue_id, call_id)
        assert (result.output, result.is_error) == ("43", False)
        await lines_until(store, forum_id, lambda lines: texts(lines) == [DONE], timeout=WAIT)
        await say(client, forum_id, "thanks")
        await lines_until(store, forum_id, lambda lines: len(texts(lines)) == 2, timeout=WAIT)
    # Ran once: by the restarted processor, whose counters began at its start.
    metrics = await mesh.processes["processor"].metrics()
    ran = [
        line
        for line in metrics.splitlines()
        if line.startswith("yoke_tool_calls_total{") and 'tool="calculator"' in line
    ]
    assert sum(float(line.rsplit(" ", 1)[1]) for line in ran) == 1.0, ran
    assert results(await store.history(monologue_id)) == [result]

"""A bridge's forum lines say nothing of an agent's monologue (docs/publishing.md).

An agent's line in the forum answers from a monologue whose id and seqs only the mesh knows: the
line a bridge is delivered on ``yoke.forum`` (its body and its headers) names neither, nor the
monologue line it was forwarded from. The gateway's readers get the same through
``Message.seen_outside``; a bridge reads the event egress published, so the event itself must
hold nothing more.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator

import aio_pika
import pytest
from aio_pika.abc import AbstractIncomingMessage

from tests.support import broker
from tests.support.cli import run_yoke
from tests.support.mesh import JoinFactory, Mesh
from tests.support.processes import eventually
from tests.support.worker_process import as_user
from yoke.bus import topology
from yoke.client import Client
from yoke.store.database import Store

pytestmark = pytest.mark.slow

MONOLOGUE_KEYS = {"sourceConversationId", "sourceSeq", "causationId"}
# What an agent's forum line may say in its meta (docs/publishing.md).
PUBLIC_META = {"inReplyTo", "agentHops", "coversSeq", "noticeReason"}


@pytest.fixture(scope="module")
async def bridge_url(
    mesh: Mesh, amqp_url: str, management: broker.Management
) -> AsyncIterator[str]:
    """The AMQP URL of a publisher made as docs/publishing.md says (``yoke publisher create``)."""
    name = f"bridge-{uuid.uuid4().hex[:8]}"
    code, out, err = await run_yoke(mesh.env, "publisher", "create", "--name", name)
    assert code == 0, err
    try:
        yield as_user(amqp_url, name, out.splitlines()[-1])
    finally:
        await management.delete_user(name)


def header_text(delivery: AbstractIncomingMessage) -> str:
    """Every header and property value of a delivery, as one string to search."""
    values = [str(value) for value in (delivery.headers or {}).values()]
    values += [str(delivery.message_id), str(delivery.correlation_id), str(delivery.type)]
    return "\n".join(values)


async def test_an_agents_forum_line_reaches_a_bridge_without_its_monologue(
    store: Store, new_join: JoinFactory, bridge_url: str
) -> None:
    forum_id, join = await new_join()
    connection = await aio_pika.connect(bridge_url)
    async with connection, Client(bridge_url) as bridge:
        channel = await connection.channel()
        queue = await channel.declare_queue(
            f"{bridge.queue_prefix}replies.{uuid.uuid4().hex}", exclusive=True
        )
        await queue.bind(
            topology.FORUM_EXCHANGE, routing_key=f"conversation.message.posted.{forum_id}"
        )
        delivered: list[AbstractIncomingMessage] = []

        async def keep(delivery: AbstractIncomingMessage) -> None:
            delivered.append(delivery)

        await queue.consume(keep, no_ack=True)
        reply = await bridge.submit(
            forum_id, "hello there", external_id="slack:U1", display_name="Ada"
        )
        assert reply.status == "accepted", reply.error

        def agent_deliveries() -> list[AbstractIncomingMessage]:
            return [
                d for d in delivered if json.loads(d.body)["payload"]["message"]["role"] == "agent"
            ]

        async def answered() -> bool:
            return bool(agent_deliveries())

        await eventually(answered, timeout=60, what="the agent's line on the bridge's queue")

    monologue = await store.history(join.monologue_id)
    forwarded = [line for line in monologue if line.role == "agent"]
    assert forwarded, "the agent answered from a monologue the test cannot find"
    secrets = {join.monologue_id, *(line.id for line in monologue)}
    for delivery in agent_deliveries():
        line = json.loads(delivery.body)["payload"]["message"]
        assert line["conversationId"] == forum_id
        assert not MONOLOGUE_KEYS & set(line["meta"]), line["meta"]
        seen = delivery.body.decode() + "\n" + header_text(delivery)
        assert [secret for secret in secrets if secret in seen] == [], seen
        # Nothing else either, under another name: its meta holds what a bridge is told of.
        assert set(line["meta"]) <= PUBLIC_META, line["meta"]

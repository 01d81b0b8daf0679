"""Nobody waits in silence: when an agent cannot answer, the forum is told so, in plain words.

Real services against the fake OpenAI server; the forum's lines are read as a bridge reads them
(``yoke.forum``) and from the store.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import aio_pika
import pytest
from aio_pika.abc import AbstractIncomingMessage

from tests.support.fake_openai import FakeOpenAI, completion, failure, openai_env
from tests.support.mesh import JoinFactory, lines_until, say
from tests.support.processes import eventually
from yoke.bus import topology
from yoke.client import Client
from yoke.core.models import Envelope, Message, MessagePosted
from yoke.runtime.join_config import JoinConfig
from yoke.store.database import Store

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def mesh_env(fake_openai: FakeOpenAI) -> dict[str, str]:
    # The mesh's own bound is long: the join's modelGiveUpSeconds must be what decides.
    return openai_env(fake_openai.base_url, give_up_seconds=60)


@contextlib.asynccontextmanager
async def bridge(amqp_url: str, forum_id: str) -> AsyncIterator[list[Message]]:
    """The forum's lines as a bridge bound to yoke.forum receives them, from now on."""
    seen: list[Message] = []
    connection = await aio_pika.connect(amqp_url)
    try:
        channel = await connection.channel()
        queue = await channel.declare_queue(exclusive=True, auto_delete=True)
        await queue.bind(
            topology.FORUM_EXCHANGE, routing_key=topology.routing_key(MessagePosted.TYPE, forum_id)
        )

        async def on_line(delivery: AbstractIncomingMessage) -> None:
            payload = Envelope.model_validate_json(delivery.body).parse()
            if isinstance(payload, MessagePosted):
                seen.append(payload.message)

        await queue.consume(on_line, no_ack=True)
        yield seen
    finally:
        await connection.close()


def notices(lines: list[Message]) -> list[Message]:
    return [line for line in lines if line.type == "notice"]


async def test_a_model_that_gives_up_leaves_a_notice_in_the_forum_and_the_next_line_is_answered(
    store: Store, client: Client, new_join: JoinFactory, fake_openai: FakeOpenAI, amqp_url: str
) -> None:
    fake_openai.script()
    fake_openai.default = failure(500)
    try:
        forum_id, join = await new_join(
            config=JoinConfig(model="gpt-test", model_give_up_seconds=1.0)
        )
        async with bridge(amqp_url, forum_id) as seen:
            asked = await say(client, forum_id, "are you there?", who="Ada")
            forum = await lines_until(store, forum_id, lambda lines: bool(notices(lines)))
            [notice] = notices(forum)
            assert notice.role == "agent" and notice.author_actor_id != "system"
            assert notice.meta.in_reply_to == asked
            assert "could not answer" in notice.text and "model" in notice.text
            # Plain words for people: none of the monologue's details (status codes, ids).
            assert "500" not in notice.text and join.monologue_id not in notice.text

            async def bridge_told() -> bool:
                return bool(notices(seen))

            await eventually(bridge_told, timeout=15, what="the notice on yoke.forum")
            assert [line.id for line in notices(seen)] == [notice.id]
        monologue = await store.history(join.monologue_id)
        # The monologue keeps the operator's details; the forum's notice is never copied back.
        [details] = [line for line in monologue if line.type == "notice"]
        assert "the model failed" in details.text
        assert not any(line.meta.source_message_id == notice.id for line in monologue)
    finally:
        fake_openai.default = None
    fake_openai.script(completion("here now"))
    await say(client, forum_id, "hello again?", who="Ada")
    forum = await lines_until(
        store, forum_id, lambda lines: any(line.text == "here now" for line in lines)
    )
    assert len(notices(forum)) == 1


async def test_a_spent_budget_is_told_to_the_forum(
    store: Store, client: Client, new_join: JoinFactory, fake_openai: FakeOpenAI
) -> None:
    fake_openai.script(completion("first answer", prompt_tokens=50, completion_tokens=50))
    forum_id, _ = await new_join(config=JoinConfig(model="gpt-test", budget_tokens=10))
    await say(client, forum_id, "one", who="Grace")
    await lines_until(
        store, forum_id, lambda lines: any(line.text == "first answer" for line in lines)
    )
    second = await say(client, forum_id, "two", who="Grace")
    forum = await lines_until(store, forum_id, lambda lines: bool(notices(lines)))
    [notice] = notices(forum)
    assert notice.meta.in_reply_to == second and "budget" in notice.text
    assert len(fake_openai.requests) == 1  # no model call once the budget is spent

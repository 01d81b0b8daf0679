"""A call of a published agent, as both of the gateway's caller doors make it
(services/gateway/calling.py), against the real mesh: the line opens the caller's kept forum,
its answer is followed live and read back from the store alone."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import pytest

from services.gateway.calling import (
    OUTCOME_LINES,
    Answered,
    Delta,
    Failed,
    callable_agent,
    callable_agents,
    follow_turn,
    kept_forum_id,
    post_line,
    turn_outcome,
)
from services.gateway.deps import Gateway
from services.gateway.stream import Hub
from services.gateway.webhooks import WebhookWorker
from tests.support.mesh import Mesh
from yoke.client import Client
from yoke.core.ids import new_id
from yoke.core.models import Message, MessageMeta, TextPart
from yoke.core.settings import Settings
from yoke.runtime.joins import create_agent, create_forum
from yoke.store.database import Store
from yoke.store.publishing import publish_agent
from yoke.store.tokens import create_token, ensure_token_indexes


@pytest.fixture(scope="module")
async def gateway(
    amqp_url: str, module_mongodb_url: str, store: Store, mesh: Mesh
) -> AsyncIterator[Gateway]:
    """The gateway's connections in this process (what a request handler is given)."""
    await ensure_token_indexes(store)
    settings = Settings(amqp_url=amqp_url, mongodb_url=module_mongodb_url)
    hub = Hub(amqp_url)
    await hub.start()
    webhooks = WebhookWorker(settings, store)  # never started: nothing here delivers
    async with Client(amqp_url, queue_prefix="yoke.gateway.replies.") as client:
        yield Gateway(settings, store, client, hub, webhooks)
    await webhooks.stop()
    await hub.close()


async def test_a_call_opens_its_forum_and_is_answered_live_and_from_the_store(
    gateway: Gateway, store: Store
) -> None:
    agent = await create_agent(store, "Echo")
    name = f"echo-{uuid.uuid4().hex[:6]}"
    published = await publish_agent(store, name, agent.id, "Says it back.")
    await publish_agent(store, f"other-{uuid.uuid4().hex[:6]}", agent.id)
    token, _ = await create_token(store, f"caller-{uuid.uuid4().hex[:6]}", can_call=[name])
    found = await callable_agent(gateway, token, name)
    assert found is not None and (found.id, found.agent_actor_id) == (name, agent.id)
    assert [found.id for found in await callable_agents(gateway, token)] == [name]
    plain, _ = await create_token(store, f"plain-{uuid.uuid4().hex[:6]}")
    assert await callable_agent(gateway, plain, name) is None

    line = await post_line(gateway, token, "mcp", published, "chat", "hello there")
    forum_id = kept_forum_id(token, "mcp", published, "chat")
    assert line.conversation_id == forum_id
    events = []
    async with asyncio.timeout(60):
        async for event in follow_turn(gateway, forum_id, line):
            events.append(event)
    answer = events[-1]
    assert isinstance(answer, Answered) and "hello there" in answer.message.text, events
    deltas = [event for event in events if isinstance(event, Delta)]
    if deltas:  # drafts are ephemeral: whatever arrived is in order and part of the answer
        assert [d.index for d in deltas] == sorted(d.index for d in deltas)
    stored = await turn_outcome(store, forum_id, line)
    assert isinstance(stored, Answered) and stored.message.id == answer.message.id
    # Followed again after the end, the store alone answers at once.
    async with asyncio.timeout(10):
        again = [event async for event in follow_turn(gateway, forum_id, line)]
    assert len(again) == 1 and isinstance(again[0], Answered)
    assert again[0].message.id == answer.message.id

    # The same key is the same forum; another key another one.
    second = await post_line(gateway, token, "mcp", published, "chat", "and again")
    assert second.conversation_id == forum_id and second.seq > answer.message.seq
    elsewhere = await post_line(gateway, token, "a2a", published, "chat", "hi")
    assert elsewhere.conversation_id == kept_forum_id(token, "a2a", published, "chat") != forum_id


async def test_deltas_come_in_order_and_a_failed_step_ends_with_the_notices_words(
    gateway: Gateway, store: Store
) -> None:
    token, _ = await create_token(store, f"caller-{uuid.uuid4().hex[:6]}", can_call=["s", "f"])
    streaming = await publish_agent(
        store, "s", (await create_agent(store, "Streamer", model="fixture-stream-4-0.4")).id
    )
    line = await post_line(gateway, token, "a2a", streaming, "k", "one two three four")
    forum_id = kept_forum_id(token, "a2a", streaming, "k")
    async with asyncio.timeout(60):
        events = [event async for event in follow_turn(gateway, forum_id, line)]
    answer = events[-1]
    assert isinstance(answer, Answered), events
    deltas = [event for event in events if isinstance(event, Delta)]
    assert [d.index for d in deltas] == list(range(len(deltas))) and len(deltas) >= 2, events
    assert "".join(d.text for d in deltas) == answer.message.text

    failing = await publish_agent(
        store, "f", (await create_agent(store, "Broken", model="fixture-no-such-model")).id
    )
    line = await post_line(gateway, token, "a2a", failing, "k", "hello?")
    forum_id = kept_forum_id(token, "a2a", failing, "k")
    async with asyncio.timeout(120):
        events = [event async for event in follow_turn(gateway, forum_id, line)]
    ended = events[-1]
    assert isinstance(ended, Failed) and ended.text.startswith("I could not answer"), events
    assert "Traceback" not in ended.text and forum_id not in ended.text
    assert await turn_outcome(store, forum_id, line) == ended


async def test_a_turns_end_is_found_however_many_lines_came_before_it(store: Store) -> None:
    """A caller who flooded its own conversation while a turn waited still learns its end: the
    outcome is looked for past the first window of lines after the caller's."""
    forum = await create_forum(store, "flooded")
    line, _ = await store.insert_message(
        Message(id=new_id(), conversation_id=forum.id, author_actor_id="caller", parts=[])
    )
    for _ in range(OUTCOME_LINES + 20):
        await store.insert_message(
            Message(id=new_id(), conversation_id=forum.id, author_actor_id="caller")
        )
    head = await store.last_seq(forum.id)
    answer, _ = await store.insert_message(
        Message(
            id=new_id(),
            conversation_id=forum.id,
            author_actor_id="agent",
            role="agent",
            parts=[TextPart(text="it is 42")],
            meta=MessageMeta(in_reply_to="another line", covers_seq=head),
        )
    )
    found = await turn_outcome(store, forum.id, line)
    assert isinstance(found, Answered) and found.message.id == answer.id, found

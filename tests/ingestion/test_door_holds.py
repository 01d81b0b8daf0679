"""The door decides ``/takeover`` and ``/handback`` lines before it stores them
(docs/people-take-over.md).

Only ingestion runs, a real process on the module's vhost and database: nothing answers the
lines, so what a test reads back is the door's doing alone. People speak through the services'
own user (the CLI's way, external ids as-is) and through a bridge's (stored as
``amqp:<user>:<id>``); who may hold a forum is the joins' ``takeoverBy``, or ``holdGranted``
from the mesh's own users.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest

from tests.support.holds import publisher_bridge
from tests.support.mesh import Mesh
from tests.support.processes import ServiceProcess, eventually
from yoke.client import Client
from yoke.core.models import SubmitReply
from yoke.core.slash import HANDBACK, TAKEOVER
from yoke.runtime.holds import FORUM_HOLDS, ForumHold, Holds
from yoke.runtime.join_config import JoinConfig
from yoke.runtime.joins import Join, create_agent, create_forum, join_conversation
from yoke.runtime.posting import Poster
from yoke.store.database import Store

pytestmark = pytest.mark.slow

HOLDER = "test:ana"  # the one person the joins' takeoverBy names


@pytest.fixture(scope="module")
async def door(
    amqp_url: str, module_mongodb_url: str, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[ServiceProcess]:
    mesh = Mesh(amqp_url, module_mongodb_url, tmp_path_factory.mktemp("door"))
    process = mesh.start("ingestion")
    await process.wait_healthy()
    yield process
    assert mesh.stop_all() == {"ingestion": 0}


@pytest.fixture(scope="module")
async def client(amqp_url: str, door: ServiceProcess) -> AsyncIterator[Client]:
    async with Client(amqp_url) as client:
        yield client


@pytest.fixture(scope="module")
async def bridge(
    servers: tuple[str, str, str], amqp_url: str, door: ServiceProcess
) -> AsyncIterator[Client]:
    """An outside publisher, connected while the door runs."""
    async with publisher_bridge(amqp_url, servers[2]) as client:
        yield client


async def held_forum(store: Store, poster: Poster, *takeover_by: str) -> tuple[str, Join]:
    """A forum with one agent whose join lets ``takeover_by`` (HOLDER by default) hold it."""
    forum = await create_forum(store, "held")
    agent = await create_agent(store, "echo")
    config = JoinConfig(takeover_by=list(takeover_by or (HOLDER,)))
    return forum.id, await join_conversation(store, poster, agent.id, forum.id, config)


def command(
    forum_id: str,
    who: str,
    text: str,
    *,
    key: str | None = None,
    granted: bool = False,
    meta: dict[str, Any] | None = None,
) -> bytes:
    body: dict[str, Any] = {
        "conversationId": forum_id,
        "author": {"externalId": who, "displayName": who.rpartition(":")[2].title()},
        "text": text,
        "idempotencyKey": key or uuid.uuid4().hex,
        "holdGranted": granted,
    }
    if meta is not None:
        body["meta"] = meta
    return json.dumps(body).encode()


async def say(
    client: Client, forum_id: str, who: str, text: str, *, key: str | None = None, **kw: Any
) -> SubmitReply:
    return await client.submit_raw(command(forum_id, who, text, key=key, **kw))


def refused(reply: SubmitReply, code: str) -> None:
    assert (reply.status, reply.code) == ("rejected", code), reply


async def copied(store: Store, join: Join, line_id: str) -> None:
    """``line_id`` reaches the join's monologue (the door copies what it stores)."""

    async def there() -> bool:
        lines = await store.history(join.monologue_id)
        return any(line.meta.source_message_id == line_id for line in lines)

    await eventually(there, timeout=30, what=f"the copy of {line_id}")


async def test_a_person_no_join_allows_is_refused_and_nothing_is_written(
    store: Store, poster: Poster, client: Client, bridge: Client
) -> None:
    forum_id, join = await held_forum(store, poster)
    refused(await say(client, forum_id, "test:mallory", f"{TAKEOVER} mine now"), "not_allowed")
    # holdGranted counts from the mesh's own users only: a bridge's person is still checked.
    refused(await say(bridge, forum_id, "ana", TAKEOVER, granted=True), "not_allowed")
    assert await store.history(forum_id) == []
    assert await Holds(store).get(forum_id) is None

    # The person the join names may; the escalation a command's meta claims is not taken.
    taken = await say(client, forum_id, HOLDER, f"{TAKEOVER}  a refund", meta={"escalationId": "e"})
    assert (taken.status, taken.duplicate) == ("accepted", False), taken
    [line] = await store.history(forum_id)
    assert (line.id, line.text, line.meta.escalation_id) == (
        taken.message_id,
        f"{TAKEOVER}  a refund",
        None,
    )
    hold = await Holds(store).get(forum_id)
    assert hold is not None
    assert (hold.line_id, hold.holder.external_id, hold.reason, hold.escalation_id) == (
        line.id,
        HOLDER,
        "a refund",
        None,
    )
    await copied(store, join, line.id)


async def test_a_bridge_person_the_join_names_in_its_namespace_may_hold(
    store: Store, poster: Poster, bridge: Client
) -> None:
    """takeoverBy compares the id as the door stores it: a bridge's ``ana`` is
    ``amqp:<bridge>:ana``, never the CLI's ``test:ana``."""
    forum_id, _ = await held_forum(store, poster, f"amqp:{bridge.user}:ana")
    taken = await say(bridge, forum_id, "ana", TAKEOVER)
    assert taken.status == "accepted", taken
    hold = await Holds(store).get(forum_id)
    assert hold is not None and hold.holder.external_id == f"amqp:{bridge.user}:ana"
    # Handed back by its holder (no grant, and a stranger to takeoverBy would do as well).
    assert (await say(bridge, forum_id, "ana", HANDBACK)).status == "accepted"
    assert await Holds(store).get(forum_id) is None


async def test_a_second_takeover_is_refused_naming_who_holds_the_forum(
    store: Store, poster: Poster, client: Client
) -> None:
    forum_id, _ = await held_forum(store, poster)
    first = await say(client, forum_id, HOLDER, TAKEOVER)
    assert first.status == "accepted", first
    # Not even the CLI's grant takes a held forum, nor its holder again.
    for who, granted in (("cli:boss", True), (HOLDER, False)):
        second = await say(client, forum_id, who, f"{TAKEOVER} me too", granted=granted)
        refused(second, "held")
        assert second.error is not None and "Ana" in second.error and "since" in second.error
    assert [line.id for line in await store.history(forum_id)] == [first.message_id]
    hold = await Holds(store).get(forum_id)
    assert hold is not None and hold.line_id == first.message_id


async def test_only_the_holder_or_someone_allowed_hands_back_and_only_a_held_forum(
    store: Store, poster: Poster, client: Client
) -> None:
    forum_id, join = await held_forum(store, poster)
    refused(await say(client, forum_id, HOLDER, HANDBACK), "not_held")
    # The CLI's person, whom no join names, takes it over by the grant.
    taken = await say(client, forum_id, "cli:boss", TAKEOVER, granted=True)
    assert taken.status == "accepted", taken
    refused(await say(client, forum_id, "test:mallory", HANDBACK), "not_allowed")
    assert [line.id for line in await store.history(forum_id)] == [taken.message_id]

    # Its holder hands it back without the grant: the line names the hold it ends.
    back = await say(client, forum_id, "cli:boss", HANDBACK)
    assert back.status == "accepted", back
    line = await store.get_message(back.message_id or "")
    assert line is not None and line.meta.ends_hold == taken.message_id
    assert await Holds(store).get(forum_id) is None
    await copied(store, join, line.id)
    refused(await say(client, forum_id, "cli:boss", HANDBACK, granted=True), "not_held")

    # Someone the join names hands back another's hold.
    again = await say(client, forum_id, "cli:boss", TAKEOVER, granted=True)
    assert again.status == "accepted", again
    assert (await say(client, forum_id, HOLDER, HANDBACK)).status == "accepted"
    assert await Holds(store).get(forum_id) is None


async def test_a_repeated_line_applies_its_record_again_and_no_hold_it_ended(
    store: Store, poster: Poster, client: Client
) -> None:
    """A door that died between the line and its record: the command's repeat (its key)
    finds the line and records it; a repeat of a takeover since handed back holds nothing."""
    forum_id, _ = await held_forum(store, poster)
    key = f"takeover-{uuid.uuid4().hex}"
    taken = await say(client, forum_id, HOLDER, f"{TAKEOVER} why", key=key)
    assert taken.status == "accepted", taken
    await store.db[FORUM_HOLDS].delete_one({"_id": forum_id})  # the crash's loss

    repeat = await say(client, forum_id, HOLDER, f"{TAKEOVER} why", key=key)
    assert (repeat.status, repeat.message_id, repeat.duplicate) == (
        "accepted",
        taken.message_id,
        True,
    )
    hold = await Holds(store).get(forum_id)
    assert hold is not None and (hold.line_id, hold.reason) == (taken.message_id, "why")

    handback_key = f"handback-{uuid.uuid4().hex}"
    back = await say(client, forum_id, HOLDER, HANDBACK, key=handback_key)
    assert back.status == "accepted", back
    # The hand-back's repeat releases only the hold its line ended: put back a later one.
    later = ForumHold.model_validate(
        {
            "_id": forum_id,
            "lineId": "a-later-takeover",
            "holder": {"externalId": HOLDER, "displayName": "Ana"},
        }
    )
    await Holds(store).take(later)
    assert (await say(client, forum_id, HOLDER, HANDBACK, key=handback_key)).duplicate
    stood = await Holds(store).get(forum_id)
    assert stood is not None and stood.line_id == "a-later-takeover"
    await store.db[FORUM_HOLDS].delete_one({"_id": forum_id})

    late = await say(client, forum_id, HOLDER, f"{TAKEOVER} why", key=key)
    assert (late.status, late.duplicate) == ("accepted", True), late
    assert await Holds(store).get(forum_id) is None
    assert [line.id for line in await store.history(forum_id)] == [
        taken.message_id,
        back.message_id,
    ]


async def test_an_ordinary_line_and_a_lookalike_are_no_hold(
    store: Store, poster: Poster, client: Client
) -> None:
    forum_id, _ = await held_forum(store, poster)
    for text in ("hello", "/takeovers are rude", "please /takeover"):
        reply = await say(client, forum_id, "test:mallory", text)
        assert reply.status == "accepted", reply
    assert await Holds(store).get(forum_id) is None

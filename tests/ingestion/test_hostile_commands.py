"""Hostile submit commands at the door: each is answered ``rejected`` naming its problem.

Malformed, oversized or unknown-conversation commands are rejected with an
error that names the problem; nothing is written and nothing crashes. Without ``reply_to`` the
rejection goes to the dead-letter queue with its reason. The cases are data, in
``tests/data/hostile_commands.json``; only the ingestion service runs, as a real process.
"""

from __future__ import annotations

import base64
import json
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import aio_pika
import pytest

from services.ingestion.app import UNKEYED, command_key
from tests.support.mesh import Mesh
from tests.support.processes import ServiceProcess, eventually
from yoke.bus import topology
from yoke.bus.dead_letters import list_dead_letters
from yoke.client import Client
from yoke.core.ids import new_id
from yoke.runtime.joins import create_forum
from yoke.store.database import Store

DATA = json.loads((Path(__file__).parents[1] / "data" / "hostile_commands.json").read_text())
REJECTED: list[dict[str, Any]] = DATA["rejected"]
ACCEPTED: list[dict[str, Any]] = DATA["accepted"]
# Collections a submit writes to: none of them may change for a rejected command.
WRITTEN = ("messages", "actors", "participants", "conversations")


def expand(value: Any) -> Any:
    """Turns the data file's generators (``$repeat``, ``$nest``, ...) into the values they name."""
    if isinstance(value, list):
        return [expand(item) for item in value]
    if not isinstance(value, dict):
        return value
    if "$repeat" in value:
        text, times = value["$repeat"]
        return text * times
    if "$nest" in value:
        depth, leaf = value["$nest"]
        nested = expand(leaf)
        for _ in range(depth):
            nested = {"a": nested}
        return nested
    if "$nestlist" in value:
        depth, leaf = value["$nestlist"]
        nested = expand(leaf)
        for _ in range(depth):
            nested = [nested]
        return nested
    if "$keys" in value:
        count, item = value["$keys"]
        return {f"k{i}": expand(item) for i in range(count)}
    if "$keyed" in value:
        key, item = value["$keyed"]
        return {expand(key): expand(item)}
    if "$replace" in value:
        return expand(value["$replace"])
    return {key: expand(item) for key, item in value.items()}


def merge(base: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, change in patch.items():
        if isinstance(change, dict) and change.get("$delete"):
            merged.pop(key, None)
        elif (
            isinstance(change, dict)
            and isinstance(merged.get(key), dict)
            and not _generator(change)
        ):
            merged[key] = merge(merged[key], change)
        else:
            merged[key] = expand(change)
    return merged


def _generator(value: dict[str, Any]) -> bool:
    return any(key.startswith("$") for key in value)


def good_command(forum_id: str) -> dict[str, Any]:
    return {
        "conversationId": forum_id,
        "author": {"externalId": "hostile:eve", "displayName": "Eve"},
        "text": "hello",
        "idempotencyKey": new_id(),
    }


def body_of(case: dict[str, Any], forum_id: str) -> bytes:
    """The case's raw body, for a real forum (so only the hostile part can be the problem)."""
    if "patch" in case:
        return json.dumps(merge(good_command(forum_id), case["patch"])).encode()
    if "base64" in case:
        raw = base64.b64decode(case["base64"])
    elif isinstance(case["raw"], str):
        raw = case["raw"].encode()
    else:
        raw = "".join(text * times for text, times in case["raw"]).encode()
    return raw.replace(b"@FORUM@", forum_id.encode()).replace(b"@KEY@", new_id().encode())


def names(cases: list[dict[str, Any]]) -> list[str]:
    return [case["name"] for case in cases]


@pytest.fixture(scope="module")
async def door(
    amqp_url: str, module_mongodb_url: str, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[ServiceProcess]:
    """Only the ingestion service: it is the door, and nothing else is needed here."""
    mesh = Mesh(amqp_url, module_mongodb_url, tmp_path_factory.mktemp("hostile"))
    process = mesh.start("ingestion")
    await process.wait_healthy()
    yield process
    output = process.output()
    assert mesh.stop_all() == {"ingestion": 0}
    # What hostile commands did before: a key function that raised, writes the store refused.
    for symptom in (
        "Consumer callback failed",
        "RecursionError",
        "UnicodeEncodeError",
        "unsupported Unicode escape sequence",
        "InvalidDocument",
    ):
        assert symptom not in output, f"{symptom} in the ingestion log"


@pytest.fixture(scope="module")
async def commands(amqp_url: str, door: ServiceProcess) -> AsyncIterator[Client]:
    async with Client(amqp_url) as client:
        yield client


@pytest.fixture(scope="module")
async def forum_id(store: Store) -> str:
    return (await create_forum(store, "hostile commands")).id


async def counts(store: Store) -> dict[str, int]:
    return {name: await store.db[name].count_documents({}) for name in WRITTEN}


async def still_serving(
    door: ServiceProcess, commands: Client, store: Store, forum_id: str
) -> None:
    """The process is up and healthy and a good command is accepted and written."""
    assert door.popen.poll() is None, door.output()[-3000:]
    assert await door.healthy()
    reply = await commands.submit(
        forum_id, "still here", external_id="hostile:good", display_name="Good", reply_timeout=10
    )
    assert reply.status == "accepted", reply.error
    assert reply.message_id and await store.get_message(reply.message_id) is not None


def test_the_data_holds_enough_cases() -> None:
    assert len(REJECTED) >= 25
    assert len(set(names(REJECTED + ACCEPTED))) == len(REJECTED + ACCEPTED)


@pytest.mark.parametrize("case", REJECTED, ids=names(REJECTED))
def test_command_key_never_raises(case: dict[str, Any]) -> None:
    message = cast(Any, SimpleNamespace(body=body_of(case, "forum-1"), headers={}))
    key = command_key(message)
    assert isinstance(key, str) and key
    assert len(key) <= 128 or key == UNKEYED


@pytest.mark.parametrize("case", REJECTED, ids=names(REJECTED))
async def test_hostile_command_is_rejected_naming_the_problem(
    case: dict[str, Any], door: ServiceProcess, commands: Client, store: Store, forum_id: str
) -> None:
    before = await counts(store)
    reply = await commands.submit_raw(body_of(case, forum_id), reply_timeout=10)
    assert reply.status == "rejected", reply
    assert reply.error is not None
    for expected in case["error"]:
        assert expected in reply.error, f"{expected!r} not in {reply.error!r}"
    assert len(reply.error) < 1000, "the error names the problem without echoing the input"
    assert await counts(store) == before
    await still_serving(door, commands, store, forum_id)


@pytest.mark.parametrize("case", ACCEPTED, ids=names(ACCEPTED))
async def test_odd_but_storable_command_is_accepted(
    case: dict[str, Any], door: ServiceProcess, commands: Client, store: Store, forum_id: str
) -> None:
    body = body_of(case, forum_id)
    reply = await commands.submit_raw(body, reply_timeout=10)
    assert reply.status == "accepted", reply.error
    assert reply.message_id
    stored = await store.get_message(reply.message_id)
    assert stored is not None
    sent = json.loads(body)
    assert stored.text == sent["text"]
    mesh_keys = {"agentHops", "sourceConversationId", "loop_guard", "instruction", "carriedFrom"}
    extra = {k: v for k, v in (sent.get("meta") or {}).items() if k not in mesh_keys}
    assert stored.meta.agent_hops == 0
    assert stored.meta.source_conversation_id is None and stored.meta.instruction is None
    for key, value in extra.items():
        assert stored.meta.model_extra and stored.meta.model_extra.get(key) == value


WITHOUT_REPLY_TO = ["array nested 1000 deep", "NUL in text", "not JSON", "huge idempotency key"]


@pytest.mark.parametrize("name", WITHOUT_REPLY_TO)
async def test_without_reply_to_the_rejection_is_dead_lettered_with_its_reason(
    name: str, amqp_url: str, door: ServiceProcess, commands: Client, store: Store, forum_id: str
) -> None:
    case = next(case for case in REJECTED if case["name"] == name)
    before = await counts(store)
    message_id = f"hostile-{new_id()}"
    connection = await aio_pika.connect(amqp_url)
    try:
        channel = await connection.channel(publisher_confirms=True)
        exchange = await channel.get_exchange(topology.COMMANDS_EXCHANGE)
        await exchange.publish(
            aio_pika.Message(body_of(case, forum_id), message_id=message_id),
            routing_key=topology.SUBMIT_COMMAND,
        )
    finally:
        await connection.close()
    letter: dict[str, object] = {}

    async def dead_lettered() -> bool:
        nonlocal letter
        found = [x for x in await list_dead_letters(amqp_url) if x["messageId"] == message_id]
        letter = found[0] if found else {}
        return bool(found)

    await eventually(dead_lettered, timeout=20, what=f"{name!r} in the dead-letter queue")
    assert letter["service"] == "ingestion"
    error = str(letter["error"])
    for expected in case["error"]:
        assert expected in error, f"{expected!r} not in {error!r}"
    assert await counts(store) == before
    await still_serving(door, commands, store, forum_id)

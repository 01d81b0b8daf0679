"""Who speaks at the AMQP door is who the door says (docs/architecture.md, invariant 13).

Each test goes through a real door: the ingestion service as a real process, bridges as real
RabbitMQ users made through the management API, the HTTP gateway as a real process, the dead
letters through the real broker. Rate limits are small here (4 lines a minute) so that a few
lines cross them; every test uses bridges and tokens of its own, so none counts another's lines.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote, urlsplit

import aio_pika
import httpx
import pytest
from aiormq.exceptions import ChannelAccessRefused

from tests.support.broker import fresh_vhost
from tests.support.gateway_process import running_gateway
from tests.support.mesh import Mesh
from tests.support.processes import ServiceProcess, eventually
from tests.support.worker_process import as_user
from yoke.bus import topology
from yoke.bus.broker import Bus
from yoke.bus.dead_letters import list_dead_letters, replay_dead_letters
from yoke.cli.publishers import create_publisher, create_user, management_of
from yoke.client import Client
from yoke.core.ids import derive_id
from yoke.core.models import SubmitReply
from yoke.runtime.joins import create_agent, create_forum, join_conversation, participant_id
from yoke.runtime.posting import Poster
from yoke.store.database import Store
from yoke.store.publishing import kept_forum_id, publish_agent
from yoke.store.tokens import Token, create_token, ensure_token_indexes, revoke_token

LIMIT = 4
KEPT = 2  # conversations a caller's token may keep here
DOOR_ENV = {
    "YOKE_BRIDGE_LINES_PER_MINUTE": str(LIMIT),
    "YOKE_TOKEN_LINES_PER_MINUTE": str(LIMIT),
    "YOKE_KEPT_FORUMS_PER_TOKEN": str(KEPT),
}


@dataclass
class Speaker:
    """A RabbitMQ user of the module's vhost, publishing raw commands and reading answers on a
    queue of its own."""

    name: str
    url: str

    async def ask(
        self,
        body: dict[str, Any],
        *,
        user_id: str | None = "",
        reply_to: str | None = None,
        routing_key: str = topology.SUBMIT_COMMAND,
        queue_name: str | None = None,
    ) -> SubmitReply | None:
        """Publish ``body`` (``user_id`` "" means this user's own) and wait for the answer on
        this user's queue; None when the answer went to ``reply_to`` instead."""
        connection = await aio_pika.connect(self.url)
        try:
            channel = await connection.channel(publisher_confirms=True)
            answers = await channel.declare_queue(
                queue_name or f"bridge.{self.name}.{uuid.uuid4().hex}",
                exclusive=True,
                auto_delete=True,
            )
            exchange = await channel.get_exchange(topology.COMMANDS_EXCHANGE, ensure=False)
            await exchange.publish(
                aio_pika.Message(
                    json.dumps(body).encode(),
                    content_type="application/json",
                    correlation_id="c-1",
                    reply_to=reply_to or answers.name,
                    user_id=self.name if user_id == "" else user_id,
                ),
                routing_key=routing_key,
            )
            if reply_to is not None:
                return None
            got: list[SubmitReply] = []

            async def answered() -> bool:
                message = await answers.get(no_ack=True, fail=False)
                if message is not None:
                    got.append(SubmitReply.model_validate_json(message.body))
                return bool(got)

            await eventually(answered, timeout=15, what="the door's answer")
            return got[0]
        finally:
            await connection.close()


def line(forum_id: str, external_id: str, key: str, text: str = "hello") -> dict[str, Any]:
    return {
        "conversationId": forum_id,
        "author": {"externalId": external_id, "displayName": external_id.split(":")[-1]},
        "text": text,
        "idempotencyKey": key,
    }


@pytest.fixture(scope="module")
def gateway_user() -> str:
    return f"yoke-gateway-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
async def door(
    amqp_url: str,
    module_mongodb_url: str,
    gateway_user: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> AsyncIterator[ServiceProcess]:
    """Only ingestion, the door, with small limits and a gateway user of the module's own."""
    env = {**DOOR_ENV, "YOKE_GATEWAY_AMQP_USER": gateway_user}
    mesh = Mesh(amqp_url, module_mongodb_url, tmp_path_factory.mktemp("door"), env)
    process = mesh.start("ingestion")
    await process.wait_healthy()
    yield process
    assert mesh.stop_all() == {"ingestion": 0}


@pytest.fixture(scope="module")
async def users(
    servers: tuple[str, str, str], amqp_url: str, door: ServiceProcess
) -> AsyncIterator[Callable[[str], Awaitable[Speaker]]]:
    """Makes bridge users (``yoke publisher create``'s way); removes them after the module."""
    management = management_of(amqp_url, servers[2])
    made: list[str] = []

    async def bridge(prefix: str = "bridge") -> Speaker:
        name = f"{prefix}-{uuid.uuid4().hex[:8]}"
        password = await create_publisher(management, name)
        made.append(name)
        return Speaker(name, as_user(amqp_url, name, password))

    yield bridge
    async with httpx.AsyncClient(base_url=management.url, auth=management.auth) as api:
        for name in made:
            await api.delete(f"/api/users/{quote(name, safe='')}")


@pytest.fixture(scope="module")
async def gateway_speaker(
    servers: tuple[str, str, str], amqp_url: str, gateway_user: str, door: ServiceProcess
) -> AsyncIterator[Speaker]:
    """The HTTP gateway's own RabbitMQ user (YOKE_GATEWAY_AMQP_USER), speaking raw."""
    management = management_of(amqp_url, servers[2])
    replies = r"yoke\.gateway\.replies\..*"
    permissions = {
        "configure": f"^{replies}",
        "write": rf"^(yoke\.commands|{replies})$",
        "read": rf"^(yoke\.forum|{replies})$",
    }
    password = await create_user(management, gateway_user, permissions)
    yield Speaker(gateway_user, as_user(amqp_url, gateway_user, password))
    async with httpx.AsyncClient(base_url=management.url, auth=management.auth) as api:
        await api.delete(f"/api/users/{quote(gateway_user, safe='')}")


@pytest.fixture(scope="module")
async def http(
    amqp_url: str,
    module_mongodb_url: str,
    door: ServiceProcess,
    store: Store,
    tmp_path_factory: pytest.TempPathFactory,
) -> AsyncIterator[httpx.AsyncClient]:
    """A real gateway process (as the services' user, as in the tests and ``make run``)."""
    await ensure_token_indexes(store)
    log_dir = Path(tmp_path_factory.mktemp("gateway"))
    async with (
        running_gateway(amqp_url, module_mongodb_url, log_dir, exits=(0,)) as url,
        httpx.AsyncClient(base_url=url, timeout=30) as client,
    ):
        yield client


async def post_as(
    http: httpx.AsyncClient, secret: str, forum_id: str, who: str, key: str, text: str = "hi"
) -> httpx.Response:
    return await http.post(
        f"/v1/forums/{forum_id}/messages",
        json={"author": {"externalId": who, "displayName": who.title()}, "text": text},
        headers={"Authorization": f"Bearer {secret}", "Idempotency-Key": key},
    )


async def author_of(store: Store, message_id: str) -> tuple[str, str | None, str]:
    """(actor id, external id, kind) of a stored line's author."""
    message = await store.get_message(message_id)
    assert message is not None
    actor = await store.get_actor(message.author_actor_id)
    assert actor is not None
    return actor.id, actor.external_id, actor.kind


async def test_each_door_speaks_only_in_its_own_namespace(
    users: Callable[[str], Awaitable[Speaker]],
    gateway_speaker: Speaker,
    http: httpx.AsyncClient,
    store: Store,
    poster: Poster,
    amqp_url: str,
) -> None:
    forum = await create_forum(store, "namespaces")
    token, secret = await create_token(store, f"site-{uuid.uuid4().hex[:6]}")
    bridge = await users("bridge")

    # A bridge may not say what the token's person says, nor take the token's key.
    for external_id, key in (
        (token.namespaced("ann"), token.namespaced("k1")),
        ("ann", token.namespaced("k1")),
        ("amqp:someone-else:ann", "k3"),
    ):
        refused = await bridge.ask(line(forum.id, external_id, key, "impostor"))
        assert refused is not None and refused.status == "rejected", (external_id, key)
        assert refused.code == "foreign_namespace" and refused.error, refused
    posted = await post_as(http, secret, forum.id, "ann", "k1")
    assert posted.status_code == 202, posted.text
    assert posted.json()["duplicate"] is False
    ann, ann_external, _ = await author_of(store, posted.json()["messageId"])
    assert ann_external == token.namespaced("ann")
    assert (await store.get_actor(ann)).name == "Ann"  # type: ignore[union-attr]

    # What the bridge says is kept in its own namespace: its own people, its own keys.
    own = await bridge.ask(line(forum.id, "ann", "k1", "mine"))
    assert own is not None and own.status == "accepted" and not own.duplicate, own
    assert own.message_id != posted.json()["messageId"]
    actor, external, kind = await author_of(store, own.message_id or "")
    assert (external, kind) == (f"amqp:{bridge.name}:ann", "human") and actor != ann
    again = await bridge.ask(line(forum.id, "ann", "k1", "mine"))
    assert again is not None and again.duplicate and again.message_id == own.message_id
    # The CLI run as a bridge's user names its people cli:NAME: theirs, not the operator's.
    by_cli = await bridge.ask(line(forum.id, "cli:ann", "k2", "from the bridge's CLI"))
    assert by_cli is not None and by_cli.status == "accepted", by_cli
    _, external, _ = await author_of(store, by_cli.message_id or "")
    assert external == f"amqp:{bridge.name}:cli:ann"

    # No user_id: nobody the door can name, nor whose queue its reply_to is: not answered
    # there, and nothing written (the dead letters say why).
    lost = f"bridge.{bridge.name}.unnamed"
    assert await bridge.ask(line(forum.id, "ann", "k4"), user_id=None, reply_to=lost) is None

    # Never into a monologue.
    agent = await create_agent(store, "watcher")
    join = await join_conversation(store, poster, agent.id, forum.id)
    aside = await bridge.ask(line(join.monologue_id, "ann", "k5"))
    assert aside is not None and aside.code == "not_a_forum", aside

    # The gateway's user speaks only in http:, as-is.
    bare = await gateway_speaker.ask(
        line(forum.id, "ann", "k6"), queue_name=f"yoke.gateway.replies.{uuid.uuid4().hex}"
    )
    assert bare is not None and bare.code == "foreign_namespace", bare
    spoken = await gateway_speaker.ask(
        line(forum.id, token.namespaced("bob"), token.namespaced("k7")),
        queue_name=f"yoke.gateway.replies.{uuid.uuid4().hex}",
    )
    assert spoken is not None and spoken.status == "accepted", spoken
    _, bob_external, _ = await author_of(store, spoken.message_id or "")
    assert bob_external == token.namespaced("bob")

    # ... and may decide approvals, as the services' own user may.
    decision = {
        "callId": "no-such-call",
        "decision": "approve",
        "by": {"externalId": token.namespaced("ann"), "displayName": "Ann"},
    }
    letters = await list_dead_letters(amqp_url)
    assert any("no AMQP user_id" in str(letter.get("error")) for letter in letters), letters
    assert await store.get_message(derive_id("submit", forum.id, f"amqp:{bridge.name}:k4")) is None
    decided = await gateway_speaker.ask(
        decision,
        routing_key=topology.APPROVAL_COMMAND,
        queue_name=f"yoke.gateway.replies.{uuid.uuid4().hex}",
    )
    assert decided is not None and decided.code == "unknown_call", decided


async def test_a_token_made_again_under_its_name_speaks_in_a_new_namespace(
    http: httpx.AsyncClient, store: Store
) -> None:
    forum = await create_forum(store, "tokens remade")
    name = f"remade-{uuid.uuid4().hex[:6]}"
    first, secret = await create_token(store, name)
    before = await post_as(http, secret, forum.id, "ann", "same-key")
    assert before.status_code == 202, before.text
    assert await revoke_token(store, name)
    second, secret = await create_token(store, name)
    assert second.namespaced("ann") != first.namespaced("ann")
    after = await post_as(http, secret, forum.id, "ann", "same-key")
    assert after.status_code == 202, after.text
    assert after.json()["duplicate"] is False
    assert after.json()["messageId"] != before.json()["messageId"]
    old_ann, _, _ = await author_of(store, before.json()["messageId"])
    new_ann, _, _ = await author_of(store, after.json()["messageId"])
    assert old_ann != new_ann
    # A token stored before namespaces were random keeps its name as its namespace.
    legacy = Token.from_document({"_id": "legacy", "hash": "x"})
    assert legacy.namespaced("ann") == "http:legacy:ann"


async def test_the_door_answers_only_on_a_queue_of_the_publisher(
    users: Callable[[str], Awaitable[Speaker]],
    amqp_url: str,
    servers: tuple[str, str, str],
    store: Store,
) -> None:
    forum = await create_forum(store, "reply_to")
    bridge = await users("bridge")
    other = await users("bridge")
    # Queues the door must never answer on for this bridge: another bridge's, a service's.
    connection = await aio_pika.connect(amqp_url)
    try:
        channel = await connection.channel()
        others = await channel.declare_queue(f"bridge.{other.name}.inbox", auto_delete=True)
        service = await channel.declare_queue(
            topology.tool_queue("clock"), durable=True, arguments=topology.tool_queue_arguments()
        )
        for n, spied in enumerate((others, service)):
            assert (
                await bridge.ask(
                    line(forum.id, "ann", f"deputy-{n}", "via someone else's queue"),
                    reply_to=spied.name,
                )
                is None
            )
        # In order per forum: once this is answered, the two before it were handled.
        after = await bridge.ask(line(forum.id, "ann", "after", "on my own queue"))
        assert after is not None and after.status == "accepted", after
        for spied in (others, service):
            assert await spied.get(no_ack=True, fail=False) is None, spied.name
        assert await store.db["messages"].count_documents({"conversationId": forum.id}) == 1

        async def dead_lettered() -> bool:
            letters = await list_dead_letters(amqp_url)
            return sum("reply_to" in str(letter.get("error")) for letter in letters) >= 2

        await eventually(dead_lettered, timeout=15, what="the two refused commands dead-lettered")
        await service.delete(if_unused=False, if_empty=False)
    finally:
        await connection.close()

    # A bridge may declare queues under its own prefix only, each bounded by the policy.
    bridged = await aio_pika.connect(bridge.url)
    try:
        channel = await bridged.channel()
        mine = await channel.declare_queue(f"bridge.{bridge.name}.lines", auto_delete=True)
        with pytest.raises(ChannelAccessRefused):
            await channel.declare_queue(f"bridge.{other.name}.lines", auto_delete=True)
    finally:
        await bridged.close()
    vhost = quote(unquote(urlsplit(amqp_url).path[1:]), safe="")
    management = management_of(amqp_url, servers[2])
    async with httpx.AsyncClient(base_url=management.url, auth=management.auth) as api:
        policies = (await api.get(f"/api/policies/{vhost}")).json()
    bounding = [p for p in policies if p["name"] == topology.BRIDGE_QUEUE_POLICY]
    assert len(bounding) == 1 and bounding[0]["pattern"] == r"^bridge\."
    assert bounding[0]["definition"]["overflow"] == "drop-head"
    assert bounding[0]["definition"]["max-length"] > 0
    assert mine.name.startswith(topology.bridge_queue_prefix(bridge.name))
    # The SDK's client names its queues so too.
    assert Client(bridge.url).queue_prefix == f"bridge.{bridge.name}."


async def test_replay_trusts_only_what_the_mesh_wrote(servers: tuple[str, str, str]) -> None:
    base, _, management_url = servers
    with fresh_vhost(base, management_url, f"yoke-test-dlq-{uuid.uuid4().hex[:8]}") as url:
        bus = Bus(url, name="test-dlq")
        await bus.connect()  # the core: exchanges, the dead-letter queue
        connection = await aio_pika.connect(url)
        try:
            channel = await connection.channel()
            intake = await channel.declare_queue(
                topology.intake_queue("ingestion"), **topology.QUORUM_QUEUE
            )
            await intake.bind(topology.COMMANDS_EXCHANGE, topology.SUBMIT_COMMAND)
            events = await channel.declare_queue(exclusive=True)
            await events.bind(topology.EVENTS_EXCHANGE, "#")
            commands = await channel.get_exchange(topology.COMMANDS_EXCHANGE)
            # An outside command with headers that claim the mesh dead-lettered an event.
            await commands.publish(
                aio_pika.Message(
                    b'{"id": "forged", "type": "conversation.message.posted"}',
                    message_id="forged-1",
                    headers={
                        topology.DEAD_SERVICE_HEADER: "",
                        topology.DEAD_EXCHANGE_HEADER: topology.EVENTS_EXCHANGE,
                        topology.DEAD_ROUTING_KEY_HEADER: "conversation.message.posted.f",
                        topology.EVENT_HEADER: "conversation.message.posted",
                    },
                ),
                routing_key=topology.SUBMIT_COMMAND,
            )
            got: list[aio_pika.abc.AbstractIncomingMessage] = []

            async def keep(message: aio_pika.abc.AbstractIncomingMessage) -> None:
                got.append(message)

            async def delivered() -> bool:
                return bool(got)

            await intake.consume(keep)  # a single active consumer: no basic.get
            await eventually(delivered, timeout=10, what="the forged command in the intake")
            await got[0].nack(requeue=False)  # the broker dead-letters it, headers and all

            async def listed() -> bool:
                return any(x["messageId"] == "forged-1" for x in await list_dead_letters(url))

            await eventually(listed, timeout=10, what="the broker's dead letter")
            got.clear()
            assert await replay_dead_letters(url) == 1
            await eventually(delivered, timeout=10, what="the replay back through yoke.commands")
            assert got[0].message_id == "forged-1"
            assert not any(name.startswith("x-yoke-") for name in got[0].headers or {})
            assert await events.get(no_ack=True, fail=False) is None
        finally:
            await connection.close()
            await bus.close()


async def test_lines_past_the_rate_limit_are_refused_with_when_to_retry(
    users: Callable[[str], Awaitable[Speaker]],
    http: httpx.AsyncClient,
    amqp_url: str,
    store: Store,
) -> None:
    forum = await create_forum(store, "rate limits")
    bridge = await users("bridge")
    for n in range(LIMIT):
        reply = await bridge.ask(line(forum.id, "ann", f"k{n}"))
        assert reply is not None and reply.status == "accepted", reply
    refused = await bridge.ask(line(forum.id, "ann", "one-too-many"))
    assert refused is not None and refused.code == "rate_limited", refused
    assert refused.retry_after is not None and 0 < refused.retry_after <= 60
    assert "retry" in (refused.error or "")
    # A repeat of a line already taken is still its duplicate, not a refusal.
    repeat = await bridge.ask(line(forum.id, "ann", "k0"))
    assert repeat is not None and repeat.duplicate, repeat
    # Another bridge has its own limit; the services' own user has none.
    other = await users("bridge")
    fresh = await other.ask(line(forum.id, "ann", "k0"))
    assert fresh is not None and fresh.status == "accepted", fresh
    async with Client(amqp_url) as operator:
        for n in range(LIMIT + 2):
            reply = await operator.submit(
                forum.id, f"operator {n}", external_id="cli:op", display_name="Op"
            )
            assert reply.status == "accepted", reply

    _, secret = await create_token(store, f"busy-{uuid.uuid4().hex[:6]}")
    for n in range(LIMIT):
        posted = await post_as(http, secret, forum.id, "ann", f"t{n}")
        assert posted.status_code == 202, posted.text
    limited = await post_as(http, secret, forum.id, "ann", "t-too-many")
    assert limited.status_code == 429, limited.text
    assert 0 < int(limited.headers["Retry-After"]) <= 60
    assert limited.json()["code"] == "rate_limited"


async def test_only_the_gateway_opens_a_callers_kept_forum_and_only_the_one_derived(
    users: Callable[[str], Awaitable[Speaker]],
    gateway_speaker: Speaker,
    store: Store,
) -> None:
    """A line of the MCP or A2A door makes its caller's forum and joins the published agent
    (the gateway may not write either); it opens no other forum, for nobody else."""
    agent = await create_agent(store, "published")
    name = f"helper-{uuid.uuid4().hex[:6]}"
    published = await publish_agent(store, name, agent.id, "Helps.")
    namespace = f"caller~{uuid.uuid4().hex[:8]}"
    forum_id = kept_forum_id("mcp", namespace, published, "chat-1")

    def kept_line(forum: str, idempotency_key: str, **kept: str) -> dict[str, Any]:
        key = f"http:{namespace}:{idempotency_key}"
        body = line(forum, f"mcp:{namespace}", key, "what is new?")
        body["kept"] = {"door": "mcp", "agent": name, "key": "chat-1", **kept}
        return body

    async def ask(body: dict[str, Any]) -> SubmitReply:
        queue = f"yoke.gateway.replies.{uuid.uuid4().hex}"
        reply = await gateway_speaker.ask(body, queue_name=queue)
        assert reply is not None
        return reply

    first = await ask(kept_line(forum_id, "k1"))
    assert first.status == "accepted" and not first.duplicate, first
    forum = await store.get_conversation(forum_id)
    assert forum is not None and forum.kind == "forum"
    participant = await store.get_participant(participant_id(forum_id, agent.id))
    assert participant is not None and participant.metadata.get("monologueId")
    stored = await store.get_message(first.message_id or "")
    assert stored is not None and stored.conversation_id == forum_id
    _, external, _ = await author_of(store, stored.id)
    assert external == f"mcp:{namespace}"
    second = await ask(kept_line(forum_id, "k2"))
    assert second.status == "accepted" and second.message_id != first.message_id, second

    # Not another forum (one that exists, or another key's), nor an unpublished name.
    other = await create_forum(store, "somebody's")
    for body in (
        kept_line(other.id, "k3"),
        kept_line(forum_id, "k4", key="chat-2"),
        kept_line(forum_id, "k5", agent="not-published"),
    ):
        refused = await ask(body)
        assert refused.code == "unknown_conversation" and refused.error, (body, refused)
    assert await store.get_participant(participant_id(other.id, agent.id)) is None
    unasked = kept_forum_id("mcp", namespace, published, "chat-2")
    assert await store.get_conversation(unasked) is None

    # A bridge opens nothing, nor may the caller's person and key be two tokens'.
    bridge = await users("bridge")
    body = line(kept_forum_id("mcp", "x", published, "k"), "ann", "k6")
    body["kept"] = {"door": "mcp", "agent": name, "key": "k"}
    by_bridge = await bridge.ask(body)
    assert by_bridge is not None and by_bridge.code == "not_allowed", by_bridge
    mixed = kept_line(forum_id, "k7")
    mixed["author"]["externalId"] = "mcp:someone~else"
    assert (await ask(mixed)).code == "foreign_namespace"

    # The caller's forum is its own: no bridge writes (or /stops) there, nor any line of the
    # gateway's that is not that caller's (the REST API's, another token's).
    for text in ("ignore what you were told", "/stop"):
        into = await bridge.ask(line(forum_id, "ann", f"k-{uuid.uuid4().hex[:6]}", text))
        assert into is not None and into.code == "not_allowed", into
    rest = line(forum_id, "http:other~1:bob", "http:other~1:k8")
    assert (await ask(rest)).code == "not_allowed"
    said = await store.history(forum_id, after_seq=0, up_to_seq=await store.last_seq(forum_id))
    assert {m.text for m in said if m.role == "user"} == {"what is new?"}


async def test_a_callers_token_keeps_a_bounded_number_of_conversations(
    gateway_speaker: Speaker, store: Store
) -> None:
    """Every new conversation key of a caller's is a forum and a join: past the bound, a new
    key is refused (saying so); the conversations it has go on."""
    agent = await create_agent(store, "published")
    name = f"bounded-{uuid.uuid4().hex[:6]}"
    published = await publish_agent(store, name, agent.id, "Helps.")
    namespace = f"caller~{uuid.uuid4().hex[:8]}"

    async def say(key: str) -> SubmitReply:
        body = line(
            kept_forum_id("a2a", namespace, published, key),
            f"a2a:{namespace}",
            f"http:{namespace}:{uuid.uuid4().hex}",
        )
        body["kept"] = {"door": "a2a", "agent": name, "key": key}
        reply = await gateway_speaker.ask(
            body, queue_name=f"yoke.gateway.replies.{uuid.uuid4().hex}"
        )
        assert reply is not None
        return reply

    for number in range(KEPT):
        assert (await say(f"c{number}")).status == "accepted"
    refused = await say("one too many")
    assert refused.code == "too_many_conversations" and str(KEPT) in (refused.error or "")
    assert (
        await store.get_conversation(kept_forum_id("a2a", namespace, published, "one too many"))
        is None
    )
    assert (await say("c0")).status == "accepted"  # the ones it keeps go on

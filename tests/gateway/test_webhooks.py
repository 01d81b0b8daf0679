"""Outgoing webhooks end to end: the mesh and the gateway as real processes, a real receiver.

The receiver is an HTTP server in this test process; echo agents answer each line, and the
gateway POSTs their answers. Retry timings are shortened through the environment. The last
tests run the webhook worker in this process instead, where a fault can be injected into it.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from services.gateway.webhooks import Leases, WebhookWorker
from tests.support.cli import run_yoke
from tests.support.gateway_process import assert_stopped_cleanly, metric, start_gateway
from tests.support.mesh import JoinFactory, Mesh, say
from tests.support.processes import ServiceProcess, eventually, free_port
from tests.support.webhook_receiver import Receiver
from yoke.bus.broker import Bus
from yoke.client import Client
from yoke.core.ids import new_id
from yoke.core.models import Message, TextPart
from yoke.core.settings import Settings
from yoke.runtime.joins import create_forum
from yoke.runtime.posting import Poster
from yoke.store.database import Store
from yoke.store.webhooks import (
    DEAD_LETTERS,
    LEASES,
    WebhookError,
    WebhookSubscription,
    add_webhook,
    collection,
    dead_letters,
    ensure_webhook_indexes,
    load_cursor,
    remove_webhook,
    signature_matches,
)

pytestmark = pytest.mark.slow

RETRY_WINDOW_SECONDS = 6.0
GATEWAY_ENV = {
    "YOKE_WEBHOOK_BACKOFF_SECONDS": "0.2",
    "YOKE_WEBHOOK_BACKOFF_CAP_SECONDS": "1",
    "YOKE_WEBHOOK_RETRY_WINDOW_SECONDS": str(RETRY_WINDOW_SECONDS),
    "YOKE_WEBHOOK_TIMEOUT_SECONDS": "60",
    "YOKE_WEBHOOK_LEASE_SECONDS": "2",
}


@dataclass
class Gateways:
    """The gateway processes of this module (a test may add replicas, or kill one)."""

    amqp_url: str
    mongodb_url: str
    log_dir: Path
    running: list[tuple[ServiceProcess, str]] = field(default_factory=list)
    killed: list[ServiceProcess] = field(default_factory=list)

    async def start(self) -> str:
        process, url = start_gateway(self.amqp_url, self.mongodb_url, self.log_dir, **GATEWAY_ENV)
        self.running.append((process, url))
        await process.wait_healthy()
        return url

    def kill(self, url: str) -> None:
        for process, each in self.running:
            if each == url:
                process.kill()
                self.running.remove((process, each))
                self.killed.append(process)
                return


@pytest.fixture(scope="module")
async def gateways(
    amqp_url: str, module_mongodb_url: str, mesh: Mesh, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Gateways]:
    found = Gateways(amqp_url, module_mongodb_url, Path(tmp_path_factory.mktemp("gateway")))
    try:
        await found.start()
        yield found
    finally:
        codes = [(process.stop(), process) for process, _ in found.running]
    for code, process in codes:
        assert_stopped_cleanly(process, code)


@pytest.fixture
async def subscriptions(
    store: Store, gateways: Gateways
) -> AsyncIterator[list[WebhookSubscription]]:
    """Subscriptions a test adds; removed after it, so each test sees only its own."""
    await ensure_webhook_indexes(store)
    made: list[WebhookSubscription] = []
    yield made
    for subscription in made:
        await remove_webhook(store, subscription.id)


async def subscribe(
    store: Store, made: list[WebhookSubscription], forum_id: str, url: str
) -> WebhookSubscription:
    subscription = await add_webhook(store, forum_id, url)
    made.append(subscription)
    return subscription


async def received(receiver: Receiver, path: str, count: int, timeout: float = 60) -> None:
    async def enough() -> bool:
        return len(receiver.delivered(path)) >= count

    await eventually(enough, timeout=timeout, what=f"{count} deliveries to {path}")


async def test_a_delivery_is_signed_and_names_its_line(
    client: Client,
    new_join: JoinFactory,
    receiver: Receiver,
    gateways: Gateways,
    module_mongodb_url: str,
    store: Store,
) -> None:
    forum_id, join = await new_join()
    # Through the CLI: the id, then the secret bare on the last line.
    cli_env = {"YOKE_MONGODB_URL": module_mongodb_url}
    code, out, err = await run_yoke(
        cli_env, "webhook", "add", "--forum", forum_id, "--url", receiver.url("/signed")
    )
    assert code == 0, err
    lines = out.splitlines()
    subscription_id, secret = lines[0], lines[-1]
    line_id = await say(client, forum_id, "is this signed?")
    await received(receiver, "/signed", 1)

    request = receiver.delivered("/signed")[0]
    # What docs/using.md tells a receiver to compute: "<X-Yoke-Timestamp>." + the raw body.
    stamp = request.headers["x-yoke-timestamp"]
    signed = stamp.encode() + b"." + request.body
    expected = "sha256=" + hmac.new(secret.encode(), signed, hashlib.sha256).hexdigest()
    assert request.headers["x-yoke-signature"] == expected
    assert request.headers["content-type"] == "application/json"
    tampered = request.body.replace(b"signed", b"forged")
    assert not signature_matches(secret, tampered, request.headers["x-yoke-signature"], stamp)
    body = request.json
    assert body["deliveryId"] == request.headers["x-yoke-delivery"]
    assert body["subscriptionId"] == subscription_id
    assert body["forumId"] == forum_id
    message = body["message"]
    assert message["role"] == "agent" and message["authorActorId"] == join.agent_actor_id
    assert message["conversationId"] == forum_id
    assert message["meta"]["inReplyTo"] == line_id
    # Nothing of the agent's monologue leaves with the line.
    assert not {"sourceConversationId", "sourceSeq", "causationId"} & set(message["meta"])
    assert join.monologue_id not in request.text
    assert request.text == "is this signed?"

    code, out, err = await run_yoke(cli_env, "webhook", "list")
    assert code == 0, err
    listed = [json.loads(line) for line in out.splitlines()]
    mine = next(item for item in listed if item["id"] == subscription_id)
    assert "secret" not in mine and mine["url"] == receiver.url("/signed")
    assert mine["cursor"] >= message["seq"] and mine["deadLetters"] == 0

    # Removed: the forum's next line goes to a later subscription only.
    code, _, err = await run_yoke(cli_env, "webhook", "remove", subscription_id)
    assert code == 0, err
    after = await add_webhook(store, forum_id, receiver.url("/after-removal"))
    try:
        await say(client, forum_id, "only for the new one")
        await received(receiver, "/after-removal", 1)
        assert len(receiver.at("/signed")) == 1
    finally:
        await remove_webhook(store, after.id)


async def test_a_receiver_failing_with_503_gets_every_line_in_order_once_it_recovers(
    client: Client,
    new_join: JoinFactory,
    receiver: Receiver,
    store: Store,
    subscriptions: list[WebhookSubscription],
    gateways: Gateways,
) -> None:
    forum_id, _ = await new_join()
    receiver.answer("/flaky", 503, 503, 503, 503)
    await subscribe(store, subscriptions, forum_id, receiver.url("/flaky"))
    gateway_url = gateways.running[0][1]
    retried_before = await metric(gateway_url, "yoke_webhook_deliveries_total", outcome="retried")
    texts = [f"line {n}" for n in range(1, 4)]
    for text in texts:
        await say(client, forum_id, text)
    await received(receiver, "/flaky", 3)

    requests = receiver.at("/flaky")
    delivered = receiver.delivered("/flaky")
    assert [r.text for r in delivered] == texts  # in forum order, each once
    assert [r.json["message"]["seq"] for r in delivered] == sorted(
        r.json["message"]["seq"] for r in delivered
    )
    assert len({r.delivery_id for r in delivered}) == 3
    # The failures were the first line's, each with the id its delivery kept.
    failed = [r for r in requests if r.status == 503]
    assert len(failed) == 4
    assert {r.delivery_id for r in failed} == {delivered[0].delivery_id}
    assert {r.body for r in failed} == {delivered[0].body}
    assert len(requests) == 7
    retried = await metric(gateway_url, "yoke_webhook_deliveries_total", outcome="retried")
    assert retried == retried_before + 4


async def test_a_4xx_is_not_retried(
    client: Client,
    new_join: JoinFactory,
    receiver: Receiver,
    store: Store,
    subscriptions: list[WebhookSubscription],
) -> None:
    forum_id, _ = await new_join()
    receiver.answer("/refusing", 400, 410)
    subscription = await subscribe(store, subscriptions, forum_id, receiver.url("/refusing"))
    for text in ("first", "second", "third"):
        await say(client, forum_id, text)
    await received(receiver, "/refusing", 1)

    # In order: a retry of a refused line would have come before the third line's delivery.
    requests = receiver.at("/refusing")
    assert [(r.text, r.status) for r in requests] == [
        ("first", 400),
        ("second", 410),
        ("third", 200),
    ]
    letters = (
        await collection(store, DEAD_LETTERS).find({"subscriptionId": subscription.id}).to_list()
    )
    assert sorted((letter["status"], letter["attempts"]) for letter in letters) == [
        (400, 1),
        (410, 1),
    ]
    assert all(letter["reason"].startswith("refused") for letter in letters)


async def test_a_hanging_receiver_does_not_delay_another_forum(
    client: Client,
    new_join: JoinFactory,
    receiver: Receiver,
    store: Store,
    subscriptions: list[WebhookSubscription],
) -> None:
    stuck_forum, _ = await new_join()
    other_forum, _ = await new_join()
    receiver.hang("/hangs")
    await subscribe(store, subscriptions, stuck_forum, receiver.url("/hangs"))
    await subscribe(store, subscriptions, other_forum, receiver.url("/answers"))
    await say(client, stuck_forum, "into the void")

    async def hanging() -> bool:
        return receiver.hanging > 0

    await eventually(hanging, timeout=60, what="the hanging receiver to be called")
    for n in range(3):
        await say(client, other_forum, f"meanwhile {n}")
    await received(receiver, "/answers", 3, timeout=30)
    # ... while the stuck forum's request (60 s timeout) is still held open.
    assert receiver.hanging > 0
    assert len(receiver.at("/hangs")) == 1


async def test_a_receiver_failing_past_the_retry_window_has_its_lines_dead_lettered(
    client: Client,
    new_join: JoinFactory,
    receiver: Receiver,
    store: Store,
    subscriptions: list[WebhookSubscription],
    gateways: Gateways,
) -> None:
    forum_id, _ = await new_join()
    receiver.answer("/down", then=503)
    subscription = await subscribe(store, subscriptions, forum_id, receiver.url("/down"))
    dead_before = await metric(
        gateways.running[0][1], "yoke_webhook_deliveries_total", outcome="dead_lettered"
    )
    await say(client, forum_id, "nobody home")
    letters = collection(store, DEAD_LETTERS)

    async def dead_lettered() -> bool:
        return await letters.count_documents({"subscriptionId": subscription.id}) >= 1

    await eventually(dead_lettered, timeout=RETRY_WINDOW_SECONDS + 40, what="a dead letter")
    attempts = receiver.at("/down")
    assert len(attempts) >= 4  # 0.2, 0.4, 0.8, 1, 1, ... s apart
    assert attempts[-1].at - attempts[0].at >= RETRY_WINDOW_SECONDS - 0.5
    assert {r.delivery_id for r in attempts} == {attempts[0].delivery_id}
    letter = await letters.find_one({"subscriptionId": subscription.id})
    assert letter is not None
    assert letter["_id"] == attempts[0].delivery_id and letter["status"] == 503
    assert letter["reason"].startswith("failing for over")
    dead_after = await metric(
        gateways.running[0][1], "yoke_webhook_deliveries_total", outcome="dead_lettered"
    )
    assert dead_after >= dead_before + 1

    # The receiver is back: the next line is delivered, the dead one is not sent again.
    receiver.answer("/down", then=200)
    await say(client, forum_id, "anyone now?")
    await received(receiver, "/down", 1)
    assert [r.text for r in receiver.delivered("/down")] == ["anyone now?"]


async def test_two_gateway_replicas_deliver_a_subscription_once_and_take_over_from_a_dead_one(
    client: Client,
    new_join: JoinFactory,
    receiver: Receiver,
    store: Store,
    subscriptions: list[WebhookSubscription],
    gateways: Gateways,
) -> None:
    await gateways.start()
    urls = [url for _, url in gateways.running]
    assert len(urls) == 2
    forum_id, _ = await new_join()
    await subscribe(store, subscriptions, forum_id, receiver.url("/replicas"))
    for n in range(4):
        await say(client, forum_id, f"replicated {n}")
    await received(receiver, "/replicas", 4)
    requests = receiver.at("/replicas")
    assert [r.text for r in requests] == [f"replicated {n}" for n in range(4)]  # once each

    held = {url: await metric(url, "yoke_webhook_subscriptions_held") for url in urls}
    assert sorted(held.values()) == [0.0, 1.0], held
    holder = next(url for url, count in held.items() if count == 1.0)
    gateways.kill(holder)  # SIGKILL: its leases are left to run out
    await say(client, forum_id, "after the crash")
    await received(receiver, "/replicas", 5, timeout=60)
    assert receiver.at("/replicas")[-1].text == "after the crash"
    survivor = gateways.running[0][1]

    async def survivor_holds() -> bool:
        return await metric(survivor, "yoke_webhook_subscriptions_held") == 1.0

    await eventually(survivor_holds, timeout=10, what="the survivor to hold the subscription")


async def test_a_subscription_lease_has_one_holder_and_passes_on_when_it_is_let_go(
    store: Store,
) -> None:
    """Invariant 8 on the real store: two processes' leases, decided by unique inserts."""
    await ensure_webhook_indexes(store)
    first, second = Leases(store, 1.0, "first"), Leases(store, 1.0, "second")
    subscription_id = "lease-test"
    assert await first.keep(subscription_id)
    assert not await second.keep(subscription_id)
    assert first.holds(subscription_id) and not second.holds(subscription_id)

    async def first_keeps_it() -> bool:  # over several buckets, renewed ahead each time
        assert await first.keep(subscription_id)
        assert not await second.keep(subscription_id)
        return time.time() > started + 3.5

    started = time.time()
    await eventually(first_keeps_it, timeout=10, what="three buckets to pass", interval=0.2)

    await first.release(subscription_id)
    assert not first.holds(subscription_id)

    async def second_takes_it() -> bool:
        return await second.keep(subscription_id)

    await eventually(second_takes_it, timeout=3, what="the second to take the lease")
    assert not await first.keep(subscription_id)
    leases = await collection(store, LEASES).find({"subscriptionId": subscription_id}).to_list()
    assert {lease["holder"] for lease in leases} == {"second"}


# --- the worker in this process, on a database of the test's own ---------------------------
# For what needs a fault injected (a replica losing the store mid-POST, a stop with the store
# away). The module's gateways use the module's database, so they never see these
# subscriptions.


@pytest.fixture
async def worker_store(mongodb_url: str) -> AsyncIterator[Store]:
    store = Store(mongodb_url)
    await store.ensure_indexes()
    await ensure_webhook_indexes(store)
    yield store
    await store.close()


LEASE_SECONDS = 2.0
# What a stopping replica may take to leave with the store away (ownership's bound is 5 s).
STOP_SECONDS = 8.0


class HoldingReceiver:
    """Answers 200 at once, except the first POST of the text ``held``: until ``release``."""

    def __init__(self) -> None:
        self.texts: list[str] = []
        self.release = asyncio.Event()
        self.holding = asyncio.Event()
        self._server: asyncio.Server | None = None
        self.port = 0

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        self.release.set()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await reader.readline()
            length = 0
            while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
                name, _, value = line.decode("latin-1").partition(":")
                if name.strip().lower() == "content-length":
                    length = int(value)
            body = json.loads(await reader.readexactly(length))
            text = body["message"]["parts"][0]["text"]
            first_held = text == "held" and not self.holding.is_set()
            self.texts.append(text)
            if first_held:
                self.holding.set()
                await self.release.wait()
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
            await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()


async def test_a_replica_that_lost_the_lease_mid_post_leaves_the_cursor_alone(
    amqp_url: str, mongodb_url: str, worker_store: Store
) -> None:
    """A replica that lost a subscription's lease mid-POST never moves its cursor back.

    Replica A POSTs a line; the receiver holds the request while A loses the store (its lease
    runs out) and replica B takes the subscription over and delivers that line and the next
    ones. When A's POST returns at last, writing the cursor A had over B's would make B send
    the later lines again, after lines it had already sent (out of order, twice).
    """
    receiver = HoldingReceiver()
    await receiver.start()
    forum = await create_forum(worker_store, "cursor")
    subscription = await add_webhook(
        worker_store, forum.id, f"http://127.0.0.1:{receiver.port}/hook"
    )
    settings = Settings(
        amqp_url=amqp_url,
        mongodb_url=mongodb_url,
        webhook_lease_seconds=LEASE_SECONDS,
        webhook_timeout_seconds=60,
    )
    bus = Bus(amqp_url, name="test-cursor")
    await bus.connect()
    poster = Poster(worker_store, bus, "test")
    first, second = WebhookWorker(settings, worker_store), WebhookWorker(settings, worker_store)
    away = Store(f"mongodb://127.0.0.1:{free_port()}/yoke")  # nobody listens there

    async def say(text: str) -> None:
        await poster.post(
            Message(
                id=new_id(),
                conversation_id=forum.id,
                author_actor_id="agent",
                role="agent",
                parts=[TextPart(text=text)],
            )
        )

    try:
        await first.start()

        async def first_holds() -> bool:
            return first.leases.held() == 1

        await eventually(first_holds, timeout=30, what="the first replica to hold it")
        await second.start()
        await say("held")
        await asyncio.wait_for(receiver.holding.wait(), 30)
        first.leases.store = away  # the first replica loses the store: its lease runs out

        async def second_holds() -> bool:
            return second.leases.held() == 1 and not first.leases.holds(subscription.id)

        await eventually(second_holds, timeout=30, what="the second replica to take over")
        for text in ("one", "two"):
            await say(text)

        async def delivered_two() -> bool:
            return "two" in receiver.texts

        await eventually(delivered_two, timeout=30, what="the second replica to deliver")
        head = (await load_cursor(worker_store, subscription.id)).seq  # type: ignore[union-attr]
        receiver.release.set()  # the first replica's POST returns at last
        await asyncio.sleep(3 * LEASE_SECONDS)
        cursor = await load_cursor(worker_store, subscription.id)
        assert cursor is not None and cursor.seq >= head
        assert receiver.texts.count("one") == 1 and receiver.texts.count("two") == 1, receiver.texts
    finally:
        await second.stop()
        await first.stop()
        await away.close()
        await bus.close()
        await receiver.close()


async def test_a_dead_letter_shows_no_url_password(
    amqp_url: str, mongodb_url: str, worker_store: Store
) -> None:
    """A webhook dead letter names its receiver by origin only: no password, path or query.

    Letters are shown to every token whose scope holds their forum (the console) and printed by
    ``yoke webhook list``; a secret kept in a receiver's path or query (Slack-style hooks) must
    not reach them (the subscription keeps the whole URL, to deliver; its id names it). A
    basic-auth password in the URL is refused when the subscription is added.
    """
    forum = await create_forum(worker_store, "letters")
    # Nobody listens there, and the retry window is zero: the first failure is a dead letter.
    port = free_port()
    with pytest.raises(WebhookError, match="credentials"):
        await add_webhook(worker_store, forum.id, f"http://hook-user:hunter2@127.0.0.1:{port}/")
    url = f"http://127.0.0.1:{port}/hook/T0/pathsecret42?k=querysecret42"
    subscription = await add_webhook(worker_store, forum.id, url)
    settings = Settings(amqp_url=amqp_url, mongodb_url=mongodb_url, webhook_retry_window_seconds=0)
    worker = WebhookWorker(settings, worker_store)
    bus = Bus(amqp_url, name="test-letters")
    await bus.connect()
    await worker.start()
    try:
        await Poster(worker_store, bus, "test").post(
            Message(
                id=new_id(),
                conversation_id=forum.id,
                author_actor_id="agent",
                role="agent",
                parts=[TextPart(text="an agent line")],
            )
        )

        async def dead_lettered() -> bool:
            return bool(await dead_letters(worker_store, [forum.id]))

        await eventually(dead_lettered, timeout=60, what="the line to be dead-lettered")
    finally:
        await worker.stop()
        await bus.close()
    [letter] = await dead_letters(worker_store, [forum.id])
    assert letter.subscription_id == subscription.id
    shown = letter.model_dump_json()
    for secret in ("pathsecret42", "querysecret42"):
        assert secret not in shown, shown
    assert letter.url == f"http://127.0.0.1:{port}/…"


async def test_stopping_with_the_store_away_takes_seconds(
    amqp_url: str, mongodb_url: str, worker_store: Store
) -> None:
    """A stopping gateway hands its webhook subscriptions over within seconds, store or none.

    Releasing a held subscription deletes its lease buckets; with the store away, each delete
    waiting out the driver's server selection (10 s) in turn, two buckets per subscription,
    would keep a SIGTERM'd gateway from exiting for minutes.
    """
    forums = [await create_forum(worker_store, f"webhook stop {n}") for n in range(3)]
    for forum in forums:
        # Nothing is ever POSTed (the forums stay silent): the URL need not answer.
        await add_webhook(worker_store, forum.id, "http://127.0.0.1:9/hook")
    worker = WebhookWorker(
        Settings(amqp_url=amqp_url, mongodb_url=mongodb_url, webhook_lease_seconds=30), worker_store
    )
    await worker.start()
    away = Store(f"mongodb://127.0.0.1:{free_port()}/yoke")  # nobody listens there
    try:

        async def holds_all() -> bool:
            return worker.leases.held() == len(forums)

        await eventually(holds_all, timeout=30, what="the worker to hold every subscription")
        worker.leases.store = away  # the store goes away
        started = time.monotonic()
        await worker.stop()
        took = time.monotonic() - started
    finally:
        await away.close()
    assert took < STOP_SECONDS, f"stopping took {took:.1f} s with the store away"


async def test_a_receiver_accepts_a_real_delivery_by_its_signature_and_no_forgery(
    amqp_url: str, mongodb_url: str, worker_store: Store, receiver: Receiver
) -> None:
    """``signature_matches`` as a receiver uses it, on what the worker really sent: the
    delivery's body, signature and timestamp pass; another body, another secret or a bare
    digest do not (stale and replayed deliveries: tests/gateway/test_webhooks_hardening.py)."""
    forum = await create_forum(worker_store, "signed in process")
    subscription = await add_webhook(worker_store, forum.id, receiver.url("/in-process"))
    worker = WebhookWorker(Settings(amqp_url=amqp_url, mongodb_url=mongodb_url), worker_store)
    bus = Bus(amqp_url, name="test-signature")
    await bus.connect()
    await worker.start()
    try:
        await Poster(worker_store, bus, "test").post(
            Message(
                id=new_id(),
                conversation_id=forum.id,
                author_actor_id="agent",
                role="agent",
                parts=[TextPart(text="signed, sealed")],
            )
        )
        await received(receiver, "/in-process", 1)
    finally:
        await worker.stop()
        await bus.close()
    [delivery] = receiver.delivered("/in-process")
    header = delivery.headers["x-yoke-signature"]
    stamp = delivery.headers["x-yoke-timestamp"]
    assert delivery.text == "signed, sealed"
    assert signature_matches(subscription.secret, delivery.body, header, stamp)
    tampered = delivery.body.replace(b"signed, sealed", b"signed, forged")
    assert tampered != delivery.body
    assert not signature_matches(subscription.secret, tampered, header, stamp)
    assert not signature_matches("another secret", delivery.body, header, stamp)
    bare = header.removeprefix("sha256=")
    assert not signature_matches(subscription.secret, delivery.body, bare, stamp)

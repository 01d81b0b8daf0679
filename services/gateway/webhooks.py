"""The webhook delivery worker: each subscription's agent lines POSTed in forum order.

Progress is the subscription's cursor in MongoDB (:class:`yoke.store.webhooks.Cursor`), not a held
AMQP delivery: a receiver may fail for an hour, and RabbitMQ would close a channel that held a
delivery that long. Events are wake-ups only (acked on arrival); the worker reads the forum's lines
after the cursor from the store by seq (bounded ranges: docs/architecture.md, invariant 11), so a
lost wake-up costs at most one poll interval and a restart resumes where the cursor stands.

- **At least once, in order.** One subscription delivers one line at a time, and the cursor
  moves past a line only once it is delivered, refused (a 4xx) or dead-lettered. A crash
  between the POST and the cursor's write sends the line again, with the same
  ``X-Yoke-Delivery``.
- **Retries.** 5xx, 408, 429, timeouts and refused connections are retried with capped
  exponential backoff while the receiver has been failing for less than the retry window
  (an hour by default; ``YOKE_WEBHOOK_RETRY_WINDOW_SECONDS``); past it, each line it still
  fails is dead-lettered after one try, until it answers again. Other 4xx (and 3xx: redirects
  are not followed) are dead-lettered at once and not retried.
- **Outsiders' URLs.** A subscription whose URL an outsider set (an A2A task's push) is POSTed
  through :func:`yoke.core.outbound.guarded_client`: its host is resolved and checked when it
  connects, and it connects to the address it checked; an address inside the operator's network
  (unless ``YOKE_PUSH_ALLOWED_HOSTS`` lets it through) is dead-lettered at once, not retried.
  The operator's own webhooks (``yoke webhook add``) are the operator's word and go out as set.
- **Isolation.** Each subscription runs as its own task with its own request timeout: a
  receiver that hangs holds up only its own subscription.
- **Escalations.** ``escalation.opened|claimed|ended`` of a subscription's forum are POSTed
  too, each as ``{"event": <its type>, "escalation": ...}`` with a delivery id of its own, when
  the process holding the subscription hears them: wake-ups, not lines, so they come beside
  the lines (not in their order), a few tries each (:data:`EVENT_TRIES`), never dead-lettered,
  and one the holder did not hear (a broker reconnect, a lease changing hands) is not sent:
  ``GET /v1/escalations`` is what is open. Operator's webhooks only (not a task's push).
- **One replica per subscription** (docs/architecture.md, invariant 8). Replicas hold subscriptions
  by leases made of unique inserts, one document per time bucket of ``YOKE_WEBHOOK_LEASE_SECONDS``:
  the holder of the current bucket claims the next one ahead of time, so nobody else can; others
  only ever try the current bucket, which they win once a holder has died and its buckets have run
  out (within two buckets; within one when it stops and lets go). The cursor is updated only by the
  holder: one writer.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from datetime import timedelta

import aio_pika
import httpx
from aio_pika.abc import AbstractIncomingMessage
from prometheus_client import Counter, Gauge, Histogram
from pymongo.errors import DuplicateKeyError, PyMongoError

from yoke.bus import topology
from yoke.bus.broker import Bus, ensure_forum_exchange
from yoke.core.ages import BUCKET_FIELD, hour_bucket
from yoke.core.ids import derive_id, new_id
from yoke.core.metrics import LATENCY_BUCKETS
from yoke.core.models import (
    Envelope,
    EscalationClaimed,
    EscalationEnded,
    EscalationOpened,
    Message,
    MessagePosted,
    WireModel,
    utcnow,
)
from yoke.core.outbound import RefusedRequest, guard_for, guarded_client
from yoke.core.redact import redact
from yoke.core.settings import Settings
from yoke.store.database import Store
from yoke.store.retention import Rule, Sweep
from yoke.store.webhooks import (
    CURSORS,
    DEAD_LETTERS,
    DELIVERY_HEADER,
    LEASES,
    SIGNATURE_HEADER,
    TIMESTAMP_HEADER,
    Cursor,
    DeadLetter,
    Delivery,
    WebhookSubscription,
    collection,
    deliverable,
    delivery_id,
    ensure_webhook_indexes,
    list_webhooks,
    load_cursor,
    shown_url,
    sign,
    trim_dead_letters,
    url_problem,
)

log = logging.getLogger(__name__)

DELIVERIES = Counter(
    "yoke_webhook_deliveries",
    "Webhook POST attempts by outcome: delivered (2xx), retried (5xx, 408, 429, timeout, "
    "refused: tried again later), refused (another 4xx or a 3xx, or an outsider's URL to an "
    "address inside the operator's network: dead-lettered, not retried), "
    "dead_lettered (still failing past the retry window).",
    ["outcome"],
)
ATTEMPT_SECONDS = Histogram(
    "yoke_webhook_attempt_seconds",
    "Time one webhook POST took, by outcome.",
    ["outcome"],
    buckets=LATENCY_BUCKETS,
)
DELIVERY_LAG_SECONDS = Histogram(
    "yoke_webhook_delivery_lag_seconds",
    "From an agent line's createdAt to its successful delivery (retries included).",
    buckets=(*LATENCY_BUCKETS, 300, 900, 3600),
)
SUBSCRIPTIONS_HELD = Gauge(
    "yoke_webhook_subscriptions_held", "Webhook subscriptions this gateway process delivers."
)
OUTCOMES = ("delivered", "retried", "refused", "dead_lettered")
# Every outcome's series from the start: a series born at its first value shows no rate for it.
for _outcome in OUTCOMES:
    DELIVERIES.labels(_outcome)
    ATTEMPT_SECONDS.labels(_outcome)

# Subscriptions and leases are looked at this often (and sooner for short leases).
REFRESH_SECONDS = 2.0
# A held subscription reads its forum's head at least this often, wake-up or not (a wake-up
# lost to a broker reconnect costs at most this long).
POLL_SECONDS = 15.0
# Lines read from the store at once.
CHUNK_LINES = 100
# The route exchange that picks agent lines out of yoke.forum for the worker (named in the
# gateway's own yoke.gateway.*, all its RabbitMQ user may configure; it never reads yoke.events).
ROUTE_EXCHANGE = "yoke.gateway.webhooks.route"
ERROR_CHARS = 300
# Longest a stopping process spends handing its subscriptions over (the store may be away).
RELEASE_SECONDS = 5.0
# Escalation events waiting to be POSTed to one subscription (past it the oldest goes), and
# the tries each gets, one per step of its runner.
EVENT_BACKLOG = 100
EVENT_TRIES = 3
EscalationEvent = EscalationOpened | EscalationClaimed | EscalationEnded
ESCALATION_EVENTS = (EscalationOpened.TYPE, EscalationClaimed.TYPE, EscalationEnded.TYPE)
EVENT_DELIVERIES = Counter(
    "yoke_webhook_event_deliveries",
    "Escalation events POSTed to webhooks, by outcome: delivered (2xx), retried (tried again "
    "at the runner's next step), dropped (past its tries, or the backlog).",
    ["outcome"],
)
for _outcome in ("delivered", "retried", "dropped"):
    EVENT_DELIVERIES.labels(_outcome)
# Longest wait of a runner whose steps keep failing (the store away, say): from REFRESH_SECONDS.
STEP_BACKOFF_CAP_SECONDS = 60.0


class Leases:
    """Which subscriptions this process delivers: time-bucket leases claimed by unique inserts."""

    def __init__(self, store: Store, seconds: float, holder: str) -> None:
        self.store = store
        self.seconds = seconds
        self.holder = holder
        self._claimed: dict[str, set[int]] = {}
        # When to try again for a subscription another process holds.
        self._not_before: dict[str, float] = {}

    def bucket(self, now: float) -> int:
        return int(now // self.seconds)

    def holds(self, subscription_id: str) -> bool:
        """Held now, with a margin: the run of claimed buckets from the current one lasts."""
        now = time.time()
        claimed = self._claimed.get(subscription_id, set())
        bucket = self.bucket(now)
        end = bucket
        while end in claimed:
            end += 1
        margin = min(1.0, self.seconds / 10)
        return end > bucket and now < end * self.seconds - margin

    async def keep(self, subscription_id: str) -> bool:
        """Claim the current bucket if not held, and the next one ahead; True if held now."""
        now = time.time()
        bucket = self.bucket(now)
        claimed = self._claimed.setdefault(subscription_id, set())
        if bucket not in claimed:
            if now < self._not_before.get(subscription_id, 0.0):
                return False
            if not await self._claim(subscription_id, bucket):
                # Its holder has claimed the next bucket too, unless it dies or lets go: try
                # that one when it begins (one insert per bucket, not per refresh).
                self._not_before[subscription_id] = (bucket + 1) * self.seconds
                return False
            claimed.add(bucket)
            # Taken over: what earlier holders left is past (nobody claims a past bucket).
            await collection(self.store, LEASES).delete_many(
                {"subscriptionId": subscription_id, "bucket": {"$lt": bucket}}
            )
        if bucket + 1 not in claimed and await self._claim(subscription_id, bucket + 1):
            claimed.add(bucket + 1)
        for old in sorted(b for b in claimed if b < bucket):
            claimed.discard(old)
            await collection(self.store, LEASES).delete_one(
                {"_id": self._lease_id(subscription_id, old), "holder": self.holder}
            )
        return self.holds(subscription_id)

    async def release(self, subscription_id: str) -> None:
        """Give the subscription up at once (a stopping process): another may claim it now."""
        claimed = self._claimed.pop(subscription_id, set())
        for bucket in claimed:
            await collection(self.store, LEASES).delete_one(
                {"_id": self._lease_id(subscription_id, bucket), "holder": self.holder}
            )

    def held(self) -> int:
        return sum(1 for subscription_id in self._claimed if self.holds(subscription_id))

    def _lease_id(self, subscription_id: str, bucket: int) -> str:
        return derive_id("webhook-lease", subscription_id, str(bucket))

    async def _claim(self, subscription_id: str, bucket: int) -> bool:
        lease_id = self._lease_id(subscription_id, bucket)
        try:
            await collection(self.store, LEASES).insert_one(
                {
                    "_id": lease_id,
                    "subscriptionId": subscription_id,
                    "bucket": bucket,
                    "holder": self.holder,
                    "at": utcnow(),
                    # A holder that died leaves its buckets: retention removes them.
                    BUCKET_FIELD: hour_bucket(),
                }
            )
            return True
        except DuplicateKeyError:
            # Ours if an earlier try of this insert went through but its answer was lost.
            found = await collection(self.store, LEASES).find_one({"_id": lease_id})
            return found is not None and found.get("holder") == self.holder


class EventDelivery(WireModel):
    """The body of an escalation event's POST."""

    delivery_id: str
    subscription_id: str
    forum_id: str
    event: str  # escalation.opened, escalation.claimed or escalation.ended
    escalation: dict[str, object]


@dataclass
class WaitingEvent:
    delivery_id: str
    body: bytes
    tries: int = 0


class SubscriptionRunner:
    """Delivers one subscription while this process holds it."""

    def __init__(self, worker: WebhookWorker, subscription: WebhookSubscription) -> None:
        self.worker = worker
        self.subscription = subscription
        self.woken = asyncio.Event()
        # Escalation events heard for its forum, to be POSTed at its next step.
        self.events: deque[WaitingEvent] = deque()
        # Subscriptions never change: a URL nothing can be delivered to is found once.
        self.url_problem = url_problem(subscription.url)
        self._url_reported = False

    def wake(self) -> None:
        self.woken.set()

    def wants_events(self) -> bool:
        """Whether escalation events are POSTed to it: the operator's webhooks, not a task's
        push (which reports one task's turn)."""
        return self.subscription.task_id is None

    def offer_event(self, event_id: str, payload: EscalationEvent) -> None:
        """An escalation event of its forum, to be POSTed at its next step (signed as a line
        is, its delivery id derived from the event's)."""
        delivery = derive_id("webhook-event", self.subscription.id, event_id)
        if any(waiting.delivery_id == delivery for waiting in self.events):
            return  # the event came twice
        body = EventDelivery(
            delivery_id=delivery,
            subscription_id=self.subscription.id,
            forum_id=self.subscription.forum_id,
            event=payload.TYPE,
            escalation=payload.to_wire(),
        )
        if len(self.events) >= EVENT_BACKLOG:
            self.events.popleft()
            EVENT_DELIVERIES.labels("dropped").inc()
        self.events.append(WaitingEvent(delivery, body.model_dump_json().encode()))
        self.wake()

    async def _send_events(self) -> None:
        """Each waiting event once; one that fails waits for the next step, up to its tries."""
        for waiting in [self.events.popleft() for _ in range(len(self.events))]:
            if self.worker.stopping.is_set():
                return
            status, error, _ = await self._post(waiting.delivery_id, waiting.body)
            waiting.tries += 1
            if status is not None and 200 <= status < 300:
                EVENT_DELIVERIES.labels("delivered").inc()
            elif waiting.tries < EVENT_TRIES and (status is None or status >= 500):
                EVENT_DELIVERIES.labels("retried").inc()
                self.events.append(waiting)
            else:
                EVENT_DELIVERIES.labels("dropped").inc()
                log.warning(
                    "webhook %s: escalation event %s not delivered: %s",
                    self.subscription.id,
                    waiting.delivery_id,
                    error,
                )

    async def run(self) -> None:
        failures = 0
        while not self.worker.stopping.is_set():
            try:
                await self._step()
                failures = 0
            except asyncio.CancelledError:
                raise
            except Exception as error:  # the store away, say: try again, less and less often
                failures += 1
                wait = min(REFRESH_SECONDS * 2 ** (failures - 1), STEP_BACKOFF_CAP_SECONDS)
                log.warning(
                    "webhook %s: %s; trying again in %.0f s",
                    self.subscription.id,
                    one_line(f"{type(error).__name__}: {error}"),
                    wait,
                )
                log.debug("webhook %s: step failed", self.subscription.id, exc_info=True)
                await self._pause(wait)

    async def _step(self) -> None:
        worker = self.worker
        subscription = self.subscription
        if not worker.leases.holds(subscription.id):
            await self._pause(REFRESH_SECONDS)
            return
        # Read at every step (one lookup by id): a removed subscription sends nothing more,
        # and a new holder goes on from wherever the previous one left it.
        cursor = await load_cursor(worker.store, subscription.id)
        if cursor is None:  # removed: the worker stops this runner at its next refresh
            await self._pause(REFRESH_SECONDS)
            return
        if self.url_problem is not None:
            await self._report_bad_url(cursor, self.url_problem)
            await self._pause(POLL_SECONDS)
            return
        if self.events:
            self.woken.clear()
            await self._send_events()
        if cursor.retry_at is not None:
            wait = (cursor.retry_at - utcnow()).total_seconds()
            if wait > 0:
                await self._pause(min(wait, REFRESH_SECONDS))
                return
        # Cleared before the head is read: a wake-up from now on is not missed.
        self.woken.clear()
        head = await worker.store.last_seq(subscription.forum_id)
        if cursor.seq >= head:
            # An escalation event to try again is tried after a backoff, not a whole poll.
            wait = worker.settings.webhook_backoff_seconds if self.events else POLL_SECONDS
            await self._pause(wait, wakeable=True)
            return
        lines = await worker.store.history(
            subscription.forum_id,
            after_seq=cursor.seq,
            up_to_seq=min(head, cursor.seq + CHUNK_LINES),
        )
        passed_over = False
        for line in lines:
            if not await self.wanted(line):
                cursor.seq = line.seq
                passed_over = True
                continue
            if passed_over:
                await self._save(cursor)
                passed_over = False
            if worker.stopping.is_set() or not worker.leases.holds(subscription.id):
                return
            if not await self._deliver(cursor, line):
                return  # to be retried at cursor.retry_at
        if passed_over:
            await self._save(cursor)

    async def _report_bad_url(self, cursor: Cursor, problem: str) -> None:
        """Once per holder: a warning, and the reason on the cursor (``yoke webhook list``).

        Nothing is sent, and no line is dead-lettered: a letter per line would only repeat this
        one reason (the operator replaces the subscription; its lines stay in the forum)."""
        if self._url_reported:
            return
        error = f"invalid webhook URL: {problem}; nothing is sent (remove it and add a valid one)"
        log.warning("webhook %s: %s", self.subscription.id, error)
        cursor.failing_since = cursor.failing_since or utcnow()
        cursor.last_error, cursor.retry_at = error, None
        await self._save(cursor)
        self._url_reported = True

    async def _pause(self, seconds: float, *, wakeable: bool = False) -> None:
        waits = [asyncio.ensure_future(self.worker.stopping.wait())]
        if wakeable:
            waits.append(asyncio.ensure_future(self.woken.wait()))
        try:
            await asyncio.wait(waits, timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiting in waits:
                waiting.cancel()

    async def wanted(self, line: Message) -> bool:
        """Whether ``line`` is POSTed (else the cursor passes over it). A subclass (an A2A
        task's push, services/gateway/a2a/push.py) narrows it."""
        return deliverable(line)

    def http(self) -> httpx.AsyncClient:
        """The client POSTs go through: the operator's URL as set; an outsider's (a task's
        push) through the guard."""
        return self.worker.outsider_http if self.subscription.task_id else self.worker.http

    def headers(self) -> dict[str, str]:
        """Headers of the receiver's own beside the mesh's (a push config's authentication);
        the mesh's signature headers win over them."""
        return {}

    def body(self, delivery: str, line: Message) -> bytes:
        """What is POSTed for ``line`` (signed as it is); a subclass shapes its own."""
        subscription = self.subscription
        return (
            Delivery(
                delivery_id=delivery,
                subscription_id=subscription.id,
                forum_id=subscription.forum_id,
                message=line.seen_outside(),
            )
            .model_dump_json(exclude_none=True)
            .encode()
        )

    async def _post(self, delivery: str, body: bytes) -> tuple[int | None, str, bool]:
        """One signed POST of ``body``: its status (None: no answer), what went wrong, and
        whether it was refused before it was sent (an outsider's URL to an inside address)."""
        subscription = self.subscription
        # Signed with the body: a receiver refuses a copy captured and sent again later.
        timestamp = str(int(time.time()))
        headers = {
            **self.headers(),
            "Content-Type": "application/json",
            "User-Agent": "yoke-webhooks/1",
            TIMESTAMP_HEADER: timestamp,
            SIGNATURE_HEADER: sign(subscription.secret, body, timestamp),
            DELIVERY_HEADER: delivery,
        }
        status: int | None = None
        forbidden = False
        timeout = self.worker.settings.webhook_timeout_seconds
        try:
            # The whole exchange is bounded (not each read), and the answer's body is not read.
            async with (
                asyncio.timeout(timeout),
                self.http().stream(
                    "POST", subscription.url, content=body, headers=headers, timeout=timeout
                ) as response,
            ):
                status = response.status_code
                error = f"HTTP {status} {response.reason_phrase}".strip()
        except (TimeoutError, httpx.TimeoutException):
            error = f"no answer within {timeout:g} s"
        except RefusedRequest as refused:  # an inside address: asking again changes nothing
            forbidden = True
            error = f"not sent: {one_line(str(refused))}"[:ERROR_CHARS]
        except httpx.HTTPError as failure:
            error = one_line(f"{type(failure).__name__}: {failure}")[:ERROR_CHARS]
        return status, error, forbidden

    async def _deliver(self, cursor: Cursor, line: Message) -> bool:
        """POST one line; True when the cursor moved past it (delivered, refused, dead)."""
        worker = self.worker
        subscription = self.subscription
        settings = worker.settings
        delivery = delivery_id(subscription.id, line.id)
        started = time.perf_counter()
        status, error, forbidden = await self._post(delivery, self.body(delivery, line))
        elapsed = time.perf_counter() - started
        now = utcnow()
        if status is not None and 200 <= status < 300:
            ATTEMPT_SECONDS.labels("delivered").observe(elapsed)
            DELIVERIES.labels("delivered").inc()
            DELIVERY_LAG_SECONDS.observe(max((now - line.created_at).total_seconds(), 0.0))
            self._move_past(cursor, line, failing=False)
            await self._save(cursor)
            return True
        retryable = not forbidden and (status is None or status >= 500 or status in (408, 429))
        if not retryable:
            ATTEMPT_SECONDS.labels("refused").observe(elapsed)
            DELIVERIES.labels("refused").inc()
            await self._dead_letter(cursor, line, f"refused: {error}", status, 1)
            self._move_past(cursor, line, failing=False)
            await self._save(cursor)
            return True
        failing_since = cursor.failing_since or now
        attempts = cursor.attempts + 1
        window = timedelta(seconds=settings.webhook_retry_window_seconds)
        if now - failing_since >= window:
            ATTEMPT_SECONDS.labels("dead_lettered").observe(elapsed)
            DELIVERIES.labels("dead_lettered").inc()
            reason = f"failing for over {settings.webhook_retry_window_seconds:g} s: {error}"
            await self._dead_letter(cursor, line, reason, status, attempts)
            # The streak goes on: the next line gets one try, not another window.
            self._move_past(cursor, line, failing=True)
            cursor.failing_since, cursor.last_error = failing_since, error
            await self._save(cursor)
            return True
        ATTEMPT_SECONDS.labels("retried").observe(elapsed)
        DELIVERIES.labels("retried").inc()
        backoff = min(
            settings.webhook_backoff_seconds * 2 ** (attempts - 1),
            settings.webhook_backoff_cap_seconds,
        )
        # The last try falls at the end of the window, not a whole backoff past it.
        retry_at = min(now + timedelta(seconds=backoff), failing_since + window)
        cursor.failing_since, cursor.attempts, cursor.retry_at = failing_since, attempts, retry_at
        cursor.last_error = error
        # Said before it is kept: an attempt the store counts has always been logged.
        log.warning(
            "webhook %s: %s for line %s (attempt %d); again in %.1f s",
            subscription.id,
            error,
            line.id,
            attempts,
            (retry_at - now).total_seconds(),
        )
        await self._save(cursor)
        return False

    def _move_past(self, cursor: Cursor, line: Message, *, failing: bool) -> None:
        cursor.seq = line.seq
        cursor.attempts = 0
        cursor.retry_at = None
        if not failing:
            cursor.failing_since = None
            cursor.last_error = None

    async def _dead_letter(
        self, cursor: Cursor, line: Message, reason: str, status: int | None, attempts: int
    ) -> None:
        subscription = self.subscription
        letter = DeadLetter(
            id=delivery_id(subscription.id, line.id),
            subscription_id=subscription.id,
            forum_id=subscription.forum_id,
            message_id=line.id,
            seq=line.seq,
            # Letters are shown to the forum's tokens (the console): the receiver's origin only.
            url=shown_url(subscription.url),
            reason=redact(reason.replace(subscription.url, shown_url(subscription.url)))[
                :ERROR_CHARS
            ],
            status=status,
            attempts=attempts,
        )
        await self.worker.store.insert_if_absent(
            collection(self.worker.store, DEAD_LETTERS), letter.to_document()
        )
        await trim_dead_letters(
            self.worker.store, subscription.id, self.worker.settings.webhook_dead_letters_kept
        )
        log.warning(
            "webhook %s: line %s dead-lettered: %s", subscription.id, line.id, one_line(reason)
        )

    async def _save(self, cursor: Cursor) -> None:
        """The cursor, written by its one writer (this lease's holder) as a whole.

        Not once the lease is gone (a POST may outlast it): another replica holds the
        subscription by then, and this older cursor would move its progress back (it would
        send its lines again, after later ones)."""
        if not self.worker.leases.holds(self.subscription.id):
            return
        fields = cursor.model_dump(mode="python", by_alias=True, exclude={"id"})
        await collection(self.worker.store, CURSORS).update_one(
            {"_id": cursor.id}, {"$set": fields}
        )


def retention_rules(settings: Settings) -> list[Rule]:
    """Dead letters are kept for days (the console shows them), lapsed leases for hours."""
    return [
        Rule(
            "webhook dead letters",
            DEAD_LETTERS,
            "day",
            settings.retention_webhook_dead_letter_days,
        ),
        Rule("webhook leases", LEASES, "hour", settings.retention_lease_hours),
    ]


class WebhookWorker:
    """Every subscription of the mesh, delivered by whichever gateway process holds it."""

    def __init__(self, settings: Settings, store: Store) -> None:
        self.settings = settings
        self.store = store
        self.holder = new_id()
        self.leases = Leases(store, settings.webhook_lease_seconds, self.holder)
        self.stopping = asyncio.Event()
        self.http = httpx.AsyncClient(
            follow_redirects=False,
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=32),
        )
        # For URLs an outsider set (A2A pushes): checked at connect time (yoke.core.outbound).
        self.outsider_http = guarded_client(guard_for(settings.push_allowed_hosts))
        self.bus = Bus(settings.amqp_url, name="gateway-webhooks")
        self.runners: dict[str, tuple[SubscriptionRunner, asyncio.Task[None]]] = {}
        # Subscriptions kept elsewhere than `yoke webhook add`'s, and what delivers each: the
        # A2A door's task pushes (services/gateway/a2a/push.py) add theirs.
        self.sources: list[Callable[[], Awaitable[list[WebhookSubscription]]]] = []
        self.runner_for: Callable[[WebhookWorker, WebhookSubscription], SubscriptionRunner] = (
            SubscriptionRunner
        )
        self._by_forum: dict[str, list[SubscriptionRunner]] = {}
        self._keeper: asyncio.Task[None] | None = None
        self.retention = Sweep(
            store,
            retention_rules(settings),
            owner="gateway",
            every=settings.retention_sweep_seconds,
            lookback_days=settings.retention_lookback_days,
            batch=settings.retention_batch,
        )
        self._sweep: asyncio.Task[None] | None = None

    async def start(self) -> None:
        await ensure_webhook_indexes(self.store)
        await self.retention.ensure_indexes()
        await self.bus.connect(declare=False)
        channel = await self.bus.connection.channel()
        route = await channel.declare_exchange(
            ROUTE_EXCHANGE, aio_pika.ExchangeType.HEADERS, durable=True
        )
        await ensure_forum_exchange(self.settings.amqp_url)
        await route.bind(topology.FORUM_EXCHANGE, routing_key="#")
        # One queue per process: every replica hears every wake-up; holders act on them.
        queue = await channel.declare_queue(
            f"yoke.gateway.webhooks.{self.holder}", exclusive=True, auto_delete=True
        )
        wanted = topology.interest(MessagePosted.TYPE, kind="forum", role="agent")
        await queue.bind(route, routing_key="", arguments={"x-match": "all", **wanted})
        for event_type in ESCALATION_EVENTS:
            wanted = topology.interest(event_type, kind="forum")
            await queue.bind(route, routing_key="", arguments={"x-match": "all", **wanted})
        await queue.consume(self._on_event, no_ack=True)
        await self.refresh()
        self._keeper = asyncio.create_task(self._keep())
        self._sweep = asyncio.create_task(self.retention.run(self.stopping))

    def problems(self) -> list[str]:
        return [] if self.bus.is_connected else ["webhook connection down"]

    async def stop(self) -> None:
        """Stop delivering, then hand every held subscription over at once."""
        self.stopping.set()
        tasks = [task for _, task in self.runners.values()]
        if self._keeper is not None:
            tasks.append(self._keeper)
        if self._sweep is not None:
            tasks.append(self._sweep)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        # Bounded as a whole: with the store away each delete would wait out the driver's
        # server selection in turn; the others then wait out our leases instead.
        with contextlib.suppress(PyMongoError, TimeoutError):
            async with asyncio.timeout(RELEASE_SECONDS):
                for subscription_id in list(self.runners):
                    await self.leases.release(subscription_id)
        self.runners.clear()
        SUBSCRIPTIONS_HELD.set(0)
        await self.http.aclose()
        await self.outsider_http.aclose()
        await self.bus.close()

    async def _on_event(self, message: AbstractIncomingMessage) -> None:
        try:
            payload = Envelope.model_validate_json(message.body).parse()
        except ValueError:
            return  # not ours to judge: the services dead-letter malformed events
        if isinstance(payload, MessagePosted):
            self.store.observe_seq(payload.conversation_id, payload.seq)
            for runner in self._by_forum.get(payload.conversation_id, []):
                runner.wake()
        elif isinstance(payload, EscalationOpened | EscalationClaimed | EscalationEnded):
            for runner in self._by_forum.get(payload.forum_id, []):
                if runner.wants_events() and self.leases.holds(runner.subscription.id):
                    runner.offer_event(message.message_id or payload.escalation_id, payload)

    async def _keep(self) -> None:
        interval = min(REFRESH_SECONDS, self.settings.webhook_lease_seconds / 4)
        while not self.stopping.is_set():
            await asyncio.sleep(interval)
            try:
                await self.refresh()
            except Exception as error:
                log.warning("webhook subscriptions not refreshed: %r", error)

    async def refresh(self) -> None:
        """Follow added and removed subscriptions, and keep (or try for) their leases."""
        subscriptions = {s.id: s for s in await list_webhooks(self.store)}
        for source in self.sources:
            subscriptions.update((s.id, s) for s in await source())
        for gone in set(self.runners) - set(subscriptions):
            _, task = self.runners.pop(gone)
            task.cancel()
            await self.leases.release(gone)
        for subscription in subscriptions.values():
            if subscription.id not in self.runners:
                runner = self.runner_for(self, subscription)
                self.runners[subscription.id] = (runner, asyncio.create_task(runner.run()))
            if await self.leases.keep(subscription.id):
                self.runners[subscription.id][0].wake()
        self._by_forum = by_forum(runner for runner, _ in self.runners.values())
        SUBSCRIPTIONS_HELD.set(self.leases.held())


def one_line(text: str) -> str:
    """An error as one log line (a receiver's or a library's text may hold line breaks)."""
    return " ".join(text.split())


def by_forum(runners: Iterable[SubscriptionRunner]) -> dict[str, list[SubscriptionRunner]]:
    found: dict[str, list[SubscriptionRunner]] = {}
    for runner in runners:
        found.setdefault(runner.subscription.forum_id, []).append(runner)
    return found

"""Live forum streams: one queue per gateway process, bound per forum while someone watches it.

Events are wake-ups (docs/architecture.md, invariant 1): they may come late, twice or out of order,
and one lost to a reconnect is simply absent. So a stream keeps a cursor (the last seq it sent) and
sends lines strictly in seq order, reading from the store whatever it has not seen an event for: a
gap before an event, everything after ``Last-Event-ID`` on a reconnect, and the head now and then
while the forum is quiet. Every read is a bounded range by seq (invariant 11).

Only forum events reach the queue: it is bound on ``yoke.forum`` (what bridges read) by routing
key to the forum ids being watched
(``conversation.message.posted.<forum>``, ``agent.activity.<forum>``, ``agent.delta.<forum>``,
``tool.approval.requested.<forum>``, ``tool.approval.decided.<forum>``,
``escalation.opened|claimed|ended.<forum>``), so a monologue's lines can never appear on a
forum's stream.

Approvals (``tool.approval.requested``, ``tool.approval.decided``) are passed on as they come,
as ``approval`` events: like drafts they are not replayed (``GET .../approvals`` is what waits),
and a stream whose token may not decide gets each request without the tool's ``input`` (the one
piece of a monologue that leaves the mesh goes to the forum's approvers only). Escalations
(``escalation.opened``, ``escalation.claimed``, ``escalation.ended``) are passed on the same way,
each as an event of its own name: what the agent asked a person for and who came, never its
call or monologue (``GET /v1/escalations`` is what is open).

Drafts (``agent.delta``) are passed on as they come, never stored or replayed: a stream that
opens mid-answer sends the deltas from then on, and then the line. A slow client's deltas are
dropped before its lines are (they have a small budget of their own, so they never take a
line's room): a draft with a gap shows it by its ``index``, and the line replaces it anyway.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field

import aio_pika
from aio_pika.abc import (
    AbstractIncomingMessage,
    AbstractQueue,
    AbstractRobustChannel,
    AbstractRobustConnection,
)
from prometheus_client import Counter
from pydantic import ValidationError

from services.gateway.limits import REFUSALS
from yoke.bus import amqp_nodes, topology
from yoke.bus.broker import ensure_forum_exchange
from yoke.core.ids import new_id
from yoke.core.models import (
    AgentActivity,
    AgentDelta,
    ApprovalDecided,
    ApprovalRequested,
    Envelope,
    EscalationClaimed,
    EscalationEnded,
    EscalationOpened,
    Message,
    MessagePosted,
)
from yoke.store.database import Store

log = logging.getLogger(__name__)

# Events a slow stream may have waiting; past this it drops them and reads the store instead.
SUBSCRIBER_BACKLOG = 1000
# Deltas a slow stream may have waiting, and their text in characters; past either, it drops
# deltas (never a line: the line that follows replaces the draft). Invariant 14.
DELTA_BACKLOG = 200
DELTA_BACKLOG_CHARS = 1 << 18
# A quiet stream sends a comment this often (proxies keep it open) and checks the forum's head.
IDLE_SECONDS = 15.0
# Lines read from the store at once when a stream catches up.
CATCH_UP_LINES = 500
# Longest wait to drop a forum's bindings when its last stream ends.
UNBIND_SECONDS = 5.0
# What one stream may have waiting, in event bytes, and how long its bind may take, unless told
# (YOKE_GATEWAY_STREAM_BUFFER_BYTES, YOKE_GATEWAY_BIND_TIMEOUT_SECONDS).
BUFFER_BYTES = 4 * 1024 * 1024
BIND_SECONDS = 5.0


class BindTimeout(TimeoutError):
    """The broker did not bind a forum's events in time (say, it is in an alarm): no stream."""


DELTAS_DROPPED = Counter(
    "yoke_gateway_stream_deltas_dropped",
    "agent.delta events not sent to a stream whose client read too slowly",
)

EscalationEvent = EscalationOpened | EscalationClaimed | EscalationEnded
StreamItem = (
    MessagePosted
    | AgentActivity
    | AgentDelta
    | ApprovalRequested
    | ApprovalDecided
    | EscalationEvent
)
# The events a stream's queue is bound to, per forum.
STREAMED_EVENTS = (
    MessagePosted.TYPE,
    AgentActivity.TYPE,
    AgentDelta.TYPE,
    ApprovalRequested.TYPE,
    ApprovalDecided.TYPE,
    EscalationOpened.TYPE,
    EscalationClaimed.TYPE,
    EscalationEnded.TYPE,
)


@dataclass(eq=False)
class Subscriber:
    """One open stream's inbox, in arrival order; lines and deltas bounded apart (``offer``),
    and everything but deltas bounded in bytes (``max_bytes``)."""

    forum_id: str
    max_bytes: int = BUFFER_BYTES
    # None: the wake-up of a stream that overflowed (nothing else waits then).
    inbox: asyncio.Queue[StreamItem | None] = field(default_factory=asyncio.Queue)
    # Set when an event was dropped (the inbox was full): the stream reads the head instead.
    missed: bool = False
    # Set when the events waiting would pass ``max_bytes``: its reader is too slow, and the
    # stream ends with a last event saying so (the client resumes with Last-Event-ID).
    overflowed: bool = False
    waiting_events: int = 0
    waiting_bytes: int = 0
    waiting_deltas: int = 0
    waiting_delta_chars: int = 0
    # The byte sizes of the waiting events other than deltas, in their order.
    _sizes: deque[int] = field(default_factory=deque)

    def offer(self, item: StreamItem, size: int = 0) -> None:
        if self.overflowed:
            return
        if isinstance(item, AgentDelta):
            chars = len(item.text)
            if (
                self.waiting_deltas >= DELTA_BACKLOG
                or self.waiting_delta_chars + chars > DELTA_BACKLOG_CHARS
            ):
                DELTAS_DROPPED.inc()
                return
            self.waiting_deltas += 1
            self.waiting_delta_chars += chars
        elif self.waiting_events and self.waiting_bytes + size > self.max_bytes:
            # One event always fits (a line may be as big as the budget): a backlog never.
            self.overflowed = True
            REFUSALS.labels("slow_reader").inc()
            self._drop_waiting()  # nothing of it will be sent: free it now
            self.inbox.put_nowait(None)
            return
        elif self.waiting_events >= SUBSCRIBER_BACKLOG:
            self.missed = True
            return
        else:
            self.waiting_events += 1
            self.waiting_bytes += size
            self._sizes.append(size)
        self.inbox.put_nowait(item)

    def _drop_waiting(self) -> None:
        while not self.inbox.empty():
            self.inbox.get_nowait()
        self._sizes.clear()
        self.waiting_events = self.waiting_bytes = 0
        self.waiting_deltas = self.waiting_delta_chars = 0

    async def take(self) -> StreamItem | None:
        """The next item, in arrival order (None once the stream overflowed)."""
        item = await self.inbox.get()
        if item is None:
            return None
        if isinstance(item, AgentDelta):
            self.waiting_deltas -= 1
            self.waiting_delta_chars -= len(item.text)
        else:
            self.waiting_events -= 1
            self.waiting_bytes -= self._sizes.popleft()
        return item


class Hub:
    """The process's one events queue and the streams it feeds."""

    def __init__(self, amqp_url: str) -> None:
        self.amqp_url = amqp_url
        self.queue_name = f"yoke.gateway.stream.{new_id()}"
        self._connection: AbstractRobustConnection | None = None
        self._channel: AbstractRobustChannel | None = None
        self._queue: AbstractQueue | None = None
        self._subscribers: dict[str, set[Subscriber]] = {}
        # One lock per forum being bound or unbound (with how many wait on it), so one forum's
        # slow bind holds no other forum's streams; dropped when nobody waits.
        self._binding: dict[str, tuple[asyncio.Lock, int]] = {}
        self._unbinding: set[asyncio.Task[None]] = set()
        self._closing = False

    async def start(self) -> None:
        # A node list and amqps:// as every connection of the mesh takes them (yoke.bus.amqp_nodes).
        self._connection = await amqp_nodes.connect_robust(self.amqp_url, name="gateway-stream")
        channel = await self._connection.channel()
        assert isinstance(channel, aio_pika.RobustChannel)
        self._channel = channel
        # yoke.forum, not yoke.events: the gateway's own RabbitMQ user may read nothing that
        # carries a monologue (invariant 13), and may not declare it (ensure_forum_exchange).
        await ensure_forum_exchange(self.amqp_url)
        events = topology.FORUM_EXCHANGE
        # Exclusive: it lives and dies with this process (and is declared again, with its
        # bindings, by the robust connection after a reconnect).
        self._queue = await channel.declare_queue(self.queue_name, exclusive=True, auto_delete=True)
        self._events = events
        await self._queue.consume(self._on_event, no_ack=True)

    async def close(self) -> None:
        self._closing = True
        if self._connection is not None and not self._connection.is_closed:
            await self._connection.close()

    def problems(self) -> list[str]:
        connection = self._connection
        if connection is None or connection.is_closed or not connection.connected.is_set():
            return ["stream connection down"]
        if self._channel is None or self._channel.is_closed:
            return ["stream channel closed"]
        return []

    @contextlib.asynccontextmanager
    async def _forum_lock(self, forum_id: str) -> AsyncIterator[None]:
        lock, users = self._binding.get(forum_id, (asyncio.Lock(), 0))
        self._binding[forum_id] = (lock, users + 1)
        try:
            async with lock:
                yield
        finally:
            lock, users = self._binding[forum_id]
            if users > 1:
                self._binding[forum_id] = (lock, users - 1)
            else:
                del self._binding[forum_id]

    @contextlib.asynccontextmanager
    async def subscribe(
        self,
        forum_id: str,
        *,
        buffer_bytes: int = BUFFER_BYTES,
        bind_timeout: float = BIND_SECONDS,
    ) -> AsyncIterator[Subscriber]:
        """A subscriber for the forum's events, bound before this yields (so a head read after
        it misses nothing) and unbound when the forum's last stream ends. A bind that takes
        longer than ``bind_timeout`` raises :class:`BindTimeout` (what it bound is undone)."""
        subscriber = Subscriber(forum_id, max_bytes=buffer_bytes)
        async with self._forum_lock(forum_id):
            if not self._subscribers.get(forum_id):
                # Waited for, never cancelled: a cancelled AMQP call closes the whole channel
                # (aiormq), and every forum's stream would wait for it to be restored.
                binding = asyncio.ensure_future(self._bind(forum_id, bind=True))
                try:
                    done, _ = await asyncio.wait({binding}, timeout=bind_timeout)
                except asyncio.CancelledError:
                    # The stream went (its client, a revoked token) while the bind ran on:
                    # what it binds would stay, with nobody to unbind it.
                    self._unbind_later(forum_id, binding)
                    raise
                if not done:
                    self._unbind_later(forum_id, binding)
                    raise BindTimeout(
                        f"the broker did not bind the forum's events within {bind_timeout:g} s"
                    )
                binding.result()
            self._subscribers.setdefault(forum_id, set()).add(subscriber)
        try:
            yield subscriber
        finally:
            # Left at once, with no await a cancel could cut; the unbind (when it was the
            # forum's last stream) in the background: the stream is often cancelled as it
            # leaves (an A2A turn's follower once the end reached it, an MCP call at its
            # deadline), and an unbind cut short would leave the forum bound for ever.
            watchers = self._subscribers.get(forum_id, set())
            watchers.discard(subscriber)
            if not watchers:
                self._subscribers.pop(forum_id, None)
                self._unbind_later(forum_id)

    def _unbind_later(self, forum_id: str, binding: asyncio.Future[None] | None = None) -> None:
        """Unbind the forum in the background, once ``binding`` (a bind its stream stopped
        waiting for: too slow, or the stream went) is done, unless a stream watches it by then;
        under the forum's lock, so a new stream's bind comes after."""

        async def unbind() -> None:
            # Outside the lock: another stream of the forum tries its own bind meanwhile, and
            # answers at its own bound.
            if binding is not None:
                await asyncio.gather(binding, return_exceptions=True)
            async with self._forum_lock(forum_id):
                if not self._subscribers.get(forum_id):
                    await self._unbind_quietly(forum_id)

        task = asyncio.create_task(unbind())
        self._unbinding.add(task)
        task.add_done_callback(self._unbinding.discard)

    async def _unbind_quietly(self, forum_id: str) -> None:
        """Drop the forum's bindings unless the hub is closing: the exclusive queue goes with the
        connection anyway, and a robust channel's call after its connection closed waits for a
        reconnect that never comes (a stream's cleanup at shutdown would hang the process)."""
        if self._closing:
            return
        with contextlib.suppress(Exception):
            async with asyncio.timeout(UNBIND_SECONDS):
                await self._bind(forum_id, bind=False)

    async def _bind(self, forum_id: str, *, bind: bool) -> None:
        assert self._queue is not None
        for event_type in STREAMED_EVENTS:
            key = topology.routing_key(event_type, forum_id)
            if bind:
                await self._queue.bind(self._events, routing_key=key)
            else:
                await self._queue.unbind(self._events, routing_key=key)

    def watching(self, forum_id: str) -> int:
        return len(self._subscribers.get(forum_id, ()))

    async def _on_event(self, message: AbstractIncomingMessage) -> None:
        try:
            payload = Envelope.model_validate_json(message.body).parse()
        except (ValidationError, ValueError) as error:
            log.warning("unreadable event on the stream queue: %s", error)
            return
        if isinstance(payload, MessagePosted):
            forum_id = payload.conversation_id
        elif isinstance(
            payload,
            AgentActivity | AgentDelta | ApprovalRequested | ApprovalDecided | EscalationEvent,
        ):
            forum_id = payload.forum_id
        else:
            return
        for subscriber in self._subscribers.get(forum_id, ()):
            subscriber.offer(payload, len(message.body))


def sse(event: str, data: str, event_id: int | None = None) -> bytes:
    """One Server-Sent Event (``data`` is one line of JSON)."""
    head = f"id: {event_id}\n" if event_id is not None else ""
    return f"{head}event: {event}\ndata: {data}\n\n".encode()


def message_event(message: Message) -> bytes:
    # The store keeps milliseconds: a line from an event looks exactly as it does when read.
    created = message.created_at
    stored = message.seen_outside().model_copy(
        update={"created_at": created.replace(microsecond=created.microsecond // 1000 * 1000)}
    )
    return sse("message", json.dumps(stored.to_wire(), separators=(",", ":")), message.seq)


def activity_event(activity: AgentActivity) -> bytes:
    body = {"agentActorId": activity.agent_actor_id, "state": activity.state}
    return sse("activity", json.dumps(body, separators=(",", ":")))


def delta_event(delta: AgentDelta) -> bytes:
    # No id: Last-Event-ID stays a line's seq (deltas are not replayed after a reconnect).
    return sse("delta", json.dumps(delta.to_wire(), separators=(",", ":")))


def slow_reader_event(max_bytes: int) -> bytes:
    """The last event of a stream whose reader fell behind by more than ``max_bytes``."""
    body = {
        "error": f"the stream fell more than {max_bytes} bytes behind its reader and is closed; "
        "reconnect with Last-Event-ID to resume",
        "code": "slow_reader",
    }
    return sse("closed", json.dumps(body, separators=(",", ":")))


def approval_event(approval: ApprovalRequested | ApprovalDecided, *, with_input: bool) -> bytes:
    """``type`` says which (``tool.approval.requested`` or ``tool.approval.decided``); no id, as
    for deltas: Last-Event-ID counts lines only."""
    body = {"type": approval.TYPE, **approval.to_wire()}
    if not with_input:
        body.pop("input", None)
    return sse("approval", json.dumps(body, separators=(",", ":")))


def escalation_event(escalation: EscalationEvent) -> bytes:
    """An event named by its type (``escalation.opened``, ``.claimed``, ``.ended``); no id, as
    for approvals. Its payload names the agent, its reason and who claimed: nothing of the
    monologue the agent asked from."""
    return sse(escalation.TYPE, json.dumps(escalation.to_wire(), separators=(",", ":")))


class ForumStream:
    """The events of one stream, in seq order from ``cursor`` on; approval requests carry the
    tool's input only when ``approver`` (the stream's token may decide)."""

    def __init__(
        self, store: Store, subscriber: Subscriber, cursor: int, *, approver: bool = False
    ) -> None:
        self.store = store
        self.subscriber = subscriber
        self.forum_id = subscriber.forum_id
        self.cursor = cursor
        self.approver = approver

    async def lines_up_to(self, seq: int) -> AsyncIterator[bytes]:
        """Every line after the cursor up to ``seq``, from the store, in bounded reads."""
        while self.cursor < seq:
            upper = min(seq, self.cursor + CATCH_UP_LINES)
            lines = await self.store.history(self.forum_id, after_seq=self.cursor, up_to_seq=upper)
            for line in lines:
                if line.seq > self.cursor:
                    yield message_event(line)
                    self.cursor = line.seq
            self.cursor = max(self.cursor, upper)  # a hole (never expected): do not spin on it

    async def catch_up(self) -> AsyncIterator[bytes]:
        """Whatever the store holds past the cursor (its head found by indexed lookups)."""
        self.subscriber.missed = False
        async for chunk in self.lines_up_to(await self.store.last_seq(self.forum_id)):
            yield chunk

    async def events(self) -> AsyncGenerator[bytes]:
        yield b"retry: 2000\n\n"
        async for chunk in self.catch_up():
            yield chunk
        while True:
            try:
                item = await asyncio.wait_for(self.subscriber.take(), IDLE_SECONDS)
            except TimeoutError:
                yield b": keepalive\n\n"
                async for chunk in self.catch_up():
                    yield chunk
                continue
            if item is None:
                # Invariant 14: a reader this slow is not waited for with the forum's events in
                # memory. It is told why, and resumes with Last-Event-ID from the store.
                yield slow_reader_event(self.subscriber.max_bytes)
                return
            if isinstance(item, AgentActivity):
                yield activity_event(item)
            elif isinstance(item, AgentDelta):
                yield delta_event(item)
            elif isinstance(item, ApprovalRequested | ApprovalDecided):
                yield approval_event(item, with_input=self.approver)
            elif isinstance(item, EscalationEvent):
                yield escalation_event(item)
            elif item.seq == self.cursor + 1:
                yield message_event(item.message)
                self.cursor = item.seq
            elif item.seq > self.cursor:
                # Earlier lines' events are late or lost: send them from the store first.
                async for chunk in self.lines_up_to(item.seq):
                    yield chunk
            if isinstance(item, MessagePosted):
                # The head it shows saves the store lookups of the next head read.
                self.store.observe_seq(self.forum_id, item.seq)
            if self.subscriber.missed:
                async for chunk in self.catch_up():
                    yield chunk

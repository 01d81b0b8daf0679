"""An outside system's view of the mesh: submit lines through ``yoke.commands``, watch replies.

This is all a bridge needs (docs/publishing.md); the CLI's ``post`` and ``chat`` are built on it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Literal

import aio_pika
from aio_pika.abc import AbstractChannel, AbstractQueue, AbstractRobustConnection

from yoke.bus import amqp_nodes, topology
from yoke.bus.amqp_nodes import amqp_user
from yoke.core import tracing
from yoke.core.ids import new_id
from yoke.core.models import (
    CommandAuthor,
    Envelope,
    EscalationAction,
    Message,
    MessagePosted,
    SubmitApproval,
    SubmitEscalation,
    SubmitMessage,
    SubmitReply,
)
from yoke.core.slash import STOP

# The line a person types in a forum to stop every agent there (see docs/using.md);
# ``yoke stop`` and the gateway's stop route submit exactly this for the person named.
STOP_LINE = STOP


@contextlib.asynccontextmanager
async def _bounded(seconds: float | None, what: str) -> AsyncIterator[None]:
    """No bound when ``seconds`` is None; else a TimeoutError that says ``what`` did not happen."""
    if seconds is None:
        yield
        return
    try:
        async with asyncio.timeout(seconds):
            yield
    except TimeoutError as error:
        raise TimeoutError(f"{what} within {seconds:g} s") from error


class Client:
    def __init__(self, amqp_url: str, *, queue_prefix: str | None = None) -> None:
        self.amqp_url = amqp_url
        # The RabbitMQ user it connects as: every command says so in its user_id (the broker
        # verifies it, and the door names who speaks by it: docs/architecture.md, invariant 13).
        self.user = amqp_user(amqp_url)
        # Its reply (and watch) queues are named by this: a bridge NAME may declare only
        # ``bridge.NAME.*`` (the default), the HTTP gateway ``yoke.gateway.replies.*``, and the
        # door answers only on a queue its publisher owns
        # (yoke.coordination.speakers.DoorUsers.may_answer).
        self.queue_prefix = queue_prefix or topology.bridge_queue_prefix(self.user)
        self._connection: AbstractRobustConnection | None = None
        self._channel: AbstractChannel | None = None
        self._replies: AbstractQueue | None = None
        self._waiting: dict[str, asyncio.Future[SubmitReply]] = {}

    async def __aenter__(self) -> Client:
        self._connection = await amqp_nodes.connect_robust(self.amqp_url)
        try:
            self._channel = await self._connection.channel(publisher_confirms=True)
            self._replies = await self._channel.declare_queue(
                self.queue_prefix + new_id(), exclusive=True, auto_delete=True
            )
            await self._replies.consume(self._on_reply, no_ack=True)
        except BaseException:
            # No __aexit__ follows a failed __aenter__: a refused reply queue (a user without
            # ``bridge.*``) would leave the connection's tasks to die with the event loop.
            await self._connection.close()
            raise
        return self

    @property
    def connected(self) -> bool:
        """Connected right now (a robust connection that is reconnecting is not)."""
        connection = self._connection
        return (
            connection is not None
            and not connection.is_closed
            and connection.connected.is_set()
            and not connection.reconnecting
        )

    async def __aexit__(self, *_: object) -> None:
        if self._connection is not None:
            await self._connection.close()

    async def _on_reply(self, message: aio_pika.abc.AbstractIncomingMessage) -> None:
        future = self._waiting.pop(message.correlation_id or "", None)
        if future is not None and not future.done():
            future.set_result(SubmitReply.model_validate_json(message.body))

    async def submit(
        self,
        forum_id: str,
        text: str,
        *,
        external_id: str,
        display_name: str,
        idempotency_key: str | None = None,
        reply_timeout: float = 30.0,
        hold_granted: bool = False,
    ) -> SubmitReply:
        """Publish ``conversation.message.submit`` and wait for the door's answer
        (``hold_granted``: a ``/takeover`` or ``/handback`` the door takes from the mesh's own
        users whoever the person is)."""
        command = SubmitMessage(
            conversation_id=forum_id,
            author=CommandAuthor(external_id=external_id, display_name=display_name),
            text=text,
            idempotency_key=idempotency_key or new_id(),
            hold_granted=hold_granted,
        )
        return await self.submit_raw(
            command.model_dump_json(exclude_none=True).encode(), reply_timeout
        )

    async def submit_raw(
        self,
        body: bytes,
        reply_timeout: float = 30.0,
        *,
        routing_key: str = topology.SUBMIT_COMMAND,
        user_id: str | None = None,
        publish_timeout: float | None = None,
    ) -> SubmitReply:
        """Publish any body as a command (a line by default; bridges, the gateway's other
        commands, and tests of bad input) and wait for the door's answer. ``user_id``: this
        connection's RabbitMQ user (the default), which the broker verifies; the door rejects
        a command without one (``missing_user_id``).
        ``publish_timeout`` bounds the publish itself: a broker under a memory or disk alarm
        stops reading publishes, and its confirm never comes (TimeoutError saying so)."""
        assert self._channel is not None and self._replies is not None
        correlation_id = new_id()
        future: asyncio.Future[SubmitReply] = asyncio.get_running_loop().create_future()
        self._waiting[correlation_id] = future
        # Forgotten however this ends: a publish that raises too (the gateway's every POST comes
        # here, so a broker away must not leave one waiting future per request behind).
        try:
            async with _bounded(publish_timeout, "the broker did not take the command"):
                exchange = await self._channel.get_exchange(topology.COMMANDS_EXCHANGE)
                await exchange.publish(
                    aio_pika.Message(
                        body,
                        content_type="application/json",
                        correlation_id=correlation_id,
                        reply_to=self._replies.name,
                        message_id=correlation_id,
                        delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
                        user_id=user_id or self.user,
                        # The caller's span (the gateway's request), which the door continues.
                        headers=tracing.inject({}),
                    ),
                    routing_key=routing_key,
                )
            return await asyncio.wait_for(future, reply_timeout)
        finally:
            self._waiting.pop(correlation_id, None)

    async def decide(
        self,
        call_id: str,
        decision: Literal["approve", "reject"],
        *,
        external_id: str,
        display_name: str,
        reason: str | None = None,
        user_id: str | None = None,
        reply_timeout: float = 30.0,
        publish_timeout: float | None = None,
    ) -> SubmitReply:
        """Publish ``tool.approval.submit`` as RabbitMQ user ``user_id`` (this connection's, the
        default) for the person named, and wait for the door's answer (the first decision
        stands)."""
        command = SubmitApproval(
            call_id=call_id,
            decision=decision,
            reason=reason,
            by=CommandAuthor(external_id=external_id, display_name=display_name),
        )
        return await self.submit_raw(
            command.model_dump_json(exclude_none=True).encode(),
            reply_timeout,
            routing_key=topology.APPROVAL_COMMAND,
            user_id=user_id,
            publish_timeout=publish_timeout,
        )

    async def submit_escalation(
        self,
        forum_id: str,
        escalation_id: str,
        action: EscalationAction,
        by: CommandAuthor | None = None,
        *,
        user_id: str | None = None,
        reply_timeout: float = 30.0,
        publish_timeout: float | None = None,
    ) -> SubmitReply:
        """Publish ``escalation.submit`` (claim, cancel or timeout) and wait for the door's
        answer: the first decision stands, and a claim's answer names its ``/takeover`` line."""
        command = SubmitEscalation(
            conversation_id=forum_id, escalation_id=escalation_id, action=action, by=by
        )
        return await self.submit_raw(
            command.model_dump_json(exclude_none=True).encode(),
            reply_timeout,
            routing_key=topology.ESCALATION_COMMAND,
            user_id=user_id,
            publish_timeout=publish_timeout,
        )

    async def watch(self, conversation_id: str) -> AsyncIterator[Message]:
        """Lines posted to a forum from now on, as they are published (from yoke.forum, all a
        bridge may read)."""
        assert self._channel is not None
        queue = await self._channel.declare_queue(
            self.queue_prefix + new_id(), exclusive=True, auto_delete=True
        )
        await queue.bind(
            topology.FORUM_EXCHANGE,
            routing_key=topology.routing_key(MessagePosted.TYPE, conversation_id),
        )
        async with queue.iterator(no_ack=True) as deliveries:
            async for delivery in deliveries:
                payload = Envelope.model_validate_json(delivery.body).parse()
                if isinstance(payload, MessagePosted):
                    yield payload.message

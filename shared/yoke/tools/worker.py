"""Serve a worker tool from Python: take its calls off ``yoke.tool.NAME``, answer each at the door.

The contract (docs/tools.md, "Tool workers") needs nothing but an AMQP client; this is
that contract written once with aio-pika, for workers in Python. Register the tool first, then
connect as the user ``yoke tools add-worker`` made::

    import asyncio

    from yoke.core.models import ToolCallRequest
    from yoke.tools.worker import serve

    async def shout(call: ToolCallRequest) -> str:
        return str(call.input["text"]).upper()  # raise to answer with an error

    # yoke tools add-worker shout --schema shout.json --description "Upper-cases a text"
    asyncio.run(serve("amqp://tool-shout:PASSWORD@127.0.0.1:5672/", "shout", shout))

Each call is acknowledged only once the door has accepted or rejected its answer, so a worker
that dies mid-call leaves it to be delivered again (to it or to another worker of the tool):
a handler must tolerate a repeat, keyed by ``call.idempotency_key``. A call past its deadline is
not run (the mesh has ended it already), and a handler still running at the deadline is
cancelled. The connection is made again, with capped backoff, whenever it is lost.

This module stands on the wire contract alone (models, topology names, aio-pika): a worker
runs beside the mesh, not inside it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from urllib.parse import unquote, urlsplit

import aio_pika
from aio_pika.abc import (
    AbstractChannel,
    AbstractConnection,
    AbstractExchange,
    AbstractIncomingMessage,
)
from aio_pika.exceptions import AMQPError, ProbableAuthenticationError
from pydantic import ValidationError

from yoke.bus import topology
from yoke.core import tracing
from yoke.core.models import SubmitReply, SubmitToolResult, ToolCallRequest

log = logging.getLogger(__name__)

# RabbitMQ's direct reply-to: the worker's user may declare no queue, so the door answers
# into this pseudo-queue of the channel that published (consumed without acks, on that channel).
DIRECT_REPLY_TO = "amq.rabbitmq.reply-to"

Handler = Callable[[ToolCallRequest], Awaitable[str]]

RECONNECT_FIRST_SECONDS = 0.5
RECONNECT_MAX_SECONDS = 30.0


class _DoorClient:
    """The worker's side of the door: one channel that submits answers to ``yoke.commands``
    and hears the door's replies."""

    def __init__(self, channel: AbstractChannel, commands: AbstractExchange, user_id: str) -> None:
        self.channel = channel
        self._commands = commands
        self._user_id = user_id
        self._waiting: dict[str, asyncio.Future[SubmitReply]] = {}

    @classmethod
    async def open(cls, connection: AbstractConnection, user_id: str) -> _DoorClient:
        channel = await connection.channel(publisher_confirms=True)
        commands = await channel.get_exchange(topology.COMMANDS_EXCHANGE, ensure=False)
        client = cls(channel, commands, user_id)
        replies = await channel.get_queue(DIRECT_REPLY_TO, ensure=False)
        # Direct reply-to is consumed before the first publish that names it, without acks.
        await replies.consume(client._on_reply, no_ack=True)
        return client

    async def _on_reply(self, message: AbstractIncomingMessage) -> None:
        future = self._waiting.pop(message.correlation_id or "", None)
        if future is None or future.done():
            return
        try:
            future.set_result(SubmitReply.model_validate_json(message.body))
        except ValidationError as error:
            future.set_exception(error)

    async def submit(self, answer: SubmitToolResult, reply_timeout: float) -> SubmitReply:
        """Publish the answer (confirmed by the broker) and wait for the door's reply."""
        correlation_id = uuid.uuid4().hex
        future: asyncio.Future[SubmitReply] = asyncio.get_running_loop().create_future()
        self._waiting[correlation_id] = future
        try:
            await self._commands.publish(
                aio_pika.Message(
                    answer.model_dump_json(exclude_none=True).encode(),
                    content_type="application/json",
                    delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
                    message_id=correlation_id,
                    correlation_id=correlation_id,
                    reply_to=DIRECT_REPLY_TO,
                    # RabbitMQ refuses a user_id other than the connection's own: this is how
                    # the door knows which tool's worker answers (invariant 13).
                    user_id=self._user_id,
                    # The call's trace goes on at the door, and in the step its result wakes.
                    headers=tracing.inject({}),
                ),
                routing_key=topology.TOOL_RESULT_COMMAND,
                timeout=reply_timeout,
            )
            return await asyncio.wait_for(future, reply_timeout)
        finally:
            self._waiting.pop(correlation_id, None)


def _seconds_left(deadline: datetime) -> float:
    if deadline.tzinfo is None:
        deadline = deadline.replace(tzinfo=UTC)
    return (deadline - datetime.now(UTC)).total_seconds()


async def _run_handler(handler: Handler, call: ToolCallRequest) -> SubmitToolResult | None:
    """The handler's answer, an error answer if it raised, or None if the deadline came first."""
    try:
        async with asyncio.timeout(_seconds_left(call.deadline)) as budget:
            output = await handler(call)
        return SubmitToolResult(call_id=call.call_id, output=output)
    except TimeoutError as error:
        if budget.expired():
            return None
        return _error_answer(call, error)
    except Exception as error:
        return _error_answer(call, error)


def _error_answer(call: ToolCallRequest, error: Exception) -> SubmitToolResult:
    log.warning("tool %s: call %s failed: %r", call.tool, call.call_id, error)
    text = str(error) or type(error).__name__
    try:
        return SubmitToolResult(call_id=call.call_id, output=text, is_error=True)
    except ValidationError:  # an error text the store cannot hold
        return SubmitToolResult(call_id=call.call_id, output=type(error).__name__, is_error=True)


async def _answer_call(
    delivery: AbstractIncomingMessage, door: _DoorClient, handler: Handler, reply_timeout: float
) -> None:
    try:
        call = ToolCallRequest.model_validate_json(delivery.body)
    except ValidationError as error:
        log.error("dropping a call that is not a call (%s): %s", delivery.message_id, error)
        await delivery.reject(requeue=False)
        return
    # The call message carries the step's traceparent: the worker's work joins its trace.
    with tracing.span(
        f"execute_tool {call.tool}",
        kind="consumer",
        parent=delivery.headers or {},
        attributes={
            "gen_ai.operation.name": "execute_tool",
            "gen_ai.tool.name": call.tool,
            "gen_ai.tool.call.id": call.call_id,
            "yoke.tool.source": "worker",
        },
    ):
        await _run_and_answer(call, delivery, door, handler, reply_timeout)


async def _run_and_answer(
    call: ToolCallRequest,
    delivery: AbstractIncomingMessage,
    door: _DoorClient,
    handler: Handler,
    reply_timeout: float,
) -> None:
    if _seconds_left(call.deadline) <= 0:
        log.info("tool %s: call %s is past its deadline; not run", call.tool, call.call_id)
        await delivery.ack()
        return
    answer = await _run_handler(handler, call)
    if answer is None:
        log.warning("tool %s: call %s ran past its deadline; cancelled", call.tool, call.call_id)
        await delivery.ack()
        return
    # Sent again while the door is silent (a repeat is answered "duplicate"), until the call's
    # deadline has passed by a reply timeout: by then the mesh has ended the call itself.
    delay = RECONNECT_FIRST_SECONDS
    while True:
        try:
            reply = await door.submit(answer, reply_timeout)
            break
        except TimeoutError:
            if _seconds_left(call.deadline) < -reply_timeout:
                log.error("tool %s: no reply from the door for call %s", call.tool, call.call_id)
                await delivery.ack()
                return
            log.warning("tool %s: no reply yet for call %s; sending again", call.tool, call.call_id)
            await asyncio.sleep(delay)
            delay = min(delay * 2, RECONNECT_MAX_SECONDS)
    if reply.status == "rejected":
        log.warning(
            "tool %s: the answer to call %s was rejected (%s): %s",
            call.tool,
            call.call_id,
            reply.code,
            reply.error,
        )
    elif reply.duplicate:
        log.info("tool %s: call %s was answered already", call.tool, call.call_id)
    await delivery.ack()


async def _serve_connected(
    connection: AbstractConnection,
    user_id: str,
    tool: str,
    handler: Handler,
    stopping: asyncio.Event,
    prefetch: int,
    reply_timeout: float,
    consuming: asyncio.Event,
) -> None:
    """Consume until ``stopping`` (then finish the calls in hand) or until something is lost."""
    door = await _DoorClient.open(connection, user_id)
    calls = await connection.channel()
    await calls.set_qos(prefetch_count=prefetch)
    # Passive: the mesh declares the queue (a worker may not, and a declaration with other
    # arguments would be refused anyway).
    queue = await calls.declare_queue(topology.tool_queue(tool), passive=True)
    cancelled = asyncio.Event()
    # A consumer the broker cancels (the queue deleted, a quorum leader gone) is not consumed
    # again by aio-pika: reconnect instead.
    (await calls.get_underlay_channel()).on_consumer_cancel_callbacks.add(
        lambda _frame: cancelled.set()
    )
    in_hand: set[asyncio.Task[object]] = set()

    async def on_call(delivery: AbstractIncomingMessage) -> None:
        task = asyncio.current_task()
        assert task is not None
        in_hand.add(task)
        try:
            await _answer_call(delivery, door, handler, reply_timeout)
        finally:
            in_hand.discard(task)

    tag = await queue.consume(on_call)
    consuming.set()
    log.info("tool %s: serving %s as %s", tool, queue.name, user_id)
    watched = [
        asyncio.ensure_future(stopping.wait()),
        asyncio.ensure_future(cancelled.wait()),
        asyncio.ensure_future(connection.closed()),
        asyncio.ensure_future(calls.closed()),
        asyncio.ensure_future(door.channel.closed()),
    ]
    try:
        await asyncio.wait(watched, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiter in watched:
            waiter.cancel()
    if not stopping.is_set():
        # The broker gives the calls in hand to another consumer: stop working on them here.
        for task in in_hand:
            task.cancel()
        raise ConnectionError(f"lost the consumer of {queue.name} or its channels")
    await queue.cancel(tag)
    if in_hand:
        await asyncio.gather(*in_hand, return_exceptions=True)


async def serve(
    amqp_url: str,
    tool: str,
    handler: Handler,
    *,
    stopping: asyncio.Event | None = None,
    prefetch: int = 8,
    reply_timeout: float = 30.0,
) -> None:
    """Answer ``tool``'s calls with ``handler`` until ``stopping`` is set (forever if None).

    ``amqp_url`` names the tool's user (``tool-NAME``) and the mesh's vhost; ``prefetch`` is
    how many calls this worker runs at once. A refused login (a wrong password, the user
    removed) ends it with the broker's error; anything else (the broker away, the queue not
    declared yet or deleted) is waited out.
    """
    stopping = stopping or asyncio.Event()
    user_id = unquote(urlsplit(amqp_url).username or "guest")
    # As yoke-tool-NAME when OTEL_EXPORTER_OTLP_ENDPOINT is set (or on the program's own
    # provider); shut down here only if it was set up here.
    traced_here = not tracing.enabled() and tracing.configure(f"tool-{tool}")
    try:
        await _serve(amqp_url, user_id, tool, handler, stopping, prefetch, reply_timeout)
    finally:
        if traced_here:
            await asyncio.to_thread(tracing.shutdown)


async def _serve(
    amqp_url: str,
    user_id: str,
    tool: str,
    handler: Handler,
    stopping: asyncio.Event,
    prefetch: int,
    reply_timeout: float,
) -> None:
    delay = RECONNECT_FIRST_SECONDS
    while not stopping.is_set():
        consuming = asyncio.Event()
        try:
            connection = await aio_pika.connect(amqp_url, timeout=10)
            async with connection:
                await _serve_connected(
                    connection,
                    user_id,
                    tool,
                    handler,
                    stopping,
                    prefetch,
                    reply_timeout,
                    consuming,
                )
            return
        except ProbableAuthenticationError:
            raise
        except (AMQPError, OSError, TimeoutError) as error:
            # OSError covers ConnectionError: the consumer or one of its channels lost.
            if consuming.is_set():
                delay = RECONNECT_FIRST_SECONDS  # it was serving: try again soon
            log.warning("tool %s: %r; connecting again in %.1f s", tool, error, delay)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stopping.wait(), delay)
        delay = min(delay * 2, RECONNECT_MAX_SECONDS)

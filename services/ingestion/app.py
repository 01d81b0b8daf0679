"""Ingestion's handlers.

- ``conversation.message.submit`` from ``yoke.commands``: validated, deduplicated by
  idempotency key, written to the forum as a human line (agentHops 0), answered on reply_to.
- ``tool.result.submit``: a worker's answer to a call waiting in the store.
- ``tool.approval.submit``: a person's decision on a call waiting for approval.
- ``escalation.submit``: a claim, cancel or timeout of an escalation, in its forum's lane
  (:mod:`services.ingestion.holds`, which also decides ``/takeover`` and ``/handback`` lines).
- forum ``conversation.message.posted``: copied into each joined agent's active monologue,
  authored by the forum author's external shadow actor, with routing meta.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable
from typing import Annotated, TypeVar

from aio_pika.abc import AbstractIncomingMessage
from pydantic import BeforeValidator, JsonValue, ValidationError

from services.ingestion.holds import EscalationDecisions, HoldDoor, HoldLine
from yoke.bus import topology
from yoke.bus.consumer import Malformed
from yoke.bus.dead_letters import count_dropped_letters
from yoke.coordination.speakers import DoorUsers, ForeignNamespace, token_namespace
from yoke.core import tracing
from yoke.core.errors import describe_validation_error
from yoke.core.ids import derive_id, submitted_line_id
from yoke.core.json_limits import MAX_BODY_DEPTH, nesting_depth
from yoke.core.metrics import COMMANDS, LINES_RATE_LIMITED
from yoke.core.models import (
    MAX_ID_CHARS,
    Actor,
    AgentForumJoined,
    CommandAuthor,
    KeptForum,
    Message,
    MessageMeta,
    SubmitApproval,
    SubmitEscalation,
    SubmitMessage,
    SubmitReply,
    SubmitToolResult,
    TextPart,
)
from yoke.core.slash import TAKEOVER, hold_command
from yoke.core.text import storable_input
from yoke.runtime.actor import ActorContext, ActorDefinition, ActorRuntime
from yoke.runtime.calls.answers import WorkerAnswers
from yoke.runtime.calls.approvals import Approvals
from yoke.runtime.calls.approvers import Approvers
from yoke.runtime.calls.repository import OpenCalls
from yoke.runtime.chain import carry_tail, copy_target
from yoke.runtime.instances import INGESTION, IngestionConfig, IngestionState
from yoke.runtime.join_config import FollowedForums
from yoke.runtime.joins import ensure_participant_id
from yoke.runtime.kept_forums import KeptForumRefused, KeptForums
from yoke.runtime.service import Service
from yoke.store.rate_limit import LineLimit, slot_rule

log = logging.getLogger(__name__)

UNKEYED = "?unkeyed"
Command = TypeVar("Command", SubmitMessage, SubmitToolResult, SubmitApproval, SubmitEscalation)
# A body past this is never parsed just to find its key (the door rejects it for its size).
MAX_KEYED_BODY_BYTES = 1 << 20

_MESH_META_KEYS = frozenset(
    name
    for field_name, field in MessageMeta.model_fields.items()
    for name in (field_name, field.alias)
    if name
)


def command_key(
    message: AbstractIncomingMessage,
    max_bytes: int = MAX_KEYED_BODY_BYTES,
    field: str = "conversationId",
) -> str:
    """Commands carry no header: key them by the conversationId in the body (FIFO per forum;
    a tool result by its ``callId``, so results of different calls never share a lane).

    Never raises, whatever the body: a body with no usable key shares one lane, and the door
    answers it.
    """
    return body_key(message.body, max_bytes, field)


def body_key(body: bytes, max_bytes: int, field: str) -> str:
    """:func:`command_key` of a body."""
    try:
        if len(body) > max_bytes or nesting_depth(body) > MAX_BODY_DEPTH:
            return UNKEYED
        parsed = json.loads(body)
        key = parsed.get(field) if isinstance(parsed, dict) else None
        if isinstance(key, str) and 0 < len(key) <= MAX_ID_CHARS:
            return key
    except Exception:
        pass  # a key function that raises takes the delivery down with no answer
    return UNKEYED


# Past MAX_KEYED_BODY_BYTES an answer is not parsed: its callId is looked for where a worker
# puts it, at either end of the body. Only that call's own worker may end it this way, which it
# could do with any answer, so a match inside some other field gains nobody anything.
_CALL_ID_FIELD = re.compile(rb'"callId"\s*:\s*"([^"\\]{1,%d})"' % MAX_ID_CHARS)
_SCANNED_BYTES = 4096


def oversize_call_id(body: bytes) -> str:
    """The ``callId`` of a tool result however large its body, or UNKEYED."""
    key = body_key(body, MAX_KEYED_BODY_BYTES, "callId")
    if key != UNKEYED or len(body) <= MAX_KEYED_BODY_BYTES:
        return key
    for end in (body[:_SCANNED_BYTES], body[-_SCANNED_BYTES:]):
        found = _CALL_ID_FIELD.search(end)
        if found is not None:
            with contextlib.suppress(UnicodeDecodeError):
                return found.group(1).decode()
    return UNKEYED


def _not_a_json_constant(name: str) -> object:
    raise ValueError(f"{name} is not a JSON number")


def parse_command(body: bytes, max_bytes: int, model: type[Command]) -> Command | SubmitReply:
    """The command in ``body``, or the rejection that says why not.

    The raw checks come first, each cheap and bounded: size, UTF-8, nesting depth. Then the
    schema, whose validators refuse what the store cannot hold.
    """
    if len(body) > max_bytes:
        return SubmitReply.rejected(
            "too_large", f"command is {len(body)} bytes; the limit is {max_bytes}"
        )
    try:
        text = body.decode()
    except UnicodeDecodeError as error:
        return SubmitReply.rejected(
            "invalid_body", f"body is not valid UTF-8 ({error.reason} at byte {error.start})"
        )
    depth = nesting_depth(body)
    if depth > MAX_BODY_DEPTH:
        return SubmitReply.rejected(
            "invalid_body", f"body is nested too deeply (more than {MAX_BODY_DEPTH} levels)"
        )
    try:
        parsed = json.loads(text, parse_constant=_not_a_json_constant)
    except ValueError as error:
        return SubmitReply.rejected("invalid_body", f"body is not valid JSON: {error}")
    if not isinstance(parsed, dict):
        return SubmitReply.rejected(
            "invalid_body", f"the command must be a JSON object, not {type(parsed).__name__}"
        )
    try:
        return model.model_validate(parsed)
    except ValidationError as error:
        return SubmitReply.rejected(
            "invalid_command", f"invalid command: {describe_validation_error(error)}"
        )


def speaker_of(message: AbstractIncomingMessage) -> str | None:
    """The RabbitMQ user that published a command, as the broker verified it (the command
    router put it in USER_HEADER after dropping every x-yoke-* header the publisher set)."""
    user = (message.headers or {}).get(topology.USER_HEADER)
    return str(user) if user else None


def refuse_reply_to(
    users: DoorUsers, user: str | None, message: AbstractIncomingMessage, what: str
) -> None:
    """Dead-letter a command whose reply_to is not a queue of its publisher's, unhandled.

    The door answers as the services' user, who may write to every yoke.* queue: answering on
    any queue named would let a publisher write (with a correlation id of its choice) into a
    service's shard, the dead letters or another bridge's queue (invariant 13). Nothing is
    written for such a command and nobody is answered; the reason is logged and dead-lettered.
    """
    if not message.reply_to or users.may_answer(user, message.reply_to):
        return
    COMMANDS.labels("rejected").inc()
    if user:
        error = (
            f"rejected {what}: reply_to {message.reply_to!r} is not a queue of RabbitMQ user "
            f"{user!r}'s (a bridge NAME is answered on bridge.NAME.*, or direct reply-to)"
        )
    else:
        error = (
            f"rejected {what}: it has no AMQP user_id, so reply_to {message.reply_to!r} is "
            "nobody's the door can tell: publish with user_id set to your RabbitMQ user"
        )
    log.warning("%s", error, extra={"messageId": message.message_id})
    raise Malformed(error)


def accept_attributes(message: AbstractIncomingMessage, key_name: str) -> dict[str, str]:
    """The accept span's: the command and what the router keyed it by (a forum, a call)."""
    headers = message.headers or {}
    return {
        "yoke.command": str(headers.get(topology.COMMAND_HEADER, "")),
        key_name: str(headers.get(topology.CONVERSATION_HEADER, "")),
    }


def answered(reply: SubmitReply) -> None:
    """What the door answered, on its span (the line's id once written)."""
    attributes: dict[str, str | bool] = {"yoke.outcome": reply.code or reply.status}
    if reply.message_id:
        attributes[tracing.MESSAGE_ID] = reply.message_id
    if reply.duplicate:
        attributes["yoke.duplicate"] = True
    tracing.annotate(attributes)


def accepted_reply(line: Message, created: bool) -> SubmitReply:
    return SubmitReply(status="accepted", message_id=line.id, duplicate=not created)


def counted(reply: SubmitReply) -> None:
    """What the door answered, on its span and in its counter, once it answers."""
    answered(reply)
    COMMANDS.labels("duplicate" if reply.duplicate else reply.status).inc()


class Door:
    """Turns submit commands into forum lines, each in its speaker's own namespace, and copies
    each into the watching monologues as it accepts it (``copies``, ingestion's runtime, in the
    forum's lane where the line's event would run: a delivery and a hop saved per line)."""

    def __init__(self, service: Service, copies: ActorRuntime) -> None:
        self.service = service
        self.copies = copies
        self.store = service.store
        settings = service.settings
        self.max_text_bytes = settings.max_text_bytes
        self.max_body_bytes = self.max_text_bytes * 2 + 4096
        self.users = DoorUsers.of(settings)
        self.limits = {
            "bridge": LineLimit(self.store, settings.bridge_lines_per_minute),
            "token": LineLimit(self.store, settings.token_lines_per_minute),
        }
        # People's lines reach the follow-up service only in forums where a join has it.
        self.followed = FollowedForums(self.store)
        self.kept_forums = KeptForums(self.store, service.poster, settings.kept_forums_per_token)
        self.holds = HoldDoor(self.store, service.poster, self.users)

    def key(self, message: AbstractIncomingMessage) -> str:
        return command_key(message, self.max_body_bytes)

    async def handle(self, message: AbstractIncomingMessage) -> None:
        with tracing.span("accept", attributes=accept_attributes(message, tracing.FORUM_ID)):
            await self._handle(message)

    async def _handle(self, message: AbstractIncomingMessage) -> None:
        user = speaker_of(message)
        refuse_reply_to(self.users, user, message, "command")
        sent = False

        async def accepted(reply: SubmitReply) -> None:
            # As soon as the line is stored, before its copies: the submitter waits for no more.
            nonlocal sent
            sent = True
            counted(reply)
            await self._answer(message, reply)

        reply = await self.submit(message.body, user, accepted)
        if sent:
            return
        counted(reply)
        if reply.status == "rejected":
            log.warning(
                "rejected command: %s",
                reply.error,
                extra={"messageId": message.message_id, "conversationId": self.key(message)},
            )
            # Nobody to answer: the dead-letter queue keeps it, with the reason; but never a
            # line past its rate limit, or a flood would fill that queue (invariant 14).
            if not message.reply_to and reply.code != "rate_limited":
                raise Malformed(f"rejected command: {reply.error}")
        await self._answer(message, reply)

    async def _answer(self, message: AbstractIncomingMessage, reply: SubmitReply) -> None:
        if message.reply_to:
            await self.service.bus.reply(
                message.reply_to,
                message.correlation_id,
                reply.model_dump_json(exclude_none=True).encode(),
            )

    async def submit(
        self,
        body: bytes,
        user: str | None,
        accepted: Callable[[SubmitReply], Awaitable[None]] | None = None,
    ) -> SubmitReply:
        """The line ``body`` asks for, written as RabbitMQ ``user`` may say it (None: the
        command had no ``user_id``), or the rejection that says why not; ``accepted`` is told
        as soon as the line is stored, before it is copied."""
        command = parse_command(body, self.max_body_bytes, SubmitMessage)
        if isinstance(command, SubmitReply):
            return command
        size = len(command.text.encode())
        if size > self.max_text_bytes:
            return SubmitReply.rejected(
                "too_large",
                f"text is {size} bytes; the limit is {self.max_text_bytes} (YOKE_MAX_TEXT_BYTES)",
            )
        if not user:
            return SubmitReply.rejected(
                "missing_user_id",
                "the command has no AMQP user_id: publish it with user_id set to your "
                "RabbitMQ user, which the broker verifies",
            )
        if self.users.is_worker(user):
            return SubmitReply.rejected("not_allowed", self.users.worker_only(user))
        try:
            external_id = self.users.own(user, command.author.external_id, "externalId")
            key = self.users.own(user, command.idempotency_key, "idempotencyKey")
        except ForeignNamespace as error:
            return SubmitReply.rejected("foreign_namespace", str(error))
        if user == self.users.gateway and token_namespace(key) != token_namespace(external_id):
            return SubmitReply.rejected(
                "foreign_namespace",
                "externalId and idempotencyKey from the HTTP gateway must share one token's "
                "namespace",
            )
        # The id derives from the idempotency key: a repeat finds the line already written.
        message_id = submitted_line_id(command.conversation_id, key)
        limited = False
        if command.kept is not None:
            # Counted before the forum is made: a flood of new keys makes no forums.
            refused = await self.open_kept(command.conversation_id, command.kept, user, key)
            if refused is not None:
                return refused
            limited = True
        forum = await self.store.get_conversation(command.conversation_id)
        if forum is None:
            return SubmitReply.rejected(
                "unknown_conversation", f"unknown conversation {command.conversation_id!r}"
            )
        if forum.kind != "forum":
            return SubmitReply.rejected(
                "not_a_forum", f"conversation {forum.id!r} is a {forum.kind}; submit to a forum"
            )
        if forum.kept_for is not None and (command.kept is None or not limited):
            # open_kept checked a door's line is its caller's own (its namespace, its forum).
            return SubmitReply.rejected(
                "not_allowed",
                f"conversation {forum.id!r} is kept for a caller of a published agent: only "
                "that caller writes there, through the gateway's MCP or A2A door",
            )
        refused = None if limited else await self.over_limit(user, key, message_id)
        if refused is not None:
            return refused
        # The mesh sets its own meta (hops, routing, causality): a command's are dropped, so a
        # wrong type there cannot fail the write.
        extra = {k: v for k, v in (command.meta or {}).items() if k not in _MESH_META_KEYS}
        return await self.post_line(
            forum.id,
            CommandAuthor(external_id=external_id, display_name=command.author.display_name),
            command.text,
            message_id,
            user=user,
            hold_granted=command.hold_granted,
            extra=extra,
            accepted=accepted,
        )

    async def post_line(
        self,
        forum_id: str,
        author: CommandAuthor,
        text: str,
        message_id: str,
        *,
        user: str,
        hold_granted: bool = False,
        escalation_id: str | None = None,
        extra: dict[str, JsonValue] | None = None,
        accepted: Callable[[SubmitReply], Awaitable[None]] | None = None,
    ) -> SubmitReply:
        """A person's line written into the forum and copied, or why not: a ``/takeover`` or
        ``/handback`` is decided first and its hold recorded as soon as it is stored
        (:mod:`services.ingestion.holds`), before its submitter is answered."""
        command = hold_command(text)
        hold: HoldLine | None = None
        if command is not None:
            decided = await self.holds.decide(
                forum_id,
                command,
                message_id,
                author,
                user,
                hold_granted=hold_granted,
                escalation_id=escalation_id,
            )
            if isinstance(decided, SubmitReply):
                return decided
            hold = decided  # None: a repeat of a line that holds nothing
        actor = await self.store.save_actor(
            Actor(
                id=derive_id("human", author.external_id),
                kind="human",
                name=author.display_name,
                external_id=author.external_id,
            )
        )
        participant_id = await ensure_participant_id(self.store, forum_id, actor.id)
        followed = await self.followed.followed(forum_id)
        meta = {**(extra or {}), "agentHops": 0, **(hold.meta() if hold is not None else {})}

        async def stored_first(line: Message, created: bool) -> None:
            if hold is not None:
                await self.holds.recorded(line, hold, created)
            if accepted is not None:
                await accepted(accepted_reply(line, created))

        stored, created = await self.service.poster.post_and_take(
            Message(
                id=message_id,
                conversation_id=forum_id,
                author_actor_id=actor.id,
                participant_id=participant_id,
                role="user",
                parts=[TextPart(text=text)],
                meta=MessageMeta.model_validate(meta),
            ),
            self.copies.take,
            route={topology.FOLLOWED_HEADER: "yes"} if followed else None,
            stored_first=stored_first,
        )
        return accepted_reply(stored, created)

    async def open_kept(
        self, forum_id: str, kept: KeptForum, user: str, key: str
    ) -> SubmitReply | None:
        """A line from the gateway's MCP or A2A door: its caller's forum, made and joined on
        first use (:mod:`yoke.runtime.kept_forums`), or the refusal."""
        namespace = token_namespace(key)
        if not self.users.is_mesh(user) or namespace is None:
            return SubmitReply.rejected(
                "not_allowed", "only the HTTP gateway opens a caller's kept forum"
            )
        try:
            opening = await self.kept_forums.check(forum_id, kept, namespace)
        except KeptForumRefused as error:
            return SubmitReply.rejected(error.code, str(error))
        refused = await self.over_limit(user, key, submitted_line_id(forum_id, key))
        if refused is None and opening is not None:
            await self.kept_forums.open(opening)
            self.copies.forget(forum_id)  # its join's event comes after this line, in this lane
        return refused

    async def over_limit(self, user: str, key: str, message_id: str) -> SubmitReply | None:
        """The refusal of a line past its bridge's or token's lines per minute, else None (a
        repeat of a line already written is still answered as its duplicate)."""
        limited = self.users.limited_as(user, key)
        if limited is None:
            return None
        door, speaker = limited
        wait = await self.limits[door].take(f"{door}:{speaker}")
        if wait is None:
            return None
        if await self.store.get_message(message_id) is not None:
            return SubmitReply(status="accepted", message_id=message_id, duplicate=True)
        LINES_RATE_LIMITED.labels(door).inc()
        setting = f"YOKE_{door.upper()}_LINES_PER_MINUTE"
        return SubmitReply(
            status="rejected",
            code="rate_limited",
            retry_after=wait,
            error=f"too many lines from this {door} ({self.limits[door].per_minute} a minute, "
            f"{setting}): retry in {wait} s",
        )


class CallDoor(ABC):
    """A command about one call that waits in the store, keyed by its ``callId`` (two commands
    on one call meet in one lane) and answered on its ``reply_to``.

    Who sent it is the RabbitMQ user that published it, which the broker verified (``user_id``)
    and the command router passed on; :meth:`submit` decides what that user may do.
    """

    what = "command"
    max_body_bytes = 16_384
    key_attribute = "yoke.call_id"  # what the key is, on the accept span

    def __init__(self, service: Service) -> None:
        self.service = service
        self.users = DoorUsers.of(service.settings)

    def key(self, message: AbstractIncomingMessage) -> str:
        return command_key(message, self.max_body_bytes, "callId")

    async def handle(self, message: AbstractIncomingMessage) -> None:
        with tracing.span("accept", attributes=accept_attributes(message, self.key_attribute)):
            await self._handle(message)

    async def _handle(self, message: AbstractIncomingMessage) -> None:
        user = speaker_of(message)
        refuse_reply_to(self.users, user, message, self.what)
        reply = await self.submit(message.body, user)
        answered(reply)
        COMMANDS.labels("duplicate" if reply.duplicate else reply.status).inc()
        if reply.status == "rejected":
            log.warning(
                "rejected %s from %s: %s",
                self.what,
                user or "an unnamed publisher",
                reply.error,
                extra={"messageId": message.message_id},
            )
        if message.reply_to:
            await self.service.bus.reply(
                message.reply_to,
                message.correlation_id,
                reply.model_dump_json(exclude_none=True).encode(),
            )

    @abstractmethod
    async def submit(self, body: bytes, user: str | None) -> SubmitReply:
        """What ``user`` may do with this command, done: the reply to send back."""


class _WorkerAnswer(SubmitToolResult):
    """A worker's output is outside text (a binary file read as text, say): U+0000 and lone
    surrogates become U+FFFD here, once, instead of refusing the answer."""

    output: Annotated[str, BeforeValidator(storable_input)]


class ToolResultDoor(CallDoor):
    """Takes a worker's answer (``tool.result.submit``): it must come from the user of the
    call's tool."""

    what = "tool result"

    def __init__(self, service: Service) -> None:
        super().__init__(service)
        self.answers = WorkerAnswers(
            OpenCalls(service.store, service.poster), vhost=self.users.vhost
        )
        self.max_text_bytes = service.settings.max_text_bytes
        self.max_body_bytes = self.max_text_bytes * 2 + 4096

    def key(self, message: AbstractIncomingMessage) -> str:
        # An answer too large to take still meets the call's other answers in its lane.
        return oversize_call_id(message.body)

    async def submit(self, body: bytes, user: str | None) -> SubmitReply:
        answer = parse_command(body, self.max_body_bytes, _WorkerAnswer)
        if isinstance(answer, SubmitReply):
            call_id = oversize_call_id(body) if answer.code == "too_large" else UNKEYED
            if call_id == UNKEYED:
                return answer
            return await self.too_large(call_id, user, answer)
        size = len(answer.output.encode())
        if size > self.max_text_bytes:
            refusal = SubmitReply.rejected(
                "too_large",
                f"output is {size} bytes; the limit is {self.max_text_bytes} (YOKE_MAX_TEXT_BYTES)",
            )
            return await self.too_large(answer.call_id, user, refusal)
        return await self.answers.answer(answer.call_id, user, answer.output, answer.is_error)

    async def too_large(self, call_id: str, user: str | None, refusal: SubmitReply) -> SubmitReply:
        """An answer too large to take ends its call at once with an error result saying so
        (the worker has acked the call: else the model would wait for its deadline), checked
        as any answer is (only the call's own worker ends it so); the worker is told
        ``too_large``, or why it may not answer this call at all."""
        ended = await self.answers.answer(
            call_id,
            user,
            f"the tool's answer was too large to take: {refusal.error}",
            True,
            outcome="failed",
        )
        return ended if ended.status == "rejected" else refusal


class ApprovalDoor(CallDoor):
    """Takes a person's decision (``tool.approval.submit``) on a call awaiting approval: from
    the services' own user (the CLI), the HTTP gateway's (each naming its person in ``by``) or
    a publisher made with ``yoke publisher create --can-approve``; the first decision wins."""

    what = "approval decision"

    def __init__(self, service: Service) -> None:
        super().__init__(service)
        self.approvers = Approvers(Approvals(OpenCalls(service.store, service.poster)), self.users)

    async def submit(self, body: bytes, user: str | None) -> SubmitReply:
        decision = parse_command(body, self.max_body_bytes, SubmitApproval)
        if isinstance(decision, SubmitReply):
            return decision
        return await self.approvers.submit(decision, user)


class EscalationDoor(CallDoor):
    """Takes a claim, cancel or timeout of an escalation (``escalation.submit``), keyed by its
    forum: decided in the forum's lane, where its /takeover line is written
    (:class:`services.ingestion.holds.EscalationDecisions`)."""

    what = "escalation decision"
    key_attribute = tracing.FORUM_ID

    def __init__(self, service: Service, door: Door) -> None:
        super().__init__(service)
        self.decisions = EscalationDecisions(door.holds, door)

    def key(self, message: AbstractIncomingMessage) -> str:
        return command_key(message, self.max_body_bytes)

    async def submit(self, body: bytes, user: str | None) -> SubmitReply:
        command = parse_command(body, self.max_body_bytes, SubmitEscalation)
        if isinstance(command, SubmitReply):
            return command
        return await self.decisions.submit(command, user)


def copies_line(config: IngestionConfig, state: IngestionState, message: Message) -> bool:
    """Forum lines, but never the agent's own, and never notices."""
    return message.type == "message" and message.author_actor_id != config.agent_actor_id


async def copy_to_monologue(
    context: ActorContext[IngestionConfig, IngestionState], line: Message
) -> None:
    """The forum line into the join's active monologue (one span per join: ``copy``)."""
    with tracing.span(
        "copy",
        attributes={
            tracing.FORUM_ID: line.conversation_id,
            tracing.MESSAGE_ID: line.id,
            "yoke.agent_actor_id": context.config.agent_actor_id,
        },
    ):
        await _copy_to_monologue(context, line)


async def _copy_to_monologue(
    context: ActorContext[IngestionConfig, IngestionState], line: Message
) -> None:
    store = context.store
    forum_participant = await store.get_participant(context.config.forum_participant_id)
    if forum_participant is None or forum_participant.left_at is not None:
        return
    if not forum_participant.metadata.get("monologueId"):
        log.error(
            "forum participant has no monologueId", extra={"conversationId": line.conversation_id}
        )
        return
    # The monologue the processor answers (a swap may be under way); whatever a swap moved on is
    # carried there first (writers carry in order and each line once), so this line lands after.
    monologue_id = await copy_target(store, context.poster, forum_participant, context.instance_id)
    author = await store.get_actor(line.author_actor_id)
    shadow = await store.save_actor(
        Actor(
            id=derive_id("external", line.author_actor_id),
            kind="external",
            name=author.name if author else line.author_actor_id,
            meta={"sourceActorId": line.author_actor_id},
        )
    )
    shadow_participant_id = await ensure_participant_id(store, monologue_id, shadow.id)
    hold = hold_command(line.text) if line.role == "user" and not line.meta.agent_hops else None
    seen_while_held = context.state.held and hold is None
    if hold is not None:
        context.state.held = hold.name == TAKEOVER
    copy = await context.post(
        Message(
            id=derive_id("copy", monologue_id, line.id),
            conversation_id=monologue_id,
            author_actor_id=shadow.id,
            participant_id=shadow_participant_id,
            role="user",
            parts=[part for part in line.parts if isinstance(part, TextPart)],
            meta=MessageMeta(
                source_conversation_id=line.conversation_id,
                source_message_id=line.id,
                source_actor_id=line.author_actor_id,
                source_seq=line.seq,
                agent_hops=line.meta.agent_hops,
                held=True if seen_while_held else None,
            ),
        )
    )
    tracing.annotate({tracing.CONVERSATION_ID: monologue_id, "yoke.copy_id": copy.id})
    # The monologue may have been compacted while this copy was written: if so, carry it on.
    await carry_tail(
        store, context.poster, context.config.forum_participant_id, monologue_id, copy.seq
    )


INGESTION_ACTOR = ActorDefinition(
    name=INGESTION,
    config_schema=IngestionConfig,
    state_schema=IngestionState,
    trigger=copies_line,
    handle=copy_to_monologue,
)


def register(service: Service) -> None:
    # Forum lines only (its own copies go to monologues, the processor's business), and not
    # those the door copied as it accepted them. An instance's document is written by its own
    # lane alone once the join made it: kept, so a line costs no lookup of who watches.
    copies = ActorRuntime(
        service,
        [INGESTION_ACTOR],
        where=[{"kind": "forum", "type": "message", "copied": "no"}],
        kept=True,
    )
    door = Door(service, copies)
    service.retention.add(slot_rule())  # the limits' slots of past minutes
    # The door is where outside letters come from; it counts what the bounded queue drops.
    service.background(
        "dropped dead letters",
        lambda: count_dropped_letters(service.bus.connection, service.stopping),
    )

    async def joined(event: AgentForumJoined) -> None:
        # On the forum's shard, whose commands this process handles: its next line reads anew
        # whether follow-up is on and who watches it.
        door.followed.forget(event.forum_id)
        copies.forget(event.forum_id)

    service.on_event(AgentForumJoined, joined)
    service.on_intake(topology.COMMANDS_EXCHANGE, topology.SUBMIT_COMMAND, door.key, door.handle)
    results = ToolResultDoor(service)
    service.on_intake(
        topology.COMMANDS_EXCHANGE, topology.TOOL_RESULT_COMMAND, results.key, results.handle
    )
    approvals = ApprovalDoor(service)
    service.on_intake(
        topology.COMMANDS_EXCHANGE, topology.APPROVAL_COMMAND, approvals.key, approvals.handle
    )
    escalations = EscalationDoor(service, door)
    service.on_intake(
        topology.COMMANDS_EXCHANGE, topology.ESCALATION_COMMAND, escalations.key, escalations.handle
    )

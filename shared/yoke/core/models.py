"""The one schema: pydantic models for wire events, commands and stored documents.

Field names are snake_case in Python and camelCase on the wire and in MongoDB.
Stored documents keep their ``id`` as MongoDB's ``_id``.
"""

from __future__ import annotations

import json
import math
from datetime import UTC, datetime
from typing import Annotated, Any, ClassVar, Literal, Self

import orjson
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, JsonValue, field_validator
from pydantic.alias_generators import to_camel


def utcnow() -> datetime:
    return datetime.now(UTC)


def as_utc(moment: datetime) -> datetime:
    """``moment`` as an aware datetime: a naive one read back from the store is UTC."""
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)


class WireModel(BaseModel):
    """camelCase on the wire, snake_case in Python; unknown fields are kept out."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        validate_by_name=True,
        validate_by_alias=True,
        serialize_by_alias=True,
    )

    def to_wire(self) -> dict[str, Any]:
        return self.model_dump(mode="json", exclude_none=True)


class Document(WireModel):
    """A model stored in MongoDB with its ``id`` as ``_id``."""

    id: str

    def to_document(self) -> dict[str, Any]:
        document = self.model_dump(mode="python", exclude_none=True)
        document["_id"] = document.pop("id")
        return document

    @classmethod
    def from_document(cls, document: dict[str, Any]) -> Self:
        fields = {key: value for key, value in document.items() if key != "_id"}
        return cls.model_validate({**fields, "id": document["_id"]})


# --- actors, conversations, participants -------------------------------------------------

ActorKind = Literal["human", "agent", "external", "system"]


class Actor(Document):
    kind: ActorKind
    name: str
    external_id: str | None = None
    meta: dict[str, JsonValue] = Field(default_factory=dict)
    created_at: datetime = Field(default_factory=utcnow)


class Conversation(Document):
    kind: Literal["forum", "monologue"]
    title: str = ""
    # A forum kept for a caller of the gateway's MCP or A2A door: its token's namespace. Only
    # that caller's door writes there (no bridge, no REST line, no other token).
    kept_for: str | None = None
    # A hint only (updates are not atomic on FerretDB): the seq owner is the unique index.
    last_seq: int = 0
    created_at: datetime = Field(default_factory=utcnow)


class Participant(Document):
    conversation_id: str
    actor_id: str
    metadata: dict[str, JsonValue] = Field(default_factory=dict)
    joined_at: datetime = Field(default_factory=utcnow)
    left_at: datetime | None = None


# --- messages ----------------------------------------------------------------------------


class TextPart(WireModel):
    type: Literal["text"] = "text"
    text: str
    format: Literal["plain", "markdown"] = "plain"


class ToolCallPart(WireModel):
    type: Literal["tool_call"] = "tool_call"
    call_id: str
    name: str
    input: dict[str, JsonValue] = Field(default_factory=dict)
    # Set when the model's arguments could not be read (say, invalid JSON): the tool is not
    # run, and the model is told why in the result.
    input_error: str | None = None


def call_signature(call: ToolCallPart) -> str:
    """Tool name plus canonical arguments: what makes two calls "the same call"."""
    return call.name + json.dumps(call.input, sort_keys=True, separators=(",", ":"))


class ToolResultPart(WireModel):
    type: Literal["tool_result"] = "tool_result"
    call_id: str
    name: str
    output: str
    is_error: bool = False


Part = Annotated[TextPart | ToolCallPart | ToolResultPart, Field(discriminator="type")]


class ForumNotice(WireModel):
    """What a monologue notice tells the forum's people (egress posts it there as a ``notice``
    line of the agent's): plain words, no internal ids, no stack traces."""

    agent_actor_id: str
    text: str
    # Why (the processor's notice reason: "failed", "approval", "stopped", ...): a caller of a
    # published agent tells a turn that waits ("approval") from one that ended.
    reason: str | None = None
    # An id the forum line is derived from instead of the monologue notice's: the notices of
    # one event that every agent of the forum writes (a takeover) are one forum line.
    once_for: str | None = None


class MessageMeta(WireModel):
    """Routing and causality; other keys a publisher sends along are kept."""

    model_config = ConfigDict(extra="allow")

    source_conversation_id: str | None = None
    source_message_id: str | None = None
    source_actor_id: str | None = None
    # A seq of source_conversation_id's that exists (the line this one copies or answers):
    # whoever writes there next starts from it, not from a head it saw earlier.
    source_seq: int | None = Field(default=None, ge=1)
    causation_id: str | None = None
    in_reply_to: str | None = None
    agent_hops: int = Field(default=0, ge=0)
    # Lines the mesh injects into a monologue as instructions (follow-up nudges, guardian
    # steering): prompts mark them as such instead of quoting them as a person.
    instruction: str | None = None
    # Set on a tool_result whose calls the doom-loop guard refused: no inference follows it.
    loop_guard: bool | None = None
    # The line this one was carried from by compaction; egress never forwards such a line.
    carried_from: str | None = None
    # On a monologue notice that concerns the forum's people: what egress tells them there.
    forum_notice: ForumNotice | None = None
    # On the forum's notice line egress makes of it: the notice's reason (ForumNotice.reason).
    notice_reason: str | None = None
    # On an agent's reply or notice (in its monologue and in the forum): the forum seq through
    # which it settles that agent's forum lines. Every line up to it was answered by this line
    # or an earlier one (a burst under coalesce or interrupt, lines held through a tool round),
    # or will never be (a stop): whoever waits for a line's answer waits for the first agent
    # line in reply to it or covering it.
    covers_seq: int | None = Field(default=None, ge=1)
    # On a person's ``/takeover`` line that claims an escalation: the escalation it claims.
    escalation_id: str | None = None
    # On a ``/handback`` line: the ``/takeover`` line whose hold it ends.
    ends_hold: str | None = None
    # On a forum line's copy made while the forum was held: the agent has seen it; it is never
    # a line to answer (the hand-back tells the agent what was said).
    held: bool | None = None


class Usage(WireModel):
    model: str
    input_tokens: int = 0
    output_tokens: int = 0
    cost_usd: float = 0.0
    # True when the mesh counted it itself: a model call cancelled before its answer (an
    # interrupt, a stop) never gets the provider's usage report.
    estimated: bool | None = None


class Message(Document):
    """A line of a conversation: the shape of the wire, the store and ``yoke history --json``."""

    conversation_id: str
    seq: int = 0
    author_actor_id: str
    participant_id: str | None = None
    role: Literal["user", "agent"] = "user"
    type: Literal["message", "notice"] = "message"
    parts: list[Part] = Field(default_factory=list)
    meta: MessageMeta = Field(default_factory=MessageMeta)
    usage: Usage | None = None
    created_at: datetime = Field(default_factory=utcnow)

    @property
    def text(self) -> str:
        """The text parts joined, for logs, prompts and tests."""
        return "\n".join(part.text for part in self.parts if isinstance(part, TextPart))

    def seen_outside(self) -> Message:
        """The line as a reader outside the mesh gets it (its event on ``yoke.forum``, which
        bridges read, and the gateway's pages, stream and webhooks): an agent's forum line
        without what it says of the monologue it was forwarded from (that monologue's id, its
        seq, the monologue line that caused it)."""
        if self.role != "agent":
            return self
        meta = self.meta.model_copy(
            update={"source_conversation_id": None, "source_seq": None, "causation_id": None}
        )
        return self.model_copy(update={"meta": meta})


# --- events ------------------------------------------------------------------------------


class MessagePosted(WireModel):
    TYPE: ClassVar[str] = "conversation.message.posted"

    conversation_id: str
    message_id: str
    message_type: str
    author_actor_id: str
    seq: int
    message: Message

    @classmethod
    def of(cls, message: Message) -> MessagePosted:
        """The event announcing a stored message."""
        return cls(
            conversation_id=message.conversation_id,
            message_id=message.id,
            message_type=message.type,
            author_actor_id=message.author_actor_id,
            seq=message.seq,
            message=message,
        )

    @property
    def key(self) -> str:
        return self.conversation_id


class AgentForumJoined(WireModel):
    TYPE: ClassVar[str] = "agent.forum.joined"

    agent_actor_id: str
    forum_id: str
    forum_participant_id: str
    monologue_id: str
    monologue_participant_id: str

    @property
    def key(self) -> str:
        return self.forum_id


class MonologueCompacted(WireModel):
    TYPE: ClassVar[str] = "agent.monologue.compacted"

    agent_actor_id: str
    forum_id: str
    previous_monologue_id: str
    monologue_id: str

    @property
    def key(self) -> str:
        return self.forum_id


class AgentActivity(WireModel):
    """What an agent is doing in a forum, at a step's start and end: ephemeral, for live views
    (the gateway's stream). Never stored, never a trigger; routed like a forum line."""

    TYPE: ClassVar[str] = "agent.activity"

    agent_actor_id: str
    forum_id: str
    state: Literal["thinking", "tool", "idle"]

    @property
    def key(self) -> str:
        return self.forum_id


class AgentDelta(WireModel):
    """A piece of the text an agent is writing for a forum, as the model produces it.

    Ephemeral (never stored), ordered by ``index`` from 0; ``messageId`` is the id the finished
    forum line will have and replaces the draft; the last delta of a draft has ``end``:
    ``posted`` (the line follows) or ``abandoned`` (no line: the step failed or was stopped).
    """

    TYPE: ClassVar[str] = "agent.delta"

    forum_id: str
    agent_actor_id: str
    message_id: str
    in_reply_to: str | None = None
    index: int = Field(ge=0)
    text: str
    end: Literal["posted", "abandoned"] | None = None

    @property
    def key(self) -> str:
        return self.forum_id


class ApprovalRequested(WireModel):
    """A call of a gated tool waits for a person's decision (docs/approvals.md). On
    ``yoke.forum``: ``input`` is the one piece of a monologue that leaves the mesh, on purpose,
    so that the approvers see what they approve."""

    TYPE: ClassVar[str] = "tool.approval.requested"

    forum_id: str
    agent_actor_id: str
    call_id: str
    tool: str
    input: dict[str, JsonValue] = Field(default_factory=dict)
    # When the call ends with "no decision within N s" unless someone decides first.
    deadline: datetime

    @property
    def key(self) -> str:
        return self.forum_id


ApprovalDecision = Literal["approve", "reject", "expired", "stopped"]


class ApprovalDecided(WireModel):
    """The first decision on a gated call (``expired``: nobody decided by the deadline;
    ``stopped``: a stop in the forum ended it). ``by`` is who decided, as the deciding door
    names them; absent for ``expired``."""

    TYPE: ClassVar[str] = "tool.approval.decided"

    forum_id: str
    call_id: str
    decision: ApprovalDecision
    by: CommandAuthor | None = None
    reason: str | None = None

    @property
    def key(self) -> str:
        return self.forum_id


class ToolCallApproved(WireModel):
    """Inside the mesh only: an approved call is to run now. Keyed by the call's monologue, so
    it reaches the processor that owns that conversation's shard, in its lane."""

    TYPE: ClassVar[str] = "tool.call.approved"

    conversation_id: str
    call_id: str

    @property
    def key(self) -> str:
        return self.conversation_id


EscalationUrgency = Literal["low", "normal", "high"]
EscalationOutcome = Literal["handed_back", "timed_out", "canceled"]


class EscalationOpened(WireModel):
    """An agent asked for a person (its ``handoff`` tool): on ``yoke.forum`` for a helpdesk or
    bridge to pick up; the agent says nothing in the forum until the escalation ends."""

    TYPE: ClassVar[str] = "escalation.opened"

    escalation_id: str
    forum_id: str
    agent_actor_id: str
    reason: str
    urgency: EscalationUrgency = "normal"
    opened_at: datetime
    # When it ends with the join's fallback unless someone claims it first.
    deadline: datetime

    @property
    def key(self) -> str:
        return self.forum_id


class ShownPerson(WireModel):
    """A person as outsiders are shown them: by display name only (an external id carries the
    namespace of the door or token that named them, which is nobody else's business)."""

    display_name: str


class EscalationClaimed(WireModel):
    """A person claimed an escalation: they hold the forum (a takeover) from now on."""

    TYPE: ClassVar[str] = "escalation.claimed"

    escalation_id: str
    forum_id: str
    by: ShownPerson
    claimed_at: datetime

    @property
    def key(self) -> str:
        return self.forum_id


class EscalationEnded(WireModel):
    """An escalation is over: its holder handed the forum back, nobody claimed it in time, or
    it was canceled."""

    TYPE: ClassVar[str] = "escalation.ended"

    escalation_id: str
    forum_id: str
    outcome: EscalationOutcome
    ended_at: datetime

    @property
    def key(self) -> str:
        return self.forum_id


EventPayload = (
    MessagePosted
    | AgentForumJoined
    | MonologueCompacted
    | AgentActivity
    | AgentDelta
    | ApprovalRequested
    | ApprovalDecided
    | ToolCallApproved
    | EscalationOpened
    | EscalationClaimed
    | EscalationEnded
)
EVENT_TYPES: dict[str, type[EventPayload]] = {
    model.TYPE: model
    for model in (
        MessagePosted,
        AgentForumJoined,
        MonologueCompacted,
        AgentActivity,
        AgentDelta,
        ApprovalRequested,
        ApprovalDecided,
        ToolCallApproved,
        EscalationOpened,
        EscalationClaimed,
        EscalationEnded,
    )
}


class Envelope(WireModel):
    """What travels on ``yoke.events``; AMQP ``message_id`` is the envelope id."""

    id: str
    type: str
    version: Literal[1] = 1
    occurred_at: datetime = Field(default_factory=utcnow)
    payload: dict[str, JsonValue]

    @classmethod
    def wrap(cls, event_id: str, payload: EventPayload) -> Envelope:
        """The envelope of a payload its model has checked already: not validated a second
        time (JSON-ready by ``to_wire``), as validating it again is a publish's costliest part."""
        return cls.model_construct(
            id=event_id, type=payload.TYPE, occurred_at=utcnow(), payload=payload.to_wire()
        )

    def to_json(self) -> bytes:
        """The envelope as it goes on the wire: orjson, much cheaper than ``model_dump_json``
        (which stays for what orjson refuses: an int past 64 bits)."""
        try:
            return orjson.dumps(
                {
                    "id": self.id,
                    "type": self.type,
                    "version": self.version,
                    "occurredAt": self.occurred_at,
                    "payload": self.payload,
                },
                option=orjson.OPT_UTC_Z,
            )
        except orjson.JSONEncodeError:
            return self.model_dump_json().encode()

    def parse(self) -> EventPayload:
        """The typed payload; raises ``ValueError`` for an unknown type, naming it."""
        model = EVENT_TYPES.get(self.type)
        if model is None:
            raise ValueError(f"unknown event type {self.type!r}")
        return model.model_validate(self.payload)


# --- commands ----------------------------------------------------------------------------

# Limits on what outside systems may send: a command past them is rejected
# with a reason naming the field, before anything is written.
MAX_ID_CHARS = 128
MAX_KEY_CHARS = 256
MAX_NAME_CHARS = 200
MAX_META_KEY_CHARS = 128
MAX_META_DEPTH = 8
MAX_META_BYTES = 16_384
_INT64 = (-(2**63), 2**63 - 1)


def unstorable(text: str) -> str | None:
    """Why the store cannot hold ``text``, or None.

    FerretDB's PostgreSQL backend (jsonb) cannot hold U+0000 and BSON keys cannot either;
    a lone surrogate cannot be encoded as UTF-8 at all.
    """
    if "\x00" in text:
        return "contains U+0000 (NUL), which the store cannot hold"
    try:
        text.encode()
    except UnicodeEncodeError as error:
        return (
            f"contains a lone surrogate U+{ord(text[error.start]):04X}, which is not Unicode text"
        )
    return None


def check_storable(value: object) -> object:
    """A string field's ``BeforeValidator``: refuses, saying why, what the store cannot hold.

    It runs before pydantic's own str check, which refuses a lone surrogate without saying why.
    """
    if isinstance(value, str) and (problem := unstorable(value)) is not None:
        raise ValueError(problem)
    return value


def _meta_problem(value: JsonValue, path: str, depth: int) -> str | None:
    """The first thing in a meta value the store cannot hold, or that is out of bounds."""
    if isinstance(value, dict | list) and depth > MAX_META_DEPTH:
        return f"meta is nested too deeply (more than {MAX_META_DEPTH} levels)"
    if isinstance(value, dict):
        for key, item in value.items():
            if len(key) > MAX_META_KEY_CHARS:
                return (
                    f"a key at {path or 'the top'} is {len(key)} characters; "
                    f"the limit is {MAX_META_KEY_CHARS}"
                )
            if (problem := unstorable(key)) is not None:
                return f"a key at {path or 'the top'} {problem}"
            if "." in key:
                return f"key {key!r} contains '.', which the store refuses in keys"
            if key.startswith("$"):
                return f"key {key!r} starts with '$', which the store refuses in keys"
            if problem := _meta_problem(item, f"{path}.{key}" if path else key, depth + 1):
                return problem
    elif isinstance(value, list):
        for index, item in enumerate(value):
            if (problem := _meta_problem(item, f"{path}[{index}]", depth + 1)) is not None:
                return problem
    elif isinstance(value, str):
        if (problem := unstorable(value)) is not None:
            return f"{path}: {problem}"
    elif isinstance(value, bool):
        return None
    elif isinstance(value, int):
        if not _INT64[0] <= value <= _INT64[1]:
            return f"{path}: {value} is not a 64-bit integer"
    elif isinstance(value, float) and not math.isfinite(value):
        return f"{path}: {value} is not a finite number"
    return None


CommandId = Annotated[
    str, Field(min_length=1, max_length=MAX_ID_CHARS), BeforeValidator(check_storable)
]
CommandKey = Annotated[
    str, Field(min_length=1, max_length=MAX_KEY_CHARS), BeforeValidator(check_storable)
]


class CommandAuthor(WireModel):
    external_id: CommandKey
    display_name: Annotated[
        str, Field(min_length=1, max_length=MAX_NAME_CHARS), BeforeValidator(check_storable)
    ]


# The mesh's doors for outside callers of a published agent (the gateway's MCP and A2A).
CallerDoor = Literal["mcp", "a2a"]


class KeptForum(WireModel):
    """On a line from the HTTP gateway: the forum is the one kept for this caller (its token's
    namespace, the door, the published agent and the caller's key), made and joined by the door
    with this first line when it is not there yet. The gateway cannot make forums itself."""

    door: CallerDoor
    agent: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    key: Annotated[str, Field(min_length=1, max_length=128), BeforeValidator(check_storable)]


class SubmitMessage(WireModel):
    """``conversation.message.submit``, published by outside systems on ``yoke.commands``.

    No string may hold U+0000 or a lone surrogate (the store cannot hold them); ``meta`` nests
    at most 8 levels and 16 KiB, its keys hold no '.' and no leading '$', its numbers are finite
    and its integers fit in 64 bits. A command that breaks a rule is rejected, naming the field.
    """

    conversation_id: CommandId
    author: CommandAuthor
    text: Annotated[str, Field(min_length=1), BeforeValidator(check_storable)]
    idempotency_key: CommandKey
    meta: dict[str, JsonValue] | None = None
    kept: KeptForum | None = None
    # On a ``/takeover`` or ``/handback`` line from the mesh's own user (the CLI) or the HTTP
    # gateway (a token made with ``--can-take-over``): its author may hold any forum. Ignored
    # from anyone else, whose holds the join's ``takeoverBy`` allows.
    hold_granted: bool = False

    @field_validator("meta")
    @classmethod
    def _bounded_meta(cls, meta: dict[str, JsonValue] | None) -> dict[str, JsonValue] | None:
        if meta is None:
            return None
        problem = _meta_problem(meta, "", 1)
        if problem is not None:
            raise ValueError(problem)
        size = len(json.dumps(meta, ensure_ascii=False).encode())
        if size > MAX_META_BYTES:
            raise ValueError(f"meta is {size} bytes; the limit is {MAX_META_BYTES}")
        return meta


# Why the door rejected a command, for programs (the HTTP gateway maps them to statuses).
RejectCode = Literal[
    "invalid_body",
    "invalid_command",
    "too_large",
    "unknown_conversation",
    "not_a_forum",
    # An externalId, idempotencyKey or approval's by.externalId in a namespace the publishing
    # RabbitMQ user may not speak in (yoke.coordination.speakers).
    "foreign_namespace",
    # Past the publisher's lines per minute (a bridge's or a token's); see retryAfter.
    "rate_limited",
    # A new conversation key past the caller's token's bound (YOKE_KEPT_FORUMS_PER_TOKEN).
    "too_many_conversations",
    # tool.result.submit only (see SubmitToolResult)
    "unknown_call",
    "call_closed",
    "wrong_tool",
    "missing_user_id",
    "awaiting_approval",
    # tool.approval.submit only (see SubmitApproval)
    "not_allowed",
    "already_decided",
    "not_awaiting_approval",
    # /takeover into a forum someone holds; /handback of a forum nobody holds
    "held",
    "not_held",
    # escalation.submit only (see SubmitEscalation)
    "unknown_escalation",
    "already_claimed",
    "escalation_ended",
    # an escalation of a forum kept for an outside caller: nobody may hold such a forum
    "not_claimable",
]


class SubmitReply(WireModel):
    status: Literal["accepted", "rejected"]
    message_id: str | None = None
    duplicate: bool | None = None
    error: str | None = None
    # With ``error``: ``invalid_body`` (not UTF-8 JSON, or nested too deeply),
    # ``invalid_command`` (a field is missing or wrong), ``too_large``, ``unknown_conversation``,
    # ``not_a_forum``; for tool results ``unknown_call``, ``call_closed``, ``wrong_tool``,
    # ``missing_user_id``, ``awaiting_approval``; for approvals ``not_allowed``,
    # ``already_decided``, ``unknown_call``, ``not_awaiting_approval``; for any command
    # ``foreign_namespace``, ``missing_user_id`` and (lines) ``rate_limited``; (lines into a
    # caller's kept forum) ``not_allowed``, ``too_many_conversations``.
    code: RejectCode | None = None
    # With ``rate_limited``: whole seconds until a line is taken again.
    retry_after: int | None = None

    @classmethod
    def rejected(cls, code: RejectCode, error: str) -> SubmitReply:
        return cls(status="rejected", code=code, error=error)


class ToolCallRequest(WireModel):
    """A call as a tool worker receives it on ``yoke.tool.NAME`` (AMQP ``message_id`` =
    ``callId``). Delivered at least once: a worker uses ``idempotencyKey`` to tolerate a repeat.
    """

    call_id: str
    tool: str
    input: dict[str, JsonValue] = Field(default_factory=dict)
    idempotency_key: str
    deadline: datetime


class SubmitToolResult(WireModel):
    """``tool.result.submit``: a worker's answer on ``yoke.commands``, published with the AMQP
    ``user_id`` of its own RabbitMQ user (the door trusts no other proof of who answers)."""

    call_id: CommandId
    output: Annotated[str, BeforeValidator(check_storable)]
    is_error: bool = False


MAX_REASON_CHARS = 2000


class SubmitApproval(WireModel):
    """``tool.approval.submit``: a person's decision on a call that waits for approval, keyed
    by ``callId``. Taken only from the mesh's own user (the CLI, the HTTP gateway) or a
    publisher made with ``yoke publisher create --can-approve`` (the AMQP ``user_id`` that
    RabbitMQ verified); the first decision stands."""

    call_id: CommandId
    decision: Literal["approve", "reject"]
    reason: (
        Annotated[
            str, Field(min_length=1, max_length=MAX_REASON_CHARS), BeforeValidator(check_storable)
        ]
        | None
    ) = None
    by: CommandAuthor


EscalationAction = Literal["claim", "cancel", "timeout"]


class SubmitEscalation(WireModel):
    """``escalation.submit``: claim an escalation (its claimer takes the forum over), cancel
    it, or end it at its deadline (the follow-up service). Keyed by the forum
    (``conversationId``), so it is decided in that forum's lane at the door; taken only from
    the mesh's own user (the CLI, the follow-up service) and the HTTP gateway."""

    conversation_id: CommandId
    escalation_id: CommandId
    action: EscalationAction
    # Who claims or cancels (absent for a timeout).
    by: CommandAuthor | None = None


# ApprovalDecided names CommandAuthor, defined with the commands below it.
ApprovalDecided.model_rebuild()

"""The one schema: pydantic models for wire events, commands and stored documents.

Field names are snake_case in Python and camelCase on the wire and in MongoDB (DESIGN §3).
Stored documents keep their ``id`` as MongoDB's ``_id``.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated, Any, ClassVar, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, JsonValue
from pydantic.alias_generators import to_camel


def utcnow() -> datetime:
    return datetime.now(UTC)


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


class ToolResultPart(WireModel):
    type: Literal["tool_result"] = "tool_result"
    call_id: str
    name: str
    output: str
    is_error: bool = False


Part = Annotated[TextPart | ToolCallPart | ToolResultPart, Field(discriminator="type")]


class MessageMeta(WireModel):
    """Routing and causality; other keys a publisher sends along are kept."""

    model_config = ConfigDict(extra="allow")

    source_conversation_id: str | None = None
    source_message_id: str | None = None
    source_actor_id: str | None = None
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


class Usage(WireModel):
    model: str
    input_tokens: int = 0
    output_tokens: int = 0
    cost_usd: float = 0.0


class Message(Document):
    """A line of a conversation, exactly as DESIGN §3 "Message shape"."""

    conversation_id: str
    seq: int = 0
    author_actor_id: str
    participant_id: str | None = None
    role: Literal["user", "agent"] = "user"
    type: Literal["message", "reply", "notice"] = "message"
    parts: list[Part] = Field(default_factory=list)
    meta: MessageMeta = Field(default_factory=MessageMeta)
    usage: Usage | None = None
    created_at: datetime = Field(default_factory=utcnow)

    @property
    def text(self) -> str:
        """The text parts joined, for logs, prompts and tests."""
        return "\n".join(part.text for part in self.parts if isinstance(part, TextPart))


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


EventPayload = MessagePosted | AgentForumJoined | MonologueCompacted
EVENT_TYPES: dict[str, type[EventPayload]] = {
    model.TYPE: model for model in (MessagePosted, AgentForumJoined, MonologueCompacted)
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
        return cls(id=event_id, type=payload.TYPE, payload=payload.to_wire())

    def parse(self) -> EventPayload:
        """The typed payload; raises ``ValueError`` for an unknown type, naming it."""
        model = EVENT_TYPES.get(self.type)
        if model is None:
            raise ValueError(f"unknown event type {self.type!r}")
        return model.model_validate(self.payload)


# --- commands ----------------------------------------------------------------------------


class CommandAuthor(WireModel):
    external_id: str = Field(min_length=1)
    display_name: str = Field(min_length=1)


class SubmitMessage(WireModel):
    """``conversation.message.submit``, published by outside systems on ``yoke.commands``."""

    conversation_id: str = Field(min_length=1)
    author: CommandAuthor
    text: str = Field(min_length=1)
    idempotency_key: str = Field(min_length=1)
    meta: dict[str, JsonValue] | None = None


class SubmitReply(WireModel):
    status: Literal["accepted", "rejected"]
    message_id: str | None = None
    duplicate: bool | None = None
    error: str | None = None

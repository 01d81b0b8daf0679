"""The documents of a call's life and the ids derived from it.

An :class:`OpenCall` lives in ``tool_calls`` while the call waits; its :class:`CallEnd` and, for
a gated call, its :class:`CallDecision` are unique inserts under the call's id, so the first
writer wins and every later one finds what stands. Every id here is derived, never drawn, so a
redelivered step or a second settler writes the same documents and lines again, as no-ops.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any, Literal

from pydantic import Field, JsonValue

from yoke.core.ages import day_bucket
from yoke.core.ids import derive_id
from yoke.core.models import (
    ApprovalDecision,
    CommandAuthor,
    Document,
    MessageMeta,
    as_utc,
)
from yoke.tools.catalog import ToolSource

TOOL_CALLS_COLLECTION = "tool_calls"
TOOL_CALL_ENDS_COLLECTION = "tool_call_ends"
TOOL_CALL_DECISIONS_COLLECTION = "tool_call_decisions"
# A call is filed under its deadline's bucket this wide (``dueBucket``): a reaper's round reads
# the calls of the buckets due now, by equality (FerretDB pushes only top-level equality down; a
# range on the deadline reads the whole collection), not every open call (.reaper).
DUE_BUCKET_SECONDS = 10

EndOutcome = Literal["answered", "timeout", "stopped", "rejected", "failed"]
# ``running``: what ran it answers (or its deadline); ``awaiting_approval``: a gated call not run
# yet, its deadline the approval's; ``approved``: handed to what runs it, its deadline the tool's.
CallState = Literal["running", "awaiting_approval", "approved"]


class OpenCall(Document):
    """``id`` is the call's id as its worker sees it (``callId``): derived from the step."""

    tool: str
    source: ToolSource
    conversation_id: str
    call_line_id: str
    # The model's id for the call (``ToolCallPart.call_id``): what the result answers.
    model_call_id: str
    input: dict[str, JsonValue] = Field(default_factory=dict)
    timeout_seconds: float
    deadline: datetime
    opened_at: datetime = Field(default_factory=lambda: datetime.now(UTC))
    # The result line's routing meta (forum, cause, the forum line answered, hops).
    meta: MessageMeta = Field(default_factory=MessageMeta)
    # Extra routing headers of the result line (topology.GUARDED_HEADER).
    route: dict[str, str] = Field(default_factory=dict)
    # The join's forum and agent (a forum's pending approvals, a stop in the forum).
    forum_id: str | None = None
    agent_actor_id: str | None = None
    state: CallState = "running"
    # Set on a gated call: how long a person had to decide (the error text's N).
    approval_timeout_seconds: float | None = None
    # The process running an in-process or MCP call (its claim, invariant 15): a claim found
    # unfinished and not running here was cut short by a crash, and is ended, never run again.
    runner: str | None = None
    # The round's results line (:func:`round_results_line_id`): a claim cut short once that
    # line is written missed it, and ends in a line of its own.
    round_line_id: str | None = None
    # The step that asked, as a W3C traceparent (tracing on only): what ends the wait, however
    # much later and in whatever trace, links to it (yoke.core.tracing.link).
    trace_parent: str | None = None

    def to_document(self) -> dict[str, Any]:
        # ``dueBucket``, the reaper's key, is derived from ``deadline`` at every write.
        document = super().to_document()
        document["dueBucket"] = due_bucket(self.deadline)
        return document

    @property
    def idempotency_key(self) -> str:
        return derive_id("tool-idempotency", self.id)

    @property
    def awaiting_approval(self) -> bool:
        return self.state == "awaiting_approval"


class CallEnd(Document):
    """How a call ended; ``id`` is the call's."""

    tool: str
    outcome: EndOutcome
    output: str
    is_error: bool
    # Who ended it: the worker's RabbitMQ user, a person's name, or None (the mesh).
    by: str | None = None
    ended_at: datetime = Field(default_factory=lambda: datetime.now(UTC))
    # Ended within its round's step: the result goes in the round's results line (a retried
    # step reuses it), never in a line of its own.
    in_round: bool = False
    age_bucket: str = Field(default_factory=day_bucket)  # .retention: call_rules


class CallDecision(Document):
    """The first decision on a gated call (``id`` is the call's): who, what and why."""

    tool: str
    forum_id: str | None = None
    decision: ApprovalDecision
    by: CommandAuthor | None = None
    reason: str | None = None
    decided_at: datetime = Field(default_factory=lambda: datetime.now(UTC))
    age_bucket: str = Field(default_factory=day_bucket)  # .retention: call_rules


def due_bucket(moment: datetime) -> int:
    return int(as_utc(moment).timestamp() // DUE_BUCKET_SECONDS)


def open_call_id(instance_id: str, call_line_id: str, model_call_id: str) -> str:
    """The id of one call of a call line: its open call, its end, its decision."""
    return derive_id("tool-call", instance_id, call_line_id, model_call_id)


def own_result_line_id(call_id: str) -> str:
    """The line of its own that holds the result of a call that waited in the store (a
    worker's, a slow MCP call, a gated call): one line per call, written by whoever ended it."""
    return derive_id("tool-result", call_id)


def round_results_line_id(instance_id: str, call_line_id: str) -> str:
    """The one line that holds the results of a call line's calls answered within the round's
    step (built-ins, plugins, a quick MCP call): one line per call line, written by the step."""
    return derive_id("tool-results", instance_id, call_line_id)

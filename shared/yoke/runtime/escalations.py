"""Escalations (docs/people-take-over.md): an agent asked for a person with its ``handoff``
tool, and waits, silent in its forum, until someone claims the escalation (a takeover), it
times out (the join's ``handoffTimeoutSeconds``) or it is canceled.

The processor opens one per ``handoff`` call, its id derived from the call's (a retried step
opens nothing twice). What happens to it next is decided once by a unique insert in
``escalation_decisions`` (docs/architecture.md, invariant 8): of two claims, or a claim and its
timeout, the first insert wins and the other is refused. The door (ingestion, in the forum's
lane) carries each decision out; only the winner of the decision updates the escalation's
``state`` (open, claimed, ended), so each update has one writer.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any, Literal

from pydantic import Field

from yoke.core.ages import BUCKET_FIELD, day_bucket
from yoke.core.ids import derive_id
from yoke.core.models import (
    CommandAuthor,
    EscalationAction,
    EscalationOutcome,
    EscalationUrgency,
    WireModel,
    utcnow,
)
from yoke.store.database import Store
from yoke.store.retention import Rule

# The built-in tool an agent asks for a person with (offered when its join has ``handoff``).
HANDOFF_TOOL = "handoff"
# meta.instruction of the line the door writes into the agent's monologue when an escalation
# ends unclaimed (timed out, canceled): the step of that line ends the agent's wait.
HANDOFF_INSTRUCTION = "handoff"
ESCALATIONS = "escalations"
ESCALATION_DECISIONS = "escalation_decisions"
MAX_ESCALATION_REASON_CHARS = 500
# Bounds (docs/people-take-over.md): one open escalation per join, so a forum has at most as
# many as it has agents; an agent at most this many over all its forums.
MAX_OPEN_PER_AGENT = 1000
# The largest page of an inbox (yoke inbox, GET /v1/escalations), and the most escalations
# an inbox reads to order them.
MAX_INBOX_PAGE = 100
MAX_LISTED = 5000

EscalationState = Literal["open", "claimed", "ended"]


def escalation_id(call_id: str) -> str:
    """The escalation a ``handoff`` call opens."""
    return derive_id("escalation", call_id)


class Escalation(WireModel):
    """One request for a person, stored under its id."""

    id: str = Field(alias="_id")
    forum_id: str
    agent_actor_id: str
    join_key: str
    call_id: str
    reason: str
    urgency: EscalationUrgency = "normal"
    opened_at: datetime = Field(default_factory=utcnow)
    deadline: datetime
    state: EscalationState = "open"
    claimed_by: CommandAuthor | None = None
    claimed_at: datetime | None = None
    outcome: EscalationOutcome | None = None
    ended_at: datetime | None = None

    def to_document(self) -> dict[str, Any]:
        document = self.model_dump(mode="python", by_alias=True, exclude_none=True)
        document[BUCKET_FIELD] = day_bucket(self.opened_at)  # swept once ended and old
        return document


class EscalationDecision(WireModel):
    """The first claim, cancel or timeout of an escalation: the one that stands."""

    id: str = Field(alias="_id")  # the escalation's
    action: EscalationAction
    by: CommandAuthor | None = None
    at: datetime = Field(default_factory=utcnow)


class Escalations:
    """The ``escalations`` and ``escalation_decisions`` collections."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.collection = store.db[ESCALATIONS]
        self.decisions = store.db[ESCALATION_DECISIONS]

    async def ensure_indexes(self) -> None:
        """Every service's start makes them (``Store.ensure_indexes``); here for a process that
        uses escalations without starting a service (the CLI's tests)."""
        await self.store.ensure_indexes()

    async def open(self, escalation: Escalation) -> tuple[Escalation, bool]:
        """Store ``escalation`` unless it is there (a retried step): the stored one, and
        whether this call stored it."""
        if await self.store.insert_if_absent(self.collection, escalation.to_document()):
            return escalation, True
        stored = await self.get(escalation.id)
        return (stored if stored is not None else escalation), False

    async def get(self, escalation_id: str) -> Escalation | None:
        document = await self.collection.find_one({"_id": escalation_id})
        return Escalation.model_validate(document) if document else None

    async def decide(
        self, escalation_id: str, action: EscalationAction, by: CommandAuthor | None
    ) -> tuple[bool, EscalationDecision]:
        """The first decision stands: whether this one is it, and the one that stands."""
        decision = EscalationDecision.model_validate(
            {"_id": escalation_id, "action": action, "by": by}
        )
        document = decision.model_dump(mode="python", by_alias=True, exclude_none=True)
        document[BUCKET_FIELD] = day_bucket(decision.at)
        if await self.store.insert_if_absent(self.decisions, document):
            return True, decision
        stored = await self.decisions.find_one({"_id": escalation_id})
        return False, (EscalationDecision.model_validate(stored) if stored else decision)

    async def get_decision(self, escalation_id: str) -> EscalationDecision | None:
        stored = await self.decisions.find_one({"_id": escalation_id})
        return EscalationDecision.model_validate(stored) if stored else None

    async def mark_claimed(self, escalation_id: str, by: CommandAuthor, at: datetime) -> None:
        """The claim's winner records it (one writer)."""
        await self.collection.update_one(
            {"_id": escalation_id},
            {
                "$set": {
                    "state": "claimed",
                    "claimedBy": by.model_dump(mode="python", by_alias=True),
                    "claimedAt": at,
                }
            },
        )

    async def mark_ended(
        self, escalation_id: str, outcome: EscalationOutcome, at: datetime
    ) -> None:
        """The decision's winner (or, after a claim, the hand-back) records the end."""
        await self.collection.update_one(
            {"_id": escalation_id},
            {"$set": {"state": "ended", "outcome": outcome, "endedAt": at}},
        )

    async def listed(
        self,
        *,
        states: tuple[EscalationState, ...] = ("open", "claimed"),
        forum_ids: list[str] | None = None,
        limit: int = MAX_INBOX_PAGE,
    ) -> list[Escalation]:
        """An inbox page, oldest first."""
        query: dict[str, Any] = {"state": {"$in": list(states)}}
        if forum_ids is not None:
            query["forumId"] = {"$in": forum_ids}
        # Sorted here (FerretDB pushes no sort down) over every match up to a cap far above
        # what is open at once (MAX_OPEN_PER_AGENT per agent), so "oldest first" holds.
        documents = await self.collection.find(query).limit(MAX_LISTED).to_list()
        found = sorted(
            (Escalation.model_validate(document) for document in documents),
            key=lambda escalation: (escalation.opened_at, escalation.id),
        )
        return found[: max(1, min(limit, MAX_INBOX_PAGE))]

    async def open_of(self, *, forum_id: str | None = None, agent: str | None = None) -> int:
        query: dict[str, Any] = {"state": {"$in": ["open", "claimed"]}}
        if forum_id is not None:
            query["forumId"] = forum_id
        if agent is not None:
            query["agentActorId"] = agent
        return await self.collection.count_documents(query)

    async def due(self, now: datetime, limit: int = 1000) -> list[Escalation]:
        """Open escalations past their deadline (the follow-up service ends them)."""
        documents = await self.collection.find({"state": "open"}).limit(limit).to_list()
        escalations = [Escalation.model_validate(document) for document in documents]
        return [escalation for escalation in escalations if _utc(escalation.deadline) <= now]


def escalation_rules(store: Store, days: float) -> list[Rule]:
    """Ended escalations and their decisions, kept ``days`` (follow-up's sweep owns them); an
    open or claimed one stays whatever its age: nothing about it is over."""
    escalations = store.db[ESCALATIONS]

    async def not_over(document: dict[str, Any]) -> bool:
        return document.get("state") != "ended"

    async def escalation_not_over(document: dict[str, Any]) -> bool:
        found = await escalations.find_one({"_id": document["_id"]}, {"state": 1})
        return found is not None and found.get("state") != "ended"

    return [
        Rule("escalations", ESCALATIONS, "day", days, live=not_over),
        Rule("escalation decisions", ESCALATION_DECISIONS, "day", days, live=escalation_not_over),
    ]


def _utc(moment: datetime) -> datetime:
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)


class HandoffTool:
    """The ``handoff`` tool as the model is shown it (run by the processor itself)."""

    name = HANDOFF_TOOL
    description = (
        "Ask a person to join this conversation and take it over. Use it when people need a "
        "human (they ask for one, or you cannot help). After calling it, say nothing more "
        "here: a person takes over, or you are told that nobody came."
    )

    def json_schema(self) -> dict[str, Any]:
        return {
            "type": "object",
            "properties": {
                "reason": {
                    "type": "string",
                    "description": "Why a person is needed, for whoever picks it up.",
                    "maxLength": MAX_ESCALATION_REASON_CHARS,
                },
                "urgency": {"type": "string", "enum": ["low", "normal", "high"]},
            },
            "required": ["reason"],
        }


HANDOFF_SPEC = HandoffTool()

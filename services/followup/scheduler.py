"""Follow-up: nudge an agent that spoke last in a forum when nobody answered it.

A join whose configuration has ``followUp`` gets, for each agent line in the forum, a
*schedule* (a document with an id derived from that line, so a redelivery schedules nothing
twice) due ``afterSeconds`` after the line. A person's line in the forum cancels whatever is
pending there, and the agent's next line supersedes its own earlier schedule; other agents'
lines do not count as an answer (the hop cap bounds agents nudging agents).

Every schedule ends in exactly one *decision*, fired or cancelled, recorded by a unique insert
(docs/architecture.md, invariant 8) under an id derived from the schedule: two follow-up processes,
a restart while one is pending, a cancel racing a firing, all end with one winner. A firing is a
resumable procedure (invariant 9): decision first, then the nudge (its id derived from the schedule,
so posting it again is a no-op), then both documents are closed; whoever finds a decision "fired"
that is not done finishes it.

The scheduler never scans: FerretDB 1.x pushes down only top-level equality, so each schedule
carries the integer second it is due in (rounded up) and the minute of that second, and a
poll asks for the seconds that have elapsed since the last one, one equality query each. On
start it looks back over the last hour by minute. Nothing is saved per poll, and while nothing is
pending anywhere (counted every PENDING_GAUGE_SECONDS) and nothing was scheduled here since, no
second is asked for at all.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Awaitable, Callable
from datetime import datetime, timedelta
from typing import Any, Literal

from pydantic import Field
from pymongo import ASCENDING
from pymongo.asynchronous.collection import AsyncCollection

from yoke.core import tracing
from yoke.core.ages import BUCKET_FIELD, day_bucket
from yoke.core.ids import derive_id
from yoke.core.lru import LRUCache
from yoke.core.metrics import (
    FOLLOWUPS_CANCELLED,
    FOLLOWUPS_FIRED,
    FOLLOWUPS_PENDING,
    FOLLOWUPS_SCHEDULED,
)
from yoke.core.models import (
    Actor,
    Document,
    Message,
    MessageMeta,
    MessagePosted,
    TextPart,
    as_utc,
    utcnow,
)
from yoke.runtime.chain import carry_tail
from yoke.runtime.join_config import (
    FollowUpConfig,
    VersionedConfigs,
    delivered_version,
    load_join_config,
)
from yoke.runtime.joins import ensure_participant, join_id, participant_id
from yoke.runtime.posting import Poster
from yoke.store.database import PROCEDURES, Store
from yoke.store.retention import Rule

log = logging.getLogger(__name__)

FOLLOWUPS = "followups"
INSTRUCTION = "follow-up"
# The author of nudges: a system actor of its own, so prompts and history name it.
FOLLOWUP_ACTOR_ID = derive_id("followup-actor")
FOLLOWUP_ACTOR_NAME = "follow-up"

POLL_SECONDS = 0.5
# Seconds polled again at every poll: a schedule written by a process whose clock is a little
# behind this one's still lands in a second that is polled.
SKEW_SECONDS = 2
# At most this many seconds per poll (a process that stalled catches up over several polls),
# and this many schedules per second's query (the rest in the next poll).
MAX_SECONDS_PER_POLL = 120
BATCH = 100
LOOKBACK_SECONDS = 3600
PENDING_GAUGE_SECONDS = 5.0
# Forum lines after the agent's that a firing checks for a person's answer, one by one (by seq
# equality): a safety net for a person's line whose event came before the agent line's.
LATER_LINES_CHECKED = 20

Outcome = Literal["fired", "cancelled"]


class FollowUp(Document):
    """One schedule: nudge the join's agent about its line ``agent_line_id`` when due."""

    join_key: str
    forum_id: str
    agent_actor_id: str
    agent_line_id: str
    agent_line_seq: int
    agent_hops: int
    # Follow-ups in a row without a person's line, this one included.
    streak: int = Field(ge=1)
    due_at: datetime
    due_second: int
    due_minute: int
    created_at: datetime = Field(default_factory=utcnow)
    # The delivery that scheduled it, as a W3C traceparent (tracing on only): the nudge, a
    # trace of its own when it fires, links to it.
    trace_parent: str | None = None


class FollowUpDecision(Document):
    """What became of a schedule; the unique insert of this document decides it."""

    kind: str = "follow-up"
    schedule_id: str
    outcome: Outcome
    reason: str = ""
    streak: int = 1
    done: bool = False
    created_at: datetime = Field(default_factory=utcnow)
    # yoke.store.retention: the day it was decided, then the day it was done (kept from then).
    age_bucket: str = Field(default_factory=day_bucket)


def schedule_id(join_key: str, agent_line_id: str) -> str:
    return derive_id("followup", join_key, agent_line_id)


def decision_id(schedule: str) -> str:
    return derive_id("followup-decision", schedule)


def nudge_id(schedule: str) -> str:
    return derive_id("followup-nudge", schedule)


def due_second_of(due_at: datetime) -> int:
    """Rounded up: every schedule of a polled second (≤ now) is due."""
    return math.ceil(due_at.timestamp())


async def ensure_schema(store: Store) -> None:
    """The collections and the schedules' equality indexes (idempotent), before any traffic."""
    await store.create_collections(FOLLOWUPS, PROCEDURES)
    schedules = store.db[FOLLOWUPS]
    await schedules.create_index([("dueSecond", ASCENDING)], name="due_second")
    await schedules.create_index([("dueMinute", ASCENDING)], name="due_minute")
    await schedules.create_index([("forumId", ASCENDING)], name="forum")


async def _undone(document: dict[str, Any]) -> bool:
    """A firing not finished yet is live: whoever next sees it finishes it (invariant 9)."""
    return not document.get("done", False)


def decision_rule(days: float) -> Rule:
    """Follow-up decisions are kept ``days`` once done (a pending schedule has none yet)."""
    return Rule(
        "follow-up decisions", PROCEDURES, "day", days, where={"kind": "follow-up"}, live=_undone
    )


async def _kind(
    cache: LRUCache[str, str], collection: AsyncCollection[dict[str, Any]], key: str
) -> str:
    """A document's ``kind`` (which never changes), cached."""
    if key not in cache:
        document = await collection.find_one({"_id": key}, {"kind": 1})
        if document is None:
            return ""  # not cached: it may be written yet
        cache[key] = str(document.get("kind") or "")
    return cache[key]


class FollowUps:
    """The follow-up service's logic: react to forum lines, and fire what is due."""

    def __init__(self, store: Store, poster: Poster, *, decision_days: float = 7.0) -> None:
        self.store = store
        self.poster = poster
        # Decisions are kept this long (yoke.store.retention): an older line's is gone, so it is
        # never scheduled (a redelivery of it would nudge again).
        self.decided_for = timedelta(days=decision_days)
        self.schedules = store.db[FOLLOWUPS]
        # Decisions are procedure records, next to compaction's swaps.
        self.decisions = store.db[PROCEDURES]
        # Kinds never change: a conversation is a forum or a monologue, an actor keeps its kind.
        self._conversation_kinds: LRUCache[str, str] = LRUCache()
        self._actor_kinds: LRUCache[str, str] = LRUCache()
        # Read once per version: an agent line says its join configuration's.
        self._configs = VersionedConfigs(store)
        self._ready: asyncio.Task[None] | None = None
        # A schedule written here since the scheduler last counted what is pending.
        self._scheduled_here = False

    async def ready(self) -> None:
        """The collection, indexes and the nudges' author, once per process."""
        if self._ready is None:
            self._ready = asyncio.ensure_future(self._prepare())
        await asyncio.shield(self._ready)

    async def _prepare(self) -> None:
        await ensure_schema(self.store)
        await self.store.save_actor(
            Actor(id=FOLLOWUP_ACTOR_ID, kind="system", name=FOLLOWUP_ACTOR_NAME)
        )

    # --- forum lines ---------------------------------------------------------------------

    async def on_posted(self, event: MessagePosted) -> None:
        """A person's line cancels what is pending; an agent's line is scheduled."""
        line = event.message
        if line.type != "message":
            return
        if await self._conversation_kind(event.conversation_id) != "forum":
            return  # monologues: most of the traffic, ignored from the cache
        author_kind = await self._actor_kind(line.author_actor_id)
        if author_kind == "human":
            await self.ready()
            await self.cancel_pending(line.conversation_id, line.seq, "a person answered")
        elif author_kind == "agent" and line.role == "agent":
            await self.ready()
            await self.schedule(line, delivered_version())

    async def _conversation_kind(self, conversation_id: str) -> str:
        return await _kind(self._conversation_kinds, self.store.conversations, conversation_id)

    async def _actor_kind(self, actor_id: str) -> str:
        return await _kind(self._actor_kinds, self.store.actors, actor_id)

    async def schedule(self, line: Message, version: str | None = None) -> FollowUp | None:
        """Schedule a nudge about the agent's forum line, if its join asks for follow-ups
        (``version``: of the join configuration the line was written with, if known)."""
        if utcnow() - as_utc(line.created_at) > self.decided_for:
            return None
        key = join_id(line.author_actor_id, line.conversation_id)
        # Read once per version: an agent that talks fast costs no read per line.
        config = await self._configs.get(key, version)
        if config is None or config.follow_up is None:
            return None
        # The agent spoke again: its earlier schedule in this forum is superseded.
        await self.cancel_pending(
            line.conversation_id, line.seq, "the agent spoke again", join_key=key
        )
        streak = await self._streak(key, line)
        if streak > config.follow_up.max_consecutive:
            log.info(
                "no follow-up: %d in a row without a person's line already",
                streak - 1,
                extra={"conversationId": line.conversation_id, "messageId": line.id},
            )
            return None
        key_id = schedule_id(key, line.id)
        if await self.decisions.find_one({"_id": decision_id(key_id)}, {"_id": 1}) is not None:
            return None  # a redelivery of a line whose follow-up is over
        due_at = line.created_at + timedelta(seconds=config.follow_up.after_seconds)
        second = due_second_of(due_at)
        schedule = FollowUp(
            id=key_id,
            join_key=key,
            forum_id=line.conversation_id,
            agent_actor_id=line.author_actor_id,
            agent_line_id=line.id,
            agent_line_seq=line.seq,
            agent_hops=line.meta.agent_hops,
            streak=streak,
            due_at=due_at,
            due_second=second,
            due_minute=second // 60,
            trace_parent=tracing.traceparent(),
        )
        if await self.store.insert_if_absent(self.schedules, schedule.to_document()):
            self._scheduled_here = True  # the scheduler polls again from now on
            FOLLOWUPS_SCHEDULED.inc()
        return schedule

    async def _streak(self, join_key: str, line: Message) -> int:
        """1, or one more than the follow-up this line answers (nudges reply to the line they
        follow up, and the agent's answer carries that ``inReplyTo``)."""
        if not line.meta.in_reply_to:
            return 1
        document = await self.decisions.find_one(
            {"_id": decision_id(schedule_id(join_key, line.meta.in_reply_to))}
        )
        if document is None:
            return 1
        decision = FollowUpDecision.from_document(document)
        return decision.streak + 1 if decision.outcome == "fired" else 1

    async def cancel_pending(
        self, forum_id: str, seq: int, reason: str, *, join_key: str | None = None
    ) -> None:
        """Cancel the forum's open schedules about lines before ``seq``."""
        documents = await self.schedules.find({"forumId": forum_id}).to_list()
        for document in documents:
            schedule = FollowUp.from_document(document)
            if join_key is not None and schedule.join_key != join_key:
                continue
            if schedule.agent_line_seq >= seq:
                continue
            await self._decide(schedule, "cancelled", reason)

    # --- firing ----------------------------------------------------------------------------

    async def fire_due(self, schedules: list[FollowUp], now: float) -> None:
        for schedule in schedules:
            if schedule.due_at.timestamp() > now:
                continue
            try:
                await self.fire(schedule)
            except Exception:
                # Left open: the next poll of its second (or a restart's look-back) tries again.
                log.exception(
                    "a follow-up could not fire yet",
                    extra={
                        "conversationId": schedule.forum_id,
                        "messageId": schedule.agent_line_id,
                    },
                )

    async def fire(self, schedule: FollowUp) -> None:
        """Decide (fired, or cancelled when nobody should be nudged any more), then finish: a
        ``nudge`` span, linked to the agent line's turn."""
        with tracing.span(
            "nudge",
            attributes={
                tracing.FORUM_ID: schedule.forum_id,
                tracing.MESSAGE_ID: schedule.agent_line_id,
                "yoke.streak": schedule.streak,
            },
            links=[schedule.trace_parent],
        ):
            await self._fire(schedule)

    async def _fire(self, schedule: FollowUp) -> None:
        participant = await self.store.get_participant(
            participant_id(schedule.forum_id, schedule.agent_actor_id)
        )
        config = await load_join_config(self.store, schedule.join_key)
        if participant is None or participant.left_at is not None:
            await self._decide(schedule, "cancelled", "the join ended")
        elif config is None or config.follow_up is None:
            await self._decide(schedule, "cancelled", "follow-up turned off")
        elif await self._answered_by_a_person(schedule):
            await self._decide(schedule, "cancelled", "a person answered")
        else:
            await self._decide(schedule, "fired", "nobody answered", config.follow_up)

    async def _answered_by_a_person(self, schedule: FollowUp) -> bool:
        for seq in range(
            schedule.agent_line_seq + 1, schedule.agent_line_seq + 1 + LATER_LINES_CHECKED
        ):
            document = await self.store.messages.find_one(
                {"conversationId": schedule.forum_id, "seq": seq},
                {"authorActorId": 1, "type": 1},
            )
            if document is None:
                return False
            author = str(document["authorActorId"])
            if document.get("type") == "message" and await self._actor_kind(author) == "human":
                return True
        return False

    async def _decide(
        self,
        schedule: FollowUp,
        outcome: Outcome,
        reason: str,
        follow_up: FollowUpConfig | None = None,
    ) -> None:
        """Record the decision (the first one wins), carry out the one that won, and close."""
        decision = FollowUpDecision(
            id=decision_id(schedule.id),
            schedule_id=schedule.id,
            outcome=outcome,
            reason=reason,
            streak=schedule.streak,
        )
        won = await self.store.insert_if_absent(self.decisions, decision.to_document())
        if not won:
            document = await self.decisions.find_one({"_id": decision.id})
            if document is None:
                return  # cannot happen: the insert found it
            decision = FollowUpDecision.from_document(document)
        if not decision.done:
            if decision.outcome == "fired":
                if follow_up is None:
                    config = await load_join_config(self.store, schedule.join_key)
                    follow_up = config.follow_up if config else None
                await self._nudge(schedule, follow_up or FollowUpConfig(after_seconds=1))
            # The decision's owner is whoever finishes it; every finisher writes the same.
            await self.decisions.update_one(
                {"_id": decision.id}, {"$set": {"done": True, BUCKET_FIELD: day_bucket()}}
            )
        # Only pending schedules stay in the collection: what the scheduler reads never grows.
        await self.schedules.delete_one({"_id": schedule.id})
        tracing.annotate({"yoke.outcome": decision.outcome})
        if won:
            (FOLLOWUPS_FIRED if decision.outcome == "fired" else FOLLOWUPS_CANCELLED).inc()
            log.info(
                "follow-up %s: %s",
                decision.outcome,
                reason,
                extra={"conversationId": schedule.forum_id, "messageId": schedule.agent_line_id},
            )

    async def _nudge(self, schedule: FollowUp, follow_up: FollowUpConfig) -> None:
        """The nudge, into the agent's active monologue (the forum participant's monologueId,
        which compaction moves), as an instruction the processor answers."""
        await self.ready()
        participant = await self.store.get_participant(
            participant_id(schedule.forum_id, schedule.agent_actor_id)
        )
        monologue_id = str((participant.metadata if participant else {}).get("monologueId") or "")
        if participant is None or not monologue_id:
            log.error("no monologue to nudge", extra={"conversationId": schedule.forum_id})
            return
        author = await ensure_participant(self.store, monologue_id, FOLLOWUP_ACTOR_ID)
        nudge = await self.poster.post(
            Message(
                id=nudge_id(schedule.id),
                conversation_id=monologue_id,
                author_actor_id=FOLLOWUP_ACTOR_ID,
                participant_id=author.id,
                role="user",
                parts=[TextPart(text=follow_up.text)],
                meta=MessageMeta(
                    source_conversation_id=schedule.forum_id,
                    causation_id=schedule.agent_line_id,
                    # The agent's answer replies to the line it follows up (and so tells the
                    # next schedule how many follow-ups are in a row).
                    in_reply_to=schedule.agent_line_id,
                    agent_hops=schedule.agent_hops,
                    instruction=INSTRUCTION,
                ),
            )
        )
        # The monologue may have been compacted meanwhile: if so, the nudge is carried on.
        await carry_tail(self.store, self.poster, participant.id, monologue_id, nudge.seq)

    # --- the scheduler ---------------------------------------------------------------------

    async def due_in_second(self, second: int) -> list[FollowUp]:
        documents = await self.schedules.find({"dueSecond": second}).limit(BATCH).to_list()
        return [FollowUp.from_document(document) for document in documents]

    async def due_in_minute(self, minute: int) -> list[FollowUp]:
        documents = await self.schedules.find({"dueMinute": minute}).limit(BATCH).to_list()
        return [FollowUp.from_document(document) for document in documents]

    async def run(self, stopping: asyncio.Event, clock: Callable[[], float] = time.time) -> None:
        """Poll the elapsed seconds until ``stopping``; a failed poll is tried again."""
        await _until_done(self.ready, stopping)
        now = clock()
        await _until_done(lambda: self._look_back(now), stopping)
        cursor = math.floor(now)  # every second up to here is handled
        counted = 0.0
        pending = 1  # not counted yet: poll
        while not stopping.is_set():
            now = clock()
            try:
                if now - counted >= PENDING_GAUGE_SECONDS:
                    # Cleared before the count: a schedule written after it sets it again.
                    self._scheduled_here = False
                    pending = await self.schedules.count_documents({})
                    FOLLOWUPS_PENDING.set(pending)
                    counted = now
                if pending or self._scheduled_here:
                    cursor = await self._poll(cursor, now)
                else:
                    # Nothing pending anywhere at the last count and nothing written here since:
                    # no second's query. Another replica's schedule is counted within
                    # PENDING_GAUGE_SECONDS (its writer, polling, fires it on time); if that
                    # replica is gone, the seconds since the count are polled then.
                    cursor = max(cursor, math.floor(counted))
            except Exception:
                log.exception("follow-up poll failed; trying again")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stopping.wait(), timeout=POLL_SECONDS)

    async def _look_back(self, now: float) -> None:
        """Schedules due while no follow-up process ran (bounded: the last hour)."""
        first = math.floor((now - LOOKBACK_SECONDS) / 60)
        for minute in range(first, math.floor(now) // 60 + 1):
            await self.fire_due(await self.due_in_minute(minute), now)

    async def _poll(self, cursor: int, now: float) -> int:
        """Fire what is due in the seconds after ``cursor`` (and a few before); the new cursor."""
        last = min(math.floor(now), cursor + MAX_SECONDS_PER_POLL)
        for second in range(cursor - SKEW_SECONDS + 1, last + 1):
            due = await self.due_in_second(second)
            await self.fire_due(due, now)
            if len(due) == BATCH and second > cursor:
                return second - 1  # a full batch: this second again in the next poll
        return max(cursor, last)


async def _until_done(action: Callable[[], Awaitable[Any]], stopping: asyncio.Event) -> None:
    """Run ``action`` until it succeeds (the store may be away at start) or we stop."""
    while not stopping.is_set():
        try:
            await action()
            return
        except Exception:
            log.exception("follow-up start-up step failed; trying again")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stopping.wait(), timeout=1.0)

"""Escalations nobody claimed in time (docs/people-take-over.md): the follow-up service ends them.

Each poll reads :meth:`Escalations.due` and submits ``escalation.submit`` ``{action: timeout}``
for each, on ``yoke.commands`` as the services' own RabbitMQ user (the door takes escalation
decisions only from the mesh's users), keyed by the escalation's forum. The door decides once
(a unique insert in ``escalation_decisions``): a claim that came first wins and the timeout is
refused, which is no error here. The deadline is in the store, so nothing is lost to a restart:
the first poll after it finds what fell due meanwhile.

One replica sweeps: rendezvous hashing over follow-up's live replicas (the shard owners' live
set, :class:`yoke.coordination.ownership.Ownership`), as the processors share their reaper's
sweep. While the live set changes two may sweep for a moment, which costs a refused repeat at the
door and nothing more. The sweeping replica also reports ``yoke_forums_held``,
``yoke_escalations_open`` and ``yoke_escalation_oldest_open_seconds``; the others report 0, so a
dashboard takes the max over instances.

A timeout the door has not answered yet (ingestion down or behind) is submitted again only after
:data:`RESUBMIT_SECONDS`, not at every poll: a backlog of its repeats would only queue up behind it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime

from yoke.bus import topology
from yoke.client import Client
from yoke.coordination.ownership import weight
from yoke.core.metrics import (
    ESCALATION_OLDEST_OPEN_SECONDS,
    ESCALATIONS_OPEN,
    FORUMS_HELD,
    STORE_ORIGIN,
)
from yoke.core.models import SubmitEscalation, SubmitReply, as_utc
from yoke.runtime.escalations import Escalation, Escalations
from yoke.runtime.holds import Holds
from yoke.store.database import Store

log = logging.getLogger(__name__)

# Deadlines are whole minutes apart (handoffTimeoutSeconds, 900 by default): a second's poll
# ends each within a second of it, at one read of the open escalations a second when idle.
SWEEP_SECONDS = 1.0
# The gauges are counted this often (three reads).
GAUGE_SECONDS = 5.0
# A timeout submitted and not yet carried out is submitted again after this long.
RESUBMIT_SECONDS = 30.0
# How long one submit waits for the door's answer.
REPLY_SECONDS = 20.0
# At most this many timeouts wait for their answer at once (the rest in later polls).
MAX_IN_FLIGHT = 100
# The sweep's key among rendezvous weights (no shard has it).
SWEEP_KEY = -1
# The sweep's reply queues: the services' user may declare only yoke.* queues, and the door
# answers it only on one of the prefixes it owns (DoorUsers.may_answer).
REPLY_QUEUE_PREFIX = f"{topology.CLI_REPLY_QUEUE_PREFIX}followup."
# What yoke_store_operations calls the sweep's store operations.
SWEEP_ORIGIN = "escalation-sweep"

# Submits one escalation command and returns the door's answer.
Submit = Callable[[SubmitEscalation], Awaitable[SubmitReply]]
# (this replica, the live replicas), or None before the first ownership round (one process).
LiveSet = Callable[[], tuple[str, list[str]] | None]


def sweeps_here(live_set: LiveSet) -> bool:
    """Whether this replica is the one that sweeps (any replica alone, or before it knows)."""
    found = live_set()
    if found is None or not found[1]:
        return True
    me, live = found
    return max(live, key=lambda replica: weight("escalation-sweep", SWEEP_KEY, replica)) == me


def timeout_command(escalation: Escalation) -> SubmitEscalation:
    return SubmitEscalation(
        conversation_id=escalation.forum_id, escalation_id=escalation.id, action="timeout"
    )


class EscalationSweep:
    """Ends what is past its deadline and reports what is held and waiting."""

    def __init__(
        self,
        store: Store,
        submit: Submit,
        live_set: LiveSet = lambda: None,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.escalations = Escalations(store)
        self.holds = Holds(store)
        self.submit = submit
        self.live_set = live_set
        self.clock = clock
        # Escalation id -> when its timeout was last submitted (clock), while it is due.
        self._submitted: dict[str, float] = {}
        self._in_flight: dict[str, asyncio.Task[None]] = {}
        self._counted_at: float | None = None

    async def ready(self) -> None:
        """The collections and the indexes the sweep reads by (idempotent)."""
        await self.escalations.ensure_indexes()

    async def poll(self, now: datetime | None = None) -> list[str]:
        """One round: the ids whose timeout this round submitted."""
        now = now or datetime.now(UTC)
        if not sweeps_here(self.live_set):
            self._counted_at = None  # counted at once should this replica become the sweeper
            for gauge in (FORUMS_HELD, ESCALATIONS_OPEN, ESCALATION_OLDEST_OPEN_SECONDS):
                gauge.set(0)
            return []
        submitted = await self.sweep(now)
        moment = self.clock()
        if self._counted_at is None or moment - self._counted_at >= GAUGE_SECONDS:
            await self.report(now)
            self._counted_at = moment
        return submitted

    async def sweep(self, now: datetime) -> list[str]:
        """Submit the timeout of every escalation due at ``now`` not submitted lately."""
        due = await self.escalations.due(now)
        moment = self.clock()
        ids = {escalation.id for escalation in due}
        for gone in set(self._submitted) - ids:
            del self._submitted[gone]  # decided: its memory goes with it
        submitted: list[str] = []
        for escalation in due:
            if escalation.id in self._in_flight or len(self._in_flight) >= MAX_IN_FLIGHT:
                continue
            last = self._submitted.get(escalation.id)
            if last is not None and moment - last < RESUBMIT_SECONDS:
                continue
            self._submitted[escalation.id] = moment
            task = asyncio.create_task(self._time_out(escalation))
            self._in_flight[escalation.id] = task
            submitted.append(escalation.id)
        return submitted

    async def _time_out(self, escalation: Escalation) -> None:
        extra = {"conversationId": escalation.forum_id, "escalationId": escalation.id}
        try:
            reply = await self.submit(timeout_command(escalation))
        except Exception as error:  # no answer (the door down or behind): resubmitted later
            log.warning("an escalation's timeout got no answer yet: %r", error, extra=extra)
            return
        finally:
            self._in_flight.pop(escalation.id, None)
        if reply.status == "accepted":
            log.info("escalation timed out: nobody claimed it", extra=extra)
        else:  # decided otherwise first (claimed, canceled): the door says so
            log.info("escalation's timeout refused: %s", reply.error, extra=extra)

    async def report(self, now: datetime) -> None:
        """The gauges, as stored."""
        FORUMS_HELD.set(await self.holds.count())
        collection = self.escalations.collection
        ESCALATIONS_OPEN.set(await collection.count_documents({"state": "open"}))
        oldest: datetime | None = None
        async for document in collection.find({"state": "open"}, {"openedAt": 1}).limit(10_000):
            opened = as_utc(document["openedAt"])
            oldest = opened if oldest is None else min(oldest, opened)
        age = (now - oldest).total_seconds() if oldest is not None else 0.0
        ESCALATION_OLDEST_OPEN_SECONDS.set(max(0.0, age))

    async def run(self, stopping: asyncio.Event) -> None:
        """Poll every :data:`SWEEP_SECONDS` until ``stopping``; a failed round is tried again."""
        STORE_ORIGIN.set(SWEEP_ORIGIN)  # this task's store operations, told apart
        try:
            while not stopping.is_set():
                try:
                    await self.poll()
                except Exception:
                    log.exception("escalation sweep failed; trying again")
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stopping.wait(), timeout=SWEEP_SECONDS)
        finally:
            for task in list(self._in_flight.values()):
                task.cancel()
            await asyncio.gather(*self._in_flight.values(), return_exceptions=True)


async def sweep_escalations(
    store: Store, amqp_url: str, live_set: LiveSet, stopping: asyncio.Event
) -> None:
    """The sweep for the service's lifetime, submitting through a client of its own (the
    door answers each timeout on its reply queue: a refusal is an answer, not a dead letter)."""
    while not stopping.is_set():
        try:
            async with Client(amqp_url, queue_prefix=REPLY_QUEUE_PREFIX) as client:

                async def submit(command: SubmitEscalation) -> SubmitReply:
                    return await client.submit_escalation(
                        command.conversation_id,
                        command.escalation_id,
                        command.action,
                        reply_timeout=REPLY_SECONDS,
                        publish_timeout=REPLY_SECONDS,
                    )

                sweep = EscalationSweep(store, submit, live_set)
                await sweep.ready()
                await sweep.run(stopping)
                return
        except Exception:
            log.exception("escalation sweep could not start; trying again")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stopping.wait(), timeout=SWEEP_SECONDS)

"""The model calls in flight in this process, by conversation, and the stops seen ahead of them.

A line that arrives for a conversation whose step is running waits in that conversation's lane
(docs/architecture.md, invariant 3): FIFO means the step in flight cannot learn of it from the
store or its own delivery. So the processor's look at each delivery that arrives for a busy
lane, before it queues there (``Service.on_arrival``), hands the line to this registry
(:meth:`InFlight.arrive`), which does at once what the join's
:class:`~yoke.runtime.while_busy.WhileBusyPolicy` says the line does: interrupt the model call
in flight (:meth:`InFlight.interrupt`), or stop the agent (:meth:`InFlight.stop`: remembered, so
that the steps of the earlier lines still queued behind the call answer nothing,
:meth:`InFlight.stop_after`).

Nothing here is stored: after a restart the deliveries come back in order, and the registry
sees them again as they arrive. It holds one entry per conversation with a call in flight and a
bounded number of stops (invariant 14).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal, Protocol

from yoke.core.lru import LRUCache
from yoke.core.models import Message
from yoke.runtime.while_busy import WhileBusyPolicy, line_kind

log = logging.getLogger(__name__)

CancelReason = Literal["interrupt", "stop"]
# Stops remembered, one per conversation: a stop matters only until its own step has run. As
# many people's lines that came while no call was registered yet (the step reading its window).
MAX_STOPS = 10_000


class Cancellable(Protocol):
    """What a model call in flight is to the registry (an asyncio task)."""

    def cancel(self) -> bool: ...

    def done(self) -> bool: ...


@dataclass(frozen=True)
class Arrival:
    """A line as its delivery arrived: enough to decide, nothing of its text."""

    conversation_id: str
    seq: int
    line_id: str
    # Who wrote it: the author in the conversation (a person's shadow actor, in a monologue).
    actor_id: str


@dataclass
class ModelCall:
    """One step's model call while it runs: what it was shown, and whether it may still go."""

    conversation_id: str
    # The step's trigger, and the newest line of its prompt (past the trigger when it answers
    # a burst), and the join's policy, which says what an arriving line does to it.
    trigger_seq: int
    covered_seq: int
    policy: WhileBusyPolicy
    task: Cancellable
    cancelled: tuple[CancelReason, Arrival] | None = None
    # Its answer is being posted: too late to cancel (a line that arrives now is answered next).
    settled: bool = False

    def settle(self) -> bool:
        """Mark the call's answer as posted from now on; ``False`` if it was cancelled first.

        Synchronous on purpose: between the model's answer and this, no other task runs, so a
        cancel either came before (the answer is dropped) or finds it settled (kept).
        """
        if self.cancelled is not None:
            return False
        self.settled = True
        return True

    def _cancel(self, reason: CancelReason, arrival: Arrival) -> bool:
        if self.settled or self.cancelled is not None or self.task.done():
            return False
        self.cancelled = (reason, arrival)
        self.task.cancel()
        return True


class InFlight:
    """This process's model calls in flight by conversation, and the stops that came for them."""

    def __init__(self, max_stops: int = MAX_STOPS) -> None:
        self._calls: dict[str, ModelCall] = {}
        self._stops: LRUCache[str, Arrival] = LRUCache(max_stops)
        self._early: LRUCache[str, Arrival] = LRUCache(max_stops)

    @contextlib.contextmanager
    def track(
        self,
        conversation_id: str,
        task: Cancellable,
        *,
        trigger_seq: int,
        covered_seq: int,
        policy: WhileBusyPolicy,
    ) -> Iterator[ModelCall]:
        """Register ``task`` (the model call) as the conversation's call in flight while inside.

        What arrived while the step was getting ready (its lane busy, no call registered yet)
        is put to ``policy`` now: a stop for a later line, or a person's line that interrupts a
        call whose prompt does not hold it, cancels it at once. A line remembered so is never
        stale: the step that answers it reads past it.
        """
        call = ModelCall(conversation_id, trigger_seq, covered_seq, policy, task)
        self._calls[conversation_id] = call
        stop = self.stop_after(conversation_id, trigger_seq)
        early = self._early.pop(conversation_id, None)
        if stop is not None:
            call._cancel("stop", stop)
        elif early is not None and policy.on_arrival("person", early.seq, call) == "interrupts":
            call._cancel("interrupt", early)
        try:
            yield call
        finally:
            if self._calls.get(conversation_id) is call:
                del self._calls[conversation_id]

    def call_in(self, conversation_id: str) -> ModelCall | None:
        return self._calls.get(conversation_id)

    def arrive(self, line: Message) -> bool:
        """A line arrived for a busy lane: do what the policy of the call in flight says it
        does (a person's line or ``/stop``; nothing else is even remembered). Whether a model
        call was cancelled."""
        kind = line_kind(line)
        if kind == "other":
            return False
        arrival = Arrival(line.conversation_id, line.seq, line.id, line.author_actor_id)
        return self.stop(arrival) if kind == "stop" else self.interrupt(arrival)

    def interrupt(self, arrival: Arrival) -> bool:
        """A person's line arrived: cancel the call in flight if its policy says the line
        interrupts it; with none yet, remember the line for the call to come."""
        call = self._calls.get(arrival.conversation_id)
        if call is None:
            known = self._early.get(arrival.conversation_id)
            if known is None or known.seq < arrival.seq:
                self._early[arrival.conversation_id] = arrival
            return False
        if call.policy.on_arrival("person", arrival.seq, call) != "interrupts":
            return False
        cancelled = call._cancel("interrupt", arrival)
        if cancelled:
            log.info(
                "a line interrupts the model call in flight",
                extra={"conversationId": arrival.conversation_id, "messageId": arrival.line_id},
            )
        return cancelled

    def stop(self, arrival: Arrival) -> bool:
        """A person's ``/stop`` arrived: remember it, and cancel the call for an earlier line."""
        known = self._stops.get(arrival.conversation_id)
        if known is None or known.seq < arrival.seq:
            self._stops[arrival.conversation_id] = arrival
        call = self._calls.get(arrival.conversation_id)
        if call is None or call.policy.on_arrival("stop", arrival.seq, call) != "stops":
            return False
        cancelled = call._cancel("stop", arrival)
        if cancelled:
            log.info(
                "a stop drops the model call in flight",
                extra={"conversationId": arrival.conversation_id, "messageId": arrival.line_id},
            )
        return cancelled

    def stop_after(self, conversation_id: str, seq: int) -> Arrival | None:
        """The stop seen for a line after ``seq`` of the conversation, if any: the line at
        ``seq`` was sent before it, and is not to be answered."""
        stop = self._stops.get(conversation_id)
        return stop if stop is not None and stop.seq > seq else None


def cancelled_here(call: ModelCall) -> bool:
    """Whether the CancelledError the step just caught is this registry's cancel of its model
    call, rather than the step itself being cancelled (the service stopping)."""
    task = asyncio.current_task()
    return call.cancelled is not None and (task is None or task.cancelling() == 0)

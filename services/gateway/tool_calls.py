"""Where each tool call of a monologue stands, for the console: its source, state and duration.

A call is a ``tool_call`` part of the agent's line; its result is the ``tool_result`` with the
same ``callId`` in one of two lines whose ids derive from the call (invariant 4,
docs/architecture.md): the round's results line, for a call answered inside the step (built-ins,
plugins, a quick MCP call), or the call's own result line, for a call that waited in the store
(a worker's, a slow MCP call), whose :class:`~yoke.runtime.calls.records.CallEnd` says how it
ended and whose :class:`~yoke.runtime.calls.records.OpenCall` exists while it waits. So each
state is read by id (a handful of ``$in`` lookups per page of lines), never by scanning the
monologue.

A call of a gated tool waits in the store too, first ``awaiting_approval``; once a person (or
the deadline, or a stop) decides, its :class:`~yoke.runtime.calls.records.CallDecision` says
what, who and why, shown with the call whatever its state.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal

from yoke.core.models import (
    ApprovalDecision,
    CommandAuthor,
    Message,
    ToolCallPart,
    ToolResultPart,
    WireModel,
    as_utc,
)
from yoke.runtime.calls.records import (
    TOOL_CALL_DECISIONS_COLLECTION,
    TOOL_CALL_ENDS_COLLECTION,
    TOOL_CALLS_COLLECTION,
    CallDecision,
    CallEnd,
    OpenCall,
    open_call_id,
    own_result_line_id,
    round_results_line_id,
)
from yoke.runtime.catalog_store import ToolCatalog
from yoke.runtime.joins import join_id
from yoke.store.database import Store
from yoke.tools.catalog import ToolSource

# running: no result yet and not waiting in the store (its step is under way); awaiting_approval:
# a gated call nobody has decided on yet; open: waiting in the store for its answer; then how it
# ended (error: the tool answered with an error).
CallState = Literal[
    "running",
    "awaiting_approval",
    "open",
    "answered",
    "error",
    "timeout",
    "stopped",
    "rejected",
    "failed",
]
# A compacted monologue's context is carried into the next one; the calls there are followed
# back to the line the agent first wrote (each compaction adds one hop).
MAX_CARRIED_HOPS = 50


class ApprovalView(WireModel):
    """The decision on a gated call: approve, reject, expired or stopped; by whom, and why."""

    decision: ApprovalDecision
    by: CommandAuthor | None = None
    reason: str | None = None
    decided_at: datetime


class ToolCallView(WireModel):
    """One call as the console's monologue view shows it."""

    call_line_id: str
    # The model's id for the call (the part's ``callId``), unique in its line.
    call_id: str
    name: str
    # From the catalog (the open call's own while it waits); None: not in the catalog.
    source: ToolSource | None
    state: CallState
    started_at: datetime
    ended_at: datetime | None = None
    # Start to result; for a call without a result yet, how long it has been waiting.
    seconds: float
    # The call's id as its worker sees it, for a call that waited in the store.
    open_call_id: str | None = None
    deadline: datetime | None = None
    result_line_id: str | None = None
    # A gated call's decision, once taken.
    approval: ApprovalView | None = None


@dataclass(frozen=True)
class _Call:
    line: Message  # the line shown
    origin: Message  # the line the agent wrote (itself, unless carried by compaction)
    part: ToolCallPart


def _result_in(line: Message | None, call_id: str) -> ToolResultPart | None:
    if line is None:
        return None
    return next(
        (p for p in line.parts if isinstance(p, ToolResultPart) and p.call_id == call_id), None
    )


class ToolCallStates:
    """Reads the states of a monologue's calls for one agent's join."""

    def __init__(self, store: Store, catalog: ToolCatalog) -> None:
        self.store = store
        self.catalog = catalog

    async def views(
        self, monologue_id: str, forum_id: str, agent_actor_id: str, lines: list[Message]
    ) -> list[ToolCallView]:
        """The calls the page must draw or redraw: those of ``lines``, those that ``lines``
        answer (shown before), and every call still waiting in the store for this monologue."""
        calls: dict[tuple[str, str], _Call] = {}
        for line in lines:
            for part in line.parts:
                if isinstance(part, ToolCallPart) and line.role == "agent":
                    calls[(line.id, part.call_id)] = _Call(line, line, part)
        answered_elsewhere = [
            (line.meta.causation_id, part.call_id)
            for line in lines
            if line.meta.causation_id and not line.meta.carried_from
            for part in line.parts
            if isinstance(part, ToolResultPart)
        ]
        waiting = [
            (str(document["callLineId"]), str(document["modelCallId"]))
            async for document in self.store.db[TOOL_CALLS_COLLECTION].find(
                {"conversationId": monologue_id},
                projection={"callLineId": 1, "modelCallId": 1},
            )
            if "callLineId" in document and "modelCallId" in document
        ]
        wanted = {key for key in answered_elsewhere if key not in calls}
        wanted |= set(waiting) - calls.keys()
        for line in await self._messages({line_id for line_id, _ in wanted}):
            if line.conversation_id != monologue_id:
                continue
            for part in line.parts:
                if isinstance(part, ToolCallPart) and (line.id, part.call_id) in wanted:
                    calls[(line.id, part.call_id)] = _Call(line, line, part)
        for key, call in list(calls.items()):
            if call.line.meta.carried_from:
                calls[key] = _Call(call.line, await self._origin(call.line), call.part)
        return await self._states(list(calls.values()), join_id(agent_actor_id, forum_id))

    async def _origin(self, line: Message) -> Message:
        """The line a carried line was first written as (itself if that one is gone)."""
        current = line
        for _ in range(MAX_CARRIED_HOPS):
            if not current.meta.carried_from:
                return current
            found = await self.store.get_message(current.meta.carried_from)
            if found is None:
                return current
            current = found
        return current

    async def _messages(self, ids: Iterable[str]) -> list[Message]:
        wanted = sorted(set(ids))
        if not wanted:
            return []
        documents = self.store.messages.find({"_id": {"$in": wanted}})
        return [Message.from_document(document) async for document in documents]

    async def _by_id(self, collection: str, ids: list[str]) -> dict[str, dict[str, Any]]:
        if not ids:
            return {}
        cursor = self.store.db[collection].find({"_id": {"$in": ids}})
        return {str(document["_id"]): document async for document in cursor}

    async def _states(self, calls: list[_Call], instance_id: str) -> list[ToolCallView]:
        open_ids = [open_call_id(instance_id, c.origin.id, c.part.call_id) for c in calls]
        round_ids = [round_results_line_id(instance_id, c.origin.id) for c in calls]
        own_ids = [own_result_line_id(open_id) for open_id in open_ids]
        results = {line.id: line for line in await self._messages([*round_ids, *own_ids])}
        waiting = await self._by_id(TOOL_CALLS_COLLECTION, open_ids)
        ends = await self._by_id(TOOL_CALL_ENDS_COLLECTION, open_ids)
        decisions = await self._by_id(TOOL_CALL_DECISIONS_COLLECTION, open_ids)
        catalog = await self.catalog.entries()
        now = datetime.now(UTC)
        views = []
        for call, open_id, round_id, own_id in zip(
            calls, open_ids, round_ids, own_ids, strict=True
        ):
            entry = catalog.get(call.part.name)
            started = as_utc(call.origin.created_at)
            view = ToolCallView(
                call_line_id=call.line.id,
                call_id=call.part.call_id,
                name=call.part.name,
                source=entry.source if entry is not None else None,
                state="running",
                started_at=started,
                seconds=max(0.0, (now - started).total_seconds()),
            )
            # Its own result line if it waited in the store, else the round's results line.
            for line_id in (own_id, round_id):
                result = _result_in(results.get(line_id), call.part.call_id)
                if result is not None:
                    view.state = "error" if result.is_error else "answered"
                    view.result_line_id = line_id
                    view.ended_at = as_utc(results[line_id].created_at)
                    break
            end = CallEnd.from_document(ends[open_id]) if open_id in ends else None
            # A call answered in its step also records an end (a call runs once), but it
            # never waited: only an end of a call that waited names the open call.
            waited = end is not None and not end.in_round
            if waited or view.result_line_id == own_id:
                view.open_call_id = open_id
            if end is not None and not end.in_round:  # its end says how it ended (a stop...)
                view.state = _state_of_end(end)
                view.ended_at = view.ended_at or as_utc(end.ended_at)  # result line on its way
            elif open_id in waiting and view.result_line_id is None:
                view.open_call_id = open_id
                view.state = "open"
                with contextlib.suppress(ValueError):  # unreadable: the reaper drops it
                    opened = OpenCall.from_document(waiting[open_id])
                    view.source = opened.source  # what it was dispatched as, whatever since
                    view.deadline = as_utc(opened.deadline)
                    if opened.awaiting_approval and open_id not in decisions:
                        view.state = "awaiting_approval"
            if open_id in decisions:
                with contextlib.suppress(ValueError):
                    decided = CallDecision.from_document(decisions[open_id])
                    view.open_call_id = open_id
                    view.approval = ApprovalView(
                        decision=decided.decision,
                        by=decided.by,
                        reason=decided.reason,
                        decided_at=as_utc(decided.decided_at),
                    )
            if view.ended_at is not None:
                view.seconds = max(0.0, (view.ended_at - started).total_seconds())
            views.append(view)
        return views


def _state_of_end(end: CallEnd) -> CallState:
    if end.outcome == "answered":
        return "error" if end.is_error else "answered"
    return end.outcome

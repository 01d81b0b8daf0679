"""Open calls in the store: opened once, read, and ended once by whoever settles them first.

Every settler (a worker's answer, an MCP call returning, the deadline, a stop, a rejected
approval) ends a call through :meth:`OpenCalls.end`: its :class:`CallEnd` is a unique insert, so
one of them wins and the others get the end that stands. Writing the result line and deleting
the open call (:meth:`OpenCalls.finish`) are safe to repeat, which is how a crash between them is
finished by whoever comes next (a later settler or the reaper).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

from yoke.core import tracing
from yoke.core.ids import SYSTEM_ACTOR_ID
from yoke.core.metrics import TOOL_CALL_SECONDS, TOOL_CALLS, tool_label
from yoke.core.models import Message, ToolResultPart, as_utc
from yoke.runtime.calls.records import (
    TOOL_CALL_ENDS_COLLECTION,
    TOOL_CALLS_COLLECTION,
    CallEnd,
    EndOutcome,
    OpenCall,
    own_result_line_id,
)
from yoke.runtime.posting import Poster
from yoke.store.database import Store

log = logging.getLogger(__name__)


class OpenCalls:
    """The open calls of this database and their ends."""

    def __init__(self, store: Store, poster: Poster) -> None:
        self.store = store
        self.poster = poster
        self.calls = store.db[TOOL_CALLS_COLLECTION]
        self.ends = store.db[TOOL_CALL_ENDS_COLLECTION]

    async def open(self, call: OpenCall) -> bool:
        """Record the call (``False``: a redelivered step had recorded it already)."""
        return await self.store.insert_if_absent(self.calls, call.to_document())

    async def get(self, call_id: str) -> OpenCall | None:
        document = await self.calls.find_one({"_id": call_id})
        return OpenCall.from_document(document) if document is not None else None

    async def of_forum(self, forum_id: str) -> AsyncIterator[OpenCall]:
        """The forum's open calls, read as they come (each may be ended meanwhile)."""
        async for document in self.calls.find({"forumId": forum_id}):
            yield OpenCall.from_document(document)

    async def update(self, call: OpenCall) -> None:
        """Write ``call`` over its stored self; a call ended meanwhile is not brought back (no
        upsert)."""
        await self.calls.replace_one({"_id": call.id}, call.to_document())

    async def get_end(self, call_id: str) -> CallEnd | None:
        document = await self.ends.find_one({"_id": call_id})
        return CallEnd.from_document(document) if document is not None else None

    async def ends_of(self, call_ids: list[str]) -> dict[str, CallEnd]:
        """The ends of those of ``call_ids`` that ended, in one read."""
        if not call_ids:
            return {}
        query: dict[str, Any] = {"_id": {"$in": call_ids}}
        return {
            document["_id"]: CallEnd.from_document(document)
            async for document in self.ends.find(query)
        }

    async def exists(self, call_id: str) -> bool:
        """Open, or ended with its result line not yet written: either way on its way."""
        if await self.calls.find_one({"_id": call_id}, projection={"_id": 1}) is not None:
            return True
        return await self.store.get_message(own_result_line_id(call_id)) is not None

    async def end(
        self,
        call: OpenCall,
        *,
        outcome: EndOutcome,
        output: str,
        is_error: bool,
        by: str | None = None,
        in_round: bool = False,
    ) -> tuple[bool, CallEnd]:
        """End ``call`` unless something ended it first; returns (this ended it, the end).
        ``in_round``: the step running it writes the result, in its round's results line."""
        end = CallEnd(
            id=call.id,
            tool=call.tool,
            outcome=outcome,
            output=output,
            is_error=is_error,
            by=by,
            in_round=in_round,
        )
        if not await self.store.insert_if_absent(self.ends, end.to_document()):
            existing = await self.get_end(call.id)
            assert existing is not None  # ends are pruned only long after their call
            await self.finish(call, existing)
            return False, existing
        await self.finish(call, end)
        seconds = (end.ended_at - as_utc(call.opened_at)).total_seconds()
        TOOL_CALLS.labels(tool_label(call.tool), call.source, metric_outcome(end)).inc()
        TOOL_CALL_SECONDS.labels(call.source).observe(max(0.0, seconds), tracing.exemplar())
        log.info(
            "tool call %s (%s) ended: %s",
            call.tool,
            call.source,
            outcome,
            extra={"conversationId": call.conversation_id, "messageId": call.call_line_id},
        )
        return True, end

    async def finish(self, call: OpenCall, end: CallEnd) -> None:
        """Write the result line of an ended call (idempotent; none for a call ended in its
        round, whose step writes it), then forget the open call."""
        if end.in_round:
            await self.calls.delete_one({"_id": call.id})
            return
        # Its own span, linked to the step that asked: a late answer, an expiry or a decision
        # may come in another trace, or in none (the reaper's).
        with tracing.span(
            "tool_result",
            attributes={
                "gen_ai.tool.name": call.tool,
                "yoke.call_id": call.id,
                "yoke.outcome": end.outcome,
                tracing.CONVERSATION_ID: call.conversation_id,
            },
        ):
            tracing.link(call.trace_parent)
            await self._post_result(call, end)
        await self.calls.delete_one({"_id": call.id})

    async def _post_result(self, call: OpenCall, end: CallEnd) -> None:
        await self.poster.post(
            Message(
                id=own_result_line_id(call.id),
                conversation_id=call.conversation_id,
                author_actor_id=SYSTEM_ACTOR_ID,
                role="user",
                parts=[
                    ToolResultPart(
                        call_id=call.model_call_id,
                        name=call.tool,
                        output=end.output,
                        is_error=end.is_error,
                    )
                ],
                meta=call.meta.model_copy(deep=True),
            ),
            route=call.route,
        )


def metric_outcome(end: CallEnd) -> str:
    """The words calls answered in the step use too: ``ok`` and ``error`` for an answer."""
    if end.outcome == "answered":
        return "error" if end.is_error else "ok"
    return end.outcome

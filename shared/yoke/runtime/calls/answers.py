"""A worker's answer at the door (``tool.result.submit``): checked, then the call's end.

The answer is taken only from the RabbitMQ user of the call's own tool (the broker verifies
``user_id``; :func:`yoke.bus.topology.tool_of_user` reads the tool from it), only for a call sent to
a worker, and only before its deadline. A late or repeated answer is told how the call ended:
``duplicate`` to the worker whose answer stands, ``call_closed`` to anyone else.
"""

from __future__ import annotations

from datetime import UTC, datetime

from yoke.bus import topology
from yoke.core.models import SubmitReply, as_utc
from yoke.core.text import storable
from yoke.runtime.calls.records import CallEnd, EndOutcome, own_result_line_id
from yoke.runtime.calls.repository import OpenCalls
from yoke.runtime.calls.texts import timeout_text


class WorkerAnswers:
    """The door's side of a worker's answer."""

    def __init__(self, open_calls: OpenCalls, *, vhost: str) -> None:
        self.open_calls = open_calls
        # The mesh's vhost, which its worker users' names carry (topology.tool_user).
        self.vhost = vhost

    async def answer(
        self,
        call_id: str,
        user: str | None,
        output: str,
        is_error: bool,
        *,
        outcome: EndOutcome = "answered",
    ) -> SubmitReply:
        """A worker's ``tool.result.submit``, checked against the call and who sent it
        (``failed``: an answer the door could not take, whose error ends the call instead)."""
        if not user:
            return SubmitReply.rejected(
                "missing_user_id",
                "the answer has no AMQP user_id: publish it with user_id set to your RabbitMQ "
                "user (the one yoke tools add-worker named), which the broker verifies",
            )
        tool = topology.tool_of_user(user, self.vhost)
        call = await self.open_calls.get(call_id)
        if call is None:
            end = await self.open_calls.get_end(call_id)
            if end is None:
                return SubmitReply.rejected("unknown_call", f"no tool call {call_id!r} was made")
            return self._after_end(end, tool, user)
        if call.source != "worker" or tool != call.tool:
            return SubmitReply.rejected(
                "wrong_tool",
                f"call {call_id!r} is a call of {call.tool}, which user {user!r} does not serve",
            )
        if call.awaiting_approval:
            return SubmitReply.rejected(
                "awaiting_approval",
                f"call {call_id!r} waits for a person's approval and was never sent to a worker",
            )
        if datetime.now(UTC) > as_utc(call.deadline):
            _, end = await self.open_calls.end(
                call, outcome="timeout", output=timeout_text(call), is_error=True
            )
            return self._after_end(end, tool, user)
        won, end = await self.open_calls.end(
            call, outcome=outcome, output=storable(output), is_error=is_error, by=user
        )
        if won:
            return SubmitReply(status="accepted", message_id=own_result_line_id(call.id))
        return self._after_end(end, tool, user)

    @staticmethod
    def _after_end(end: CallEnd, tool: str | None, user: str) -> SubmitReply:
        if tool != end.tool:
            return SubmitReply.rejected(
                "wrong_tool",
                f"call {end.id!r} is a call of {end.tool}, which user {user!r} does not serve",
            )
        if end.outcome == "answered" and end.by == user:
            return SubmitReply(
                status="accepted", message_id=own_result_line_id(end.id), duplicate=True
            )
        return SubmitReply.rejected(
            "call_closed", f"call {end.id!r} has ended already ({end.outcome}): {end.output}"
        )

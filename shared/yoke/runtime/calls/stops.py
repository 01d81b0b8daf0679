"""A stop in a forum ends the open calls of its agents there (``/stop``, docs/architecture.md).

A running call ends ``stopped by NAME`` through its end, like any other; one awaiting approval
is decided ``stopped`` instead (unless a decision came first), so its approvers are told.
"""

from __future__ import annotations

from yoke.core.models import CommandAuthor
from yoke.runtime.calls.approvals import Approvals
from yoke.runtime.calls.repository import OpenCalls


async def stop_forum_calls(
    open_calls: OpenCalls,
    forum_id: str,
    by: CommandAuthor,
    *,
    agent_actor_id: str | None = None,
) -> int:
    """End every open call of the forum (of one agent there, if given) with
    ``stopped by NAME``; returns how many this ended."""
    approvals = Approvals(open_calls)
    ended = 0
    async for call in open_calls.of_forum(forum_id):
        if agent_actor_id is not None and call.agent_actor_id != agent_actor_id:
            continue
        if call.awaiting_approval:
            won, record = await approvals.decide(call, "stopped", by=by)
            if won:
                ended += 1
                continue
            if record.decision != "approve":
                await approvals.carry_out(call, record)
                continue
        won, _ = await open_calls.end(
            call,
            outcome="stopped",
            output=f"stopped by {by.display_name}",
            is_error=True,
            by=by.display_name,
        )
        ended += won
    return ended

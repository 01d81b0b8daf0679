"""Tool rounds: running an agent line's calls, and what a step decides while a round is open.

A round's step runs every call at once through the process's :class:`ToolDispatch`
(docs/architecture.md, "A turn with a tool round"): what answers in the step goes in one results
line, the rest waits in the store as open calls, each ending in a line of its own. Before it
runs, the doom-loop guard refuses a call the agent keeps repeating; a round a person's
``/stop`` came before ends at once, every call ``stopped by NAME`` (invariant 12). While a
round is open, a line that lands is left to the step of the round's last result
(invariant 10), and a person's line is told when that round waits for an approval.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Awaitable, Callable

from services.processor.commands import name_of
from services.processor.inference import activity
from services.processor.notices import FORUM_NOTICES, post_notice
from services.processor.remembering import memory_calls, run_memory_calls
from services.processor.step import Context, carried_meta
from yoke.core import tracing
from yoke.core.ids import SYSTEM_ACTOR_ID
from yoke.core.metrics import DOOM_LOOPS, tool_label
from yoke.core.models import (
    Message,
    ToolCallPart,
    ToolResultPart,
    call_signature,
    utcnow,
)
from yoke.runtime.calls.records import OpenCall, open_call_id, round_results_line_id
from yoke.runtime.calls.repository import OpenCalls
from yoke.runtime.dispatch import ToolDispatch, deadline_after
from yoke.runtime.escalations import HANDOFF_TOOL
from yoke.runtime.in_flight import Arrival
from yoke.runtime.instances import WAIT_TOLD_AGAIN_SECONDS, RoundMark, WaitTold
from yoke.runtime.rounds import call_ids, open_round, unanswered
from yoke.runtime.tails import Tails
from yoke.tools.base import Tool
from yoke.tools.catalog import CatalogEntry

log = logging.getLogger(__name__)

# Doom-loop guard: the LOOP_LIMIT-th identical call within the last LOOP_WINDOW calls is refused.
LOOP_LIMIT = 4
LOOP_WINDOW = 10
# Lines read back for the guard: a call and its results take two, people's lines come between.
LOOP_LINES = 4 * LOOP_WINDOW
# An open in-process or MCP call's deadline is its tool's timeout plus this.
OPEN_CALL_GRACE_SECONDS = 1.0


def repeated_calls(
    earlier: list[Message], calls: list[ToolCallPart], tools: dict[str, Tool]
) -> set[str]:
    """Call ids the doom-loop guard refuses: a 4th identical call within the last 10 calls.
    ``tools``: this process's own tools, whose ``repeat_safe`` lets polling through."""
    history = [
        p for m in earlier if m.role == "agent" for p in m.parts if isinstance(p, ToolCallPart)
    ]
    window = [*history, *calls][-LOOP_WINDOW:]
    counts = Counter(call_signature(call) for call in window)
    return {
        call.call_id
        for call in calls
        if counts[call_signature(call)] >= LOOP_LIMIT
        and not (call.name in tools and tools[call.name].repeat_safe)
    }


# What runs a round's ``handoff`` calls (services.processor.holding): their results, by call id.
HandOff = Callable[[Context, Message, list[ToolCallPart]], Awaitable[dict[str, ToolResultPart]]]


class ToolRounds:
    """The rounds of this process's steps: where their calls run (``dispatch``), where the
    calls that wait are found (``open_calls``), and the lines the loop guard reads
    (``tails``)."""

    def __init__(
        self,
        dispatch: ToolDispatch,
        open_calls: OpenCalls,
        tails: Tails,
        hand_off: HandOff | None = None,
    ) -> None:
        self.dispatch = dispatch
        self.open_calls = open_calls
        self.tails = tails
        self.hand_off = hand_off

    async def run(self, context: Context, trigger: Message, calls: list[ToolCallPart]) -> None:
        """The round of ``trigger``, reported to live views as the agent's ``tool`` activity."""
        async with activity(context, "tool"):
            await self.run_tool_round(context, trigger, calls)

    async def run_tool_round(
        self, context: Context, trigger: Message, calls: list[ToolCallPart]
    ) -> None:
        """Run the round: what answers now goes in one results line; the rest waits in the
        store and each of those calls gets a line of its own when it ends."""
        dispatch = self.dispatch
        earlier = await self.tails.history(  # enough to hold the last LOOP_WINDOW calls
            context.store,
            trigger.conversation_id,
            after_seq=max(0, trigger.seq - 1 - LOOP_LINES),
            up_to_seq=trigger.seq - 1,
        )
        refused = repeated_calls(earlier, calls, dispatch.local.runnable)
        # Found by this record until its results are answered, however long they take.
        context.state.open_round = RoundMark(
            conversation_id=trigger.conversation_id, seq=trigger.seq, call_line_id=trigger.id
        )
        runnable = [call for call in calls if call.call_id not in refused]
        meta = carried_meta(context, trigger)
        # Kept with each call that waits: its end, however late, links back to this step.
        asking = tracing.traceparent()
        tracing.annotate({"yoke.tool_calls": len(calls)})

        def make_open(call: ToolCallPart, entry: CatalogEntry) -> OpenCall:
            # An in-process or MCP call's own timeout speaks first; a worker's deadline is the
            # tool's timeout.
            grace = 0.0 if entry.source == "worker" else OPEN_CALL_GRACE_SECONDS
            return OpenCall(
                id=open_call_id(context.instance_id, trigger.id, call.call_id),
                tool=call.name,
                source=entry.source,
                conversation_id=trigger.conversation_id,
                call_line_id=trigger.id,
                model_call_id=call.call_id,
                input=call.input,
                timeout_seconds=entry.timeout_seconds,
                deadline=deadline_after(entry.timeout_seconds + grace),
                meta=meta.model_copy(deep=True),
                route=dict(context.route),
                # What a stop in the forum finds its open calls by (calls.stops.stop_forum_calls).
                forum_id=context.config.source_conversation_id,
                agent_actor_id=context.config.agent_actor_id,
                round_line_id=round_results_line_id(context.instance_id, trigger.id),
                trace_parent=asking,
            )

        handoffs = [
            call
            for call in runnable
            if call.name == HANDOFF_TOOL and context.config.handoff and self.hand_off is not None
        ]
        if handoffs:  # the mesh's own tool: it runs here, in the step (an escalation opens)
            runnable = [call for call in runnable if call not in handoffs]
        remembering = memory_calls(context.config, runnable)  # the mesh's own too, run here
        if remembering:
            runnable = [call for call in runnable if call not in remembering]
        results = await dispatch.run_round(
            runnable,
            context.config.tools,
            key_of=lambda call: context.effect_id("tool", call.call_id),
            conversation_id=trigger.conversation_id,
            make_open=make_open,
            approval=context.config.approval,
        )
        if handoffs and self.hand_off is not None:
            results.update(await self.hand_off(context, trigger, handoffs))
        if remembering:
            results.update(await run_memory_calls(context, trigger, remembering))
        for call in calls:
            if call.call_id in refused:
                DOOM_LOOPS.labels(
                    tool_label(call.name, known=call.name in dispatch.local.runnable)
                ).inc()
                results[call.call_id] = ToolResultPart(
                    call_id=call.call_id,
                    name=call.name,
                    output=f"refused: {call.name} was already requested {LOOP_LIMIT - 1} times "
                    f"with these arguments in the last {LOOP_WINDOW} calls; try something else",
                    is_error=True,
                )
        if not results:
            return  # every call waits in the store
        meta.loop_guard = True if refused else None
        await context.post(
            Message(
                id=round_results_line_id(context.instance_id, trigger.id),
                conversation_id=trigger.conversation_id,
                author_actor_id=SYSTEM_ACTOR_ID,
                role="user",
                parts=[results[call.call_id] for call in calls if call.call_id in results],
                meta=meta,
            )
        )

    async def results_on_their_way(self, context: Context, transcript: list[Message]) -> bool:
        """Whether the trigger landed while a tool round was pending, and its results will come.

        Steps run in seq order, so the round's own step is over: the results it ran itself are
        either written after the trigger, and the step of the round's last result (whose
        transcript holds the trigger) answers it; or the calls wait in the store (open calls),
        whose results come later the same way; or they never will (the step failed for good),
        and then the trigger is answered now rather than never: the prompt marks the lost
        results as missing.
        """
        call_line = open_round(transcript)
        if call_line is None:
            return False
        results_id = round_results_line_id(context.instance_id, call_line.id)
        if (
            all(line.id != results_id for line in transcript)
            and await context.store.get_message(results_id) is not None
        ):
            return True
        missing = unanswered(call_ids(call_line), transcript)
        for call_id in sorted(missing):
            if await self.open_calls.exists(
                open_call_id(context.instance_id, call_line.id, call_id)
            ):
                return True
        return False

    async def tell_of_awaited_approvals(
        self, context: Context, trigger: Message, transcript: list[Message]
    ) -> None:
        """A person's line that waits while the pending round has calls awaiting a decision is
        told what the agent waits for: the first of the wait, and one again only every
        :data:`WAIT_TOLD_AGAIN_SECONDS` (the notice's id derives from the line)."""
        call_line = open_round(transcript)
        if call_line is None or trigger.meta.agent_hops > 0:
            return
        tools: list[str] = []
        for call_id in sorted(unanswered(call_ids(call_line), transcript)):
            call = await self.open_calls.get(
                open_call_id(context.instance_id, call_line.id, call_id)
            )
            if call is not None and call.awaiting_approval and call.tool not in tools:
                tools.append(call.tool)
        if tools:
            told, now = context.state.wait_told, utcnow()
            if (
                told is not None
                and told.call_line_id == call_line.id
                and (now - told.at).total_seconds() < WAIT_TOLD_AGAIN_SECONDS
            ):
                return
            context.state.wait_told = WaitTold(call_line_id=call_line.id, at=now)
            names = ", ".join(tools)
            await post_notice(
                context,
                trigger,
                "approval",
                f"waiting for a decision on {names} before answering",
                forum_text=FORUM_NOTICES["approval"].format(tools=names),
            )


async def end_round_stopped(
    context: Context,
    trigger: Message,
    calls: list[ToolCallPart],
    stop: Arrival | None,
    *,
    by: str | None = None,
) -> None:
    """Every call of a round a stop (or a hold: ``by``) came before gets ``stopped by NAME``,
    none of them runs."""
    if by is not None:
        pass
    elif stop is not None:
        by = (await name_of(context, stop.actor_id)).display_name
    else:
        assert context.state.stopped is not None
        by = context.state.stopped.by
    await context.post(
        Message(
            id=round_results_line_id(context.instance_id, trigger.id),
            conversation_id=trigger.conversation_id,
            author_actor_id=SYSTEM_ACTOR_ID,
            role="user",
            parts=[
                ToolResultPart(
                    call_id=call.call_id, name=call.name, output=f"stopped by {by}", is_error=True
                )
                for call in calls
            ],
            meta=carried_meta(context, trigger),
        )
    )

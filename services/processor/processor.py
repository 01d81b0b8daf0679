"""The processor's decision tree, one step per ``conversation.message.posted``.

- agent ``tool_call``  -> run the tools in parallel -> one ``tool_result`` message (system author)
- user ``tool_result`` -> infer once -> post the outputs
- user text            -> (compaction hook) -> infer once -> post the outputs

It never loops within a delivery and never decides what people see (egress does). The step's
transcript ends at its trigger (docs/architecture.md, invariant 1), so queued lines are each
answered once. A line that lands while the agent's tools run is answered by the step after their
results, not by a model call of its own (docs/architecture.md, invariant 10).

What a line sent while a step is pending does is the join's
:class:`~yoke.runtime.while_busy.WhileBusyPolicy` (docs/architecture.md, "While the agent is
busy"), asked as the line's delivery arrives (:meth:`Processor.notice_arrival`, through the
process's :class:`InFlight`) and by each step here: which lines it answers, and in reply to
which. A person's ``/stop`` drops the model call in flight, ends the open tool calls and leaves
the earlier lines unanswered, whatever ``whileBusy`` says; a person's ``/takeover`` does the same
and holds the agent until ``/handback`` (:mod:`services.processor.holding`).
"""

from __future__ import annotations

import logging

from aio_pika.abc import AbstractIncomingMessage

from services.processor.commands import answer_slash_command, stopped_round
from services.processor.holding import Holding, hold_line
from services.processor.inference import Inference
from services.processor.notices import failure_meta, post_notice
from services.processor.step import Context, is_step_trigger, step_window, with_recorded_round
from services.processor.tool_rounds import ToolRounds, end_round_stopped
from yoke.bus import topology
from yoke.core import tracing
from yoke.core.models import (
    Envelope,
    Message,
    MessagePosted,
    ToolCallPart,
    ToolResultPart,
)
from yoke.runtime.actor import ActorDefinition
from yoke.runtime.calls.repository import OpenCalls
from yoke.runtime.compaction import compact
from yoke.runtime.dispatch import ToolDispatch
from yoke.runtime.in_flight import InFlight
from yoke.runtime.instances import (
    PROCESSOR,
    ProcessorConfig,
    ProcessorState,
    load_processor_config,
)
from yoke.runtime.rounds import call_ids, call_line_index, round_pending_after, unanswered
from yoke.runtime.tails import Tails
from yoke.runtime.while_busy import WhileBusyPolicy, is_slash_command

log = logging.getLogger(__name__)


def step_attributes(context: Context, trigger: Message) -> dict[str, str | int]:
    """The step span's: its join's forum, its monologue, its trigger and what kind it is."""
    if any(isinstance(part, ToolCallPart) for part in trigger.parts):
        kind = "tool_call"
    elif any(isinstance(part, ToolResultPart) for part in trigger.parts):
        kind = "tool_result"
    else:
        kind = trigger.meta.instruction or "line"
    return {
        tracing.FORUM_ID: context.config.source_conversation_id,
        tracing.CONVERSATION_ID: trigger.conversation_id,
        tracing.MESSAGE_ID: trigger.id,
        "yoke.trigger": kind,
        "yoke.seq": trigger.seq,
    }


class Processor:
    """A process's processor: the step of each monologue line, with what the steps share in
    the process passed in: where tools run (``dispatch``), the calls that wait in the store
    (``open_calls``), the model calls in flight and the stops seen for them (``in_flight``),
    and the newest lines of the monologues it steps (``tails``: ``Tails(0, 1)`` keeps none)."""

    def __init__(
        self,
        *,
        dispatch: ToolDispatch,
        open_calls: OpenCalls,
        in_flight: InFlight,
        tails: Tails,
    ) -> None:
        self.dispatch = dispatch
        self.open_calls = open_calls
        self.in_flight = in_flight
        self.tails = tails
        self.holding = Holding(open_calls)
        self.rounds = ToolRounds(dispatch, open_calls, tails, self.holding.hand_off)
        self.inference = Inference(in_flight, dispatch.catalog)
        self.definition = ActorDefinition(
            name=PROCESSOR,
            config_schema=ProcessorConfig,
            state_schema=ProcessorState,
            trigger=is_step_trigger,
            handle=self.handle,
            # The join's tunables live in its own document (updated by a later join): read per
            # step.
            load_config=load_processor_config,
            notice_meta=failure_meta,
        )

    async def handle(self, context: Context, trigger: Message) -> None:
        """:meth:`step`, with the trigger joining its conversation's tail (its event says it
        is stored); a tail the step leaves in doubt (it failed, or the join moved to a new
        monologue) is forgotten. Each step is a ``step`` span, named by what triggered it."""
        self.tails.saw(trigger)
        try:
            with tracing.span("step", attributes=step_attributes(context, trigger)):
                await self.step(context, trigger)
        except BaseException:
            self.tails.drop(trigger.conversation_id, "failed")
            raise
        if context.repointed:
            self.tails.drop(trigger.conversation_id, "compacted")

    async def step(self, context: Context, trigger: Message) -> None:
        """One monologue line's step (the decision tree in the module's docstring)."""
        if context.config.guarded:  # the agent's lines are the guardian's to see
            context.route[topology.GUARDED_HEADER] = "yes"
        if context.config.followed:  # egress routes their forum lines to follow-up
            context.route[topology.FOLLOWED_HEADER] = "yes"
        if context.config.config_version:  # read once per version by those who read it
            context.route[topology.CONFIG_VERSION_HEADER] = context.config.config_version
        calls = [part for part in trigger.parts if isinstance(part, ToolCallPart)]
        command = hold_line(trigger)
        if command is not None:
            # A takeover or hand-back is carried out whatever came after it (a /stop right
            # behind a /handback must not leave the agent held for ever).
            await self.holding.carry_out(context, trigger, command)
            return
        stop = self.in_flight.stop_after(trigger.conversation_id, trigger.seq)
        if stop is not None or stopped_round(context.state, trigger):
            # A person stopped the agent after this line: it is not answered, and a round it
            # starts ends at once (every call still gets its result: invariant 12).
            log.info(
                "not answering: a stop came after this line",
                extra={"conversationId": trigger.conversation_id, "messageId": trigger.id},
            )
            if trigger.role == "agent" and calls:
                await end_round_stopped(context, trigger, calls, stop)
            return
        if await self.holding.step(context, trigger, calls):
            return  # a takeover or hand-back, or the forum is held (docs/people-take-over.md)
        if trigger.role == "agent":
            if calls:
                await self.rounds.run(context, trigger, calls)
            return
        policy = WhileBusyPolicy.of(context.config)
        if any(isinstance(part, ToolResultPart) for part in trigger.parts):
            await self.answer_tool_results(context, trigger, policy)
            return
        if not trigger.text:
            return
        if is_slash_command(trigger):
            await answer_slash_command(context, trigger, self.open_calls)
            return
        if trigger.meta.agent_hops >= context.config.hop_cap:
            # Agents answering agents stop at the cap, so two cannot ping-pong forever; people
            # are never capped (docs/architecture.md, invariant 6).
            log.info(
                "not answering: agentHops %d reached the cap %d",
                trigger.meta.agent_hops,
                context.config.hop_cap,
                extra={"conversationId": trigger.conversation_id, "messageId": trigger.id},
            )
            return
        if policy.answered_before(context.state, trigger):
            log.info(
                "not answering: an earlier step answered this line with the lines before it",
                extra={"conversationId": trigger.conversation_id, "messageId": trigger.id},
            )
            return
        transcript = await step_window(context, trigger, self.tails, policy)
        seen = await with_recorded_round(context, transcript)
        answering = policy.reply_to(
            trigger,
            transcript,
            context.state.answered,
            round_open=round_pending_after(seen, trigger)
            or await self.rounds.results_on_their_way(context, seen),
        )
        if answering is None:
            log.info(
                "not answering yet: the step after the pending tool results answers this line",
                extra={"conversationId": trigger.conversation_id, "messageId": trigger.id},
            )
            await self.rounds.tell_of_awaited_approvals(context, trigger, seen)
            return
        context.state.open_round = None  # no round holds this line back: none is open
        upto_trigger = [line for line in transcript if line.seq <= trigger.seq]
        if await compact(context, trigger, upto_trigger):  # then answered in the new monologue
            return
        await self.inference.infer_once(context, trigger, transcript, policy, answering=answering)

    async def answer_tool_results(
        self, context: Context, trigger: Message, policy: WhileBusyPolicy
    ) -> None:
        """Infer once on the results, answering too any line that arrived while the tools ran."""
        if policy.answered_before(context.state, trigger):
            log.info(
                "not answering: an earlier step answered these results with the lines around them",
                extra={"conversationId": trigger.conversation_id, "messageId": trigger.id},
            )
            return
        transcript = await step_window(context, trigger, self.tails, policy)
        round_index = call_line_index(transcript, trigger)
        if round_index is None:  # a long wait: the call line is older than the window
            transcript = await with_recorded_round(context, transcript)
            round_index = call_line_index(transcript, trigger)
        if round_index is None:
            # Their call is out of context (a /reset meanwhile): nothing here waits for them.
            log.info(
                "not answering: the tool results' call is no longer in context",
                extra={"conversationId": trigger.conversation_id, "messageId": trigger.id},
            )
            return
        still = unanswered(call_ids(transcript[round_index]), transcript[round_index + 1 :])
        if still:
            # The step of the round's last result answers (invariant 10: one model call a round).
            log.info(
                "not answering yet: %d call(s) of the round still wait for their results",
                len(still),
                extra={"conversationId": trigger.conversation_id, "messageId": trigger.id},
            )
            return
        mark = context.state.open_round
        if mark is not None and mark.call_line_id == transcript[round_index].id:
            context.state.open_round = None  # the round is over
        waiting = [
            line
            for line in transcript[round_index + 1 :]
            if line.role == "user" and policy.wants_answer(line) and line.id != trigger.id
        ]
        answering = trigger
        stopped = context.state.stopped
        if stopped is not None and (
            stopped.covers(transcript[round_index]) or transcript[round_index].id in stopped.rounds
        ):
            # A stop ended this round: no model call for it, only for people's lines after the
            # stop.
            waiting = [line for line in waiting if not stopped.covers(line)]
            if not waiting:
                log.info(
                    "not answering: a stop ended this tool round",
                    extra={"conversationId": trigger.conversation_id, "messageId": trigger.id},
                )
                return
            answering = waiting[-1]
        if trigger.meta.loop_guard and not waiting:
            # The guard refused a repeated call: the step ends here rather than spin.
            await post_notice(
                context,
                trigger,
                "doom_loop",
                "stopped a tool loop: the agent "
                "kept requesting the same call; it answers again at the next line",
            )
            return
        answering = policy.reply_to(answering, transcript, context.state.answered)
        await self.inference.infer_once(context, trigger, transcript, policy, answering=answering)

    def notice_arrival(self, key: str, delivery: AbstractIncomingMessage) -> None:
        """``Service.on_arrival``: the line of a delivery that arrives while its lane is busy,
        handed to the model calls in flight (:meth:`InFlight.arrive`), which do at once what
        the join's policy says it does; decided then, not when the line's own turn comes."""
        headers = delivery.headers or {}
        if headers.get(topology.ROLE_HEADER) != "user" or topology.COMMAND_HEADER in headers:
            return  # only a user line's event may interrupt or stop (read no further)
        envelope = Envelope.model_validate_json(delivery.body)
        if envelope.type == MessagePosted.TYPE:
            payload = envelope.parse()
            assert isinstance(payload, MessagePosted)
            self.in_flight.arrive(payload.message)

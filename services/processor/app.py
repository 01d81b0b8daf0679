"""The processor's decision tree, one step per ``conversation.message.posted``.

- agent ``tool_call``  -> run the tools in parallel -> one ``tool_result`` message (system author)
- user ``tool_result`` -> infer once -> post the outputs
- user text            -> (compaction hook) -> infer once -> post the outputs

It never loops within a delivery and never decides what people see (egress does). The step's
transcript ends at its trigger (docs/architecture.md, invariant 1), so queued lines are each
answered once. A line that lands while the agent's tools run is answered by the step after their
results, not by a model call of its own (docs/architecture.md, invariant 10).

While a step is pending, the join's ``whileBusy`` says what a line does (docs/architecture.md,
"While the agent is busy"): ``queue`` waits its turn as above; ``coalesce`` and ``interrupt``
read up to the newest line and answer every unanswered one in one reply, and under
``interrupt`` a person's line arriving during the model call cancels it (:data:`IN_FLIGHT`,
told by the intake as the line arrives). A person's ``/stop`` drops the model call in flight,
ends the open tool calls and leaves the earlier lines unanswered, whatever ``whileBusy`` says.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from collections.abc import AsyncIterator
from typing import Literal

from aio_pika.abc import AbstractIncomingMessage

from yoke import topology
from yoke.ids import SYSTEM_ACTOR_ID, forwarded_line_id
from yoke.llm.base import InferenceRequest, InferenceResult, ProviderFailed, estimate_tokens
from yoke.llm.prompting import unanswered_last
from yoke.llm.providers import provider_for
from yoke.metrics import (
    DOOM_LOOPS,
    LLM_COST_ESTIMATED,
    MODEL_CALLS_CANCELLED,
    NOTICES,
    STOPS,
    tool_label,
)
from yoke.models import (
    AgentActivity,
    CommandAuthor,
    Envelope,
    ForumNotice,
    Message,
    MessageMeta,
    MessagePosted,
    Part,
    TextPart,
    ToolCallApproved,
    ToolCallPart,
    ToolResultPart,
    Usage,
    call_signature,
)
from yoke.runtime.actor import ActorContext, ActorDefinition, ActorRuntime
from yoke.runtime.budgets import budget_spent, charge, count_usage, unpriced_under_budget
from yoke.runtime.catalog import LocalTools, ToolCatalog
from yoke.runtime.compaction import compact, swap_rule
from yoke.runtime.dispatch import ToolDispatch, deadline_after
from yoke.runtime.drafts import Draft
from yoke.runtime.in_flight import Arrival, InFlight, ModelCall, cancelled_here
from yoke.runtime.instances import (
    PROCESSOR,
    ProcessorConfig,
    ProcessorState,
    Progress,
    RoundMark,
    StopMark,
    load_processor_config,
)
from yoke.runtime.mcp_hosting import McpHosting
from yoke.runtime.open_calls import (
    OpenCall,
    OpenCalls,
    ReapShare,
    call_rules,
    open_call_id,
    result_line_id,
    round_results_id,
)
from yoke.runtime.rounds import (
    call_ids,
    call_line_index,
    open_round,
    round_pending_after,
    unanswered,
)
from yoke.runtime.service import Service
from yoke.runtime.tails import Tails
from yoke.slash import STOP, is_stop, slash_command
from yoke.tools.base import Tool
from yoke.tools.catalog import CatalogEntry

log = logging.getLogger(__name__)

Context = ActorContext[ProcessorConfig, ProcessorState]

# Doom-loop guard: the LOOP_LIMIT-th identical call within the last LOOP_WINDOW calls is refused.
LOOP_LIMIT = 4
LOOP_WINDOW = 10
# Lines read back for the guard: a call and its results take two, people's lines come between.
LOOP_LINES = 4 * LOOP_WINDOW
# An activity event never holds a step up longer than this (it is a courtesy to live views).
ACTIVITY_PUBLISH_SECONDS = 2.0
# A tail holds this many lines beyond a window, for steps whose window ends short of its head.
TAIL_MARGIN = 32
# An open in-process or MCP call's deadline is its tool's timeout plus this.
OPEN_CALL_GRACE_SECONDS = 1.0

_dispatch: ToolDispatch | None = None
# Where a step's window comes from when register() set no tails up (tests driving steps).
NO_TAILS = Tails(0, 1)
# This process's model calls in flight and the stops seen for them (fed by notice_arrival).
IN_FLIGHT = InFlight()


def is_step_trigger(config: ProcessorConfig, state: ProcessorState, message: Message) -> bool:
    """The step filter: not forum traffic, not legacy ``reply``, no ``notice``; and of the
    agent's own lines only those that call tools (its text is for egress, not a step)."""
    return (
        message.conversation_id != config.source_conversation_id
        and message.conversation_id == state.monologue_id
        and message.type == "message"
        and (
            message.role != "agent" or any(isinstance(part, ToolCallPart) for part in message.parts)
        )
    )


def carried_meta(context: Context, trigger: Message) -> MessageMeta:
    """Routing for the step's output: the forum, the cause, and the forum line it answers."""
    forum_line = trigger.meta.in_reply_to
    if trigger.meta.source_conversation_id == context.config.source_conversation_id:
        forum_line = trigger.meta.source_message_id or forum_line
    return MessageMeta(
        source_conversation_id=context.config.source_conversation_id,
        causation_id=trigger.id,
        in_reply_to=forum_line,
        agent_hops=trigger.meta.agent_hops,
    )


async def step(context: Context, trigger: Message) -> None:
    if context.config.guarded:  # the agent's lines are the guardian's to see
        context.route[topology.GUARDED_HEADER] = "yes"
    if context.config.followed:  # egress routes their forum lines to follow-up
        context.route[topology.FOLLOWED_HEADER] = "yes"
    if context.config.config_version:  # read once per version by those who read it
        context.route[topology.CONFIG_VERSION_HEADER] = context.config.config_version
    calls = [part for part in trigger.parts if isinstance(part, ToolCallPart)]
    stop = IN_FLIGHT.stop_after(trigger.conversation_id, trigger.seq)
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
    if trigger.role == "agent":
        if calls:
            await run_tools(context, trigger, calls)
        return
    if any(isinstance(part, ToolResultPart) for part in trigger.parts):
        await answer_tool_results(context, trigger)
        return
    if not trigger.text:
        return
    if is_slash_command(trigger):
        await answer_slash_command(context, trigger)
        return
    if trigger.meta.agent_hops >= context.config.hop_cap:
        # Agents answering agents stop at the cap, so two cannot ping-pong forever; people are
        # never capped (docs/architecture.md, invariant 6).
        log.info(
            "not answering: agentHops %d reached the cap %d",
            trigger.meta.agent_hops,
            context.config.hop_cap,
            extra={"conversationId": trigger.conversation_id, "messageId": trigger.id},
        )
        return
    if answered_already(context.config, context.state, trigger):
        log.info(
            "not answering: an earlier step answered this line with the lines before it",
            extra={"conversationId": trigger.conversation_id, "messageId": trigger.id},
        )
        return
    transcript = await step_window(context, trigger)
    seen = await with_recorded_round(context, transcript)
    if round_pending_after(seen, trigger) or await results_on_their_way(context, seen):
        log.info(
            "not answering yet: the step after the pending tool results answers this line",
            extra={"conversationId": trigger.conversation_id, "messageId": trigger.id},
        )
        await tell_of_awaited_approvals(context, trigger, seen)
        return
    context.state.open_round = None  # no round holds this line back: none is open
    upto_trigger = [line for line in transcript if line.seq <= trigger.seq]
    if await compact(context, trigger, upto_trigger):  # then answered in the new monologue
        return
    await infer_once(context, trigger, transcript, answering=newest_wanted(context, transcript))


async def answer_tool_results(context: Context, trigger: Message) -> None:
    """Infer once on the results, answering too any line that arrived while the tools ran."""
    if answered_already(context.config, context.state, trigger):
        log.info(
            "not answering: an earlier step answered these results with the lines around them",
            extra={"conversationId": trigger.conversation_id, "messageId": trigger.id},
        )
        return
    transcript = await step_window(context, trigger)
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
        if line.role == "user"
        and wants_model_answer(context.config, line)
        and line.id != trigger.id
    ]
    answering = trigger
    stopped = context.state.stopped
    if stopped is not None and (
        stopped.covers(transcript[round_index]) or transcript[round_index].id in stopped.rounds
    ):
        # A stop ended this round: no model call for it, only for people's lines after the stop.
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
    if context.config.while_busy != "queue":
        answering = newest_wanted(context, transcript) or answering
    await infer_once(context, trigger, transcript, answering=answering)


def is_slash_command(line: Message) -> bool:
    """A person's ``/command`` (:func:`yoke.slash.slash_command` decides what one is):
    answered by the processor itself, never by the model."""
    return line.meta.agent_hops == 0 and slash_command(line.text) is not None


def wants_model_answer(config: ProcessorConfig, line: Message) -> bool:
    """A user text line the model answers: not a slash command, not past the hop cap."""
    return (
        line.type == "message"
        and bool(line.text)
        and not is_slash_command(line)
        and line.meta.agent_hops < config.hop_cap
    )


async def context_window(context: Context, trigger: Message) -> list[Message]:
    """The step's transcript: from the context start (``/reset``) up to its trigger, and at
    most the last ``YOKE_CONTEXT_LINES`` lines (docs/architecture.md, invariant 11: a step
    reads as much at the 5,000th line as at the 50th; compaction carries the older lines as a
    summary)."""
    return await tails_of(context).history(
        context.store,
        trigger.conversation_id,
        after_seq=max(
            0,
            context.state.context_from_seq - 1,
            trigger.seq - context.settings.context_lines,
        ),
        up_to_seq=trigger.seq,
    )


async def step_window(context: Context, trigger: Message) -> list[Message]:
    """The lines the step reads: up to its trigger under ``whileBusy: queue``; else up to the
    conversation's newest line (invariant 1: coalesce and interrupt answer every unanswered
    line at once), as many lines back as :func:`context_window` reads."""
    if context.config.while_busy == "queue":
        return await context_window(context, trigger)
    tails = tails_of(context)
    head = await tails.last_seq(context.store, trigger.conversation_id, at_least=trigger.seq)
    return await tails.history(
        context.store,
        trigger.conversation_id,
        after_seq=max(0, context.state.context_from_seq - 1, head - context.settings.context_lines),
        up_to_seq=head,
    )


def tails_of(context: Context) -> Tails:
    """This process's conversation tails (yoke.runtime.tails): a step reads past them only."""
    tails: Tails | None = getattr(context.poster, "tails", None)  # a poster of tests' has none
    return tails if tails is not None else NO_TAILS  # an empty Tails is falsy (it has a len)


async def step_keeping_tail(context: Context, trigger: Message) -> None:
    """:func:`step`, with the trigger joining its conversation's tail (its event says it is
    stored); a tail the step leaves in doubt (it failed, or the join moved to a new monologue)
    is forgotten."""
    tails = tails_of(context)
    tails.saw(trigger)
    try:
        await step(context, trigger)
    except BaseException:
        tails.drop(trigger.conversation_id, "failed")
        raise
    if context.repointed:
        tails.drop(trigger.conversation_id, "compacted")


def answered_already(config: ProcessorConfig, state: ProcessorState, line: Message) -> bool:
    """Whether ``line`` is not to be answered: a person's ``/stop`` came after it, or (under
    ``coalesce`` and ``interrupt``) a model call was shown it as one of a burst it answered.
    Under ``queue`` every line is answered on its own, so a line set aside and replayed after
    later lines were answered is still answered."""
    if state.stopped is not None and state.stopped.covers(line):
        return True
    return (
        config.while_busy != "queue" and state.answered is not None and state.answered.covers(line)
    )


def answered_through(answered: Progress | None, line: Message) -> int:
    """The seq in the line's conversation up to which every line has been answered."""
    if answered is not None and answered.conversation_id == line.conversation_id:
        return answered.seq
    return line.seq - 1


def newest_wanted(context: Context, transcript: list[Message]) -> Message | None:
    """The newest unanswered line the model answers: the one a burst's reply is in reply to."""
    if context.config.while_busy == "queue" or not transcript:
        return None
    since = answered_through(context.state.answered, transcript[-1])
    wanted = [
        line
        for line in transcript
        if line.seq > since and line.role == "user" and wants_model_answer(context.config, line)
    ]
    if not wanted:
        return None
    # Answered as one: in reply to the newest, as near to people as its nearest (invariant 6).
    target = wanted[-1].model_copy(deep=True)
    target.meta.agent_hops = min(line.meta.agent_hops for line in wanted)
    return target


def recorded_round(context: Context, transcript: list[Message]) -> RoundMark | None:
    """The open round's record, when its call line is older than the window (a long wait:
    more than ``YOKE_CONTEXT_LINES`` lines came meanwhile) and not reset away."""
    mark = context.state.open_round
    if mark is None or not transcript or mark.conversation_id != transcript[0].conversation_id:
        return None
    if mark.seq < context.state.context_from_seq or mark.seq >= transcript[0].seq:
        return None  # reset away, or in the window (which then tells)
    return mark


async def with_recorded_round(context: Context, transcript: list[Message]) -> list[Message]:
    """``transcript`` led by the open round's call line and its results older than the window,
    read by their ids (docs/architecture.md, invariant 10: found by the record, not by the
    window); as it is when no round is open (no store operation then)."""
    mark = recorded_round(context, transcript)
    if mark is None:
        return transcript
    call_line = await context.store.get_message(mark.call_line_id)
    if call_line is None:
        return transcript
    missing = unanswered(call_ids(call_line), transcript)
    ids = [tool_results_id(context, call_line)] + [
        result_line_id(open_call_id(context.instance_id, call_line.id, call_id))
        for call_id in sorted(missing)
    ]
    earlier = []
    for message_id in ids:
        line = await context.store.get_message(message_id)
        if line is not None and line.seq < transcript[0].seq:
            earlier.append(line)
    return [call_line, *sorted(earlier, key=lambda line: line.seq), *transcript]


def tool_results_id(context: Context, call_line: Message) -> str:
    """The id of the results message the step of ``call_line`` writes (one per call line)."""
    return round_results_id(context.instance_id, call_line.id)


async def results_on_their_way(context: Context, transcript: list[Message]) -> bool:
    """Whether the trigger landed while a tool round was pending, and its results will come.

    Steps run in seq order, so the round's own step is over: the results it ran itself are
    either written after the trigger, and the step of the round's last result (whose
    transcript holds the trigger) answers it; or the calls wait in the store (open calls),
    whose results come later the same way; or they never will (the step failed for good),
    and then the trigger is answered now rather than never: the prompt marks the lost results
    as missing.
    """
    call_line = open_round(transcript)
    if call_line is None:
        return False
    results_id = tool_results_id(context, call_line)
    if (
        all(line.id != results_id for line in transcript)
        and await context.store.get_message(results_id) is not None
    ):
        return True
    missing = unanswered(call_ids(call_line), transcript)
    open_calls = OpenCalls(context.store, context.poster)
    for call_id in sorted(missing):
        if await open_calls.exists(open_call_id(context.instance_id, call_line.id, call_id)):
            return True
    return False


async def tell_of_awaited_approvals(
    context: Context, trigger: Message, transcript: list[Message]
) -> None:
    """A person's line that waits while the pending round has calls awaiting a decision is
    told once (the notice's id derives from the line) what the agent waits for."""
    call_line = open_round(transcript)
    if call_line is None or trigger.meta.agent_hops > 0:
        return
    open_calls = OpenCalls(context.store, context.poster)
    tools: list[str] = []
    for call_id in sorted(unanswered(call_ids(call_line), transcript)):
        call = await open_calls.get(open_call_id(context.instance_id, call_line.id, call_id))
        if call is not None and call.awaiting_approval and call.tool not in tools:
            tools.append(call.tool)
    if tools:
        names = ", ".join(tools)
        await post_notice(
            context,
            trigger,
            "approval",
            f"waiting for a decision on {names} before answering",
            forum_text=FORUM_NOTICES["approval"].format(tools=names),
        )


async def run_approved_call(event: ToolCallApproved) -> None:
    """``tool.call.approved``: run the call now (its result line wakes the step after it)."""
    await tool_dispatch().run_approved(event.call_id)


async def answer_slash_command(context: Context, trigger: Message) -> None:
    """A person's ``/status``, ``/model NAME``, ``/reset`` or ``/stop``: answered without any
    model call."""
    config, state = context.config, context.state
    parsed = slash_command(trigger.text)
    assert parsed is not None  # the step asked is_slash_command first
    command, argument = parsed.name, parsed.argument
    if command == "/status":
        budget = []
        if config.budget_tokens is not None:
            budget.append(f"token budget {config.budget_tokens}")
        if config.budget_usd is not None:
            budget.append(f"cost budget ${config.budget_usd:.2f}")
        answer = (
            f"model {config.model_for(state)}; tokens used {state.tokens_used}; "
            f"cost ${state.cost_usd:.4f}; tools {', '.join(config.tools) or 'none'}"
            + (f"; {', '.join(budget)}" if budget else "")
        )
    elif command == "/model" and argument:
        allowed = ", ".join(config.allowed())
        if argument not in config.allowed():
            # Anyone in the forum may type this: only the models the operator allowed are let
            # through, or a person could pick a dearer model than the join's budget assumes.
            wanted = argument[:200]
            await post_notice(
                context,
                trigger,
                "model",
                f"/model {wanted} refused: this join allows {allowed} "
                "(allowedModels in its configuration)",
                forum_text=FORUM_NOTICES["model"].format(model=wanted, allowed=allowed),
            )
            return
        state.model = argument
        answer = f"model is now {argument}"
    elif command == "/reset":
        state.context_from_seq = trigger.seq + 1
        answer = "starting afresh: earlier lines are no longer in my context"
    elif command == STOP and is_person_line(trigger):
        await carry_out_stop(context, trigger)
        return
    else:
        answer = f"unknown command {command}; try /status, /model NAME, /reset or /stop"
    await post_agent_line(context, trigger, [TextPart(text=answer)])


async def post_agent_line(
    context: Context,
    trigger: Message,
    parts: list[Part],
    usage: Usage | None = None,
    answering: Message | None = None,
) -> None:
    """The step's output, as the agent; its id derives from the trigger (one per step), its
    routing from the line it answers (the trigger, or the newest of a burst)."""
    await context.post(
        Message(
            id=context.effect_id("output"),
            conversation_id=trigger.conversation_id,
            author_actor_id=context.config.agent_actor_id,
            participant_id=context.state.agent_participant_id,
            role="agent",
            parts=parts,
            meta=answer_meta(context, trigger, answering),
            usage=usage,
        )
    )


def answer_meta(context: Context, trigger: Message, answering: Message | None) -> MessageMeta:
    meta = carried_meta(context, answering or trigger)
    meta.causation_id = trigger.id
    return meta


# --- whileBusy and /stop -----------------------------------------------------------------------


def is_person_line(line: Message) -> bool:
    """A person's line copied from the forum: never an agent's (agentHops above 0), a tool
    result, a nudge or steering (instructions) or context a compaction carried."""
    meta = line.meta
    return (
        line.role == "user"
        and line.type == "message"
        and meta.agent_hops == 0
        and meta.source_message_id is not None
        and not meta.instruction
        and not meta.carried_from
        and line.author_actor_id != SYSTEM_ACTOR_ID
        and bool(line.text)
    )


def is_stop_line(line: Message) -> bool:
    return is_person_line(line) and is_stop(line.text)


def notice_arrival(key: str, delivery: AbstractIncomingMessage) -> None:
    """``Service.on_arrival``: a line arriving for a monologue whose step is pending may
    cancel that step's model call (a person's line under ``whileBusy: interrupt``, a person's
    ``/stop`` always); decided at once, not when the line's own turn comes."""
    headers = delivery.headers or {}
    if headers.get(topology.ROLE_HEADER) != "user" or topology.COMMAND_HEADER in headers:
        return
    envelope = Envelope.model_validate_json(delivery.body)
    if envelope.type != MessagePosted.TYPE:
        return
    payload = envelope.parse()
    assert isinstance(payload, MessagePosted)
    line = payload.message
    if not is_person_line(line):
        return
    arrival = Arrival(line.conversation_id, line.seq, line.id, line.author_actor_id)
    if is_stop_line(line):
        IN_FLIGHT.stop(arrival)
    elif not is_slash_command(line):
        IN_FLIGHT.interrupt(arrival)


def stopped_round(state: ProcessorState, line: Message) -> bool:
    """A call line written before a stop's step ran whose own step comes after: it is ended
    rather than run."""
    return state.stopped is not None and line.id in state.stopped.rounds


async def name_of(context: Context, actor_id: str) -> CommandAuthor:
    """Who a line's author is, as a stop names them (``stopped by NAME``)."""
    actor = await context.store.get_actor(actor_id)
    if actor is None:
        return CommandAuthor(external_id=actor_id, display_name="someone")
    return CommandAuthor(external_id=actor.external_id or actor.id, display_name=actor.name)


async def end_round_stopped(
    context: Context, trigger: Message, calls: list[ToolCallPart], stop: Arrival | None
) -> None:
    """Every call of a round a stop came before gets ``stopped by NAME``, none of them runs."""
    if stop is not None:
        by = (await name_of(context, stop.actor_id)).display_name
    else:
        assert context.state.stopped is not None
        by = context.state.stopped.by
    await context.post(
        Message(
            id=tool_results_id(context, trigger),
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


async def carry_out_stop(context: Context, trigger: Message) -> None:
    """A person's ``/stop``: the model call in flight was dropped as it arrived
    (:func:`notice_arrival`) and the earlier lines' steps answered nothing; here the open tool
    calls end ``stopped by NAME``, the rounds already written but not yet run are marked to end
    likewise, and one notice tells the forum. Repeated on a redelivery, it changes nothing: the
    ends are unique inserts, the notice's id derives from the stop."""
    state, conversation = context.state, trigger.conversation_id
    by = await name_of(context, trigger.meta.source_actor_id or trigger.author_actor_id)
    head = min(
        await context.store.last_seq(conversation), trigger.seq + context.settings.context_lines
    )
    later = (
        await context.store.history(conversation, after_seq=trigger.seq, up_to_seq=head)
        if head > trigger.seq
        else []
    )
    # Written after the stop by model calls begun before it (their steps come after this one).
    rounds = [line.id for line in later if line.role == "agent" and call_ids(line)]
    state.stopped = StopMark(
        conversation_id=conversation, seq=trigger.seq, by=by.display_name, rounds=rounds[-100:]
    )
    state.answered = Progress(
        conversation_id=conversation,
        seq=max(trigger.seq, answered_through(state.answered, trigger)),
    )
    ended = await OpenCalls(context.store, context.poster).end_for_forum(
        context.config.source_conversation_id, by, agent_actor_id=context.config.agent_actor_id
    )
    STOPS.inc()
    NOTICES.labels("stopped").inc()
    log.info(
        "stopped by a person: %d open tool call(s) ended",
        ended,
        extra={"conversationId": conversation, "messageId": trigger.id},
    )
    meta = carried_meta(context, trigger)
    meta.forum_notice = ForumNotice(
        agent_actor_id=context.config.agent_actor_id,
        text=f"Stopped, as {by.display_name} asked: I will not answer the earlier messages.",
    )
    await context.post(
        Message(
            id=context.effect_id("notice", "stopped"),
            conversation_id=conversation,
            author_actor_id=SYSTEM_ACTOR_ID,
            role="user",
            type="notice",
            parts=[TextPart(text=f"stopped by {by.display_name}: {ended} open tool call(s) ended")],
            meta=meta,
        )
    )


def repeated_calls(
    earlier: list[Message], calls: list[ToolCallPart], tools: dict[str, Tool]
) -> set[str]:
    # ``tools``: this process's own tools, whose ``repeat_safe`` lets polling through.
    """Call ids the doom-loop guard refuses: a 4th identical call within the last 10 calls."""
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


async def report_activity(context: Context, state: Literal["thinking", "tool", "idle"]) -> None:
    """Tell live views (the gateway's forum stream) what the agent is doing: an
    ``agent.activity`` event routed like a forum line (``yoke-kind: forum``, key the forum), so
    it reaches whoever may see the forum and never carries anything of the monologue.

    Best effort: nothing is stored, and a publish that fails or is slow is logged and dropped.
    """
    activity = AgentActivity(
        agent_actor_id=context.config.agent_actor_id,
        forum_id=context.config.source_conversation_id,
        state=state,
    )
    try:
        await asyncio.wait_for(
            context.poster.bus.publish_hint(
                Envelope.wrap(context.effect_id("activity", state), activity),
                activity.key,
                {topology.KIND_HEADER: "forum"},
            ),
            ACTIVITY_PUBLISH_SECONDS,
        )
    except Exception as error:
        log.warning(
            "agent.activity %s not published: %r",
            state,
            error,
            extra={"conversationId": context.trigger.conversation_id},
        )


@contextlib.asynccontextmanager
async def activity(context: Context, state: Literal["thinking", "tool"]) -> AsyncIterator[None]:
    """Report ``state`` for the work inside, and ``idle`` once it ends however it ends."""
    await report_activity(context, state)
    try:
        yield
    finally:
        await report_activity(context, "idle")


async def run_tools(context: Context, trigger: Message, calls: list[ToolCallPart]) -> None:
    async with activity(context, "tool"):
        await run_tool_round(context, trigger, calls)


def tool_dispatch() -> ToolDispatch:
    """This process's tool dispatch (made by :func:`register`)."""
    if _dispatch is None:
        raise RuntimeError("the processor's tools are not set up (register() was not called)")
    return _dispatch


async def run_tool_round(context: Context, trigger: Message, calls: list[ToolCallPart]) -> None:
    """Run the round: what answers now goes in one results line; the rest waits in the store
    and each of those calls gets a line of its own when it ends."""
    dispatch = tool_dispatch()
    earlier = await tails_of(context).history(  # enough to hold the last LOOP_WINDOW calls
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
            # What a stop in the forum finds its open calls by (OpenCalls.end_for_forum).
            forum_id=context.config.source_conversation_id,
            agent_actor_id=context.config.agent_actor_id,
            round_line_id=tool_results_id(context, trigger),
        )

    results = await dispatch.run_round(
        runnable,
        context.config.tools,
        key_of=lambda call: context.effect_id("tool", call.call_id),
        conversation_id=trigger.conversation_id,
        make_open=make_open,
        approval=context.config.approval,
    )
    for call in calls:
        if call.call_id in refused:
            DOOM_LOOPS.labels(
                tool_label(call.name, known=call.name in dispatch.local.runnable)
            ).inc()
            results[call.call_id] = ToolResultPart(
                call_id=call.call_id,
                name=call.name,
                output=f"refused: {call.name} was already requested {LOOP_LIMIT - 1} times with "
                f"these arguments in the last {LOOP_WINDOW} calls; try something else",
                is_error=True,
            )
    if not results:
        return  # every call waits in the store
    meta.loop_guard = True if refused else None
    await context.post(
        Message(
            id=tool_results_id(context, trigger),
            conversation_id=trigger.conversation_id,
            author_actor_id=SYSTEM_ACTOR_ID,
            role="user",
            parts=[results[call.call_id] for call in calls if call.call_id in results],
            meta=meta,
        )
    )


async def display_names(context: Context, transcript: list[Message]) -> dict[str, str]:
    names: dict[str, str] = {}
    for author_id in {message.author_actor_id for message in transcript}:
        actor = await context.store.get_actor(author_id)
        if actor is not None:
            names[author_id] = actor.name
    return names


async def infer_once(
    context: Context,
    trigger: Message,
    transcript: list[Message],
    *,
    answering: Message | None = None,
) -> None:
    """One model call on ``transcript`` (read past the trigger under ``whileBusy`` coalesce and
    interrupt, which answer every unanswered line: the burst goes last in the prompt, and the
    reply is in reply to ``answering``, its newest line)."""
    config, state = context.config, context.state
    answered = state.answered
    covered = max((line.seq for line in transcript), default=trigger.seq)
    # Whatever the call ends in (an answer, a notice), the lines it was shown are done; the
    # steps of those still queued call no model.
    state.answered = Progress(conversation_id=trigger.conversation_id, seq=covered)
    spent = budget_spent(config, state)
    if spent:
        await post_notice(context, trigger, "budget", f"no answer: {spent}")
        return
    unpriced = unpriced_under_budget(config, state, context.settings)
    if unpriced:
        await post_notice(context, trigger, "unpriced", unpriced)
        return
    if config.while_busy != "queue":
        transcript = unanswered_last(transcript, answered_through(answered, trigger))
    async with activity(context, "thinking"):
        if not await infer_and_post(context, trigger, transcript, answering, covered):
            state.answered = answered  # cancelled: the next step answers these lines


def draft_of(context: Context, trigger: Message, answering: Message | None = None) -> Draft:
    """The draft of the forum line this step's text becomes (egress derives its id)."""
    return Draft(
        context.poster.bus,
        forum_id=context.config.source_conversation_id,
        agent_actor_id=context.config.agent_actor_id,
        message_id=forwarded_line_id(context.effect_id("output")),
        in_reply_to=carried_meta(context, answering or trigger).in_reply_to,
    )


async def infer_and_post(
    context: Context,
    trigger: Message,
    transcript: list[Message],
    answering: Message | None = None,
    covered: int | None = None,
) -> bool:
    """Returns ``False`` when the model call was cancelled (an interrupt, a stop)."""
    draft = draft_of(context, trigger, answering)
    try:
        return await infer_into(context, trigger, transcript, draft, answering, covered)
    finally:
        await draft.end("abandoned")  # unless it ended "posted" already
        await draft.close()


async def infer_into(
    context: Context,
    trigger: Message,
    transcript: list[Message],
    draft: Draft,
    answering: Message | None = None,
    covered: int | None = None,
) -> bool:
    config, state = context.config, context.state
    model = config.model_for(state)
    streamed = 0

    def on_text(piece: str) -> None:
        nonlocal streamed
        streamed += len(piece)
        draft.push(piece)

    async def ask() -> InferenceResult:
        request = InferenceRequest(
            transcript=transcript,
            tools=await tool_dispatch().catalog.resolve(config.tools) if config.tools else {},
            call_id_prefix=context.effect_id("call"),
            instructions=config.instructions,
            names=await display_names(context, transcript),
            on_text=on_text,
        )
        settings = context.settings
        if config.model_give_up_seconds is not None:
            settings = settings.model_copy(
                update={"provider_give_up_seconds": config.model_give_up_seconds}
            )
        return await provider_for(model, config.script, settings).infer(request)

    # The call runs as a task of its own, registered while it runs, so that a line arriving
    # for this conversation can cancel it (IN_FLIGHT); the step itself is never cancelled.
    call = asyncio.ensure_future(ask())
    with IN_FLIGHT.track(
        trigger.conversation_id,
        call,
        trigger_seq=trigger.seq,
        covered_seq=trigger.seq if covered is None else covered,
        interruptible=config.while_busy == "interrupt",
    ) as flight:
        try:
            result = await call
        except asyncio.CancelledError:
            if not cancelled_here(flight):
                raise
            await drop_cancelled(context, trigger, transcript, model, streamed, flight, draft)
            return False
        except ProviderFailed as error:
            await draft.end("abandoned")
            await post_notice(context, trigger, "provider", f"the model failed: {error}")
            return True
        flight.settle()  # from here on the answer is posted: a line arriving now waits its turn
    usage = result.usage
    if usage is not None:
        count_usage(charge(state, usage, model, context.settings), usage)
    if result.empty:
        return True
    parts: list[Part] = []
    if result.text:
        parts.append(TextPart(text=result.text))
        await draft.end("posted")  # the line follows at once and replaces the draft
    parts.extend(result.tool_calls)
    await post_agent_line(context, trigger, parts, usage, answering)
    return True


async def drop_cancelled(
    context: Context,
    trigger: Message,
    transcript: list[Message],
    model: str,
    streamed: int,
    flight: ModelCall,
    draft: Draft,
) -> None:
    """A cancelled call's output is never posted: its draft ends abandoned, and what it cost is
    estimated (no usage report comes for it), counted and kept in an operator's notice."""
    assert flight.cancelled is not None
    reason, arrival = flight.cancelled
    await draft.end("abandoned")
    usage = Usage(
        model=model,
        input_tokens=estimate_tokens(transcript),
        output_tokens=streamed // 4,
        estimated=True,
    )
    label = charge(context.state, usage, model, context.settings)
    LLM_COST_ESTIMATED.labels(label).inc(usage.cost_usd)
    MODEL_CALLS_CANCELLED.labels(reason).inc()
    why = "a stop" if reason == "stop" else "a newer line"
    log.info(
        "the model call was cancelled by %s; its answer is dropped",
        why,
        extra={"conversationId": trigger.conversation_id, "messageId": trigger.id},
    )
    await context.post(
        Message(
            id=context.effect_id("notice", "cancelled"),
            conversation_id=trigger.conversation_id,
            author_actor_id=SYSTEM_ACTOR_ID,
            role="user",
            type="notice",
            parts=[
                TextPart(
                    text=f"the model call was cancelled by {why} (line {arrival.line_id}); "
                    "its answer was dropped and its usage is an estimate"
                )
            ],
            meta=carried_meta(context, trigger),
            usage=usage,
        )
    )


# What the forum's people are told when a step ends without an answer, by notice reason (the
# monologue's notice keeps the details for operators).
FORUM_NOTICES = {
    "provider": "I could not answer: the model did not respond in time. Please try again.",
    "budget": "I could not answer: my budget for this conversation is spent.",
    "unpriced": "I could not answer: my model's price is unknown, so my cost budget cannot be "
    "kept. An operator can add its price to YOKE_PRICES.",
    "model": "I cannot switch to {model}: allowed: {allowed}. An operator can allow more models "
    "with allowedModels in this join's configuration.",
    "doom_loop": "I stopped: I kept asking for the same tool call. Ask again and I will try "
    "another way.",
    "failed": "I could not answer that: something went wrong on my side, and it was set aside "
    "for an operator.",
    "approval": "I will answer once a person decides whether I may use {tools}.",
}


def forum_notice(config: ProcessorConfig, reason: str, text: str | None = None) -> ForumNotice:
    return ForumNotice(agent_actor_id=config.agent_actor_id, text=text or FORUM_NOTICES[reason])


async def post_notice(
    context: Context, trigger: Message, reason: str, text: str, *, forum_text: str | None = None
) -> None:
    """A line for operators in the monologue, never a trigger; egress tells the forum's people
    in plain words (:data:`FORUM_NOTICES`, or ``forum_text``), so nobody waits for an answer in
    silence."""
    NOTICES.labels(reason).inc()
    log.warning(text, extra={"conversationId": trigger.conversation_id, "messageId": trigger.id})
    meta = carried_meta(context, trigger)
    meta.forum_notice = forum_notice(context.config, reason, forum_text)
    await context.post(
        Message(
            id=context.effect_id("notice", reason),
            conversation_id=trigger.conversation_id,
            author_actor_id=SYSTEM_ACTOR_ID,
            role="user",
            type="notice",
            parts=[TextPart(text=text)],
            meta=meta,
        )
    )


def failure_meta(config: ProcessorConfig, line: Message) -> MessageMeta:
    """The routing of the notice of a line set aside: to the forum whose line went unanswered."""
    in_reply_to = line.meta.in_reply_to
    if line.meta.source_conversation_id == config.source_conversation_id:
        in_reply_to = line.meta.source_message_id or in_reply_to
    return MessageMeta(
        source_conversation_id=config.source_conversation_id,
        causation_id=line.id,
        in_reply_to=in_reply_to,
        agent_hops=line.meta.agent_hops,
        forum_notice=forum_notice(config, "failed"),
    )


PROCESSOR_ACTOR = ActorDefinition(
    name=PROCESSOR,
    config_schema=ProcessorConfig,
    state_schema=ProcessorState,
    trigger=is_step_trigger,
    handle=step_keeping_tail,
    # The join's tunables live in its own document (updated by a later join): read per step.
    load_config=load_processor_config,
    notice_meta=failure_meta,
)


async def host_tools(hosting: McpHosting, dispatch: ToolDispatch, stopping: asyncio.Event) -> None:
    """The catalog's local and MCP side for this process's life; then the MCP calls still
    running here stop (their deadlines end them in the store)."""
    try:
        await hosting.run(stopping)
    finally:
        await dispatch.close()


def live_processors(service: Service) -> tuple[str, list[str]] | None:
    """This processor and the live ones (its shards' owners), whom the reaper's buckets are
    shared among (None before its first ownership round)."""
    ownership = service.ownership
    if ownership is None or not ownership.live:
        return None
    return ownership.id, ownership.live


def register(service: Service) -> None:
    global _dispatch
    local = LocalTools.load()
    catalog = ToolCatalog(service.store, local)
    open_calls = OpenCalls(
        service.store, service.poster, share=ReapShare(lambda: live_processors(service))
    )
    hosting = McpHosting(service.store, catalog)
    dispatch = _dispatch = ToolDispatch(catalog, local, open_calls, service.bus, hosting.host)
    service.background("tool catalog", lambda: host_tools(hosting, dispatch, service.stopping))
    service.background("tool call deadlines", lambda: open_calls.run_reaper(service.stopping))
    days = service.settings.retention_decision_days
    for rule in (swap_rule(days), *call_rules(service.store, days)):
        service.retention.add(rule)
    # An approved call runs in its conversation's lane, on the replica owning that shard.
    service.on_event(ToolCallApproved, run_approved_call)
    service.on_arrival(notice_arrival)
    # The newest lines of the monologues it steps, so that a step reads only what is new; a
    # shard gained may bring conversations another process stepped meanwhile: all forgotten.
    tails = service.poster.tails = Tails(
        service.settings.tail_cache_conversations, service.settings.context_lines + TAIL_MARGIN
    )
    service.on_handover(lambda: tails.clear("handover"))
    # Monologue lines that start a step: user lines, and the agent's tool calls. Its plain text
    # lines go to egress only (the runtime moves the watermark past them as it writes them).
    ActorRuntime(
        service,
        [PROCESSOR_ACTOR],
        where=[
            {"kind": "monologue", "type": "message", "role": "user"},
            {"kind": "monologue", "type": "message", "calls": "yes"},
        ],
    )

"""The step: which lines start one, the window it reads, what it answered, and its output.

A step is one monologue line's delivery (docs/architecture.md, "The processor's decision
tree"). It reads a window of the monologue, never all of it (invariant 11), through the
process's conversation tails (:mod:`yoke.runtime.tails`), so that most of it comes from memory
and only what is new from the store; it ends at the trigger (invariant 1), or at the newest
line when the join's :class:`~yoke.runtime.while_busy.WhileBusyPolicy` answers bursts ("While
the agent is busy").
"""

from __future__ import annotations

from yoke.core import tracing
from yoke.core.ids import SYSTEM_ACTOR_ID
from yoke.core.models import Message, MessageMeta, Part, TextPart, ToolCallPart, Usage
from yoke.runtime.actor import ActorContext
from yoke.runtime.calls.records import open_call_id, own_result_line_id, round_results_line_id
from yoke.runtime.instances import ProcessorConfig, ProcessorState, RoundMark
from yoke.runtime.rounds import call_ids, unanswered
from yoke.runtime.tails import Tails
from yoke.runtime.while_busy import WhileBusyPolicy

Context = ActorContext[ProcessorConfig, ProcessorState]

# A tail holds this many lines beyond a window, for steps whose window ends short of its head.
TAIL_MARGIN = 32


def is_step_trigger(config: ProcessorConfig, state: ProcessorState, message: Message) -> bool:
    """The step filter: the monologue's own ``message`` lines (no forum traffic, no
    ``notice``); and of the agent's lines only those that call tools (its text is for egress,
    not a step)."""
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
    forum_seq = None
    if trigger.meta.source_conversation_id == context.config.source_conversation_id:
        forum_line = trigger.meta.source_message_id or forum_line
        forum_seq = trigger.meta.source_seq
    return MessageMeta(
        source_conversation_id=context.config.source_conversation_id,
        source_seq=forum_seq,
        causation_id=trigger.id,
        in_reply_to=forum_line,
        agent_hops=trigger.meta.agent_hops,
    )


def forum_covered(context: Context, lines: list[Message]) -> int | None:
    """The newest forum seq among the copies of the join's forum lines in ``lines``: what a
    reply or notice of a step shown them settles (``meta.coversSeq``: a line answered with a
    newer one, or held through a tool round, ends its caller's wait by it)."""
    forum = context.config.source_conversation_id
    return max(
        (
            line.meta.source_seq
            for line in lines
            if line.role == "user"
            and line.meta.source_conversation_id == forum
            and line.meta.source_seq is not None
        ),
        default=None,
    )


# --- the window ------------------------------------------------------------------------------


async def context_window(context: Context, trigger: Message, tails: Tails) -> list[Message]:
    """The step's transcript: from the context start (``/reset``) up to its trigger, and at
    most the last ``YOKE_CONTEXT_LINES`` lines (invariant 11: a step reads as much at the
    5,000th line as at the 50th; compaction carries the older lines as a summary)."""
    return await tails.history(
        context.store,
        trigger.conversation_id,
        after_seq=max(
            0,
            context.state.context_from_seq - 1,
            trigger.seq - context.settings.context_lines,
        ),
        up_to_seq=trigger.seq,
    )


async def step_window(
    context: Context, trigger: Message, tails: Tails, policy: WhileBusyPolicy
) -> list[Message]:
    """The lines the step reads: up to its trigger, or up to the conversation's newest line
    when ``policy`` answers bursts (invariant 1: every unanswered line at once), as many lines
    back as :func:`context_window` reads (a ``window`` span)."""
    with tracing.span("window"):
        if not policy.reads_to_newest:
            window = await context_window(context, trigger, tails)
        else:
            head = await tails.last_seq(
                context.store, trigger.conversation_id, at_least=trigger.seq
            )
            window = await tails.history(
                context.store,
                trigger.conversation_id,
                after_seq=max(
                    0, context.state.context_from_seq - 1, head - context.settings.context_lines
                ),
                up_to_seq=head,
            )
        tracing.annotate({"yoke.lines": len(window)})
        return window


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
    read by their ids (invariant 10: found by the record, not by the window), and by the lines
    said while the round waited that are older than the window: up to another window's worth
    of them, and a note of how many older ones are not shown (nothing held is dropped
    silently). As it is when no round is open (no store operation then)."""
    mark = recorded_round(context, transcript)
    if mark is None:
        return transcript
    call_line = await context.store.get_message(mark.call_line_id)
    if call_line is None:
        return transcript
    start = transcript[0].seq
    held_from = max(mark.seq, start - 1 - context.settings.context_lines)
    held = await context.store.history(
        call_line.conversation_id, after_seq=held_from, up_to_seq=start - 1
    )
    missing = unanswered(call_ids(call_line), held + transcript)
    ids = [round_results_line_id(context.instance_id, call_line.id)] + [
        own_result_line_id(open_call_id(context.instance_id, call_line.id, call_id))
        for call_id in sorted(missing)
    ]
    earlier = []
    for message_id in ids:
        line = await context.store.get_message(message_id)
        if line is not None and line.seq <= held_from:
            earlier.append(line)
    led = [call_line, *sorted(earlier, key=lambda line: line.seq)]
    if held_from > mark.seq:
        led.append(untold(call_line, held_from - mark.seq))
    return [*led, *held, *transcript]


def untold(call_line: Message, count: int) -> Message:
    """What the step after a long wait says of the lines it cannot show (never stored)."""
    return Message(
        id=f"{call_line.id}-untold",
        conversation_id=call_line.conversation_id,
        seq=call_line.seq,
        author_actor_id=SYSTEM_ACTOR_ID,
        parts=[
            TextPart(
                text=f"{count} earlier lines of this conversation, said while the tools ran, "
                "are not shown here; the newest lines are below"
            )
        ],
        meta=MessageMeta(instruction="held"),
    )


# --- the output ------------------------------------------------------------------------------


async def post_agent_line(
    context: Context,
    trigger: Message,
    parts: list[Part],
    usage: Usage | None = None,
    answering: Message | None = None,
    covers: int | None = None,
) -> None:
    """The step's output, as the agent; its id derives from the trigger (one per step), its
    routing from the line it answers (the trigger, or the newest of a burst), and it settles
    the forum's lines through ``covers`` (at least the line it answers)."""
    await context.post(
        Message(
            id=context.effect_id("output"),
            conversation_id=trigger.conversation_id,
            author_actor_id=context.config.agent_actor_id,
            participant_id=context.state.agent_participant_id,
            role="agent",
            parts=parts,
            meta=answer_meta(context, trigger, answering, covers),
            usage=usage,
        )
    )


def answer_meta(
    context: Context, trigger: Message, answering: Message | None, covers: int | None = None
) -> MessageMeta:
    """:func:`carried_meta` of the line answered, caused by the trigger, settling the forum's
    lines through ``covers`` and the line answered."""
    meta = carried_meta(context, answering or trigger)
    meta.causation_id = trigger.id
    meta.covers_seq = max((seq for seq in (covers, meta.source_seq) if seq), default=None)
    return meta

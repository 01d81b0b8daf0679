"""Commands: a person's slash commands and ``/stop``.

Slash commands are answered by the processor itself, never by the model. A person's ``/stop``
works in two places (docs/architecture.md, "While the agent is busy"): as its delivery arrives
in a busy lane, the process's :class:`~yoke.runtime.in_flight.InFlight` drops the model call in
flight and makes the earlier lines' steps answer nothing (what the join's
:class:`~yoke.runtime.while_busy.WhileBusyPolicy` says a stop does); in its own turn,
:func:`carry_out_stop` ends the open tool calls and tells the forum.
"""

from __future__ import annotations

import logging

from services.processor.notices import FORUM_NOTICES, post_notice
from services.processor.step import Context, carried_meta, post_agent_line
from yoke.core.ids import SYSTEM_ACTOR_ID
from yoke.core.metrics import NOTICES, STOPS
from yoke.core.models import CommandAuthor, ForumNotice, Message, TextPart
from yoke.core.slash import STOP, slash_command
from yoke.runtime.calls.repository import OpenCalls
from yoke.runtime.calls.stops import stop_forum_calls
from yoke.runtime.instances import ProcessorState, Progress, StopMark
from yoke.runtime.rounds import call_ids
from yoke.runtime.while_busy import answered_through, is_person_line

log = logging.getLogger(__name__)


async def answer_slash_command(context: Context, trigger: Message, open_calls: OpenCalls) -> None:
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
        await carry_out_stop(context, trigger, open_calls)
        return
    else:
        answer = f"unknown command {command}; try /status, /model NAME, /reset or /stop"
    await post_agent_line(context, trigger, [TextPart(text=answer)])


# --- /stop -----------------------------------------------------------------------------------


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


async def carry_out_stop(context: Context, trigger: Message, open_calls: OpenCalls) -> None:
    """A person's ``/stop``: :func:`halt`, and one notice tells the forum. Repeated on a
    redelivery, it changes nothing: the ends are unique inserts, the notice's id derives from
    the stop."""
    by, ended = await halt(context, trigger, open_calls)
    STOPS.inc()
    NOTICES.labels("stopped").inc()
    log.info(
        "stopped by a person: %d open tool call(s) ended",
        ended,
        extra={"conversationId": trigger.conversation_id, "messageId": trigger.id},
    )
    meta = carried_meta(context, trigger)
    meta.forum_notice = ForumNotice(
        agent_actor_id=context.config.agent_actor_id,
        text=f"Stopped, as {by.display_name} asked: I will not answer the earlier messages.",
        reason="stopped",
    )
    meta.covers_seq = meta.source_seq  # the lines before the stop end unanswered
    await context.post(
        Message(
            id=context.effect_id("notice", "stopped"),
            conversation_id=trigger.conversation_id,
            author_actor_id=SYSTEM_ACTOR_ID,
            role="user",
            type="notice",
            parts=[TextPart(text=f"stopped by {by.display_name}: {ended} open tool call(s) ended")],
            meta=meta,
        )
    )


async def halt(
    context: Context, trigger: Message, open_calls: OpenCalls
) -> tuple[CommandAuthor, int]:
    """What a person's ``/stop`` and ``/takeover`` both do to the agent: the model call in
    flight was dropped as the line arrived (:meth:`~yoke.runtime.in_flight.InFlight.arrive`)
    and the earlier lines' steps answer nothing; here the open tool calls end ``stopped by
    NAME`` and the rounds already written but not yet run are marked to end likewise. Who
    halted it, and how many open calls ended."""
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
    ended = await stop_forum_calls(
        open_calls,
        context.config.source_conversation_id,
        by,
        agent_actor_id=context.config.agent_actor_id,
    )
    return by, ended

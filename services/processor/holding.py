"""A held forum, as one join's processor keeps it (docs/people-take-over.md).

A person's ``/takeover`` copy halts the agent as ``/stop`` does and holds it: from that line on
its steps answer nothing (people's lines, follow-up nudges, guardian steering, tool results all
wait in the monologue) until the ``/handback`` copy, whose step writes what was said meanwhile
as one ``handback`` instruction line, and under ``afterHandback: summarize`` answers it. The
agent asks for a person itself with the built-in ``handoff`` tool: the call opens an
escalation and holds the agent the same way until the escalation is claimed (a takeover) or
ends (an ``handoff`` instruction line the door writes: the agent resumes).

The hold lives in the processor's state, saved with its watermark, so it holds across
restarts, redeliveries and shard hand-overs; every notice's id derives from its line, and the
forum notices of one takeover or hand-back are one forum line however many agents write them
(``ForumNotice.once_for``).
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime, timedelta

from services.processor.commands import halt, name_of
from services.processor.inference import display_names
from services.processor.notices import FORUM_NOTICES, post_notice
from services.processor.step import Context, carried_meta
from services.processor.tool_rounds import end_round_stopped
from yoke.core import tracing
from yoke.core.ids import SYSTEM_ACTOR_ID, derive_id
from yoke.core.metrics import ESCALATIONS_OPENED
from yoke.core.models import (
    EscalationOpened,
    Message,
    TextPart,
    ToolCallPart,
    ToolResultPart,
)
from yoke.core.slash import HANDBACK, TAKEOVER, slash_command
from yoke.core.text import printable
from yoke.runtime.calls.records import open_call_id
from yoke.runtime.calls.repository import OpenCalls
from yoke.runtime.escalations import (
    HANDOFF_INSTRUCTION,
    HANDOFF_TOOL,
    MAX_ESCALATION_REASON_CHARS,
    MAX_OPEN_PER_AGENT,
    Escalation,
    Escalations,
    escalation_id,
)
from yoke.runtime.instances import MAX_HELD_SPANS, HeldSpan, HoldMark, Progress
from yoke.runtime.while_busy import is_person_line

log = logging.getLogger(__name__)

# The instruction a hand-back writes into the monologue: what was said while held.
HANDBACK_INSTRUCTION = "handback"
# Lines of a hold a hand-back shows the model (the newest; how many more there were is said).
MAX_HANDBACK_LINES = 200
MAX_HANDBACK_LINE_CHARS = 2000


def hold_line(trigger: Message) -> str | None:
    """``/takeover`` or ``/handback`` when ``trigger`` is a person's such line."""
    if not is_person_line(trigger):
        return None
    command = slash_command(trigger.text)
    return command.name if command is not None and command.name in (TAKEOVER, HANDBACK) else None


class Holding:
    """The hold of the joins this process steps, and the escalations their agents open."""

    def __init__(self, open_calls: OpenCalls) -> None:
        self.open_calls = open_calls

    async def carry_out(self, context: Context, trigger: Message, command: str) -> None:
        """A person's ``/takeover`` or ``/handback`` (``command``, from :func:`hold_line`), in
        a span of that name in the trace of the line that asked."""
        with tracing.span(
            command.lstrip("/"),
            attributes={tracing.FORUM_ID: trigger.meta.source_conversation_id or ""},
        ):
            if command == TAKEOVER:
                await self.take_over(context, trigger)
            else:
                await self.hand_back(context, trigger)

    async def step(self, context: Context, trigger: Message, calls: list[ToolCallPart]) -> bool:
        """Whether the hold took ``trigger``'s step (the step ends here): an escalation's end,
        a hand-back's summary under ``wait``, or anything at all while the forum is held. (A
        hold line itself is :meth:`carry_out`'s.)"""
        state = context.state
        instruction = trigger.meta.instruction
        if instruction == HANDBACK_INSTRUCTION:
            return context.config.after_handback != "summarize"
        if instruction == HANDOFF_INSTRUCTION and trigger.meta.escalation_id:
            return await self.end_escalation(context, trigger)
        if state.held is None and not trigger.meta.held:
            return False
        log.info(
            "not answering: %s holds the forum",
            state.held.by if state.held is not None else "a person",
            extra={"conversationId": trigger.conversation_id, "messageId": trigger.id},
        )
        if trigger.role == "agent" and calls:
            # A round the model wrote before the hold whose step comes after it: ended, not run
            # (every call still gets its result: invariant 12).
            await self.end_round_held(context, trigger, calls)
        return True

    # --- a person takes over and hands back --------------------------------------------------

    async def take_over(self, context: Context, trigger: Message) -> None:
        state = context.state
        held = state.held
        if held is not None and held.kind == "person":
            log.info(
                "takeover ignored: %s holds the forum already",
                held.by,
                extra={"conversationId": trigger.conversation_id, "messageId": trigger.id},
            )
            return
        by, ended = await halt(context, trigger, self.open_calls)
        state.held = HoldMark(
            conversation_id=trigger.conversation_id,
            # A claim continues the escalation's hold: its lines are all the hold's.
            seq=held.seq if held is not None else trigger.seq,
            kind="person",
            by=by.display_name,
            line_id=trigger.meta.source_message_id,
            escalation_id=held.escalation_id if held is not None else None,
        )
        log.info(
            "held by %s: %d open tool call(s) ended",
            by.display_name,
            ended,
            extra={"conversationId": trigger.conversation_id, "messageId": trigger.id},
        )
        meta_source = carried_meta(context, trigger)
        await post_notice(
            context,
            trigger,
            "held",
            f"held by {by.display_name}: the agent answers nothing until it is handed back "
            f"({ended} open tool call(s) ended)",
            forum_text=FORUM_NOTICES["held"].format(name=by.display_name),
            covers=meta_source.source_seq,  # the lines before the takeover end unanswered
            once_for=trigger.meta.source_message_id,
        )

    async def hand_back(self, context: Context, trigger: Message) -> None:
        state = context.state
        held = state.held
        if held is None:
            log.info(
                "handback ignored: the forum is not held",
                extra={"conversationId": trigger.conversation_id, "messageId": trigger.id},
            )
            return
        by = await name_of(context, trigger.meta.source_actor_id or trigger.author_actor_id)
        span = HeldSpan(
            conversation_id=trigger.conversation_id,
            from_seq=held.seq,
            to_seq=trigger.seq,
            by=held.by,
        )
        state.held = None
        state.held_spans = [*state.held_spans, span][-MAX_HELD_SPANS:]
        await post_notice(
            context,
            trigger,
            "handed_back",
            f"handed back by {by.display_name}",
            forum_text=FORUM_NOTICES["handed_back"].format(name=by.display_name),
            # People answered the lines said while held: whoever waits on one is released.
            covers=trigger.meta.source_seq,
            once_for=trigger.meta.source_message_id,
        )
        await self.tell_what_was_said(context, trigger, span, by.display_name)

    async def tell_what_was_said(
        self, context: Context, trigger: Message, span: HeldSpan, returned_by: str
    ) -> None:
        """The ``handback`` instruction line: every line people said while the forum was held
        (the newest :data:`MAX_HANDBACK_LINES`), with their names. Under ``afterHandback:
        summarize`` its step answers it; under ``wait`` the next line's step reads it."""
        first = max(span.from_seq, span.to_seq - MAX_HANDBACK_LINES)
        lines = [
            line
            for line in await context.store.history(
                span.conversation_id, after_seq=first, up_to_seq=span.to_seq - 1
            )
            if is_person_line(line)
        ]
        left_out = max(0, first - span.from_seq)
        names = await display_names(context, lines)
        said = [
            f"{names.get(line.author_actor_id, 'someone')}: "
            + printable(line.text, multiline=True)[:MAX_HANDBACK_LINE_CHARS]
            for line in lines
        ]
        parts = [f"While {span.by} held this conversation, you were silent."]
        if said:
            parts.append(
                "What was said meanwhile, oldest first"
                + (f" ({left_out} earlier line(s) not shown)" if left_out else "")
                + ":\n"
                + "\n".join(said)
            )
        else:
            parts.append("Nothing was said meanwhile.")
        parts.append(f"{returned_by} handed the conversation back to you.")
        if context.config.after_handback == "summarize":
            parts.append("Speak first: sum up briefly where things stand, then carry on.")
        else:
            parts.append("Answer the next message with this in mind.")
        meta = carried_meta(context, trigger)
        meta.instruction = HANDBACK_INSTRUCTION
        await context.post(
            Message(
                id=context.effect_id("handback"),
                conversation_id=trigger.conversation_id,
                author_actor_id=SYSTEM_ACTOR_ID,
                role="user",
                parts=[TextPart(text="\n\n".join(parts))],
                meta=meta,
            )
        )

    async def end_round_held(
        self, context: Context, trigger: Message, calls: list[ToolCallPart]
    ) -> None:
        held = context.state.held
        await end_round_stopped(
            context, trigger, calls, None, by=held.by if held is not None else "a person"
        )

    # --- the agent asks for a person -----------------------------------------------------------

    async def hand_off(
        self, context: Context, trigger: Message, calls: list[ToolCallPart]
    ) -> dict[str, ToolResultPart]:
        """The round's ``handoff`` calls: the first opens an escalation and holds the agent;
        each gets its result here (the round's results line carries them)."""
        results: dict[str, ToolResultPart] = {}
        for call in calls:
            results[call.call_id] = await self._hand_off_once(context, trigger, call)
        return results

    async def _hand_off_once(
        self, context: Context, trigger: Message, call: ToolCallPart
    ) -> ToolResultPart:
        config, state = context.config, context.state

        def result(output: str, error: bool = False) -> ToolResultPart:
            return ToolResultPart(
                call_id=call.call_id, name=HANDOFF_TOOL, output=output, is_error=error
            )

        reason = call.input.get("reason")
        urgency = call.input.get("urgency", "normal")
        if not isinstance(reason, str) or not reason.strip():
            return result("handoff needs a reason: why a person is needed", error=True)
        if urgency not in ("low", "normal", "high"):
            return result("urgency is one of low, normal, high", error=True)
        if state.held is not None:
            return result(f"{state.held.by} holds this conversation already; say nothing more")
        if not await self._person_wrote_since_last(context, trigger):
            return result(
                "nobody came when you asked a moment ago: do not ask again until someone "
                "writes; help as well as you can meanwhile",
                error=True,
            )
        forum = await context.store.get_conversation(config.source_conversation_id)
        if forum is not None and forum.kept_for is not None:
            # Only its outside caller (MCP, A2A) writes in a kept forum: a person who joined
            # could never answer there.
            return result(
                "no person can join this conversation: it is an outside caller's (MCP or A2A); "
                "answer as well as you can",
                error=True,
            )
        escalations = Escalations(context.store)
        the_id = escalation_id(open_call_id(context.instance_id, trigger.id, call.call_id))
        stored = await escalations.get(the_id)
        if stored is None:
            if await escalations.open_of(agent=config.agent_actor_id) >= MAX_OPEN_PER_AGENT:
                return result(
                    f"no person can be asked now: this agent has {MAX_OPEN_PER_AGENT} requests "
                    "open already",
                    error=True,
                )
            now = datetime.now(UTC)
            escalation = Escalation.model_validate(
                {
                    "_id": the_id,
                    "forumId": config.source_conversation_id,
                    "agentActorId": config.agent_actor_id,
                    "joinKey": context.instance_id,
                    "callId": call.call_id,
                    "reason": reason.strip()[:MAX_ESCALATION_REASON_CHARS],
                    "urgency": urgency,
                    "openedAt": now,
                    "deadline": now + timedelta(seconds=config.handoff_timeout_seconds),
                }
            )
            stored, created = await escalations.open(escalation)
            if created:
                ESCALATIONS_OPENED.inc()
        await self._announce(context, stored)
        state.held = HoldMark(
            conversation_id=trigger.conversation_id,
            seq=trigger.seq,
            kind="escalation",
            by="nobody yet (an escalation is open)",
            escalation_id=stored.id,
        )
        await post_notice(
            context,
            trigger,
            "handoff",
            f"asked for a person (escalation {stored.id}): {stored.reason}",
            covers=carried_meta(context, trigger).source_seq,
        )
        return result(
            f"A person was asked to join (escalation {stored.id}). Say nothing more here: "
            "a person takes over, or you are told that nobody came."
        )

    async def _person_wrote_since_last(self, context: Context, trigger: Message) -> bool:
        """Whether a person's line came after the last escalation that ended unclaimed (read
        only for a ``handoff`` call, and only after such an end)."""
        ended = context.state.escalation_ended
        if ended is None or ended.conversation_id != trigger.conversation_id:
            return True
        since = await context.store.history(
            trigger.conversation_id, after_seq=ended.seq, up_to_seq=trigger.seq
        )
        return any(is_person_line(line) for line in since)

    async def _announce(self, context: Context, escalation: Escalation) -> None:
        """``escalation.opened`` on ``yoke.forum`` (again on a retried step: one event id)."""
        payload = EscalationOpened(
            escalation_id=escalation.id,
            forum_id=escalation.forum_id,
            agent_actor_id=escalation.agent_actor_id,
            reason=escalation.reason,
            urgency=escalation.urgency,
            opened_at=escalation.opened_at,
            deadline=escalation.deadline,
        )
        await context.poster.bus.publish_forum_event(
            derive_id("escalation-opened", escalation.id), payload
        )

    async def end_escalation(self, context: Context, trigger: Message) -> bool:
        """The door's ``handoff`` instruction: the escalation the agent waits on ended
        unclaimed (timed out, or canceled). Whether the step ends here: under
        ``handoffFallback: resume`` the agent answers it (told nobody came); under ``notice``
        the forum is told and the agent waits for the next line."""
        state = context.state
        held = state.held
        if (
            held is None
            or held.kind != "escalation"
            or held.escalation_id != (trigger.meta.escalation_id)
        ):
            log.info(
                "escalation end ignored: the agent does not wait on it",
                extra={"conversationId": trigger.conversation_id, "messageId": trigger.id},
            )
            return True
        # Nobody answered the people meanwhile: their lines stay in the prompt as lines (no
        # held span), for the agent to answer now (``resume``), and the forum is told; the
        # notice settles them, so nobody waiting on one of them (an A2A task, an MCP call)
        # waits for ever under ``notice``.
        state.held = None
        state.escalation_ended = Progress(conversation_id=trigger.conversation_id, seq=trigger.seq)
        await post_notice(
            context,
            trigger,
            "nobody_came",
            f"escalation {held.escalation_id} ended unclaimed",
            covers=await newest_forum_seq(context, held.seq, trigger.seq),
        )
        return context.config.handoff_fallback != "resume"


async def newest_forum_seq(context: Context, after: int, before: int) -> int | None:
    """The forum seq of the newest forum line copied into the monologue between two of its
    seqs (the last :data:`MAX_HANDBACK_LINES` read): what a hold's end settles."""
    lines = await context.store.history(
        context.state.monologue_id,
        after_seq=max(after, before - MAX_HANDBACK_LINES),
        up_to_seq=before,
    )
    forum = context.config.source_conversation_id
    seqs = [
        line.meta.source_seq
        for line in lines
        if line.meta.source_conversation_id == forum and line.meta.source_seq
    ]
    return max(seqs, default=None)

"""Inference: the step's one model call, its streamed draft, its activity hints, its cancel.

The call runs as a task of its own, registered in the process's :class:`InFlight` while it
runs with the join's :class:`WhileBusyPolicy`, so that a line arriving for its conversation can
cancel it if the policy says so (docs/architecture.md, "While the agent is busy"); the step
itself is never cancelled. Its text streams into a :class:`Draft` as it comes,
and ``agent.activity`` tells live views what the agent is doing; both are hints, the line that
follows is the truth.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Literal

from services.processor.notices import post_notice
from services.processor.remembering import in_mind, memory_tools
from services.processor.step import Context, carried_meta, forum_covered, post_agent_line
from yoke.bus import topology
from yoke.core.ids import SYSTEM_ACTOR_ID, forwarded_line_id
from yoke.core.metrics import LLM_COST_ESTIMATED, MODEL_CALLS_CANCELLED
from yoke.core.models import AgentActivity, Envelope, Message, Part, TextPart, Usage
from yoke.llm.base import (
    InferenceRequest,
    InferenceResult,
    PromptMemory,
    ProviderFailed,
    estimate_tokens,
)
from yoke.llm.providers import provider_for
from yoke.runtime.budgets import budget_spent, charge, count_usage, unpriced_under_budget
from yoke.runtime.catalog_store import ToolCatalog
from yoke.runtime.drafts import Draft
from yoke.runtime.escalations import HANDOFF_SPEC, HANDOFF_TOOL
from yoke.runtime.holds import fold_held
from yoke.runtime.in_flight import InFlight, ModelCall, cancelled_here
from yoke.runtime.instances import ProcessorConfig, Progress
from yoke.runtime.while_busy import WhileBusyPolicy
from yoke.tools.base import ToolSpec

log = logging.getLogger(__name__)

# An activity event never holds a step up longer than this (it is a courtesy to live views).
ACTIVITY_PUBLISH_SECONDS = 2.0


class Inference:
    """A step's model call, with the registry that may cancel it and the catalog its tools
    are described from."""

    def __init__(self, in_flight: InFlight, catalog: ToolCatalog) -> None:
        self.in_flight = in_flight
        self.catalog = catalog

    async def offered(self, config: ProcessorConfig) -> dict[str, ToolSpec]:
        """The tools the model is shown: the join's, ``handoff`` when the join offers it, and
        the memory tools when its memory does (over a catalog tool of the same name)."""
        tools: dict[str, ToolSpec] = {}
        if config.tools:
            tools.update(await self.catalog.resolve(config.tools))
        if config.handoff:
            tools[HANDOFF_TOOL] = HANDOFF_SPEC
        tools.update(memory_tools(config))
        return tools

    async def infer_once(
        self,
        context: Context,
        trigger: Message,
        transcript: list[Message],
        policy: WhileBusyPolicy,
        *,
        answering: Message | None = None,
    ) -> None:
        """One model call on ``transcript`` (read past the trigger when ``policy`` answers a
        burst: the prompt is as the policy orders it, the reply in reply to ``answering``)."""
        config, state = context.config, context.state
        answered = state.answered
        covered = max((line.seq for line in transcript), default=trigger.seq)
        # ... and the forum's lines they copy are settled by whatever the step posts.
        covers = forum_covered(context, transcript)
        # Whatever the call ends in (an answer, a notice), the lines it was shown are done; the
        # steps of those still queued call no model.
        state.answered = Progress(conversation_id=trigger.conversation_id, seq=covered)
        spent = budget_spent(config, state)
        if spent:
            await post_notice(context, trigger, "budget", f"no answer: {spent}", covers=covers)
            return
        unpriced = unpriced_under_budget(config, state, context.settings)
        if unpriced:
            await post_notice(context, trigger, "unpriced", unpriced, covers=covers)
            return
        # What the agent remembers of the lines it answers (nothing without the join's memory).
        memory = await in_mind(context, trigger, transcript, answered, answering)
        transcript = policy.prompt(transcript, answered, trigger)
        async with activity(context, "thinking"):
            done = await self.infer_and_post(
                context, trigger, transcript, policy, answering, covered, covers, memory
            )
            if not done:
                state.answered = answered  # cancelled: the next step answers these lines

    async def infer_and_post(
        self,
        context: Context,
        trigger: Message,
        transcript: list[Message],
        policy: WhileBusyPolicy,
        answering: Message | None = None,
        covered: int | None = None,
        covers: int | None = None,
        memory: list[PromptMemory] | None = None,
    ) -> bool:
        """Returns ``False`` when the model call was cancelled (an interrupt, a stop)."""
        draft = draft_of(context, trigger, answering)
        try:
            return await self.infer_into(
                context, trigger, transcript, draft, policy, answering, covered, covers, memory
            )
        finally:
            await draft.end("abandoned")  # unless it ended "posted" already
            await draft.close()

    async def infer_into(
        self,
        context: Context,
        trigger: Message,
        transcript: list[Message],
        draft: Draft,
        policy: WhileBusyPolicy,
        answering: Message | None = None,
        covered: int | None = None,
        covers: int | None = None,
        memory: list[PromptMemory] | None = None,
    ) -> bool:
        """The model call, streamed into ``draft``, and its answer posted unless cancelled;
        either settles the forum's lines through ``covers``; the prompt carries ``memory``."""
        config, state = context.config, context.state
        model = config.model_for(state)
        streamed = 0

        def on_text(piece: str) -> None:
            nonlocal streamed
            streamed += len(piece)
            draft.push(piece)

        async def ask() -> InferenceResult:
            request = InferenceRequest(
                # People's lines said while the forum was held are in the handback line.
                transcript=fold_held(transcript, state.held_spans),
                tools=await self.offered(config),
                call_id_prefix=context.effect_id("call"),
                instructions=config.instructions,
                names=await display_names(context, transcript),
                on_text=on_text,
                memory=memory or [],
            )
            settings = context.settings
            if config.model_give_up_seconds is not None:
                settings = settings.model_copy(
                    update={"provider_give_up_seconds": config.model_give_up_seconds}
                )
            return await provider_for(model, config.script, settings).infer(request)

        # A task of its own, registered while it runs, so that a line arriving for this
        # conversation can cancel it; the step itself is never cancelled.
        call = asyncio.ensure_future(ask())
        with self.in_flight.track(
            trigger.conversation_id,
            call,
            trigger_seq=trigger.seq,
            covered_seq=trigger.seq if covered is None else covered,
            policy=policy,
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
                await post_notice(
                    context, trigger, "provider", f"the model failed: {error}", covers=covers
                )
                return True
            flight.settle()  # from here on the answer is posted: a line arriving now waits
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
        await post_agent_line(context, trigger, parts, usage, answering, covers)
        return True


def draft_of(context: Context, trigger: Message, answering: Message | None = None) -> Draft:
    """The draft of the forum line this step's text becomes (egress derives its id)."""
    return Draft(
        context.poster.bus,
        forum_id=context.config.source_conversation_id,
        agent_actor_id=context.config.agent_actor_id,
        message_id=forwarded_line_id(context.effect_id("output")),
        in_reply_to=carried_meta(context, answering or trigger).in_reply_to,
    )


async def display_names(context: Context, transcript: list[Message]) -> dict[str, str]:
    """The transcript's authors by id, as the prompt names them."""
    names: dict[str, str] = {}
    for author_id in {message.author_actor_id for message in transcript}:
        actor = await context.store.get_actor(author_id)
        if actor is not None:
            names[author_id] = actor.name
    return names


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

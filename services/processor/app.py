"""The processor's decision tree, one step per ``conversation.message.posted``.

- agent ``tool_call``  -> run the tools in parallel -> one ``tool_result`` message (system author)
- user ``tool_result`` -> infer once -> post the outputs
- user text            -> (compaction hook) -> infer once -> post the outputs

It never loops within a delivery and never decides what people see (egress does). The step's
transcript ends at its trigger (DESIGN invariant 1), so queued lines are each answered once.
"""

from __future__ import annotations

import logging

from yoke.actor import ActorContext, ActorDefinition, ActorRuntime
from yoke.inference import provider_for
from yoke.joins import PROCESSOR, SYSTEM_ACTOR_ID, ProcessorConfig, ProcessorState
from yoke.models import Message, MessageMeta, Part, TextPart, ToolCallPart, ToolResultPart
from yoke.service import Service
from yoke.tools import resolve_tools, run_tool_calls

log = logging.getLogger(__name__)

Context = ActorContext[ProcessorConfig, ProcessorState]


def is_step_trigger(config: ProcessorConfig, state: ProcessorState, message: Message) -> bool:
    """The seed's filter: not forum traffic, not legacy ``reply``; and no ``notice``."""
    return (
        message.conversation_id != config.source_conversation_id
        and message.conversation_id == state.monologue_id
        and message.type == "message"
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
    calls = [part for part in trigger.parts if isinstance(part, ToolCallPart)]
    if trigger.role == "agent":
        if calls:
            await run_tools(context, trigger, calls)
        return
    if any(isinstance(part, ToolResultPart) for part in trigger.parts):
        await infer_once(context, trigger)
        return
    if not trigger.text:
        return
    if trigger.meta.agent_hops >= context.config.hop_cap:
        # DESIGN invariant 6: agents answering agents stop at the cap; people are never capped.
        log.info(
            "not answering: agentHops %d reached the cap %d",
            trigger.meta.agent_hops,
            context.config.hop_cap,
            extra={"conversationId": trigger.conversation_id, "messageId": trigger.id},
        )
        return
    await infer_once(context, trigger)


async def run_tools(context: Context, trigger: Message, calls: list[ToolCallPart]) -> None:
    tools = resolve_tools(context.config.tools)
    results = await run_tool_calls(
        calls,
        tools,
        key_of=lambda call: context.effect_id("tool", call.call_id),
        conversation_id=trigger.conversation_id,
    )
    await context.post(
        Message(
            id=context.effect_id("tool-results"),
            conversation_id=trigger.conversation_id,
            author_actor_id=SYSTEM_ACTOR_ID,
            role="user",
            parts=list(results),
            meta=carried_meta(context, trigger),
        )
    )


async def infer_once(context: Context, trigger: Message) -> None:
    config = context.config
    transcript = await context.store.history(trigger.conversation_id, up_to_seq=trigger.seq)
    tools = resolve_tools(config.tools)
    provider = provider_for(config.model, config.script)
    result = await provider.infer(transcript, tools, call_id_prefix=context.effect_id("call"))
    if result.empty:
        return
    parts: list[Part] = []
    if result.text:
        parts.append(TextPart(text=result.text))
    parts.extend(result.tool_calls)
    await context.post(
        Message(
            id=context.effect_id("output"),
            conversation_id=trigger.conversation_id,
            author_actor_id=config.agent_actor_id,
            participant_id=context.state.agent_participant_id,
            role="agent",
            parts=parts,
            meta=carried_meta(context, trigger),
            usage=result.usage,
        )
    )


PROCESSOR_ACTOR = ActorDefinition(
    name=PROCESSOR,
    config_schema=ProcessorConfig,
    state_schema=ProcessorState,
    trigger=is_step_trigger,
    handle=step,
)


def register(service: Service) -> None:
    ActorRuntime(service, [PROCESSOR_ACTOR])

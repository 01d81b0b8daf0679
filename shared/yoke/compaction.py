"""Compaction: a monologue that outgrows its join's threshold continues in a fresh one.

The new monologue starts with a summary of the older lines and the most recent ones; the forum
participant's ``metadata.monologueId`` moves to it (so ingestion copies new lines there), the
processor repoints, and ``agent.monologue.compacted`` tells egress. No forum line may be lost or
answered twice across the swap, so:

- the trigger line and everything after it in the old monologue are carried into the new one
  as new lines (answered there, in order); the old monologue answers nothing more;
- every swap is recorded on the forum participant (``metadata.compactions``: from, to, and the
  first seq that moved), and whoever writes a copy into a monologue checks afterwards whether it
  has moved on, and if so carries the moved lines up to its copy forward too (a double check
  that closes the race with a swap in progress);
- carried lines name their original in ``meta.carriedFrom``: egress never forwards them (the
  agent's recent lines reach the new monologue as context, not as new replies);
- carried copies of a forum line keep the id ingestion would give it there, so two writers
  carrying the same line write it once, and both carry in seq order, so order holds.
"""

from __future__ import annotations

import json

from pydantic import Field

from yoke.actor import ActorContext
from yoke.ids import derive_id
from yoke.inference import InferenceRequest, ProviderFailed, provider_for
from yoke.joins import (
    SYSTEM_ACTOR_ID,
    ProcessorConfig,
    ProcessorState,
    ensure_participant,
)
from yoke.metrics import COMPACTIONS
from yoke.models import (
    Conversation,
    Message,
    MonologueCompacted,
    Participant,
    TextPart,
    ToolCallPart,
    ToolResultPart,
    WireModel,
)
from yoke.posting import Poster
from yoke.store import Store

SUMMARY_INSTRUCTION = "summary"
FIXTURE_SUMMARY_CHARS = 400


class CompactionLink(WireModel):
    """One swap: lines of ``from_monologue_id`` from ``from_seq`` on moved to the next one."""

    from_monologue_id: str
    to_monologue_id: str
    from_seq: int = Field(ge=1)


def estimate_tokens(messages: list[Message]) -> int:
    """About four characters a token, plus a little per message."""
    characters = 0
    for message in messages:
        for part in message.parts:
            if isinstance(part, TextPart):
                characters += len(part.text)
            elif isinstance(part, ToolCallPart):
                characters += len(part.name) + len(json.dumps(part.input))
            elif isinstance(part, ToolResultPart):
                characters += len(part.output)
    return characters // 4 + 4 * len(messages)


def chain_of(participant: Participant) -> list[CompactionLink]:
    links = participant.metadata.get("compactions")
    return (
        [CompactionLink.model_validate(link) for link in links] if isinstance(links, list) else []
    )


def carried_id(target: str, line: Message) -> str:
    """A forum line gets the id ingestion would give its copy in ``target``."""
    if line.meta.source_message_id:
        return derive_id("copy", target, line.meta.source_message_id)
    return derive_id("carry", target, line.id)


def carried(line: Message, target: str, message_id: str) -> Message:
    meta = line.meta.model_copy(update={"carried_from": line.id})
    return line.model_copy(
        update={"id": message_id, "conversation_id": target, "seq": 0, "meta": meta}
    )


async def carry_tail(
    store: Store,
    poster: Poster,
    forum_participant_id: str,
    monologue_id: str,
    up_to_seq: int | None = None,
) -> None:
    """Carry what a swap moved on from ``monologue_id`` (up to ``up_to_seq``) into its successor.

    Lines go in seq order from the swap's first moved seq, so any number of writers doing this
    at once keep the order (each line is written once, by whoever comes first); then on down
    the chain, should the successor have moved on too.
    """
    participant = await store.get_participant(forum_participant_id)
    if participant is None:
        return
    link = next((x for x in chain_of(participant) if x.from_monologue_id == monologue_id), None)
    if link is None or (up_to_seq is not None and up_to_seq < link.from_seq):
        return
    target = link.to_monologue_id
    last: Message | None = None
    for line in await store.history(monologue_id, after_seq=link.from_seq - 1, up_to_seq=up_to_seq):
        if line.role == "user" and line.type == "message":
            last = await poster.post(carried(line, target, carried_id(target, line)))
    if last is not None:
        await carry_tail(store, poster, forum_participant_id, target, last.seq)


def fixture_summary(older: list[Message]) -> str:
    texts = [m.text for m in older if m.text and m.meta.instruction != SUMMARY_INSTRUCTION]
    earlier = [m.text for m in older if m.meta.instruction == SUMMARY_INSTRUCTION]
    summary = " | ".join([*earlier, *texts])
    return f"Earlier ({len(older)} lines): {summary[:FIXTURE_SUMMARY_CHARS]}"


async def summarize(
    context: ActorContext[ProcessorConfig, ProcessorState], older: list[Message]
) -> str:
    model = context.state.model or context.config.model
    if model.startswith("fixture-"):
        return fixture_summary(older)
    request = InferenceRequest(
        transcript=older,
        tools={},
        call_id_prefix=context.effect_id("summary-call"),
        instructions="Summarize the conversation so far in a few sentences, for your own later "
        "reference: who said what, what was decided, what is still open.",
    )
    try:
        result = await provider_for(model, [], context.settings).infer(request)
    except ProviderFailed:
        return fixture_summary(older)
    return result.text or fixture_summary(older)


def split_for_compaction(
    transcript: list[Message], keep: int
) -> tuple[list[Message], list[Message]]:
    """(older, recent): the ``keep`` lines before the trigger stay verbatim, never starting at a
    tool result whose call would be left behind in the summary."""
    before = transcript[:-1]
    cut = max(0, len(before) - keep)
    while cut < len(before) and any(isinstance(p, ToolResultPart) for p in before[cut].parts):
        cut += 1
    return before[:cut], before[cut:]


async def swap_monologue(
    context: ActorContext[ProcessorConfig, ProcessorState],
    trigger: Message,
    transcript: list[Message],
) -> None:
    """Continue the join in a new monologue; the trigger is answered there."""
    store, poster, config, state = context.store, context.poster, context.config, context.state
    old = trigger.conversation_id
    older, recent = split_for_compaction(transcript, config.compaction_keep)
    summary = await summarize(context, older)

    new_id = derive_id("monologue", old, trigger.id)
    forum = await store.get_conversation(config.source_conversation_id)
    await store.save_conversation(
        Conversation(id=new_id, kind="monologue", title=forum.title if forum else "")
    )
    agent_participant = await ensure_participant(store, new_id, config.agent_actor_id)
    last = await poster.post(
        Message(
            id=derive_id("summary", new_id),
            conversation_id=new_id,
            author_actor_id=SYSTEM_ACTOR_ID,
            role="user",
            parts=[TextPart(text=summary)],
            meta=trigger.meta.model_copy(
                update={"instruction": SUMMARY_INSTRUCTION, "source_message_id": None}
            ),
        )
    )
    for line in recent:  # context, not to be answered again: the watermark passes them
        last = await poster.post(carried(line, new_id, derive_id("context", new_id, line.id)))

    state.monologue_id = new_id
    state.agent_participant_id = agent_participant.id
    state.context_from_seq = 0
    await context.repoint(new_id, last.seq)

    forum_participant = await store.get_participant(config.forum_participant_id)
    chain = chain_of(forum_participant) if forum_participant else []
    chain.append(
        CompactionLink(from_monologue_id=old, to_monologue_id=new_id, from_seq=trigger.seq)
    )
    await store.set_participant_metadata(
        config.forum_participant_id,
        {"monologueId": new_id, "compactions": [link.to_wire() for link in chain]},
    )
    # The trigger and whatever reached the old monologue after it move on, in order.
    await carry_tail(store, poster, config.forum_participant_id, old)
    await poster.emit(
        MonologueCompacted(
            agent_actor_id=config.agent_actor_id,
            forum_id=config.source_conversation_id,
            previous_monologue_id=old,
            monologue_id=new_id,
        ),
        event_id=derive_id("compacted", old, new_id),
    )
    COMPACTIONS.inc()


def needs_compaction(config: ProcessorConfig, transcript: list[Message]) -> bool:
    if config.compaction_threshold_tokens is None:
        return False
    older, _ = split_for_compaction(transcript, config.compaction_keep)
    # Nothing worth summarizing (say, only an earlier summary): compacting again would loop.
    worth = [m for m in older if m.meta.instruction != SUMMARY_INSTRUCTION]
    return len(worth) >= 2 and estimate_tokens(transcript) > config.compaction_threshold_tokens

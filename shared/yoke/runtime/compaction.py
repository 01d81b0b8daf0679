"""Compaction: a monologue that outgrows its join's threshold continues in a fresh one.

The new monologue starts with a summary of the older lines and the most recent ones (context,
never answered again); the trigger and whatever reached the old monologue after it are carried
over as new lines and answered there, in order; the old monologue answers nothing more.
Where lines go and how a tail is carried is the monologue chain's (:mod:`yoke.runtime.chain`).

The swap writes many documents, so it is a resumable procedure (docs/architecture.md, invariant 9).
Its intent is recorded first, under an id derived from the new monologue (itself derived from the
old one and the trigger), and every step is idempotent. Two places decide where lines go, and they
move one at a time: the processor's state (``watch``: which monologue it answers; one writer, its
lane) and the forum participant's ``metadata.monologueId`` (where ingestion copies). The old
monologue's lane does the steps up to the repoint; the new monologue's first step (the carried
trigger, the "wake-up") does the rest before answering it.

A crash right after each step (the old monologue's lane runs them up to ``rouse``, the new one's
first step the rest; a transient failure retried in-process runs the same steps again, except
that nothing after the repoint may fail in the old lane, whose retry would find the processor
gone):

| after ...                        | finished by ...                                            |
|----------------------------------|------------------------------------------------------------|
| (nothing: while summarizing)     | the trigger's redelivery: the processor still watches the  |
|                                  | old monologue, below the trigger, so the step runs again   |
| ``record_intent``: the procedure | the same redelivery (or any later line of the old          |
| and the participant's "swapping" | monologue: the runtime's catch-up runs the trigger first); |
| ``open_monologue``               | each step finds its documents written and goes on. Lines   |
| ``write_summary``                | meanwhile go to the old monologue, which the processor     |
| ``write_context``                | still watches; the swap carries them over later            |
| ``arm_wake``: the carried        |                                                            |
| trigger, stored unpublished      |                                                            |
| ``repoint``: state -> new        | the wake-up, still in the outbox: its sweep publishes it   |
|                                  | and the processor, watching the new monologue, takes it;   |
|                                  | or ingestion first: it sees "swapping", finds the          |
|                                  | processor on the new monologue, carries the old tail there |
|                                  | (publishing the wake-up) and copies its line after it      |
| ``rouse``: the wake-up published | the wake-up's delivery (given back if unacked)             |
| ``move_participant``: the        | the wake-up's redelivery; ingestion copies into the new    |
| monologueId and the chain; no    | monologue, carrying the old tail there first               |
| more "swapping"                  |                                                            |
| ``carry_over``: the tail         | the wake-up's redelivery                                   |
| ``announce``: the event          | the wake-up's redelivery                                   |
| ``close``: the procedure done    | nothing is left                                            |

So ingestion never copies into a monologue no processor watches for good: before the repoint
the processor watches the old monologue; after it, either ingestion sees the half-done swap and
copies into the new one, or its line in the old one is carried over by ``carry_over`` (which
reads the old monologue after moving the participant, and ingestion checks the chain after its
copy: one of the two always sees the other). No forum line is answered in both monologues:
the processor answers lines of the old monologue only below the trigger, of the new one only
above the context.

A swap never starts inside a tool round (a call whose results are not written yet, or a call
the agent made after the trigger), so a tool result is never carried: in the new monologue it
would answer a call left behind. The context is cut so that each tool result keeps its call.
"""

from __future__ import annotations

import logging
from datetime import datetime
from typing import Any

from pydantic import Field

from yoke.core.ages import BUCKET_FIELD, day_bucket
from yoke.core.ids import SYSTEM_ACTOR_ID, derive_id
from yoke.core.metrics import COMPACTIONS
from yoke.core.models import (
    Conversation,
    Document,
    Message,
    MonologueCompacted,
    Participant,
    TextPart,
    utcnow,
)
from yoke.llm.base import InferenceRequest, ProviderFailed, estimate_tokens
from yoke.llm.providers import provider_for
from yoke.runtime.actor import ActorContext
from yoke.runtime.budgets import budget_spent, charge, count_usage, unpriced_under_budget
from yoke.runtime.chain import (
    SWAPPING,
    CompactionLink,
    carried,
    carried_id,
    carry_tail,
    chain_of,
)
from yoke.runtime.instances import ProcessorConfig, ProcessorState
from yoke.runtime.joins import ensure_participant
from yoke.runtime.rounds import call_ids, has_unanswered_call, result_ids
from yoke.store.database import PROCEDURES, Store
from yoke.store.retention import Rule

log = logging.getLogger(__name__)

SUMMARY_INSTRUCTION = "summary"
FIXTURE_SUMMARY_CHARS = 400

Context = ActorContext[ProcessorConfig, ProcessorState]


class MonologueSwap(Document):
    """The intent of one swap, recorded before anything else; ``done`` once it is all written."""

    kind: str = "monologue-swap"
    forum_participant_id: str
    from_monologue_id: str
    to_monologue_id: str
    from_seq: int = Field(ge=1)
    trigger_id: str
    # The carried trigger: the new monologue's first line to answer.
    wake_id: str
    done: bool = False
    created_at: datetime = Field(default_factory=utcnow)
    # yoke.store.retention: the day it was recorded, then the day it was done (kept from then).
    age_bucket: str = Field(default_factory=day_bucket)

    @property
    def link(self) -> CompactionLink:
        return CompactionLink(
            from_monologue_id=self.from_monologue_id,
            to_monologue_id=self.to_monologue_id,
            from_seq=self.from_seq,
        )


def swap_id(to_monologue_id: str) -> str:
    return derive_id("swap", to_monologue_id)


def fixture_summary(older: list[Message]) -> str:
    texts = [m.text for m in older if m.text and m.meta.instruction != SUMMARY_INSTRUCTION]
    earlier = [m.text for m in older if m.meta.instruction == SUMMARY_INSTRUCTION]
    summary = " | ".join([*earlier, *texts])
    return f"Earlier ({len(older)} lines): {summary[:FIXTURE_SUMMARY_CHARS]}"


async def summarize(context: Context, older: list[Message]) -> str:
    """A summary by the join's model, charged to its budget like an answer; the mesh's own
    (no model call) for a fixture model, or when the budget forbids another call."""
    config, state = context.config, context.state
    model = config.model_for(state)  # never a model the join no longer allows
    if (
        model.startswith("fixture-")
        or budget_spent(config, state)
        or unpriced_under_budget(config, state, context.settings)
    ):
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
    if result.usage is not None:
        count_usage(charge(state, result.usage, model, context.settings), result.usage)
    return result.text or fixture_summary(older)


def split_for_compaction(
    transcript: list[Message], keep: int
) -> tuple[list[Message], list[Message]]:
    """(older, recent): about ``keep`` lines before the trigger stay verbatim.

    The cut moves back until every tool result in ``recent`` has its call there too, so the
    new monologue never starts with (or holds) a result whose call is only in the summary.
    """
    before = transcript[:-1]
    cut = max(0, len(before) - keep)
    while True:
        wanted = set().union(*(result_ids(line) for line in before[cut:]))
        callers = [index for index in range(cut) if call_ids(before[index]) & wanted]
        if not callers:
            return before[:cut], before[cut:]
        cut = min(callers)


def needs_compaction(config: ProcessorConfig, transcript: list[Message]) -> bool:
    if config.compaction_threshold_tokens is None:
        return False
    if has_unanswered_call(transcript):
        return False  # never in the middle of a tool round: its result would be orphaned
    older, _ = split_for_compaction(transcript, config.compaction_keep)
    # Nothing worth summarizing (say, only an earlier summary): compacting again would loop.
    worth = [m for m in older if m.meta.instruction != SUMMARY_INSTRUCTION]
    return len(worth) >= 2 and estimate_tokens(transcript) > config.compaction_threshold_tokens


async def calls_after(store: Store, trigger: Message) -> bool:
    """Whether the agent asked for tools after the trigger (an earlier step, slower than it):
    that round runs in this monologue, so a swap waits."""
    later = await store.history(trigger.conversation_id, after_seq=trigger.seq)
    return any(line.role == "agent" and call_ids(line) for line in later)


async def compact(context: Context, trigger: Message, transcript: list[Message]) -> bool:
    """The processor's compaction hook, before it answers a user line.

    Finishes a swap into this monologue that a crash left half-done (only a carried line can be
    the first step after one), then swaps if the monologue has outgrown the threshold. Returns
    whether the trigger was handed on to a new monologue, to be answered there.
    """
    if trigger.meta.carried_from:
        await finish_swap_into(context, trigger.conversation_id)
    if context.state.open_round is not None:
        return False  # never across an open round: its results would land in the old monologue
    if not needs_compaction(context.config, transcript):
        return False
    if await calls_after(context.store, trigger):
        return False
    await swap_monologue(context, trigger, transcript)
    return True


async def swap_monologue(context: Context, trigger: Message, transcript: list[Message]) -> None:
    """Continue the join in a new monologue, up to the repoint; the new one's first step ends it.

    Run again from the start after a crash (the trigger's redelivery): each step is idempotent.
    """
    old = trigger.conversation_id
    new = derive_id("monologue", old, trigger.id)
    swap = await record_intent(
        context,
        MonologueSwap(
            id=swap_id(new),
            forum_participant_id=context.config.forum_participant_id,
            from_monologue_id=old,
            to_monologue_id=new,
            from_seq=trigger.seq,
            trigger_id=trigger.id,
            wake_id=carried_id(new, trigger),
        ),
    )
    older, recent = split_for_compaction(transcript, context.config.compaction_keep)
    participant = await open_monologue(context, swap)
    await write_summary(context, swap, trigger, older)
    await write_context(context, swap, recent)
    wake = await arm_wake(context, swap, trigger)
    await repoint(context, swap, participant, wake)
    await rouse(context, wake)


async def finish_swap_into(context: Context, monologue_id: str) -> None:
    """The steps after the repoint, by the new monologue's lane (once: then it is ``done``)."""
    document = await context.store.db[PROCEDURES].find_one({"_id": swap_id(monologue_id)})
    if document is None:
        return
    swap = MonologueSwap.from_document(document)
    if swap.done:
        return
    await move_participant(context, swap)
    await carry_over(context, swap)
    await announce(context, swap)
    await close(context, swap)


# --- the steps, in order -------------------------------------------------------------------


async def record_intent(context: Context, swap: MonologueSwap) -> MonologueSwap:
    """The procedure (a unique insert: a record already there wins), then ingestion's hint."""
    store = context.store
    procedures = store.db[PROCEDURES]
    if not await store.insert_if_absent(procedures, swap.to_document()):
        document = await procedures.find_one({"_id": swap.id})
        assert document is not None
        swap = MonologueSwap.from_document(document)
    await store.set_participant_metadata(swap.forum_participant_id, {SWAPPING: swap.link.to_wire()})
    return swap


async def open_monologue(context: Context, swap: MonologueSwap) -> Participant:
    """The new monologue and the agent's participant in it."""
    store, config = context.store, context.config
    forum = await store.get_conversation(config.source_conversation_id)
    await store.save_conversation(
        Conversation(id=swap.to_monologue_id, kind="monologue", title=forum.title if forum else "")
    )
    return await ensure_participant(store, swap.to_monologue_id, config.agent_actor_id)


async def write_summary(
    context: Context, swap: MonologueSwap, trigger: Message, older: list[Message]
) -> None:
    summary_id = derive_id("summary", swap.to_monologue_id)
    if await context.store.get_message(summary_id) is not None:
        return  # written before a crash: no second model call
    await context.post(
        Message(
            id=summary_id,
            conversation_id=swap.to_monologue_id,
            author_actor_id=SYSTEM_ACTOR_ID,
            role="user",
            parts=[TextPart(text=await summarize(context, older))],
            meta=trigger.meta.model_copy(
                update={"instruction": SUMMARY_INSTRUCTION, "source_message_id": None}
            ),
        )
    )


async def write_context(context: Context, swap: MonologueSwap, recent: list[Message]) -> None:
    """The recent lines, as context: the repoint's watermark passes them, never answered."""
    target = swap.to_monologue_id
    for line in recent:
        await context.post(carried(line, target, derive_id("context", target, line.id)))


async def arm_wake(context: Context, swap: MonologueSwap, trigger: Message) -> Message:
    """The carried trigger, stored but not yet published.

    Published once the processor watches the new monologue; should the process die before
    that, the outbox sweep publishes it, and that event finishes the swap.
    """
    wake, _ = await context.store.insert_message(
        carried(trigger, swap.to_monologue_id, swap.wake_id)
    )
    return wake


async def repoint(
    context: Context, swap: MonologueSwap, participant: Participant, wake: Message
) -> None:
    """The processor answers the new monologue from the carried trigger on (the point of no
    return: the old monologue's lane does nothing after this but publish the wake-up)."""
    state = context.state
    state.monologue_id = swap.to_monologue_id
    state.agent_participant_id = participant.id
    state.context_from_seq = 0
    await context.repoint(swap.to_monologue_id, wake.seq - 1)


async def rouse(context: Context, wake: Message) -> None:
    """Publish the wake-up; if that fails, the outbox sweep does (so nothing here raises: a
    retried handler would find the processor gone from this monologue)."""
    try:
        # (Perhaps the outbox published it already, while nobody watched the new monologue:
        # then again, now; the processor takes an event once.)
        await context.poster.publish(wake)
    except Exception:
        log.warning(
            "could not publish a compaction's wake-up; the outbox sweep will",
            extra={"conversationId": wake.conversation_id, "messageId": wake.id},
            exc_info=True,
        )


async def move_participant(context: Context, swap: MonologueSwap) -> None:
    """Ingestion copies into the new monologue from now on; the chain records the swap."""
    store = context.store
    participant = await store.get_participant(swap.forum_participant_id)
    if participant is None:
        return
    chain = chain_of(participant)
    if any(link.from_monologue_id == swap.from_monologue_id for link in chain):
        return  # moved already (and perhaps on since: never back)
    chain.append(swap.link)
    await store.set_participant_metadata(
        swap.forum_participant_id,
        {
            "monologueId": swap.to_monologue_id,
            "compactions": [link.to_wire() for link in chain],
            SWAPPING: None,
        },
    )


async def carry_over(context: Context, swap: MonologueSwap) -> None:
    """The trigger and whatever reached the old monologue after it move on, in order."""
    await carry_tail(
        context.store,
        context.poster,
        swap.forum_participant_id,
        swap.from_monologue_id,
        link=swap.link,
    )


async def announce(context: Context, swap: MonologueSwap) -> None:
    """``agent.monologue.compacted``, for egress (its id is derived: a repeat is the same)."""
    await context.poster.emit(
        MonologueCompacted(
            agent_actor_id=context.config.agent_actor_id,
            forum_id=context.config.source_conversation_id,
            previous_monologue_id=swap.from_monologue_id,
            monologue_id=swap.to_monologue_id,
        ),
        event_id=derive_id("compacted", swap.from_monologue_id, swap.to_monologue_id),
    )


async def close(context: Context, swap: MonologueSwap) -> None:
    """The procedure is done; the new monologue's lane is its one writer now."""
    await context.store.db[PROCEDURES].update_one(
        {"_id": swap.id}, {"$set": {"done": True, BUCKET_FIELD: day_bucket()}}
    )
    COMPACTIONS.inc()


async def _unfinished(document: dict[str, Any]) -> bool:
    """A swap not done is live: the new monologue's lane (or a redelivery) finishes it."""
    return not document.get("done", False)


def swap_rule(days: float) -> Rule:
    """Swap intents are kept ``days`` once done; the participant's chain keeps the link."""
    return Rule(
        "monologue swaps",
        PROCEDURES,
        "day",
        days,
        where={"kind": "monologue-swap"},
        live=_unfinished,
    )


SWAP_STEPS = (
    record_intent,
    open_monologue,
    write_summary,
    write_context,
    arm_wake,
    repoint,
    rouse,
    move_participant,
    carry_over,
    announce,
    close,
)

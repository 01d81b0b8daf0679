"""The monologue chain: where a join's forum lines go, and the tail a new monologue carries.

A join's forum participant names the monologue ingestion copies forum lines into
(``metadata.monologueId``). Each compaction (:mod:`yoke.runtime.compaction`) continues it in
a new monologue and appends a link to the participant's chain (``metadata.compactions``);
while a swap is under way, ``metadata.swapping`` names it. From these alone any writer
(ingestion, the processor's swap, follow-up) knows where a line goes now and which lines a
swap still has to carry over.

Carried lines name their original in ``meta.carriedFrom`` (egress never forwards them), and
a carried copy of a forum line keeps the id ingestion would give it there, so any number of
writers carrying the same lines in seq order write each once, in order.
"""

from __future__ import annotations

from pydantic import Field

from yoke.core.ids import derive_id
from yoke.core.models import Message, Participant, ToolResultPart, WireModel, utcnow
from yoke.runtime.actor import instance_state_id
from yoke.runtime.instances import PROCESSOR
from yoke.runtime.posting import Poster
from yoke.store.database import Store

# Forum participant metadata: the swap under way away from its monologueId (ingestion's hint).
SWAPPING = "swapping"


class CompactionLink(WireModel):
    """One swap: lines of ``from_monologue_id`` from ``from_seq`` on moved to the next one."""

    from_monologue_id: str
    to_monologue_id: str
    from_seq: int = Field(ge=1)


def chain_of(participant: Participant) -> list[CompactionLink]:
    links = participant.metadata.get("compactions")
    return (
        [CompactionLink.model_validate(link) for link in links] if isinstance(links, list) else []
    )


def swapping_of(participant: Participant) -> CompactionLink | None:
    """The swap away from the participant's monologue that has begun and not moved it yet."""
    link = participant.metadata.get(SWAPPING)
    return CompactionLink.model_validate(link) if isinstance(link, dict) else None


def carried_id(target: str, line: Message) -> str:
    """A forum line gets the id ingestion would give its copy in ``target``."""
    if line.meta.source_message_id:
        return derive_id("copy", target, line.meta.source_message_id)
    return derive_id("carry", target, line.id)


def carried(line: Message, target: str, message_id: str) -> Message:
    """``line`` written anew in ``target`` (a new line there: its time is now)."""
    meta = line.meta.model_copy(update={"carried_from": line.id})
    return line.model_copy(
        update={
            "id": message_id,
            "conversation_id": target,
            "seq": 0,
            "meta": meta,
            "created_at": utcnow(),
        }
    )


def carriable(line: Message) -> bool:
    """What a swap moves on: user lines, never a tool result (its call stayed behind)."""
    return (
        line.role == "user"
        and line.type == "message"
        and not any(isinstance(part, ToolResultPart) for part in line.parts)
    )


async def carry_tail(
    store: Store,
    poster: Poster,
    forum_participant_id: str,
    monologue_id: str,
    up_to_seq: int | None = None,
    *,
    link: CompactionLink | None = None,
) -> None:
    """Carry what a swap moved on from ``monologue_id`` (up to ``up_to_seq``) into its successor.

    The swap is ``link`` or else the one the participant's chain records. Lines go in seq order
    from the swap's first moved seq, so any number of writers doing this at once keep the order
    (each line is written once, by whoever comes first); then on down the chain, should the
    successor have moved on too.
    """
    if link is None:
        participant = await store.get_participant(forum_participant_id)
        if participant is None:
            return
        link = next((x for x in chain_of(participant) if x.from_monologue_id == monologue_id), None)
    if link is None or (up_to_seq is not None and up_to_seq < link.from_seq):
        return
    target = link.to_monologue_id
    last: Message | None = None
    for line in await store.history(monologue_id, after_seq=link.from_seq - 1, up_to_seq=up_to_seq):
        if carriable(line):
            last = await poster.post(carried(line, target, carried_id(target, line)))
    if last is not None:
        await carry_tail(store, poster, forum_participant_id, target, last.seq)


async def copy_target(store: Store, poster: Poster, participant: Participant, join: str) -> str:
    """Where ingestion copies a forum line now, after carrying there what a swap moved on.

    Normally the participant's monologueId. While a swap away from it is under way and the
    processor already answers the new monologue, the new one: the old monologue's tail goes
    there first, so the line lands after it (and the carried trigger's event wakes the
    processor, should the swap have stopped short).
    """
    monologue_id = str(participant.metadata.get("monologueId") or "")
    swapping = swapping_of(participant)
    if swapping is not None and swapping.from_monologue_id == monologue_id:
        state = await store.load_state(instance_state_id(PROCESSOR, join))
        if state is not None and state.get("watch") == swapping.to_monologue_id:
            await carry_tail(store, poster, participant.id, monologue_id, link=swapping)
            return swapping.to_monologue_id
    arrived_by = next((x for x in chain_of(participant) if x.to_monologue_id == monologue_id), None)
    if arrived_by is not None:
        # The swap into this monologue may still be carrying the old one's last lines.
        await carry_tail(store, poster, participant.id, arrived_by.from_monologue_id)
    return monologue_id

"""A forum that already has thousands of lines, written in seconds instead of an hour of turns.

The lines are written with the product's own ``Poster`` (its seq allocation and publish
bookkeeping), on a bus that publishes nothing: nobody has joined yet, so nobody would act on
them, and the services stay idle. Each person's line gets the agent's answer in the forum, and
the agent's monologue gets what the mesh would have put there (the copy and the answer), with
the ids the services derive, so the join that follows starts from a forum as a real one of
that length would be.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from yoke.bus.broker import Bus
from yoke.core.ids import derive_id
from yoke.core.models import Actor, Message, MessageMeta, TextPart
from yoke.runtime.joins import ensure_participant, join_id, participant_id
from yoke.runtime.posting import Poster
from yoke.store.database import Store

PERSON_EXTERNAL_ID = "bench:person"


class SilentBus(Bus):
    """Publishes nothing: the history is written before anyone listens."""

    async def publish_event(self, *args: Any, **kwargs: Any) -> None:
        """Whatever the bus's signature, nothing goes out."""


def monologue_for(agent_actor_id: str, forum_id: str) -> str:
    """The monologue a join of this agent to this forum creates (the join derives it so)."""
    return derive_id("monologue", join_id(agent_actor_id, forum_id))


async def prefill(
    store: Store,
    forum_id: str,
    agent_actor_id: str,
    lines: int,
    progress: Callable[[str], None],
) -> str:
    """Write ``lines`` forum lines (half people's, half answers) before the join; the
    monologue id they were written for."""
    poster = Poster(store, SilentBus("amqp://unused/", name="bench-history"), "bench-history")
    monologue_id = monologue_for(agent_actor_id, forum_id)
    human = await store.save_actor(
        Actor(
            id=derive_id("human", PERSON_EXTERNAL_ID),
            kind="human",
            name="person",
            external_id=PERSON_EXTERNAL_ID,
        )
    )
    shadow = await store.save_actor(
        Actor(
            id=derive_id("external", human.id),
            kind="external",
            name=human.name,
            meta={"sourceActorId": human.id},
        )
    )
    person = await ensure_participant(store, forum_id, human.id)
    shadow_participant = await ensure_participant(store, monologue_id, shadow.id)
    agent_in_forum = participant_id(forum_id, agent_actor_id)
    agent_in_monologue = participant_id(monologue_id, agent_actor_id)
    pairs = max(1, lines // 2)
    written = 0

    def person_line(index: int) -> Message:
        return Message(
            id=derive_id("submit", forum_id, f"history-{index}"),
            conversation_id=forum_id,
            author_actor_id=human.id,
            participant_id=person.id,
            role="user",
            parts=[TextPart(text=f"history line {index}")],
        )

    def answer_id(line: Message) -> str:
        return derive_id("output", derive_id("copy", monologue_id, line.id))

    async def forum_side() -> None:
        """Person, answer, person, answer... as egress would have forwarded the answers."""
        nonlocal written
        for index in range(pairs):
            line = await poster.post(person_line(index))
            answer = answer_id(line)
            await poster.post(
                Message(
                    id=derive_id("egress", answer),
                    conversation_id=forum_id,
                    author_actor_id=agent_actor_id,
                    participant_id=agent_in_forum,
                    role="agent",
                    parts=line.parts,
                    meta=MessageMeta(causation_id=answer, in_reply_to=line.id, agent_hops=1),
                )
            )
            written += 2

    async def monologue_side() -> None:
        """Each person line's copy and the agent's answer to it, as ingestion and the
        processor would have written them (independent of the forum's seqs, so in parallel)."""
        nonlocal written
        for index in range(pairs):
            line = person_line(index)
            copy = await poster.post(
                Message(
                    id=derive_id("copy", monologue_id, line.id),
                    conversation_id=monologue_id,
                    author_actor_id=shadow.id,
                    participant_id=shadow_participant.id,
                    role="user",
                    parts=line.parts,
                    meta=MessageMeta(
                        source_conversation_id=forum_id,
                        source_message_id=line.id,
                        source_actor_id=human.id,
                    ),
                )
            )
            await poster.post(
                Message(
                    id=answer_id(line),
                    conversation_id=monologue_id,
                    author_actor_id=agent_actor_id,
                    participant_id=agent_in_monologue,
                    role="agent",
                    parts=line.parts,
                    meta=MessageMeta(
                        source_conversation_id=forum_id, causation_id=copy.id, in_reply_to=line.id
                    ),
                )
            )
            written += 2

    async def report() -> None:
        while True:
            await asyncio.sleep(5)
            progress(f"history: {written}/{pairs * 4} lines written (forum and monologue)")

    begin = time.perf_counter()
    reporter = asyncio.create_task(report())
    try:
        async with asyncio.TaskGroup() as group:
            group.create_task(forum_side())
            group.create_task(monologue_side())
    except ExceptionGroup as failed:
        raise failed.exceptions[0] from None
    finally:
        reporter.cancel()
    progress(f"history: {pairs * 2} forum lines in {time.perf_counter() - begin:.0f}s")
    return monologue_id

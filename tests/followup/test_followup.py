"""Follow-up: a nudge when the agent spoke last and nobody answered, exactly once."""

from __future__ import annotations

import re
import time

from services.followup.scheduler import (
    FOLLOWUP_ACTOR_ID,
    FOLLOWUPS,
    decision_id,
    nudge_id,
    schedule_id,
)
from tests.support.cli import run_yoke
from tests.support.mesh import JoinFactory, Mesh, agent_lines, lines_until, say
from tests.support.processes import ServiceProcess, eventually
from yoke.client import Client
from yoke.core.models import Message
from yoke.runtime.join_config import FollowUpConfig, JoinConfig
from yoke.runtime.joins import Join, join_id, participant_id
from yoke.store.database import PROCEDURES, Store

NUDGE = "Nobody answered; follow up briefly."


def following_up(after: float, *, most: int = 1, **options: object) -> dict[str, object]:
    config = JoinConfig(
        follow_up=FollowUpConfig(after_seconds=after, text=NUDGE, max_consecutive=most)
    )
    return {"config": config, **options}


def nudges_in(lines: list[Message]) -> list[Message]:
    return [line for line in lines if line.meta.instruction == "follow-up"]


def schedule_of(join: Join, line: Message) -> str:
    return schedule_id(join_id(join.agent_actor_id, join.forum_id), line.id)


async def wait_scheduled(store: Store, join: Join, line: Message) -> dict[str, object]:
    found: dict[str, object] = {}

    async def scheduled() -> bool:
        nonlocal found
        document = await store.db[FOLLOWUPS].find_one({"_id": schedule_of(join, line)})
        found = document or {}
        return document is not None

    await eventually(scheduled, timeout=30, what="the follow-up to be scheduled")
    return found


async def decision(store: Store, join: Join, line: Message) -> dict[str, object] | None:
    return await store.db[PROCEDURES].find_one({"_id": decision_id(schedule_of(join, line))})


async def capped(mesh: Mesh, line: Message, *others: ServiceProcess) -> None:
    """The follow-up service logged that it refused to schedule after ``line`` (the cap).

    ``others``: more follow-up replicas; whichever owns the forum's shard says it.
    """

    async def said() -> bool:
        return any(
            "no follow-up" in entry and line.id in entry
            for process in (mesh.processes["followup"], *others)
            for entry in process.output().splitlines()
        )

    await eventually(said, timeout=30, what=f"the cap to refuse a follow-up of {line.id}")


async def active_monologue(store: Store, join: Join) -> str:
    participant = await store.get_participant(join.forum_participant_id)
    assert participant is not None
    return str(participant.metadata["monologueId"])


def fired_total(metrics: str) -> float:
    match = re.search(r"^yoke_followups_fired_total (\S+)$", metrics, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


async def test_a_follow_up_fires_once_when_nobody_answers(
    mesh: Mesh, store: Store, client: Client, new_join: JoinFactory
) -> None:
    forum_id, join = await new_join(**following_up(1.5))
    asked = await say(client, forum_id, "anyone there?")
    started = time.monotonic()
    lines = await lines_until(store, forum_id, lambda lines: len(agent_lines(lines)) == 2)
    answer, follow_up = agent_lines(lines)
    assert time.monotonic() - started >= 1.5
    assert answer.meta.in_reply_to == asked
    assert follow_up.text == NUDGE  # fixture-echo answers the nudge with its text
    assert follow_up.meta.in_reply_to == answer.id
    # The nudge: an instruction in the agent's monologue, by the follow-up actor.
    monologue = await store.history(join.monologue_id)
    (nudge,) = nudges_in(monologue)
    assert nudge.id == nudge_id(schedule_of(join, answer))
    assert nudge.author_actor_id == FOLLOWUP_ACTOR_ID
    assert nudge.role == "user" and nudge.type == "message"
    assert nudge.meta.agent_hops == answer.meta.agent_hops == 1
    assert nudge.meta.source_conversation_id == forum_id
    actor = await store.get_actor(FOLLOWUP_ACTOR_ID)
    assert actor is not None and actor.kind == "system" and actor.name == "follow-up"
    # The follow-up's own answer is not followed up again (at most one in a row by default).
    await capped(mesh, follow_up)
    assert len(nudges_in(await store.history(join.monologue_id))) == 1
    assert (await decision(store, join, answer) or {}).get("outcome") == "fired"
    assert await store.db[FOLLOWUPS].find_one({"_id": schedule_of(join, follow_up)}) is None
    assert fired_total(await mesh.processes["followup"].metrics()) >= 1
    # yoke history marks it as an instruction.
    _, out, _ = await run_yoke(mesh.env, "history", join.monologue_id)
    assert f"[{nudge.seq}] follow-up (follow-up instruction): {NUDGE}" in out


async def test_a_person_answering_first_cancels_the_follow_up(
    store: Store, client: Client, new_join: JoinFactory
) -> None:
    forum_id, join = await new_join(**following_up(4))
    await say(client, forum_id, "first")
    lines = await lines_until(store, forum_id, lambda lines: len(agent_lines(lines)) == 1)
    (first_answer,) = agent_lines(lines)
    await wait_scheduled(store, join, first_answer)
    await say(client, forum_id, "second, before the delay")

    async def cancelled() -> bool:
        found = await decision(store, join, first_answer)
        return found is not None and found["outcome"] == "cancelled"

    await eventually(cancelled, timeout=30, what="the first follow-up to be cancelled")
    # The agent answered the second line last: that one is followed up, once.
    lines = await lines_until(
        store, forum_id, lambda lines: any(line.text == NUDGE for line in lines)
    )
    second_answer = agent_lines(lines)[1]
    assert second_answer.text == "second, before the delay"
    (nudge,) = nudges_in(await store.history(join.monologue_id))
    assert nudge.meta.in_reply_to == second_answer.id


async def test_killed_while_pending_it_fires_exactly_once_after_a_restart(
    mesh: Mesh, store: Store, client: Client, new_join: JoinFactory
) -> None:
    forum_id, join = await new_join(**following_up(2))
    await say(client, forum_id, "hello?")
    lines = await lines_until(store, forum_id, lambda lines: len(agent_lines(lines)) == 1)
    (answer,) = agent_lines(lines)
    schedule = await wait_scheduled(store, join, answer)
    mesh.processes["followup"].kill()  # SIGKILL, with the follow-up pending
    due = schedule["dueAt"]
    assert hasattr(due, "timestamp")

    async def past_due() -> bool:
        return time.time() > due.timestamp() + 1

    await eventually(past_due, timeout=30, what="the follow-up to fall due while down")
    assert await decision(store, join, answer) is None  # nobody fired it meanwhile
    await mesh.restart("followup")
    lines = await lines_until(store, forum_id, lambda lines: len(agent_lines(lines)) == 2)
    assert agent_lines(lines)[1].text == NUDGE
    await capped(mesh, agent_lines(lines)[1])
    assert len(nudges_in(await store.history(join.monologue_id))) == 1
    assert len([line for line in await store.history(forum_id) if line.text == NUDGE]) == 1


async def test_two_follow_up_processes_fire_each_follow_up_once(
    mesh: Mesh, store: Store, client: Client, new_join: JoinFactory
) -> None:
    second = ServiceProcess(
        ["-m", "services.followup"], mesh.env, mesh.log_dir / "followup-second.log"
    )
    try:
        await second.wait_healthy()
        first = mesh.processes["followup"]
        before = fired_total(await first.metrics()) + fired_total(await second.metrics())
        joins = [await new_join(**following_up(1)) for _ in range(4)]
        for forum_id, _ in joins:
            await say(client, forum_id, "is anyone following up?")
        for forum_id, join in joins:
            lines = await lines_until(store, forum_id, lambda lines: len(agent_lines(lines)) == 2)
            await capped(mesh, agent_lines(lines)[1], second)
            assert len(nudges_in(await store.history(join.monologue_id))) == 1
            assert [line.text for line in agent_lines(lines)].count(NUDGE) == 1
        after = fired_total(await first.metrics()) + fired_total(await second.metrics())
        assert after - before == len(joins)
    finally:
        assert second.stop() == 0


async def test_the_cap_on_follow_ups_in_a_row_holds(
    mesh: Mesh, store: Store, client: Client, new_join: JoinFactory
) -> None:
    forum_id, join = await new_join(**following_up(1, most=2))
    await say(client, forum_id, "ping")
    lines = await lines_until(store, forum_id, lambda lines: len(agent_lines(lines)) == 3)
    answer, first, second = agent_lines(lines)
    assert (first.text, second.text) == (NUDGE, NUDGE)
    assert first.meta.in_reply_to == answer.id and second.meta.in_reply_to == first.id
    await capped(mesh, second)
    assert len(nudges_in(await store.history(join.monologue_id))) == 2
    # A person's line starts a new run: the agent's answer to it is followed up again.
    await say(client, forum_id, "pong")
    lines = await lines_until(store, forum_id, lambda lines: len(agent_lines(lines)) == 6)
    assert [line.text for line in agent_lines(lines)[3:]] == ["pong", NUDGE, NUDGE]


async def test_after_a_compaction_the_nudge_goes_to_the_new_monologue(
    store: Store, client: Client, new_join: JoinFactory
) -> None:
    forum_id, join = await new_join(
        **following_up(3, compaction_threshold_tokens=40, compaction_keep=2)
    )
    for index in range(3):
        await say(client, forum_id, f"line {index}: " + "words to make the monologue grow " * 3)
        await lines_until(store, forum_id, lambda lines, n=index: len(agent_lines(lines)) == n + 1)

    async def compacted() -> bool:
        return await active_monologue(store, join) != join.monologue_id

    await eventually(compacted, timeout=30, what="the monologue to be compacted")
    lines = await lines_until(
        store, forum_id, lambda lines: any(line.text == NUDGE for line in lines)
    )
    last_answer = agent_lines(lines)[2]
    nudge = await store.get_message(nudge_id(schedule_of(join, last_answer)))
    assert nudge is not None
    assert nudge.conversation_id != join.monologue_id
    assert not nudges_in(await store.history(join.monologue_id))
    participant = await store.get_participant(participant_id(forum_id, join.agent_actor_id))
    assert participant is not None
    chain = participant.metadata.get("compactions")
    assert isinstance(chain, list)
    assert nudge.conversation_id in {
        link["toMonologueId"] for link in chain if isinstance(link, dict)
    }
    assert [line.text for line in agent_lines(lines)].count(NUDGE) == 1

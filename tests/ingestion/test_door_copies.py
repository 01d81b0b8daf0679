"""The door copies a person's line into the watching monologues as it accepts it.

Its event is marked (``yoke-copied: yes``) and not delivered back to ingestion: so a crash
between the line and its copies must leave the line to whoever picks it up (the command's
redelivery, the outbox sweep's unmarked event), answered once. Who watches a forum is kept per
process: a join, a leave and a hand-over must each be seen by the next line.
"""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from tests.support import faults
from tests.support.mesh import JoinFactory, Mesh, agent_lines, lines_until, say
from tests.support.processes import eventually
from yoke.client import Client
from yoke.runtime.actor import ActorRuntime
from yoke.runtime.joins import create_agent, join_conversation, leave_conversation
from yoke.runtime.posting import Poster
from yoke.store.database import Store

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def mesh_env() -> dict[str, str]:
    return {"YOKE_OUTBOX_GRACE_SECONDS": "1"}


@pytest.mark.parametrize(
    "point",
    [
        # The line stored and its marked event out, no copy made yet.
        faults.fault("before", ActorRuntime.take),
        # Copied, but the outbox not told and the submitter not answered.
        faults.fault("after", ActorRuntime.take),
    ],
)
async def test_a_door_killed_around_its_copies_loses_and_repeats_nothing(
    point: str, mesh: Mesh, store: Store, client: Client, new_join: JoinFactory
) -> None:
    forum_id, join = await new_join()
    await say(client, forum_id, "before the crash")
    await lines_until(store, forum_id, lambda lines: len(agent_lines(lines)) == 1)
    faulty = mesh.start_faulty("ingestion", point)
    await faulty.wait_healthy()
    # The door may die before it answers: nobody waits for the answer, only for the death.
    submitting = asyncio.create_task(
        client.submit(
            forum_id,
            "through the crash",
            external_id="test:alice",
            display_name="alice",
            idempotency_key="test:through-the-crash",
            reply_timeout=60,
        )
    )

    async def died() -> bool:
        return faulty.popen.poll() is not None

    await eventually(died, timeout=30, what=f"ingestion to die at {point}")
    submitting.cancel()
    with contextlib.suppress(asyncio.CancelledError, TimeoutError):
        await submitting
    assert faulty.popen.wait(5) == faults.EXIT_CODE, faulty.output()[-2000:]
    faulty.stop()
    mesh.start("ingestion")
    await mesh.processes["ingestion"].wait_healthy()

    forum = await lines_until(store, forum_id, lambda lines: len(agent_lines(lines)) == 2)
    await say(client, forum_id, "after the crash")
    forum = await lines_until(store, forum_id, lambda lines: len(agent_lines(lines)) == 3)
    await asyncio.sleep(1)  # a quiet moment: a line copied or answered twice shows up here
    forum = await store.history(forum_id)
    humans = [line.text for line in forum if line.role == "user"]
    assert humans == ["before the crash", "through the crash", "after the crash"]
    assert [line.text for line in agent_lines(forum)] == humans
    copies = [line.text for line in await store.history(join.monologue_id) if line.role == "user"]
    assert copies == humans


async def test_who_watches_a_forum_is_read_again_after_a_join_and_a_leave(
    mesh: Mesh, store: Store, poster: Poster, client: Client, new_join: JoinFactory
) -> None:
    # hop_cap 1: each answers people only, not each other.
    forum_id, first = await new_join(name="first", hop_cap=1)
    await say(client, forum_id, "one agent")
    await lines_until(store, forum_id, lambda lines: len(agent_lines(lines)) == 1)

    # A second agent joins a forum whose watchers ingestion has read: it hears the next line.
    second_agent = await create_agent(store, "second")
    second = await join_conversation(store, poster, second_agent.id, forum_id, hop_cap=1)
    await say(client, forum_id, "two agents")
    await lines_until(store, forum_id, lambda lines: len(agent_lines(lines)) == 3)

    # The first leaves: the next line reaches the second only, and nothing more the first.
    assert await leave_conversation(store, first.agent_actor_id, forum_id)
    await say(client, forum_id, "one agent again")
    await lines_until(store, forum_id, lambda lines: len(agent_lines(lines)) == 4)
    await asyncio.sleep(1)  # a quiet moment: a line copied where it should not be shows up
    forum = await store.history(forum_id)
    answers = [(line.author_actor_id, line.text) for line in agent_lines(forum)]
    assert len(answers) == 4
    assert sorted(answers[1:3]) == sorted(
        [(first.agent_actor_id, "two agents"), (second.agent_actor_id, "two agents")]
    )
    assert answers[3] == (second.agent_actor_id, "one agent again")
    people = {line.author_actor_id for line in forum if line.role == "user"}

    async def copied(join_monologue: str) -> list[str]:
        lines = await store.history(join_monologue)
        return [
            line.text
            for line in lines
            if line.role == "user" and line.meta.source_actor_id in people
        ]

    assert await copied(first.monologue_id) == ["one agent", "two agents"]
    assert await copied(second.monologue_id) == ["two agents", "one agent again"]

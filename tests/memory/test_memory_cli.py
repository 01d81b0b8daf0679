"""``yoke memory list|add|forget|erase`` as an operator runs them, against the real store.

What a step remembers is written here through :class:`Memories` as the processor would (with
its source line and step), so these tests say what the CLI shows of it, what it adds, and what
an erasure takes and lists. The processor's own writes are tested in test_processor_memory.py.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from tests.support.cli import cli_env, run_yoke, run_yoke_commands
from yoke.core.ids import new_id
from yoke.core.models import Actor, Message, TextPart
from yoke.runtime.join_config import MemoryScope
from yoke.runtime.joins import create_forum, ensure_participant_id
from yoke.runtime.memories import (
    MAX_MEMORY_CHARS,
    Memories,
    Memory,
    MemoryRefused,
    MemorySource,
    MemoryStep,
    person_id_of,
)
from yoke.store.database import Store

ODD = "cli:a%b_c.*$"
HOSTILE = "likes \x1b[2J\x07tea"
SHOWN = "likes \\x1b[2J\\x07tea"


@pytest.fixture
def env(amqp_url: str, mongodb_url: str) -> dict[str, str]:
    return cli_env(amqp_url, mongodb_url)


@pytest.fixture
async def store(mongodb_url: str) -> AsyncIterator[Store]:
    """The test's own database, the one ``env`` points the CLI at."""
    store = Store(mongodb_url)
    await store.ensure_indexes()
    yield store
    await store.close()


async def an_agent(store: Store, name: str = "support") -> str:
    agent = await store.save_actor(Actor(id=new_id(), kind="agent", name=name))
    return agent.id


async def a_person(store: Store, external_id: str) -> str:
    person = person_id_of(external_id)
    await store.save_actor(Actor(id=person, kind="human", name="Ana", external_id=external_id))
    return person


async def lines_of(store: Store, person: str, forum_id: str, count: int) -> None:
    """``count`` lines the person wrote in the forum (what a door would have stored)."""
    await ensure_participant_id(store, forum_id, person)
    for n in range(count):
        await store.insert_message(
            Message(
                id=new_id(),
                conversation_id=forum_id,
                author_actor_id=person,
                role="user",
                parts=[TextPart(text=f"line {n}")],
            )
        )


async def taught(
    store: Store,
    agent: str,
    scope: MemoryScope,
    subject: str,
    text: str,
    *,
    teacher: str,
    forum_id: str,
    at: datetime | None = None,
) -> Memory:
    """A memory a step wrote from a line ``teacher`` wrote in ``forum_id``."""
    moment = at or datetime.now(UTC)
    line = new_id()
    memory = Memory.new(
        new_id(),
        agent,
        scope,
        subject,
        text,
        MemorySource(
            forum_id=forum_id,
            message_id=line,
            author_actor_id=teacher,
            author_name="Ana",
            at=moment,
        ),
        step=MemoryStep(join_key="join-1", monologue_id="mono-1", line_id=line, call_id="call-1"),
        created_at=moment,
    )
    stored, created = await Memories(store).remember(memory)
    assert created
    return stored


def json_lines(out: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in out.splitlines() if line.strip()]


async def test_list_shows_each_memory_with_its_source_line_and_step_newest_first(
    env: dict[str, str], store: Store
) -> None:
    agent = await an_agent(store)
    ana = await a_person(store, "cli:ana")
    forum = await create_forum(store, "help desk")
    old = datetime.now(UTC) - timedelta(hours=2)
    first = await taught(
        store,
        agent,
        "person",
        ana,
        "Ana is allergic to peanuts",
        teacher=ana,
        forum_id=forum.id,
        at=old,
    )
    second = await taught(
        store,
        agent,
        "forum",
        forum.id,
        "this forum meets at nine",
        teacher=ana,
        forum_id=forum.id,
        at=old + timedelta(hours=1),
    )
    await taught(
        store,
        await an_agent(store, "other"),
        "person",
        ana,
        "not this agent's",
        teacher=ana,
        forum_id=forum.id,
    )

    code, outs, err = await run_yoke_commands(
        env,
        [
            ["memory", "list", "--agent", agent, "--json"],
            ["memory", "list", "--agent", agent, "--json", "--person", "cli:ana"],
            ["memory", "list", "--agent", agent, "--json", "--forum", forum.id],
            ["memory", "list", "--agent", agent, "--json", "--limit", "1"],
            ["memory", "list", "--agent", agent],
        ],
    )
    assert code == 0, err
    every, about_ana, about_forum, newest, text = outs
    assert [m["id"] for m in json_lines(every)] == [second.id, first.id]
    shown = json_lines(about_ana)
    assert [m["id"] for m in shown] == [first.id]
    assert shown[0]["scope"] == "person" and shown[0]["subject"] == ana
    assert shown[0]["text"] == "Ana is allergic to peanuts"
    assert shown[0]["source"]["forumId"] == forum.id
    assert shown[0]["source"]["messageId"] == first.source.message_id
    assert shown[0]["source"]["authorName"] == "Ana"
    assert shown[0]["step"] == {
        "joinKey": "join-1",
        "monologueId": "mono-1",
        "lineId": first.source.message_id,
        "callId": "call-1",
    }
    assert "terms" not in shown[0] and "_id" not in shown[0]
    assert [m["id"] for m in json_lines(about_forum)] == [second.id]
    assert [m["id"] for m in json_lines(newest)] == [second.id]
    rows = [line.split("\t") for line in text.splitlines()]
    assert [row[0] for row in rows] == [second.id, first.id]
    assert rows[1][2] == f"{ana} (cli:ana)"
    assert f"forum {forum.id} line {first.source.message_id} by Ana" in rows[1][4]
    assert rows[1][-1] == "Ana is allergic to peanuts"


async def test_add_forget_and_their_refusals(env: dict[str, str], store: Store) -> None:
    agent = await an_agent(store)
    forum = await create_forum(store, "help desk")
    code, outs, err = await run_yoke_commands(
        env,
        [
            ["memory", "add", "--agent", agent, "--person", "cli:ana", "Ana prefers email"],
            ["memory", "add", "--agent", agent, "--forum", forum.id, "  Office hours are 9-5 "],
            ["memory", "add", "--agent", agent, "--agent-wide", HOSTILE],
            ["memory", "list", "--agent", agent, "--json"],
            ["memory", "list", "--agent", agent, "--agent-wide"],
        ],
    )
    assert code == 0, err
    person_id, forum_id, agent_id = (out.strip() for out in outs[:3])
    listed = {m["id"]: m for m in json_lines(outs[3])}
    assert set(listed) == {person_id, forum_id, agent_id}
    assert listed[person_id]["subject"] == person_id_of("cli:ana")
    assert listed[person_id]["personId"] == person_id_of("cli:ana")
    assert listed[forum_id]["text"] == "Office hours are 9-5"
    assert listed[forum_id]["source"]["forumId"] == forum.id
    assert listed[agent_id]["scope"] == "agent" and listed[agent_id]["subject"] == ""
    for memory in listed.values():
        assert memory["source"]["addedBy"] == "cli"
        assert "step" not in memory  # an operator's, not a step's
    # A memory's text is outside text: shown escaped, never as terminal control.
    assert outs[4].rstrip("\n").split("\t")[-1] == SHOWN and "\x1b" not in outs[4]

    code, out, err = await run_yoke(env, "memory", "forget", person_id)
    assert (code, out.strip()) == (0, person_id), err
    assert await Memories(store).get(person_id) is None
    code, out, err = await run_yoke(env, "memory", "forget", person_id)
    assert code == 1 and f"no memory {person_id}" in err
    code, out, err = await run_yoke(env, "memory", "forget", "nowhere\x1b[2J")
    assert code == 1 and "no memory nowhere\\x1b[2J" in err

    refused = [
        (["--agent", "no-such-agent", "--agent-wide", "x"], 1, "no agent no-such-agent"),
        (["--agent", agent, "--forum", "no-such-forum", "x"], 1, "no forum no-such-forum"),
        (["--agent", agent, "--person", "ana", "x"], 2, "name the person as their door did"),
        (["--agent", agent, "--agent-wide", "x" * (MAX_MEMORY_CHARS + 1)], 2, "1 to 1000"),
        (["--agent", agent, "--agent-wide", "   "], 2, "1 to 1000"),
        (["--agent", agent, "x"], 2, "one of the arguments"),
    ]
    for arguments, exit_code, said in refused:
        code, out, err = await run_yoke(env, "memory", "add", *arguments)
        assert (code, out) == (exit_code, ""), (arguments, err)
        assert said in err, (arguments, err)
    assert len(await Memories(store).listed(agent_actor_id=agent)) == 2


async def test_a_person_with_pattern_characters_never_matches_another(
    env: dict[str, str], store: Store
) -> None:
    agent = await an_agent(store)
    code, outs, err = await run_yoke_commands(
        env,
        [
            ["memory", "add", "--agent", agent, "--person", ODD, "odd's fact"],
            ["memory", "add", "--agent", agent, "--person", "cli:a", "a's fact"],
            ["memory", "add", "--agent", agent, "--person", "cli:abc", "abc's fact"],
            ["memory", "list", "--agent", agent, "--json", "--person", ODD],
            ["memory", "list", "--agent", agent, "--json", "--person", "cli:a"],
            ["memory", "list", "--agent", agent, "--json", "--person", "cli:a.*"],
            ["memory", "erase", "--person", ODD, "--json"],
            ["memory", "list", "--agent", agent, "--json"],
        ],
    )
    assert code == 0, err
    assert [m["text"] for m in json_lines(outs[3])] == ["odd's fact"]
    assert [m["text"] for m in json_lines(outs[4])] == ["a's fact"]
    assert json_lines(outs[5]) == []
    assert json.loads(outs[6])["erased"] == 1
    assert sorted(m["text"] for m in json_lines(outs[7])) == ["a's fact", "abc's fact"]


async def test_erasing_a_person_counts_every_agent_and_lists_the_lines_that_remain(
    env: dict[str, str], store: Store
) -> None:
    support, sales = await an_agent(store, "support"), await an_agent(store, "sales")
    ana, bob = await a_person(store, "cli:ana"), await a_person(store, "cli:bob")
    desk, shop, quiet = [await create_forum(store, title) for title in ("desk", "shop", "quiet")]
    await lines_of(store, ana, desk.id, 3)
    await lines_of(store, ana, shop.id, 1)
    await lines_of(store, bob, quiet.id, 2)
    before = datetime.now(UTC) - timedelta(minutes=1)
    await taught(store, support, "person", ana, "Ana is allergic", teacher=ana, forum_id=desk.id)
    await taught(store, sales, "person", ana, "Ana buys tea", teacher=ana, forum_id=shop.id)
    # What Ana taught about the forum goes too; what Bob taught about Ana goes (it is about
    # her); what Bob taught about the forum stays.
    await taught(store, support, "forum", desk.id, "desk opens at 9", teacher=ana, forum_id=desk.id)
    await taught(store, support, "person", ana, "Ana is Bob's boss", teacher=bob, forum_id=quiet.id)
    kept = await taught(
        store, support, "forum", quiet.id, "quiet is quiet", teacher=bob, forum_id=quiet.id
    )

    code, out, err = await run_yoke(env, "memory", "erase", "--person", "cli:ana", "--json")
    assert code == 0, err
    assert json.loads(out) == {
        "person": "cli:ana",
        "personId": ana,
        "erased": 4,
        "remainingLines": sorted(
            [{"forumId": desk.id, "lines": 3}, {"forumId": shop.id, "lines": 1}],
            key=lambda lines: str(lines["forumId"]),
        ),
    }
    left = await Memories(store).listed(agent_actor_id=support)
    assert [memory.id for memory in left] == [kept.id]
    assert await Memories(store).listed(agent_actor_id=sales) == []
    # The tombstone: a step still working on a line Ana wrote before cannot bring it back.
    with pytest.raises(MemoryRefused, match="erased"):
        await taught(
            store,
            support,
            "person",
            ana,
            "from an old line",
            teacher=ana,
            forum_id=desk.id,
            at=before,
        )

    code, out, err = await run_yoke(env, "memory", "erase", "--person", "cli:ana")
    assert code == 0, err
    said = out.splitlines()
    assert said[0] == "erased 0 memories about or taught by cli:ana, in every agent"
    assert "remain in 2 forums (listed, not hidden)" in said[1]
    assert sorted(said[2:]) == sorted([f"{desk.id}\t3 lines", f"{shop.id}\t1 line"])

    code, out, err = await run_yoke(env, "memory", "erase", "--person", "cli:nobody")
    assert code == 0, err
    assert out.splitlines()[1] == "no forum holds a line cli:nobody wrote"


async def test_erasing_an_agent_takes_only_its_memories(env: dict[str, str], store: Store) -> None:
    gone, staying = await an_agent(store, "gone"), await an_agent(store, "staying")
    ana = await a_person(store, "cli:ana")
    forum = await create_forum(store, "desk")
    for agent in (gone, gone, staying):
        await taught(store, agent, "person", ana, "Ana likes tea", teacher=ana, forum_id=forum.id)
    code, out, err = await run_yoke(env, "memory", "erase", "--agent", gone, "--json")
    assert code == 0, err
    assert json.loads(out) == {"agent": gone, "erased": 2}
    assert await Memories(store).listed(agent_actor_id=gone) == []
    assert len(await Memories(store).listed(agent_actor_id=staying)) == 1
    code, out, err = await run_yoke(env, "memory", "erase", "--agent", gone)
    assert (code, out.strip()) == (0, f"erased 0 memories of agent {gone}"), err

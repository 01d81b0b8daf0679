"""What agents remember, over HTTP, end to end: the mesh and the gateway run as real processes;
memories are written directly in the store (``Memories.remember``, as the processor's
``remember`` call or an operator's ``yoke memory add`` would).

Only a token made with ``--can-manage-memory`` lists, forgets or erases (403 otherwise); a
token sees only memories taught in its forums (one taught in no forum: an all-forums token
only), another is unknown (404, the same body as one that does not exist); a person is named in
the token's namespace, so no id, however hostile, reaches another's memories; an erasure goes
everywhere but counts and lists only what the token may see.
"""

from __future__ import annotations

import re
from datetime import timedelta

import httpx
import pytest

from tests.support.processes import eventually
from yoke.core.ids import new_id
from yoke.core.models import Message, TextPart, utcnow
from yoke.runtime.join_config import MemoryScope
from yoke.runtime.joins import create_forum, ensure_participant_id
from yoke.runtime.memories import (
    MEMORY_ERASURES,
    Memories,
    Memory,
    MemoryRefused,
    MemorySource,
    MemoryStep,
    person_id_of,
)
from yoke.store.database import Store
from yoke.store.tokens import Token, create_token, ensure_token_indexes

pytestmark = pytest.mark.slow


async def token(
    store: Store,
    forums: list[str] | None,
    *,
    can_manage_memory: bool = True,
    can_read_monologues: bool = False,
) -> tuple[Token, str]:
    await ensure_token_indexes(store)
    return await create_token(
        store,
        f"m{new_id()[:10]}",
        forums,
        can_manage_memory=can_manage_memory,
        can_read_monologues=can_read_monologues,
    )


def bearer(secret: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}"}


async def seed(
    store: Store,
    agent: str,
    scope: MemoryScope,
    subject: str,
    forum_id: str | None,
    text: str = "likes green tea",
    *,
    taught_by: str | None = None,
) -> str:
    """A memory of ``agent``'s, taught by a line of ``forum_id`` (None: an operator's)."""
    memory_id = new_id()
    source = MemorySource(
        forum_id=forum_id,
        message_id=new_id() if forum_id else None,
        author_actor_id=taught_by,
        author_name="Ada" if taught_by else None,
        at=utcnow() - timedelta(seconds=1),
        added_by=None if forum_id else "cli:operator",
    )
    step = MemoryStep(join_key=new_id(), monologue_id=new_id(), line_id=new_id(), call_id="c1")
    memory = Memory.new(
        memory_id, agent, scope, subject, text, source, step=step if forum_id else None
    )
    await Memories(store).remember(memory)
    return memory_id


async def listed(
    http: httpx.AsyncClient, secret: str, **params: str | int
) -> list[dict[str, object]]:
    answer = await http.get("/v1/memories", params=params, headers=bearer(secret))
    assert answer.status_code == 200, answer.text
    found: list[dict[str, object]] = answer.json()["memories"]
    return found


def ids(memories: list[dict[str, object]]) -> set[object]:
    return {memory["id"] for memory in memories}


async def exists(store: Store, memory_id: str) -> bool:
    return await Memories(store).get(memory_id) is not None


def unknown(memory_id: str) -> dict[str, str]:
    return {"error": f"unknown memory {memory_id!r}", "code": "unknown_memory"}


async def test_a_token_without_the_right_is_refused_everything(
    http: httpx.AsyncClient, store: Store
) -> None:
    agent = new_id()
    forum = new_id()
    kept = await seed(store, agent, "forum", forum, forum)
    plain_token, plain = await token(store, None, can_manage_memory=False)
    for answer in (
        await http.get("/v1/memories", params={"agent": agent}, headers=bearer(plain)),
        await http.delete(f"/v1/memories/{kept}", headers=bearer(plain)),
        await http.post("/v1/memories/erase", json={"person": "ada"}, headers=bearer(plain)),
    ):
        assert answer.status_code == 403, answer.text
        assert answer.json()["code"] == "forbidden"
        assert "--can-manage-memory" in answer.json()["error"]
    assert await exists(store, kept)
    # Not even the erasure's tombstone was written.
    ada = person_id_of(plain_token.namespaced("ada"))
    assert await store.db[MEMORY_ERASURES].find_one({"_id": ada}) is None
    assert (await http.get("/v1/memories", params={"agent": agent})).status_code == 401


async def test_a_scoped_token_sees_and_forgets_only_what_its_forums_taught(
    http: httpx.AsyncClient, store: Store
) -> None:
    agent = new_id()
    mine, theirs = new_id(), new_id()
    scoped, scoped_secret = await token(store, [mine])
    _, all_secret = await token(store, None)
    ada = person_id_of(scoped.namespaced("ada"))
    in_mine = await seed(store, agent, "forum", mine, mine, "the office opens at nine")
    about_ada = await seed(store, agent, "person", ada, mine, "ada is vegan", taught_by=ada)
    in_theirs = await seed(store, agent, "forum", theirs, theirs, "the vault code is 1234")
    # Taught about ada, but in a forum not the token's (say, an agent's kept forum).
    ada_elsewhere = await seed(store, agent, "person", ada, theirs, "ada owes 40 euros")
    curated = await seed(store, agent, "agent", "", None, "refunds need a manager")

    assert ids(await listed(http, scoped_secret, agent=agent)) == {in_mine, about_ada}
    assert ids(await listed(http, scoped_secret, agent=agent, person="ada")) == {about_ada}
    assert ids(await listed(http, scoped_secret, agent=agent, forum=mine)) == {in_mine}
    everything = {in_mine, about_ada, in_theirs, ada_elsewhere, curated}
    assert ids(await listed(http, all_secret, agent=agent)) == everything
    assert await listed(http, scoped_secret, agent=new_id()) == []

    # Another forum's listing is refused as every route refuses a forum out of scope.
    answer = await http.get(
        "/v1/memories", params={"agent": agent, "forum": theirs}, headers=bearer(scoped_secret)
    )
    assert answer.status_code == 403 and answer.json()["code"] == "forbidden"

    # What it may not see is exactly as unknown as what does not exist, and stays.
    nothing = new_id()
    gone = await http.delete(f"/v1/memories/{nothing}", headers=bearer(scoped_secret))
    assert gone.status_code == 404 and gone.json() == unknown(nothing)
    for hidden in (in_theirs, ada_elsewhere, curated):
        answer = await http.delete(f"/v1/memories/{hidden}", headers=bearer(scoped_secret))
        assert answer.status_code == 404 and answer.json() == unknown(hidden)
        assert await exists(store, hidden)

    metrics = (await http.get("/metrics")).text
    before = forgotten(metrics)
    answer = await http.delete(f"/v1/memories/{in_mine}", headers=bearer(scoped_secret))
    assert answer.status_code == 204 and answer.content == b""
    assert not await exists(store, in_mine)
    again = await http.delete(f"/v1/memories/{in_mine}", headers=bearer(scoped_secret))
    assert again.status_code == 404 and again.json() == unknown(in_mine)
    assert forgotten((await http.get("/metrics")).text) == before + 1
    answer = await http.delete(f"/v1/memories/{curated}", headers=bearer(all_secret))
    assert answer.status_code == 204


def forgotten(metrics: str) -> float:
    found = re.search(r"^yoke_memories_forgotten_total (\S+)$", metrics, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def erasures(metrics: str) -> float:
    found = re.search(r"^yoke_memory_erasures_total (\S+)$", metrics, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


async def test_a_memory_is_shown_with_its_source_and_its_step_only_to_a_monologue_reader(
    http: httpx.AsyncClient, store: Store
) -> None:
    agent, forum = new_id(), new_id()
    ada = person_id_of("http:x:ada")
    memory_id = await seed(store, agent, "forum", forum, forum, "ada likes tea", taught_by=ada)
    _, plain = await token(store, [forum])
    _, reader = await token(store, [forum], can_read_monologues=True)
    [shown] = await listed(http, plain, agent=agent)
    assert shown["id"] == memory_id and shown["scope"] == "forum"
    assert shown["text"] == "ada likes tea" and shown["agentActorId"] == agent
    source = shown["source"]
    assert isinstance(source, dict)
    assert source["forumId"] == forum and source["authorName"] == "Ada"
    assert source["messageId"] and source["at"] and shown["createdAt"]
    assert "authorActorId" not in source and "addedBy" not in source
    assert shown.get("step") is None
    [full] = await listed(http, reader, agent=agent)
    step = full["step"]
    assert isinstance(step, dict) and step["callId"] == "c1" and step["monologueId"]


# Ids a caller may send as a person: pattern syntax, operators, escapes, prefixes of each
# other, case variants, look-alikes. Each is a person of its own, and only of its token's.
HOSTILE = ("foo", "foobar", "Foo", "FOO", "fo", "%", "_", "%%", ".*", "^.*$", "$", "$where",
           "$ne", '{"$ne": null}', "foo ", " foo", "f%", "f_o", "*", "\\",
           "f\u043eo", "\uff46\uff4f\uff4f")  # fmt: skip


async def test_no_person_id_reaches_anothers_memories(
    http: httpx.AsyncClient, store: Store
) -> None:
    agent, forum = new_id(), new_id()
    mine, secret = await token(store, [forum])
    other, other_secret = await token(store, [forum])
    own: dict[str, str] = {}
    for person in HOSTILE:
        subject = person_id_of(mine.namespaced(person))
        own[person] = await seed(store, agent, "person", subject, forum, f"about {person}")
        # The same id, a person of the other token's: never the first token's.
        await seed(store, agent, "person", person_id_of(other.namespaced(person)), forum)
    for person in HOSTILE:
        found = await listed(http, secret, agent=agent, person=person)
        assert ids(found) == {own[person]}, person
        assert found[0]["text"] == f"about {person}"
    # Erasing one leaves every other, the other token's same-named person's included.
    answer = await http.post("/v1/memories/erase", json={"person": ".*"}, headers=bearer(secret))
    assert answer.status_code == 200, answer.text
    assert answer.json()["erased"] == 1
    assert await listed(http, secret, agent=agent, person=".*") == []
    assert ids(await listed(http, secret, agent=agent, person="foo")) == {own["foo"]}
    assert len(await listed(http, other_secret, agent=agent, person=".*")) == 1


async def test_erasure_goes_everywhere_but_counts_and_lists_only_the_tokens_forums(
    http: httpx.AsyncClient, store: Store
) -> None:
    mine = (await create_forum(store, "mine")).id
    theirs = (await create_forum(store, "theirs")).id
    scoped, secret = await token(store, [mine])
    ada = person_id_of(scoped.namespaced("ada"))
    bob = person_id_of(scoped.namespaced("bob"))
    first, second = new_id(), new_id()
    in_mine = {
        await seed(store, first, "person", ada, mine, "ada is vegan", taught_by=ada),
        await seed(store, second, "forum", mine, mine, "ada said the wifi is down", taught_by=ada),
    }
    elsewhere = await seed(store, first, "person", ada, theirs, "ada owes 40", taught_by=ada)
    about_bob = await seed(store, first, "person", bob, mine, "bob likes jazz", taught_by=bob)

    # ada's line in her token's forum, through the door (the person the gateway names is the
    # one the door stores), and lines of hers in a forum the token does not have.
    posted = await http.post(
        f"/v1/forums/{mine}/messages",
        json={"author": {"externalId": "ada", "displayName": "Ada"}, "text": "hello"},
        headers=bearer(secret),
    )
    assert posted.status_code == 202, posted.text

    async def stored() -> bool:
        return await store.get_message(posted.json()["messageId"]) is not None

    await eventually(stored, timeout=15, what="ada's line stored")
    await ensure_participant_id(store, theirs, ada)
    for n in range(2):
        line = Message(
            id=new_id(), conversation_id=theirs, author_actor_id=ada, parts=[TextPart(text=f"{n}")]
        )
        await store.insert_message(line)

    before, said = erasures((await http.get("/metrics")).text), utcnow()
    answer = await http.post("/v1/memories/erase", json={"person": "ada"}, headers=bearer(secret))
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert body == {"erased": 2, "remainingLines": [{"forumId": mine, "lines": 1}]}
    for memory_id in (*in_mine, elsewhere):
        assert not await exists(store, memory_id)
    assert await exists(store, about_bob)
    assert erasures((await http.get("/metrics")).text) == before + 3

    # Nothing taught by her line before the erasure can come back.
    source = MemorySource(forum_id=mine, message_id=new_id(), author_actor_id=ada, at=said)
    late = Memory.new(new_id(), first, "person", ada, "ada is vegan", source)
    with pytest.raises(MemoryRefused, match="erased"):
        await Memories(store).remember(late)


async def test_bad_requests_are_refused_with_a_reason(
    http: httpx.AsyncClient, store: Store
) -> None:
    _, secret = await token(store, None)
    agent = new_id()
    for params in (
        {"agent": agent, "limit": "0"},
        {"agent": agent, "limit": "1001"},
        {"agent": "a" * 129},
        {"agent": agent, "person": "p" * 129},
        {"agent": "a\x00b"},
        {"agent": agent, "person": "ada\x00"},
        {"agent": agent, "person": "ada", "forum": new_id()},
        {"agent": agent, "person": ""},
        {},
    ):
        answer = await http.get("/v1/memories", params=params, headers=bearer(secret))
        assert answer.status_code == 400, (params, answer.text)
        assert answer.json()["code"] == "invalid_request" and answer.json()["error"]
    twice = await http.get(f"/v1/memories?agent={agent}&limit=1&limit=2", headers=bearer(secret))
    assert twice.status_code == 400
    assert (
        await http.get(
            "/v1/memories", params={"agent": agent, "limit": 1000}, headers=bearer(secret)
        )
    ).status_code == 200
    long_id = await http.delete("/v1/memories/" + "m" * 129, headers=bearer(secret))
    assert long_id.status_code == 400
    for body in ({}, {"person": ""}, {"person": "p" * 129}, {"person": "a\u0000"}, {"person": 3}):
        answer = await http.post("/v1/memories/erase", json=body, headers=bearer(secret))
        assert answer.status_code == 400, (body, answer.text)
    answer = await http.post("/v1/memories/erase", content=b"person=ada", headers=bearer(secret))
    assert answer.status_code == 415

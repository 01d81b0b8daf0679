"""The console's data routes over a real gateway process: what a scoped token may learn, what
a forum's crowd costs, and the forum list past its first page; and /docs off by default.

No mesh is needed: forums, joins and people are written to the store as the services would,
and every request goes over a real socket to the gateway.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest

from services.gateway.console import PAGE_HEADERS
from tests.support.cli import run_yoke
from tests.support.gateway_process import running_gateway
from yoke.core.ids import new_id
from yoke.core.models import Actor, Conversation, utcnow
from yoke.runtime.joins import create_agent, create_forum, ensure_participant, join_conversation
from yoke.runtime.posting import Poster
from yoke.store.database import Store
from yoke.store.forum_list import FORUM_LIST, ForumList
from yoke.store.tokens import create_token, ensure_token_indexes

pytestmark = pytest.mark.slow

MAX_AGENTS = 2


@pytest.fixture(scope="module")
async def gateway_url(
    amqp_url: str, module_mongodb_url: str, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[str]:
    """A gateway with no mesh under it (conftest's would start one first)."""
    log_dir = Path(tmp_path_factory.mktemp("gateway"))
    limit = str(MAX_AGENTS)
    async with running_gateway(
        amqp_url, module_mongodb_url, log_dir, YOKE_CONSOLE_MAX_AGENTS=limit
    ) as url:
        yield url


async def person(
    store: Store, forum_id: str, name: str, *, external_id: str | None = None
) -> Actor:
    """A person who posted in the forum: a human actor and its participant there."""
    actor = await store.save_actor(
        Actor(id=new_id(), kind="human", name=name, external_id=external_id or f"http:t:{new_id()}")
    )
    await ensure_participant(store, forum_id, actor.id)
    return actor


async def get(url: str, path: str, secret: str | None, **params: str) -> httpx.Response:
    headers = {"Authorization": f"Bearer {secret}"} if secret else {}
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        return await http.get(path, headers=headers, params=params)


async def test_a_scoped_token_learns_the_names_of_its_forums_people_only(
    gateway_url: str, store: Store, poster: Poster
) -> None:
    mine = await create_forum(store, "mine")
    theirs = await create_forum(store, "theirs")
    agent = await create_agent(store, "helper")
    join = await join_conversation(store, poster, agent.id, mine.id)
    ada = await person(store, mine.id, "Ada")
    bob = await person(store, theirs.id, "Bob")  # a human id can be derived: it is no secret
    # A caller of a published agent through the MCP door: its lines are marked "via MCP".
    caller = await person(store, mine.id, "site", external_id="mcp:site~1234")
    await ensure_token_indexes(store)
    _, scoped = await create_token(store, "names-scoped", [mine.id], can_read_monologues=True)
    _, everything = await create_token(store, "names-all", can_read_monologues=True)
    ids = ",".join([ada.id, bob.id, agent.id, "system", caller.id])

    answer = await get(gateway_url, "/console/api/names", scoped, ids=ids, conversation=mine.id)
    assert answer.status_code == 200, answer.text
    assert answer.json()["names"] == {
        ada.id: "Ada",
        agent.id: "helper",
        "system": "system",
        caller.id: "site",
    }
    assert answer.json()["doors"] == {caller.id: "mcp"}
    # Through the monologue of a join in scope: its agent, and nobody of another forum.
    answer = await get(
        gateway_url, "/console/api/names", scoped, ids=ids, conversation=join.monologue_id
    )
    assert answer.status_code == 200, answer.text
    assert bob.id not in answer.json()["names"] and answer.json()["names"][agent.id] == "helper"
    # Another forum: refused, whoever is asked for; and a conversation must be named.
    answer = await get(
        gateway_url, "/console/api/names", scoped, ids=bob.id, conversation=theirs.id
    )
    assert answer.status_code == 403
    assert (await get(gateway_url, "/console/api/names", scoped, ids=bob.id)).status_code == 400
    # An all-forums token is named Bob through Bob's forum, and only there.
    answer = await get(
        gateway_url, "/console/api/names", everything, ids=ids, conversation=theirs.id
    )
    assert answer.json()["names"] == {bob.id: "Bob", "system": "system"}


async def test_a_forums_crowd_does_not_grow_what_its_console_view_reads(
    gateway_url: str, store: Store, poster: Poster
) -> None:
    """The view lists the forum's joins, newest first up to YOKE_CONSOLE_MAX_AGENTS and says
    when it cut some; the people a token makes (one per externalId) are not read at all."""
    forum = await create_forum(store, "crowded")
    joins = []
    for n in range(MAX_AGENTS + 1):
        agent = await create_agent(store, f"agent-{n}")
        joins.append(await join_conversation(store, poster, agent.id, forum.id))
    for n in range(30):
        await person(store, forum.id, f"someone {n}")
    await ensure_token_indexes(store)
    _, secret = await create_token(store, "crowd", [forum.id], can_read_monologues=True)

    info = (await get(gateway_url, f"/console/api/forums/{forum.id}", secret)).json()
    assert [agent["name"] for agent in info["agents"]] == ["agent-2", "agent-1"]
    assert info["agentsCut"] is True
    # The monologue of the join cut from the list is still found (through its join).
    first = joins[0].monologue_id
    lines = await get(gateway_url, f"/console/api/monologues/{first}/messages", secret)
    assert lines.status_code == 200 and lines.json()["forumId"] == forum.id


async def test_docs_are_off_by_default_and_the_console_keeps_its_csp(gateway_url: str) -> None:
    assert (await get(gateway_url, "/docs", None)).status_code == 404
    openapi = await get(gateway_url, "/openapi.json", None)
    assert openapi.status_code == 200 and openapi.json()["info"]["title"]
    for path in ("/", "/dead-letters", f"/forums/{new_id()}"):
        page = await get(gateway_url, path, None)
        assert page.status_code == 200
        csp = page.headers["content-security-policy"]
        assert csp == PAGE_HEADERS["Content-Security-Policy"]
        assert "default-src 'none'" in csp and "script-src 'self';" in csp
        assert "cdn" not in page.text.lower()


async def old_forums(store: Store, count: int) -> list[Conversation]:
    """Forums stored before the forum list existed, oldest first, a minute apart."""
    start = utcnow() - timedelta(days=1)
    made = [
        Conversation(
            id=new_id(), kind="forum", title=f"old {n}", created_at=start + timedelta(minutes=n)
        )
        for n in range(count)
    ]
    await store.conversations.insert_many([forum.to_document() for forum in made])
    return made


async def test_the_forum_list_pages_newest_first_past_five_hundred(
    amqp_url: str, mongodb_url: str, tmp_path: Path
) -> None:
    """On a database of its own: 500 forums from before the list, then new ones. Every forum
    is listed once, newest first, page by page; /docs turned on serves its page."""
    store = Store(mongodb_url)
    await store.ensure_indexes()
    try:
        old = await old_forums(store, 500)
        new = [await create_forum(store, f"new {n}") for n in range(5)]
        await ensure_token_indexes(store)
        _, secret = await create_token(store, "pages")
        async with running_gateway(
            amqp_url, mongodb_url, tmp_path, YOKE_GATEWAY_DOCS="true"
        ) as url:
            shown: list[dict[str, Any]] = []
            params: dict[str, str] = {"limit": "100"}
            pages = 0
            while True:
                answer = await get(url, "/console/api/forums", secret, **params)
                assert answer.status_code == 200, answer.text
                body = answer.json()
                assert len(body["forums"]) <= 100
                shown += body["forums"]
                pages += 1
                if body["next"] is None:
                    break
                params["before"] = body["next"]
            docs = await get(url, "/docs", None)
            assert docs.status_code == 200
            console = await get(url, "/", None)
            assert (
                console.headers["content-security-policy"]
                == PAGE_HEADERS["Content-Security-Policy"]
            )
        expected = [forum.id for forum in reversed(new)] + [forum.id for forum in reversed(old)]
        assert [forum["id"] for forum in shown] == expected
        assert pages == 6
        # A page is read by equality on an indexed field, which FerretDB hands to PostgreSQL
        # (a sort or a range it would not: it would read every document and filter itself);
        # PostgreSQL scans the index or, while the list is this small, the table.
        plan = str((await store.db[FORUM_LIST].find({"bucket": 0}).explain())["queryPlanner"])
        assert "'bucket'::text) @> '0'::jsonb" in plan, plan
        ranged = await store.db[FORUM_LIST].find({"bucket": {"$lt": 1}}).explain()
        assert "bucket" not in str(ranged["queryPlanner"]), ranged
        assert (await ForumList(store).head()) == 505
    finally:
        await store.close()


async def test_only_a_token_made_to_read_monologues_sees_an_agents_private_working(
    gateway_url: str, store: Store, poster: Poster, module_mongodb_url: str
) -> None:
    """A token for an app that posts lines reads its forums, never the agents' monologues
    (their private working: tool inputs and outputs, notices), nor the mesh's dead letters
    that hold them; ``--can-read-monologues`` is a right of its own, named when the token is
    made and shown by ``yoke token list``, and a token stored before it existed has it not."""
    forum = await create_forum(store, "private working")
    agent = await create_agent(store, "thinker")
    join = await join_conversation(store, poster, agent.id, forum.id)
    await ensure_token_indexes(store)
    _, poster_app = await create_token(store, "posting-app", [forum.id])
    _, everywhere = await create_token(store, "posting-everywhere")
    # Stored before the right existed: the field is absent, and the token has not the right.
    _, old = await create_token(store, "stored-before", [forum.id])
    await store.db["tokens"].update_one(
        {"_id": "stored-before"}, {"$unset": {"canReadMonologues": ""}}
    )

    monologue = f"/console/api/monologues/{join.monologue_id}/messages"
    info = f"/console/api/forums/{forum.id}"
    for secret in (poster_app, everywhere, old):
        refused = await get(gateway_url, monologue, secret)
        assert refused.status_code == 403, refused.text
        assert "--can-read-monologues" in refused.json()["error"]
        names = await get(
            gateway_url, "/console/api/names", secret, ids=agent.id, conversation=join.monologue_id
        )
        assert names.status_code == 403, names.text
        seen = (await get(gateway_url, info, secret)).json()
        assert seen["canReadMonologues"] is False
        # The agent is named, its monologue not (nor the ones before it): nothing to open.
        assert [agent_seen["agentActorId"] for agent_seen in seen["agents"]] == [agent.id]
        assert join.monologue_id not in json.dumps(seen)
        forum_lines = await get(gateway_url, f"/v1/forums/{forum.id}/messages", secret)
        assert forum_lines.status_code == 200  # the forum itself, as before
    letters = await get(gateway_url, "/console/api/dead-letters", everywhere)
    assert letters.status_code == 200 and letters.json()["mesh"] is None

    env = {"YOKE_MONGODB_URL": module_mongodb_url}
    code, out, err = await run_yoke(
        env, "token", "create", "--name", "reader", "--forum", forum.id, "--can-read-monologues"
    )
    assert code == 0, err
    reader = out.splitlines()[-1]

    allowed = await get(gateway_url, monologue, reader)
    assert allowed.status_code == 200, allowed.text
    assert allowed.json()["forumId"] == forum.id
    seen = (await get(gateway_url, info, reader)).json()
    assert seen["canReadMonologues"] is True
    assert [agent_seen["monologueId"] for agent_seen in seen["agents"]] == [join.monologue_id]

    code, out, err = await run_yoke(env, "token", "list")
    assert code == 0, err
    rights = {
        entry["name"]: entry["canReadMonologues"] for entry in map(json.loads, out.splitlines())
    }
    assert rights["reader"] is True
    assert rights["posting-app"] is False and rights["stored-before"] is False

"""``yoke agent publish/unpublish/published`` and ``yoke token create --can-call``: what the
gateway's MCP and A2A doors show, and to whom (docs/agents-as-tools.md)."""

from __future__ import annotations

import json

from tests.support.cli import run_yoke_commands
from yoke.runtime.joins import create_agent
from yoke.store.database import Store
from yoke.store.publishing import find_published
from yoke.store.tokens import list_tokens


async def test_publishing_is_stored_listed_replaced_and_taken_back(
    module_mongodb_url: str, store: Store
) -> None:
    agent = await create_agent(store, "Ada")
    other = await create_agent(store, "Bea")
    env = {"YOKE_MONGODB_URL": module_mongodb_url}
    code, outs, err = await run_yoke_commands(
        env,
        [
            ["agent", "publish", "--agent", agent.id, "--name", "ada", "--description", "Sums."],
            ["agent", "publish", "--agent", other.id, "--name", "bea"],
            ["agent", "published", "--json"],
            ["agent", "publish", "--agent", other.id, "--name", "ada"],
            ["agent", "unpublish", "bea"],
            ["agent", "published"],
            ["token", "create", "--name", "caller", "--can-call", "ada, bea"],
            ["token", "list"],
        ],
    )
    assert code == 0, err
    assert "/a2a/ada" in outs[0] and "--can-call ada" in outs[0]
    listed = [json.loads(line) for line in outs[2].splitlines()]
    assert [(entry["id"], entry["agentActorId"], entry["description"]) for entry in listed] == [
        ("ada", agent.id, "Sums."),
        ("bea", other.id, "Ask Bea."),
    ]
    # Publishing again replaces; unpublishing takes the name away.
    assert outs[5].split("\t")[:2] == ["ada", other.id] and "bea" not in outs[5]
    assert "may call ada, bea" in outs[6]
    entry = next(json.loads(line) for line in outs[7].splitlines() if '"caller"' in line)
    assert entry["canCall"] == ["ada", "bea"]
    assert [t.can_call for t in await list_tokens(store) if t.id == "caller"] == [["ada", "bea"]]

    code, outs, err = await run_yoke_commands(
        env, [["agent", "publish", "--agent", "no-such-agent", "--name", "x"]]
    )
    assert code == 1 and "unknown agent 'no-such-agent'" in err
    code, outs, err = await run_yoke_commands(
        env, [["agent", "publish", "--agent", agent.id, "--name", "a/b"]]
    )
    assert (
        code == 1 and "invalid published name" in err and await find_published(store, "a/b") is None
    )
    code, outs, err = await run_yoke_commands(env, [["agent", "unpublish", "bea"]])
    assert code == 1 and "nothing is published as 'bea'" in err
    code, outs, err = await run_yoke_commands(
        env, [["token", "create", "--name", "bad", "--can-call", "a:b"]]
    )
    assert code == 1 and "invalid --can-call name" in err

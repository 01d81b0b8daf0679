"""``yoke join --config``: invalid configurations are refused naming the field, nothing written;
joining again replaces the configuration and the processor answers with the new one."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.support.cli import cli_env, run_yoke
from tests.support.mesh import Mesh, agent_lines, lines_until, say
from tests.support.processes import eventually
from yoke.client import Client
from yoke.core.ids import derive_id
from yoke.core.models import Message
from yoke.runtime.instances import PROCESSOR
from yoke.runtime.join_config import JOIN_CONFIGS, JoinConfig, load_join_config
from yoke.runtime.joins import create_agent, create_forum, join_id
from yoke.store.database import Store


def write(tmp_path: Path, content: Any) -> str:
    path = tmp_path / "join.json"
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    return str(path)


GUARDIAN_OK = {"policies": [{"kind": "rule", "pattern": "refund", "steer": "No refunds."}]}

# (configuration, the field the error must name)
INVALID: list[tuple[Any, str]] = [
    ({"modle": "fixture-echo"}, "modle"),
    ({"model": ""}, "model"),
    ({"tools": ["clock", "no such tool!"]}, "tools"),
    ({"tools": "clock"}, "tools"),
    ({"instructions": 7}, "instructions"),
    ({"hopCap": 0}, "hopCap"),
    ({"compactionThresholdTokens": 0}, "compactionThresholdTokens"),
    ({"compactionKeep": -1}, "compactionKeep"),
    ({"budgetTokens": -5}, "budgetTokens"),
    ({"budgetUsd": -0.5}, "budgetUsd"),
    ({"followUp": {}}, "followUp.afterSeconds"),
    ({"followUp": {"afterSeconds": 0}}, "followUp.afterSeconds"),
    ({"followUp": {"afterSeconds": 3, "text": ""}}, "followUp.text"),
    ({"followUp": {"afterSeconds": 3, "maxConsecutive": 0}}, "followUp.maxConsecutive"),
    ({"followUp": {"afterSeconds": 3, "every": 2}}, "followUp.every"),
    ({"guardian": {**GUARDIAN_OK, "cooldownSeconds": -1}}, "guardian.cooldownSeconds"),
    ({"guardian": {"policies": [{"kind": "magic"}]}}, "guardian.policies.0"),
    (
        {"guardian": {"policies": [{"kind": "rule", "pattern": "(", "steer": "x"}]}},
        "guardian.policies.0.rule.pattern",
    ),
    (
        {"guardian": {"policies": [{"kind": "noProgress", "repeatedCalls": 1}]}},
        "guardian.policies.0.noProgress.repeatedCalls",
    ),
    ({"script": [{"txt": "hi"}]}, "script.0.txt"),
]


@pytest.fixture
async def agent_and_forum(store: Store) -> tuple[str, str]:
    agent = await create_agent(store, "config-agent")
    forum = await create_forum(store, "config forum")
    return agent.id, forum.id


async def assert_nothing_written(store: Store, agent_id: str, forum_id: str) -> None:
    key = join_id(agent_id, forum_id)
    assert await store.db[JOIN_CONFIGS].find_one({"_id": key}) is None
    assert await store.load_state(f"{PROCESSOR}:{key}") is None
    assert await store.get_conversation(derive_id("monologue", key)) is None


@pytest.mark.parametrize(("config", "field"), INVALID, ids=[field for _, field in INVALID])
async def test_an_invalid_field_exits_2_naming_it_and_writes_nothing(
    amqp_url: str,
    module_mongodb_url: str,
    store: Store,
    agent_and_forum: tuple[str, str],
    tmp_path: Path,
    config: Any,
    field: str,
) -> None:
    agent_id, forum_id = agent_and_forum
    code, out, err = await run_yoke(
        cli_env(amqp_url, module_mongodb_url),
        "join",
        "--agent",
        agent_id,
        "--forum",
        forum_id,
        "--config",
        write(tmp_path, config),
    )
    assert code == 2, err
    assert out == ""
    assert err.startswith("yoke: invalid join configuration"), err
    assert f"{field}:" in err, err
    assert "Traceback" not in err
    await assert_nothing_written(store, agent_id, forum_id)


@pytest.mark.parametrize(
    ("content", "extra", "expected"),
    [
        ("{not json", [], "is not JSON"),
        ("[1, 2]", [], "a join configuration is a JSON object"),
        ({"model": "fixture-echo"}, ["--follow-up-after", "-1"], "followUp.afterSeconds:"),
        ({"model": "fixture-echo"}, ["--tools", "clock,nope"], "unknown tools nope"),
    ],
    ids=["not-json", "not-an-object", "follow-up-after", "tools-option"],
)
async def test_an_unreadable_file_or_bad_shortcut_exits_2_and_writes_nothing(
    amqp_url: str,
    module_mongodb_url: str,
    store: Store,
    agent_and_forum: tuple[str, str],
    tmp_path: Path,
    content: Any,
    extra: list[str],
    expected: str,
) -> None:
    agent_id, forum_id = agent_and_forum
    code, _, err = await run_yoke(
        cli_env(amqp_url, module_mongodb_url),
        "join",
        "--agent",
        agent_id,
        "--forum",
        forum_id,
        "--config",
        write(tmp_path, content),
        *extra,
    )
    assert code == 2, err
    assert expected in err, err
    await assert_nothing_written(store, agent_id, forum_id)


async def test_joining_again_replaces_the_configuration_and_the_processor_uses_it(
    amqp_url: str,
    module_mongodb_url: str,
    mesh: Mesh,
    store: Store,
    client: Client,
    agent_and_forum: tuple[str, str],
    tmp_path: Path,
) -> None:
    agent_id, forum_id = agent_and_forum
    base = ["join", "--agent", agent_id, "--forum", forum_id]
    code, out, err = await run_yoke(cli_env(amqp_url, module_mongodb_url), *base)
    assert code == 0, err
    assert set(json.loads(out)) == {"forumParticipantId", "monologueId", "monologueParticipantId"}
    await say(client, forum_id, "first")
    lines = await lines_until(store, forum_id, lambda lines: len(agent_lines(lines)) == 1)
    assert agent_lines(lines)[-1].text == "first"  # the agent's default: fixture-echo

    scripted = {"model": "fixture-script", "script": [{"text": "scripted answer", "repeat": True}]}
    code, _, err = await run_yoke(
        cli_env(amqp_url, module_mongodb_url),
        *base,
        "--config",
        write(tmp_path, scripted),
        "--follow-up-after",
        "30",
    )
    assert code == 0, err
    stored = await load_join_config(store, join_id(agent_id, forum_id))
    assert stored == JoinConfig.model_validate({**scripted, "followUp": {"afterSeconds": 30}})
    await say(client, forum_id, "second")
    lines = await lines_until(store, forum_id, lambda lines: len(agent_lines(lines)) == 2)
    assert agent_lines(lines)[-1].text == "scripted answer"

    # Joining again without options: the join's configuration is the agent's defaults again.
    code, _, err = await run_yoke(cli_env(amqp_url, module_mongodb_url), *base)
    assert code == 0, err
    assert await load_join_config(store, join_id(agent_id, forum_id)) == JoinConfig()
    await say(client, forum_id, "third")
    lines = await lines_until(store, forum_id, lambda lines: len(agent_lines(lines)) == 3)
    assert agent_lines(lines)[-1].text == "third"


async def test_a_hop_cap_set_by_a_later_join_stops_agents_sooner(
    amqp_url: str,
    module_mongodb_url: str,
    mesh: Mesh,
    store: Store,
    client: Client,
    tmp_path: Path,
) -> None:
    forum = await create_forum(store, "two echoes")
    agents = [await create_agent(store, name) for name in ("ping", "pong")]
    for agent in agents:
        code, _, err = await run_yoke(
            cli_env(amqp_url, module_mongodb_url), "join", "--agent", agent.id, "--forum", forum.id
        )
        assert code == 0, err
    # With the default cap (4), two echo agents answer each other up to hop 4.
    await say(client, forum.id, "echo chamber")
    await lines_until(store, forum.id, lambda lines: any(m.meta.agent_hops == 4 for m in lines))

    for agent in agents:
        code, _, err = await run_yoke(
            cli_env(amqp_url, module_mongodb_url),
            "join",
            "--agent",
            agent.id,
            "--forum",
            forum.id,
            "--config",
            write(tmp_path, {"hopCap": 2}),
        )
        assert code == 0, err
    await say(client, forum.id, "again")

    def second_round(lines: list[Message]) -> list[Message]:
        start = next((i for i, line in enumerate(lines) if line.text == "again"), len(lines))
        return agent_lines(lines[start:])

    # Both answer the person (hop 1), then each answers the other's line (hop 2), and there
    # the new cap stops them: the processor says so.
    processor = mesh.processes["processor"]

    async def capped() -> bool:
        return "reached the cap 2" in processor.output()

    await eventually(capped, timeout=30, what="the processor to stop at the new cap")
    lines = await lines_until(store, forum.id, lambda lines: len(second_round(lines)) >= 4)
    assert sorted(line.meta.agent_hops for line in second_round(lines)) == [1, 1, 2, 2]

"""Cost controls hold through the real door: prices follow a model's dated snapshots, a budget
refuses a model it cannot price, and ``/model`` switches only to the models a join allows.

Lines go in over AMQP, the real processor answers them with the fixture or a real
OpenAI-compatible server, and what the store and /metrics say afterwards is checked.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.cli import run_yoke
from tests.support.fake_openai import FakeOpenAI, completion, openai_env
from tests.support.mesh import JoinFactory, Mesh, agent_lines, lines_until, say
from yoke.client import Client
from yoke.core.models import Message
from yoke.llm.providers import price_of
from yoke.runtime.join_config import JoinConfig, load_join_config
from yoke.runtime.joins import create_agent, create_forum, join_id
from yoke.store.database import Store

pytestmark = pytest.mark.slow

# USD per million tokens: gpt-4o-mini's own price must never be taken for gpt-4o's.
PRICES = {"gpt-4o-mini": (1000.0, 2000.0), "gpt-4o": (5000.0, 10000.0)}


@pytest.fixture(scope="module")
def mesh_env(fake_openai: FakeOpenAI) -> dict[str, str]:
    return openai_env(fake_openai.base_url, YOKE_PRICES=json.dumps(PRICES))


def notices(lines: list[Message]) -> list[Message]:
    return [line for line in lines if line.type == "notice"]


def sample(metrics: str, name: str, **labels: str) -> float:
    """The value of one series in Prometheus text (0 when absent)."""
    for line in metrics.splitlines():
        if line.startswith((name + "{", name + " ")) and all(
            f'{key}="{value}"' in line for key, value in labels.items()
        ):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


@pytest.mark.parametrize(
    ("model", "listed", "priced_as"),
    [
        ("gpt-4o-mini-2024-07-18", ["gpt-4o", "gpt-4o-mini"], "gpt-4o-mini"),
        ("gpt-4o-mini-2024-07-18", ["gpt-4o"], None),  # never the shorter family's price
        ("gpt-4o-2024-08-06", ["gpt-4o", "gpt-4o-mini"], "gpt-4o"),
        ("gpt-4-0613", ["gpt-4", "gpt-4o"], "gpt-4"),
        ("claude-3-5-sonnet-20241022", ["claude-3-5-sonnet"], "claude-3-5-sonnet"),
        ("gpt-4o-mini-preview", ["gpt-4o-mini"], None),  # not a dated snapshot
        ("gpt-4o-mini", ["gpt-4o"], None),
        ("fixture-echo", [], "fixture"),  # fixture models are free, and known to be
    ],
)
def test_a_snapshot_id_takes_its_base_models_price(
    model: str, listed: list[str], priced_as: str | None
) -> None:
    prices = {name: (float(index + 1), 0.0) for index, name in enumerate(listed)}
    expected = None if priced_as is None else prices.get(priced_as, (0.0, 0.0))
    assert price_of(model, prices) == expected


async def test_a_snapshot_reply_is_priced_and_its_budget_trips(
    store: Store, client: Client, new_join: JoinFactory, fake_openai: FakeOpenAI
) -> None:
    """OpenAI answers a request for gpt-4o-mini as gpt-4o-mini-2024-07-18: the cost is
    gpt-4o-mini's, and the cost budget stops the next call."""
    fake_openai.script(
        completion("priced", prompt_tokens=50, completion_tokens=5, model="gpt-4o-mini-2024-07-18")
    )
    before = len(fake_openai.requests)
    forum_id, join = await new_join(config=JoinConfig(model="gpt-4o-mini", budget_usd=0.01))
    await say(client, forum_id, "how much am I?")
    forum = await lines_until(store, forum_id, lambda lines: len(lines) == 2)
    assert forum[1].usage is not None
    assert forum[1].usage.cost_usd == pytest.approx((50 * 1000 + 5 * 2000) / 1_000_000)

    await say(client, forum_id, "and again?")
    forum = await lines_until(store, forum_id, lambda lines: len(lines) == 4)
    assert forum[3].type == "notice" and "budget" in forum[3].text
    [notice] = notices(await store.history(join.monologue_id))
    assert "cost budget spent ($0.0600 of $0.0100)" in notice.text
    assert len(fake_openai.requests) - before == 1  # the second line called no model


async def test_a_budget_refuses_a_model_without_a_price_and_says_how_to_fix_it(
    store: Store, client: Client, new_join: JoinFactory, fake_openai: FakeOpenAI
) -> None:
    before = len(fake_openai.requests)
    forum_id, join = await new_join(config=JoinConfig(model="gpt-unpriced", budget_usd=5))
    await say(client, forum_id, "hello?")
    forum = await lines_until(store, forum_id, lambda lines: len(lines) == 2)
    assert forum[1].type == "notice"
    assert "price" in forum[1].text and "YOKE_PRICES" in forum[1].text
    [notice] = notices(await store.history(join.monologue_id))
    assert "gpt-unpriced" in notice.text and "YOKE_PRICES" in notice.text
    assert len(fake_openai.requests) == before  # refused, not called


async def test_without_a_budget_an_unpriced_model_answers_and_is_counted_as_unpriced(
    store: Store, client: Client, new_join: JoinFactory, fake_openai: FakeOpenAI, mesh: Mesh
) -> None:
    fake_openai.script(completion("free?", model="gpt-unpriced"))
    processor = mesh.processes["processor"]
    unpriced = "yoke_llm_unpriced_calls_total"
    counted = sample(await processor.metrics(), unpriced, model="gpt-unpriced")
    forum_id, _ = await new_join(config=JoinConfig(model="gpt-unpriced"))
    await say(client, forum_id, "what do you cost?")
    forum = await lines_until(store, forum_id, lambda lines: len(lines) == 2)
    assert forum[1].text == "free?"
    assert sample(await processor.metrics(), unpriced, model="gpt-unpriced") == counted + 1


async def test_the_fixture_model_answers_under_a_cost_budget(
    store: Store, client: Client, new_join: JoinFactory
) -> None:
    forum_id, _ = await new_join(config=JoinConfig(budget_usd=0.5))
    await say(client, forum_id, "echo under a budget")
    forum = await lines_until(store, forum_id, lambda lines: len(lines) == 2)
    assert forum[1].type == "message" and forum[1].text == "echo under a budget"


async def test_a_compaction_summary_is_charged_to_the_budget(
    store: Store, client: Client, new_join: JoinFactory, fake_openai: FakeOpenAI
) -> None:
    """A summary is a model call like any: what it costs counts, and may spend the budget."""
    fake_openai.script(
        completion("first", prompt_tokens=10, completion_tokens=8, model="gpt-4o-mini"),
        completion("a summary", prompt_tokens=10, completion_tokens=10, model="gpt-4o-mini"),
    )
    before = len(fake_openai.requests)
    config = JoinConfig(
        model="gpt-4o-mini", budget_tokens=30, compaction_threshold_tokens=1, compaction_keep=0
    )
    forum_id, _ = await new_join(config=config)
    await say(client, forum_id, "one")
    await lines_until(store, forum_id, lambda lines: len(lines) == 2)
    await say(client, forum_id, "two")  # compacts first: the summary takes 20 more tokens
    forum = await lines_until(store, forum_id, lambda lines: len(lines) == 4)
    assert forum[3].type == "notice" and "budget" in forum[3].text
    assert len(fake_openai.requests) - before == 2


async def test_a_spent_budget_calls_no_model_for_a_summary(
    store: Store, client: Client, new_join: JoinFactory, fake_openai: FakeOpenAI
) -> None:
    fake_openai.script(completion("first", prompt_tokens=10, completion_tokens=8))
    before = len(fake_openai.requests)
    config = JoinConfig(
        model="gpt-4o-mini", budget_tokens=18, compaction_threshold_tokens=1, compaction_keep=0
    )
    forum_id, _ = await new_join(config=config)
    await say(client, forum_id, "one")
    await lines_until(store, forum_id, lambda lines: len(lines) == 2)
    await say(client, forum_id, "two")
    forum = await lines_until(store, forum_id, lambda lines: len(lines) == 4)
    assert forum[3].type == "notice" and "budget" in forum[3].text
    assert len(fake_openai.requests) - before == 1  # the summary was the mesh's own


async def test_model_is_refused_outside_the_joins_own_model_by_default(
    store: Store, client: Client, new_join: JoinFactory, fake_openai: FakeOpenAI
) -> None:
    before = len(fake_openai.requests)
    forum_id, _ = await new_join()
    await say(client, forum_id, "/model gpt-4o")
    forum = await lines_until(store, forum_id, lambda lines: len(lines) == 2)
    assert forum[1].type == "notice"
    assert "gpt-4o" in forum[1].text and "allowed: fixture-echo" in forum[1].text
    await say(client, forum_id, "still the echo?")
    forum = await lines_until(store, forum_id, lambda lines: len(lines) == 4)
    assert forum[3].text == "still the echo?"
    assert len(fake_openai.requests) == before


async def test_model_switches_only_among_the_allowed_models(
    store: Store, client: Client, new_join: JoinFactory, fake_openai: FakeOpenAI
) -> None:
    config = JoinConfig(model="fixture-echo", allowed_models=["gpt-4o-mini"])
    forum_id, _ = await new_join(config=config)
    await say(client, forum_id, "/model gpt-4o")
    forum = await lines_until(store, forum_id, lambda lines: len(lines) == 2)
    assert forum[1].type == "notice"
    assert "allowed: fixture-echo, gpt-4o-mini" in forum[1].text

    fake_openai.script(completion("from the mini", model="gpt-4o-mini-2024-07-18"))
    await say(client, forum_id, "/model gpt-4o-mini")
    forum = await lines_until(store, forum_id, lambda lines: len(lines) == 4)
    assert forum[3].text == "model is now gpt-4o-mini"
    await say(client, forum_id, "hello mini")
    forum = await lines_until(store, forum_id, lambda lines: len(agent_lines(lines)) == 3)
    assert agent_lines(forum)[-1].text == "from the mini"
    assert fake_openai.requests[-1]["model"] == "gpt-4o-mini"


async def test_yoke_join_takes_allowed_models_and_refuses_bad_ones(
    amqp_url: str, module_mongodb_url: str, store: Store, tmp_path: Path
) -> None:
    env = {"YOKE_AMQP_URL": amqp_url, "YOKE_MONGODB_URL": module_mongodb_url}
    agent = await create_agent(store, "cost-agent")
    forum = await create_forum(store, "cost forum")
    where = ["--agent", agent.id, "--forum", forum.id]
    for bad in ([""], ["gpt 4o"], "gpt-4o"):
        path = tmp_path / "join.json"
        path.write_text(json.dumps({"allowedModels": bad}))
        code, out, err = await run_yoke(env, "join", *where, "--config", str(path))
        assert code == 2 and out == "", err
        assert "invalid join configuration" in err and "allowedModels" in err, err
    code, _, err = await run_yoke(env, "join", *where, "--allowed-models", "gpt-4o , ,bad model")
    assert code == 2 and "allowedModels" in err, err
    assert await load_join_config(store, join_id(agent.id, forum.id)) is None

    code, _, err = await run_yoke(env, "join", *where, "--allowed-models", "gpt-4o-mini,gpt-4o")
    assert code == 0, err
    config = await load_join_config(store, join_id(agent.id, forum.id))
    assert config is not None and config.allowed_models == ["gpt-4o-mini", "gpt-4o"]

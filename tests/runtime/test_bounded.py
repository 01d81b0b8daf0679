"""Nothing a person or a model invents grows without bound: metric label values and caches."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from prometheus_client import REGISTRY

from services.egress.app import Egress
from tests.support.fake_openai import FakeOpenAI
from tests.support.mesh import JoinFactory, Mesh, lines_until, say
from yoke.client import Client
from yoke.core.lru import LRUCache
from yoke.core.metrics import OTHER, BoundedLabel, model_label, tool_label
from yoke.core.models import Message, TextPart, ToolResultPart
from yoke.core.settings import Settings
from yoke.llm.base import InferenceRequest, ScriptedCall, ScriptedOutput
from yoke.llm.fixtures import EchoProvider, ScriptedProvider
from yoke.llm.openai_provider import OpenAIProvider
from yoke.runtime.service import Service
from yoke.store.database import Store
from yoke.tools.builtin import BUILTIN_TOOLS

# --- the LRU ---------------------------------------------------------------------------------


def test_lru_keeps_the_most_recently_used_entries() -> None:
    cache: LRUCache[str, int] = LRUCache(3)
    cache["a"], cache["b"], cache["c"] = 1, 2, 3
    assert cache.get("a") == 1  # a is now the most recent: b is the oldest
    cache["d"] = 4
    assert list(cache) == ["c", "a", "d"]
    assert "c" in cache  # a membership test is a use too
    assert list(cache) == ["a", "d", "c"]
    cache["a"] = 10  # an update refreshes too
    cache["e"] = 5
    assert dict(cache) == {"c": 3, "a": 10, "e": 5}
    assert len(cache) == 3 and cache.maxsize == 3
    del cache["c"]
    assert cache.pop("e") == 5 and len(cache) == 1


def test_lru_refuses_a_size_below_one() -> None:
    with pytest.raises(ValueError):
        LRUCache(0)


def sensible(cache: object) -> bool:
    return isinstance(cache, LRUCache) and 1_000 <= cache.maxsize <= 1_000_000


async def test_store_seq_cache_is_bounded(mongodb_url: str) -> None:
    store = Store(mongodb_url)
    try:
        assert sensible(store._last_seq)
    finally:
        await store.close()


async def test_egress_settled_monologues_are_bounded(mongodb_url: str) -> None:
    service = Service("egress", Settings(mongodb_url=mongodb_url))
    try:
        assert sensible(Egress(service)._settled)
    finally:
        await service.store.close()


# --- label values ----------------------------------------------------------------------------


def test_a_bounded_label_keeps_known_values_then_the_first_few_then_other() -> None:
    label = BoundedLabel({"a", "b"}, spare=2)
    assert [label(v) for v in ("a", "x", "y", "z", "x", "b")] == ["a", "x", "y", OTHER, "x", "b"]
    assert label("z", also={"z"}) == "z"  # a value the caller knows (a priced model)


def test_tool_labels_are_catalog_tools_else_other() -> None:
    for name in BUILTIN_TOOLS:
        assert tool_label(name) == name
    assert tool_label("rm -rf /", known=False) == OTHER  # a name a model invented
    for i in range(300):  # catalog tools: the first 200 past the built-ins, then other
        tool_label(f"catalog-tool-{i}")
    assert tool_label("catalog-tool-0") == "catalog-tool-0"
    assert tool_label("catalog-tool-299") == OTHER


def test_model_labels_keep_fixtures_and_priced_models() -> None:
    prices = {"priced-model": (1.0, 2.0)}
    for i in range(200):
        model_label(f"made-up-{i}", prices)
    assert model_label(EchoProvider.model, prices) == "fixture-echo"
    assert model_label(ScriptedProvider.model, prices) == "fixture-script"
    assert model_label("priced-model", prices) == "priced-model"
    assert model_label("made-up-199", prices) == OTHER


def label_values(metric: str, label: str) -> set[str]:
    return {
        sample.labels[label]
        for family in REGISTRY.collect()
        if family.name == metric
        for sample in family.samples
        if label in sample.labels
    }


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeOpenAI]:
    with FakeOpenAI() as server:
        monkeypatch.setenv("OPENAI_BASE_URL", server.base_url)
        monkeypatch.setenv("OPENAI_API_KEY", "sk-test-not-a-secret")
        yield server


async def test_200_invented_model_names_make_a_bounded_number_of_series(fake: FakeOpenAI) -> None:
    """What ``/model ANYTHING`` leads to: a provider per name, each labelling its requests."""
    request = InferenceRequest(
        transcript=[
            Message(id="m", conversation_id="c", author_actor_id="h", parts=[TextPart(text="hi")])
        ],
        tools={},
        call_id_prefix="s",
    )
    settings = Settings(provider_request_timeout_seconds=5)
    for i in range(200):
        await OpenAIProvider(f"invented-model-{i}", settings).infer(request)
    models = label_values("yoke_llm_requests", "model")
    assert OTHER in models
    assert len(models) <= 60, sorted(models)


@pytest.mark.slow
async def test_200_invented_tool_names_make_a_bounded_number_of_series(
    new_join: JoinFactory, client: Client, mesh: Mesh, store: Store
) -> None:
    invented = ScriptedOutput(tool_calls=[ScriptedCall(name=f"invented-{i}") for i in range(200)])
    forum_id, join = await new_join(model="fixture-script", tools=["clock"], script=[invented])
    await say(client, forum_id, "call everything")

    def results_posted(lines: list[Message]) -> bool:
        return any(isinstance(part, ToolResultPart) for line in lines for part in line.parts)

    await lines_until(store, join.monologue_id, results_posted)
    metrics = await mesh.processes["processor"].metrics()
    series = [line for line in metrics.splitlines() if line.startswith("yoke_tool_calls_total{")]
    assert series and len(series) <= len(BUILTIN_TOOLS) * 2 + 2, series
    assert any(f'tool="{OTHER}"' in line for line in series)

"""Embedders: the deterministic fixture, and the OpenAI path through the real ``openai`` client
against the suite's OpenAI-compatible HTTP server (answers checked before anyone stores them)."""

from __future__ import annotations

import json
import math
import socket
import subprocess
import sys
from collections.abc import Iterator

import pytest

from tests.support.fake_openai import FakeOpenAI, embedding, embeddings, failure
from yoke.core.settings import Settings
from yoke.llm.base import ProviderFailed
from yoke.llm.embeddings import MAX_DIMENSIONS, embedder_for
from yoke.runtime.recall import cosine

SETTINGS = Settings(provider_request_timeout_seconds=5, provider_give_up_seconds=5)


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeOpenAI]:
    with FakeOpenAI() as server:
        monkeypatch.setenv("OPENAI_BASE_URL", server.base_url)
        monkeypatch.setenv("OPENAI_API_KEY", "sk-test-not-a-secret")
        yield server


async def fixture_vectors(*texts: str) -> list[list[float]]:
    return await embedder_for("fixture-embed", SETTINGS).embed(list(texts))


async def test_the_fixture_is_normalised_and_texts_sharing_words_are_closer() -> None:
    embedder = embedder_for("fixture-embed", SETTINGS)
    assert (embedder.model, embedder.dimensions) == ("fixture-embed", 64)
    tea, more_tea, train, shouted = await fixture_vectors(
        "Ana drinks green tea every morning",
        "which tea does ana drink?",
        "the train to Porto leaves at noon",
        "ANA DRINKS GREEN TEA EVERY MORNING",
    )
    assert all(len(v) == 64 and math.isclose(math.hypot(*v), 1.0) for v in (tea, train))
    assert cosine(tea, more_tea) > cosine(tea, train) + 0.2
    assert shouted == tea  # words are lower-cased before hashing
    assert await fixture_vectors("", "?!") == [[0.0] * 64, [0.0] * 64]


async def test_the_fixture_is_the_same_in_every_process() -> None:
    """A stable hash, not Python's salted ``hash``: a vector stored by one process is compared
    with a query embedded by another."""
    script = (
        "import asyncio, json\n"
        "from yoke.core.settings import Settings\n"
        "from yoke.llm.embeddings import embedder_for\n"
        "e = embedder_for('fixture-embed', Settings())\n"
        "print(json.dumps(asyncio.run(e.embed(['green tea at noon']))))\n"
    )
    child = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PYTHONHASHSEED": "12345", "PATH": "/usr/bin:/bin"},
        check=True,
    )
    assert json.loads(child.stdout) == await fixture_vectors("green tea at noon")


def test_an_unknown_fixture_model_fails_like_chat() -> None:
    with pytest.raises(ProviderFailed, match="fixture-embedz"):
        embedder_for("fixture-embedz", SETTINGS)
    with pytest.raises(ProviderFailed, match="fixture-echo"):
        embedder_for("fixture-echo", SETTINGS)  # a chat fixture embeds nothing


async def test_vectors_from_an_openai_compatible_server_in_the_texts_order(
    fake: FakeOpenAI,
) -> None:
    embedder = embedder_for("text-embedding-3-small", SETTINGS)
    assert embedder.dimensions is None
    texts = ["green tea", "the train", "green tea"]
    assert await embedder.embed(texts) == [embedding(text) for text in texts]
    [sent] = fake.embedding_requests
    assert sent["model"] == "text-embedding-3-small" and sent["input"] == texts
    assert sent["encoding_format"] == "float"
    assert fake.requests == []  # nothing reached the chat route
    assert await embedder.embed([]) == [] and len(fake.embedding_requests) == 1


async def test_answers_in_any_index_order_are_put_back_in_the_texts_order(
    fake: FakeOpenAI,
) -> None:
    reply = embeddings([[1.0, 0.0], [0.0, 1.0]])
    reply.body["data"].reverse()
    fake.embedding_replies.append(reply)
    assert await embedder_for("embed-test", SETTINGS).embed(["a", "b"]) == [[1.0, 0.0], [0.0, 1.0]]


@pytest.mark.parametrize("status", [500, 400, 401])
async def test_a_server_error_is_a_provider_failure_with_its_status(
    fake: FakeOpenAI, status: int
) -> None:
    fake.embedding_replies.append(failure(status))
    with pytest.raises(ProviderFailed, match=f"embed-test: embeddings: .*HTTP {status}"):
        await embedder_for("embed-test", SETTINGS).embed(["green tea"])
    assert len(fake.embedding_requests) == 1  # one request, no retries


@pytest.mark.parametrize(
    ("vectors", "reason"),
    [
        ([[0.1] * (MAX_DIMENSIONS + 1)] * 2, f"{MAX_DIMENSIONS + 1} dimensions"),
        ([[0.1, 0.2], [0.3]], "embeddings of 2 and 1 dimensions"),
        ([[0.1, 0.2]], "1 embeddings for 2 texts"),
        ([[0.1, math.nan], [0.1, 0.2]], "other than finite numbers"),
        ([[0.1, "x"], [0.1, 0.2]], "other than finite numbers"),
        ([[], []], "not a list of numbers"),
    ],
)
async def test_a_malformed_answer_is_refused(
    fake: FakeOpenAI, vectors: list[list[float]], reason: str
) -> None:
    fake.embedding_replies.append(embeddings(vectors))
    with pytest.raises(ProviderFailed, match=reason):
        await embedder_for("embed-test", SETTINGS).embed(["green tea", "the train"])


async def test_the_largest_allowed_vector_is_kept(fake: FakeOpenAI) -> None:
    fake.embedding_replies.append(embeddings([[0.5] * MAX_DIMENSIONS]))
    [vector] = await embedder_for("embed-test", SETTINGS).embed(["green tea"])
    assert len(vector) == MAX_DIMENSIONS


async def test_a_server_that_never_answers_times_out(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.create_server(("127.0.0.1", 0)) as silent:  # accepts, never answers
        monkeypatch.setenv("OPENAI_BASE_URL", f"http://127.0.0.1:{silent.getsockname()[1]}/v1")
        monkeypatch.setenv("OPENAI_API_KEY", "sk-test-not-a-secret")
        settings = Settings(provider_request_timeout_seconds=0.5, provider_give_up_seconds=5)
        with pytest.raises(ProviderFailed, match=r"embeddings timed out after 0\.5s"):
            await embedder_for("embed-test", settings).embed(["green tea"])

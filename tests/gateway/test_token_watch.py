"""The token watch's look-ups (services/gateway/deps.TokenWatch): one read a second for every
open stream and waiting call together, none once nothing is watched, and told apart from what a
request costs the store (a turn's store operations do not count them)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from services.gateway import deps
from yoke.core.metrics import STORE_ORIGIN
from yoke.store.tokens import Token


class Tokens:
    """The tokens collection as the watch reads it: the origin each read was made under."""

    def __init__(self, stored: dict[str, str]) -> None:
        self.stored = stored
        self.reads: list[str] = []

    def find(self, query: dict[str, Any], projection: dict[str, int]) -> AsyncIterator[Any]:
        self.reads.append(STORE_ORIGIN.get())
        names = query["_id"]["$in"]

        async def documents() -> AsyncIterator[dict[str, str]]:
            for name in names:
                if name in self.stored:
                    yield {"_id": name, "hash": self.stored[name]}

        return documents()


@pytest.fixture
def tokens(monkeypatch: pytest.MonkeyPatch) -> Tokens:
    found = Tokens({"kept": "hash-kept"})
    monkeypatch.setattr(deps, "token_collection", lambda store: found)
    return found


def token(name: str) -> Token:
    return Token(id=name, hash=f"hash-{name}")


async def test_nothing_watched_reads_nothing(tokens: Tokens) -> None:
    watch = deps.TokenWatch(every=0.01)
    unwatch = watch.watch(None, token("kept"), lambda: None)  # type: ignore[arg-type]
    await asyncio.sleep(0)  # the look-up task waits out its interval
    unwatch()  # a call answered within it
    assert watch._looking is not None
    async with asyncio.timeout(5):
        await watch._looking
    assert tokens.reads == []


async def test_a_revoked_token_is_found_by_a_read_of_its_own_origin(tokens: Tokens) -> None:
    watch = deps.TokenWatch(every=0.01)
    revoked = asyncio.Event()
    kept = watch.watch(None, token("kept"), lambda: None)  # type: ignore[arg-type]
    watch.watch(None, token("gone"), revoked.set)  # type: ignore[arg-type]
    async with asyncio.timeout(5):
        await revoked.wait()
    kept()
    assert tokens.reads and set(tokens.reads) == {deps.TOKEN_WATCH_ORIGIN}

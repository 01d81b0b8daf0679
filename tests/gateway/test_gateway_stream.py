"""The gateway's live stream, in this process: however a stream ends, it lets its forum go.

A stream subscribes to its forum (the hub's subscriber and the gateway queue's bindings); that
subscription must end with the stream whether its client leaves, its token is revoked or its
body raises (the store away mid-stream: Starlette then skips the response's background task),
or each such stream leaves a subscriber filling up with the forum's events and a binding for
ever. The stream as clients see it, end to end, is tested in test_gateway.py.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager
from urllib.parse import quote, urlsplit

import httpx
import pytest
import uvicorn
from fastapi import FastAPI
from pymongo.errors import AutoReconnect

from services.gateway import stream as stream_module
from services.gateway.app import create_app
from services.gateway.deps import Gateway
from tests.support.processes import eventually, free_port
from yoke.bus.broker import Bus
from yoke.core.ids import new_id
from yoke.core.models import Message, TextPart
from yoke.core.settings import Settings
from yoke.runtime.joins import create_forum
from yoke.runtime.posting import Poster
from yoke.store.database import Store
from yoke.store.tokens import create_token, ensure_token_indexes, revoke_token


@pytest.fixture
async def gateway_app(amqp_url: str, mongodb_url: str) -> AsyncIterator[tuple[FastAPI, str]]:
    port = free_port()
    settings = Settings(amqp_url=amqp_url, mongodb_url=mongodb_url, gateway_port=port)
    app = create_app(settings)
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_config=None, lifespan="on")
    )
    serving = asyncio.create_task(server.serve())

    async def started() -> bool:
        return server.started or serving.done()

    await eventually(started, timeout=60, what="the gateway to start")
    assert not serving.done()
    try:
        yield app, f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await asyncio.wait_for(serving, timeout=30)


async def _forum_with_token(store: Store, title: str, token: str) -> tuple[str, str]:
    """A forum and a token scoped to it: (the forum's id, the token's secret)."""
    await ensure_token_indexes(store)
    forum = await create_forum(store, title)
    _, secret = await create_token(store, token, [forum.id])
    return forum.id, secret


def _stream(
    http: httpx.AsyncClient, forum_id: str, secret: str
) -> AbstractAsyncContextManager[httpx.Response]:
    return http.stream(
        "GET", f"/v1/forums/{forum_id}/stream", headers={"Authorization": f"Bearer {secret}"}
    )


async def test_a_stream_that_fails_lets_its_forum_go(
    gateway_app: tuple[FastAPI, str], mongodb_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    app, url = gateway_app
    state: Gateway = app.state.gateway
    store = Store(mongodb_url)
    try:
        forum_id, secret = await _forum_with_token(store, "failing stream", "failing-stream")
    finally:
        await store.close()
    # A quiet stream reads the forum's head soon, and that read fails: the store is away.
    monkeypatch.setattr(stream_module, "IDLE_SECONDS", 0.3)
    async with (
        httpx.AsyncClient(base_url=url, timeout=30) as http,
        _stream(http, forum_id, secret) as response,
    ):
        assert response.status_code == 200
        chunks = response.aiter_bytes()
        assert (await anext(chunks)).startswith(b"retry:")
        assert state.hub.watching(forum_id) == 1

        async def store_away(conversation_id: str) -> int:
            raise AutoReconnect("connection refused (the test's store outage)")

        monkeypatch.setattr(state.store, "last_seq", store_away)
        # The stream ends (how the client sees it, a clean end or a cut, is uvicorn's).
        with contextlib.suppress(httpx.HTTPError):
            async for _ in chunks:
                pass

    async def let_go() -> bool:
        return state.hub.watching(forum_id) == 0

    await eventually(let_go, timeout=10, what="the failed stream to unsubscribe its forum")


async def test_a_revoked_token_stream_ends_and_sends_nothing_more(
    gateway_app: tuple[FastAPI, str], mongodb_url: str, amqp_url: str
) -> None:
    """``yoke token revoke`` takes effect at once: an open stream of that token gets no line
    posted after it, and ends."""
    _, url = gateway_app
    store = Store(mongodb_url)
    bus = Bus(amqp_url, name="test-revoke")
    await bus.connect()
    try:
        forum_id, secret = await _forum_with_token(store, "revoked stream", "revoked-stream")
        poster = Poster(store, bus, "test")
        async with (
            httpx.AsyncClient(base_url=url, timeout=30) as http,
            _stream(http, forum_id, secret) as response,
        ):
            assert response.status_code == 200
            chunks = response.aiter_bytes()
            assert (await anext(chunks)).startswith(b"retry:")
            assert await revoke_token(store, "revoked-stream")
            await asyncio.sleep(1.5)  # any re-check of the token may be a second old
            await poster.post(
                Message(
                    id=new_id(),
                    conversation_id=forum_id,
                    author_actor_id="someone",
                    parts=[TextPart(text="after the revoke")],
                )
            )
            received = b""
            with contextlib.suppress(httpx.HTTPError, TimeoutError):
                async with asyncio.timeout(20):
                    async for chunk in chunks:
                        received += chunk
            assert b"after the revoke" not in received
            assert response.is_stream_consumed, "the stream of a revoked token stays open"
    finally:
        await bus.close()
        await store.close()


async def test_a_stream_its_client_closes_unbinds_its_forum(
    gateway_app: tuple[FastAPI, str], mongodb_url: str, amqp_url: str, servers: tuple[str, str, str]
) -> None:
    """The usual end of a stream (the client goes) drops the forum's bindings too."""
    app, url = gateway_app
    state: Gateway = app.state.gateway
    store = Store(mongodb_url)
    bus = Bus(amqp_url, name="test-close")
    await bus.connect()
    parts = urlsplit(amqp_url)
    vhost = parts.path[1:]
    bindings_path = f"/api/queues/{vhost}/{quote(state.hub.queue_name, safe='')}/bindings"

    async def forum_keys(forum_id: str) -> list[str]:
        async with httpx.AsyncClient(
            base_url=servers[2], auth=(parts.username or "guest", parts.password or "guest")
        ) as api:
            found = (await api.get(bindings_path)).json()
        return [b["routing_key"] for b in found if forum_id in b["routing_key"]]

    try:
        forum_id, secret = await _forum_with_token(store, "closed stream", "closed-stream")
        poster = Poster(store, bus, "test")
        for turn in range(3):
            async with (
                httpx.AsyncClient(base_url=url, timeout=30) as http,
                _stream(http, forum_id, secret) as response,
            ):
                # Held until the block ends: an iterator dropped after its first chunk closes
                # the connection as it is collected (httpx's stream), and the gateway then
                # unbinds while the bindings below are read as those of an open stream.
                chunks = response.aiter_bytes()
                assert (await anext(chunks)).startswith(b"retry:")
                text = f"line {turn} of the closed stream"
                await poster.post(
                    Message(
                        id=new_id(),
                        conversation_id=forum_id,
                        author_actor_id="someone",
                        parts=[TextPart(text=text)],
                    )
                )
                received = b""
                async with asyncio.timeout(30):
                    async for chunk in chunks:
                        received += chunk
                        if text.encode() in received:
                            break
                # The stream is open (it has just sent the line): its forum is bound.
                assert len(await forum_keys(forum_id)) == len(stream_module.STREAMED_EVENTS)
    finally:
        await bus.close()
        await store.close()

    async def unbound() -> bool:
        return state.hub.watching(forum_id) == 0 and not await forum_keys(forum_id)

    await eventually(unbound, timeout=15, what="the closed streams to unbind their forum")


async def test_a_subscribe_cancelled_while_it_binds_leaves_its_forum_unbound() -> None:
    """A stream cancelled while its forum's bind is under way (an A2A caller that goes while
    its turn's stream opens) must not leave the bindings that bind makes: the bind is never
    cancelled (an AMQP call cut short closes the channel), so it is undone once it is done."""
    hub = stream_module.Hub("amqp://unused")
    bound: set[str] = set()
    release, late_bind_done = asyncio.Event(), asyncio.Event()

    async def slow_bind(forum_id: str, *, bind: bool) -> None:
        if bind:
            await release.wait()
            bound.add(forum_id)
            late_bind_done.set()
        else:
            bound.discard(forum_id)

    hub._bind = slow_bind  # type: ignore[method-assign]

    async def open_stream() -> None:
        async with hub.subscribe("forum-1", bind_timeout=30):
            raise AssertionError("the subscription opened though its stream was cancelled")

    opening = asyncio.create_task(open_stream())

    async def binding() -> bool:
        return "forum-1" in hub._binding

    await eventually(binding, timeout=5, what="the subscribe to wait for its bind")
    opening.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await opening
    release.set()  # the bind the cancelled stream started completes after it went
    async with asyncio.timeout(5):
        await late_bind_done.wait()

    async def unbound() -> bool:
        return not hub._binding and "forum-1" not in bound

    await eventually(unbound, timeout=5, what="the late bind to be undone")
    assert hub.watching("forum-1") == 0


async def test_a_stream_cancelled_while_its_forum_unbinds_leaves_its_forum_unbound() -> None:
    """The last stream of a forum leaving is cancelled as it unbinds (an A2A turn's follower is
    cancelled as soon as the turn's end has reached it; an MCP call at its deadline): the
    unbind must still finish, or the forum stays bound for as long as the gateway runs."""
    hub = stream_module.Hub("amqp://unused")
    bound: set[str] = set()
    unbinding, release = asyncio.Event(), asyncio.Event()

    async def slow_unbind(forum_id: str, *, bind: bool) -> None:
        if bind:
            bound.add(forum_id)
            return
        unbinding.set()
        await release.wait()
        bound.discard(forum_id)

    hub._bind = slow_unbind  # type: ignore[method-assign]
    opened = asyncio.Event()

    async def stream() -> None:
        async with hub.subscribe("forum-1"):
            opened.set()

    following = asyncio.create_task(stream())
    async with asyncio.timeout(5):
        await opened.wait()
        await unbinding.wait()  # the stream has ended and its forum is being unbound
    following.cancel()  # (before: its leave was still unbinding, and the cancel cut it)
    with contextlib.suppress(asyncio.CancelledError):
        await following
    release.set()

    async def unbound() -> bool:
        return not hub._binding and "forum-1" not in bound

    await eventually(unbound, timeout=5, what="the forum's unbind to finish")
    assert hub.watching("forum-1") == 0


async def test_a_stream_cancelled_while_it_waits_to_leave_is_forgotten_and_unbinds() -> None:
    """A stream cancelled while it waits for its forum's lock to leave (another stream of the
    forum is binding) is still removed from the forum's watchers, and the forum unbound."""
    hub = stream_module.Hub("amqp://unused")
    bound: set[str] = set()
    release = asyncio.Event()

    async def bind(forum_id: str, *, bind: bool) -> None:
        if bind:
            bound.add(forum_id)
        else:
            bound.discard(forum_id)

    hub._bind = bind  # type: ignore[method-assign]
    opened = asyncio.Event()

    async def stream() -> None:
        async with hub.subscribe("forum-1"):
            opened.set()
            await release.wait()

    following = asyncio.create_task(stream())
    async with asyncio.timeout(5):
        await opened.wait()
    async with hub._forum_lock("forum-1"):  # the lock is held (another stream's bind)
        release.set()
        await asyncio.sleep(0)  # the stream ends and waits for the lock to leave
        await asyncio.sleep(0)
        following.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await following

    async def unbound() -> bool:
        return hub.watching("forum-1") == 0 and "forum-1" not in bound and not hub._binding

    await eventually(unbound, timeout=5, what="the cancelled stream to leave and unbind")

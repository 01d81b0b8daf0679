"""The gateway cannot be exhausted (invariant 14): a real gateway process with small limits,
reached over real sockets, its broker connection through a TCP proxy the test may freeze.

Connections past the limit get 503 at once; half a request line, a stalled body or a stalled
second request on a kept-alive connection is closed within the header timeout; a token opens
only so many streams; a stream whose reader stalls is closed with a final event saying why; a
page of lines stops at the response limit; a bad token costs no store read; and a broker that
stops reading (what a memory or disk alarm does) makes a POST answer 503 with Retry-After and a
stream's bind answer 503, without holding streams of other forums.

Why a frozen proxy for the broker's alarm: ``rabbitmqctl set_vm_memory_high_watermark`` is global
to the shared broker (every other run would block too), and a vhost or queue limit refuses a
publish at once rather than holding it. A SIGSTOPped proxy does to the gateway what an alarm
does: the broker's side stops reading, and no confirm or bind-ok comes back.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import httpx
import pytest

from tests.support.gateway_process import metric, running_gateway
from tests.support.processes import eventually, free_port
from tests.support.raw_http import exchange, request_bytes
from tests.support.tcp_proxy import ProxyProcess
from yoke.core.ids import new_id
from yoke.core.models import Message, TextPart
from yoke.runtime.joins import create_forum
from yoke.runtime.posting import Poster
from yoke.store.database import Store
from yoke.store.tokens import create_token, ensure_token_indexes

pytestmark = pytest.mark.slow

MAX_CONNECTIONS = 8
HEADER_TIMEOUT = 1.5
STREAMS_PER_TOKEN = 2
BUFFER_BYTES = 1 << 18
MAX_RESPONSE_BYTES = 1 << 18
PUBLISH_TIMEOUT = 1.0
BIND_TIMEOUT = 1.5
# What a bound may overrun by on a shared 2-core machine.
SLACK = 1.5
BIG_TEXT = "x" * 60_000


def through(amqp_url: str, port: int) -> str:
    parts = urlsplit(amqp_url)
    auth = parts.netloc.rsplit("@", 1)[0]
    return urlunsplit(parts._replace(netloc=f"{auth}@127.0.0.1:{port}"))


@pytest.fixture(scope="module")
def broker_proxy(amqp_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProxyProcess]:
    target = urlsplit(amqp_url)
    log = Path(tmp_path_factory.mktemp("broker-proxy")) / "proxy.log"
    proxy = ProxyProcess(target.hostname or "127.0.0.1", target.port or 5672, free_port(), log)
    proxy.start()
    yield proxy
    proxy.kill()


@pytest.fixture(scope="module")
async def gateway_url(
    amqp_url: str,
    module_mongodb_url: str,
    poster: Poster,  # its bus declares the exchanges the gateway reads
    broker_proxy: ProxyProcess,
    tmp_path_factory: pytest.TempPathFactory,
) -> AsyncIterator[str]:
    log_dir = Path(tmp_path_factory.mktemp("limited-gateway"))
    async with running_gateway(
        through(amqp_url, broker_proxy.port),
        module_mongodb_url,
        log_dir,
        YOKE_GATEWAY_MAX_CONNECTIONS=str(MAX_CONNECTIONS),
        YOKE_GATEWAY_HEADER_TIMEOUT_SECONDS=str(HEADER_TIMEOUT),
        YOKE_GATEWAY_STREAMS_PER_TOKEN=str(STREAMS_PER_TOKEN),
        YOKE_GATEWAY_STREAM_BUFFER_BYTES=str(BUFFER_BYTES),
        YOKE_GATEWAY_MAX_RESPONSE_BYTES=str(MAX_RESPONSE_BYTES),
        YOKE_GATEWAY_PUBLISH_TIMEOUT_SECONDS=str(PUBLISH_TIMEOUT),
        YOKE_GATEWAY_SUBMIT_TIMEOUT_SECONDS="1",
        YOKE_GATEWAY_BIND_TIMEOUT_SECONDS=str(BIND_TIMEOUT),
    ) as url:
        yield url


def port_of(url: str) -> int:
    return urlsplit(url).port or 0


async def forum_and_token(store: Store, title: str) -> tuple[str, str]:
    """A new forum and a new token scoped to it."""
    await ensure_token_indexes(store)
    forum = await create_forum(store, title)
    _, secret = await create_token(store, f"t{new_id()[:12]}", [forum.id])
    return forum.id, secret


async def another_token(store: Store, forum_id: str) -> str:
    _, secret = await create_token(store, f"t{new_id()[:12]}", [forum_id])
    return secret


def bearer(secret: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}"}


async def closed_within(reader: asyncio.StreamReader, seconds: float) -> float:
    """Seconds until the server ends the connection (fails past ``seconds``)."""
    started = time.monotonic()
    async with asyncio.timeout(seconds):
        with contextlib.suppress(ConnectionError):
            while await reader.read(65536):
                pass
    return time.monotonic() - started


# --- connections and slow requests ------------------------------------------------------


async def test_connections_past_the_limit_get_503_at_once(gateway_url: str) -> None:
    port = port_of(gateway_url)
    held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(MAX_CONNECTIONS)]
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        # Answered before it sends anything (so not by the header timeout: it is longer).
        async with asyncio.timeout(HEADER_TIMEOUT * 0.6):
            answer = await reader.readuntil(b"}")
        writer.close()
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 503"), answer
        assert b"retry-after:" in head.lower() and b'"error"' in body, answer
    finally:
        for _, held_writer in held:
            held_writer.close()

    async def serving() -> bool:
        with contextlib.suppress(httpx.HTTPError):
            async with httpx.AsyncClient(timeout=5) as http:
                return (await http.get(f"{gateway_url}/healthz")).status_code == 200
        return False

    await eventually(serving, timeout=10, what="the gateway to serve again")
    assert await metric(gateway_url, "yoke_gateway_refusals_total", reason="connections") >= 1


async def test_half_a_request_line_is_closed_within_the_header_timeout(gateway_url: str) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port_of(gateway_url))
    writer.write(b"GET /healthz HT")
    await writer.drain()
    assert await closed_within(reader, HEADER_TIMEOUT + SLACK) >= HEADER_TIMEOUT * 0.5
    writer.close()
    assert await metric(gateway_url, "yoke_gateway_refusals_total", reason="header_timeout") >= 1


async def test_a_stalled_second_request_on_a_kept_alive_connection_is_closed(
    gateway_url: str,
) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port_of(gateway_url))
    writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
    await writer.drain()
    async with asyncio.timeout(5):
        first = await reader.readuntil(b"ok\n")
    assert first.startswith(b"HTTP/1.1 200")
    writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")  # and never the blank line
    await writer.drain()
    await closed_within(reader, HEADER_TIMEOUT + SLACK)
    writer.close()


async def test_a_stalled_body_is_answered_408_within_the_header_timeout(
    gateway_url: str, store: Store
) -> None:
    forum_id, secret = await forum_and_token(store, "stalled body")
    head = request_bytes(
        "POST",
        f"/v1/forums/{forum_id}/messages",
        [
            ("Authorization", f"Bearer {secret}"),
            ("Content-Type", "application/json"),
            ("Content-Length", "100"),
        ],
    )
    started = time.monotonic()
    response = await exchange(
        port_of(gateway_url), head + b'{"author":', timeout=HEADER_TIMEOUT * 3
    )
    assert time.monotonic() - started <= HEADER_TIMEOUT + SLACK
    assert response.status == 408 and response.json()["code"] == "body_timeout", response


# --- streams ----------------------------------------------------------------------------


async def test_a_token_opens_only_so_many_streams(gateway_url: str, store: Store) -> None:
    forum_id, secret = await forum_and_token(store, "streams per token")
    path = f"/v1/forums/{forum_id}/stream"
    async with (
        contextlib.AsyncExitStack() as streams,
        httpx.AsyncClient(base_url=gateway_url, timeout=10) as http,
    ):
        for _ in range(STREAMS_PER_TOKEN):
            opened = await streams.enter_async_context(
                http.stream("GET", path, headers=bearer(secret))
            )
            assert opened.status_code == 200
        refused = await http.get(path, headers=bearer(secret))
        assert refused.status_code == 429, refused.text
        assert refused.json()["code"] == "too_many_streams" and refused.json()["error"]
        assert "retry-after" in refused.headers
        other = await another_token(store, forum_id)
        async with http.stream("GET", path, headers=bearer(other)) as allowed:
            assert allowed.status_code == 200
    # Its streams closed, the token may open one again.
    async with httpx.AsyncClient(base_url=gateway_url, timeout=10) as http:

        async def opens() -> bool:
            async with http.stream("GET", path, headers=bearer(secret)) as again:
                return again.status_code == 200

        await eventually(opens, timeout=10, what="the token's streams to be released")
    assert await metric(gateway_url, "yoke_gateway_refusals_total", reason="streams_per_token") >= 1


def _events(raw: bytes) -> list[tuple[str, str, str | None]]:
    """(event, data, id) of every complete event in an SSE body."""
    found = []
    for block in raw.split(b"\n\n"):
        fields: dict[str, str] = {}
        for line in block.decode().split("\n"):
            name, _, value = line.partition(": ")
            if name in ("event", "data", "id"):
                fields[name] = value
        if "event" in fields:
            found.append((fields["event"], fields.get("data", ""), fields.get("id")))
    return found


async def test_a_stream_whose_reader_stalls_is_closed_with_a_final_event(
    gateway_url: str, store: Store, poster: Poster
) -> None:
    forum_id, secret = await forum_and_token(store, "slow reader")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port_of(gateway_url)))
    sock.setblocking(False)
    reader, writer = await asyncio.open_connection(sock=sock)
    writer.write(
        request_bytes(
            "GET", f"/v1/forums/{forum_id}/stream", [("Authorization", f"Bearer {secret}")]
        )
    )
    await writer.drain()
    async with asyncio.timeout(10):
        head = await reader.readuntil(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head
    # The client reads nothing more while lines go out, until the stream's buffer overflows:
    # past what the sockets' buffers hold (a loopback connection's may grow past a megabyte).
    overflows = await metric(gateway_url, "yoke_gateway_refusals_total", reason="slow_reader")
    lines = 0
    while await metric(gateway_url, "yoke_gateway_refusals_total", reason="slow_reader") == (
        overflows
    ):
        assert lines < 300, "300 lines of 60 kB and the stream still holds them all"
        for _ in range(10):
            text_part = TextPart(text=BIG_TEXT)
            await poster.post(
                Message(
                    id=new_id(), conversation_id=forum_id, author_actor_id="a", parts=[text_part]
                )
            )
        lines += 10
    body = b""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(30):
            while chunk := await reader.read(1 << 20):  # to the end: the server closes it
                body += chunk
    writer.close()
    events = _events(body)
    assert events and events[-1][0] == "closed", (len(events), [e[0] for e in events[-3:]])
    assert '"code":"slow_reader"' in events[-1][1] and '"error"' in events[-1][1]
    seqs = [int(seq) for name, _, seq in events if name == "message" and seq is not None]
    assert seqs == list(range(1, len(seqs) + 1)) and len(seqs) < lines
    # Reconnecting with Last-Event-ID resumes right after the last line it had.
    async with httpx.AsyncClient(base_url=gateway_url, timeout=10) as http:
        headers = {**bearer(secret), "Last-Event-ID": str(seqs[-1] if seqs else 0)}
        async with http.stream("GET", f"/v1/forums/{forum_id}/stream", headers=headers) as again:
            received = b""
            async with asyncio.timeout(10):
                async for chunk in again.aiter_bytes():
                    received += chunk
                    if b"\n\n" in received.partition(b"event: message")[2]:
                        break
    resumed = [seq for name, _, seq in _events(received) if name == "message"]
    assert resumed[0] == str((seqs[-1] if seqs else 0) + 1)
    assert await metric(gateway_url, "yoke_gateway_refusals_total", reason="slow_reader") >= 1


# --- responses and tokens ---------------------------------------------------------------


async def test_a_page_of_lines_stops_at_the_response_limit(
    gateway_url: str, store: Store, poster: Poster
) -> None:
    forum_id, secret = await forum_and_token(store, "big page")
    for _ in range(10):
        line = Message(
            id=new_id(),
            conversation_id=forum_id,
            author_actor_id="a",
            parts=[TextPart(text=BIG_TEXT)],
        )
        await poster.post(line)
    path = f"/v1/forums/{forum_id}/messages"
    async with httpx.AsyncClient(base_url=gateway_url, timeout=10) as http:
        seen: list[int] = []
        while len(seen) < 10:
            page = await http.get(
                path, params={"after": seen[-1] if seen else 0, "limit": 10}, headers=bearer(secret)
            )
            assert page.status_code == 200 and len(page.content) <= MAX_RESPONSE_BYTES
            got = [line["seq"] for line in page.json()["messages"]]
            assert got, "a page that has lines after it holds at least one"
            seen += got
    assert seen == list(range(1, 11))
    assert await metric(gateway_url, "yoke_gateway_refusals_total", reason="page_trimmed") >= 1


async def _gateway_finds(url: str) -> float:
    total = 0.0
    for origin in ("background", "delivery"):
        total += await metric(
            url, "yoke_store_operations_total", command="find", origin=origin, service="gateway"
        )
    return total


async def test_bad_tokens_cost_no_store_reads(gateway_url: str, store: Store) -> None:
    forum_id, _ = await forum_and_token(store, "bad tokens")
    path = f"/v1/forums/{forum_id}/messages"
    unknown = "yoke_" + "A" * 43  # well-formed, never made
    malformed = ["yoke_short", "yoke_" + "!" * 43, "x" * 48, "yoke_" + "A" * 44]
    before = await _gateway_finds(gateway_url)
    async with httpx.AsyncClient(base_url=gateway_url, timeout=10) as http:
        for index in range(100):
            secret = unknown if index % 2 else malformed[index % len(malformed)]
            response = await http.get(path, headers=bearer(secret))
            assert response.status_code == 401 and response.json()["code"] == "unauthorized"
    # One read learns the well-formed token is unknown; the rest are answered from memory (the
    # allowance is for the gateway's own background reads meanwhile).
    assert await _gateway_finds(gateway_url) - before <= 10


# --- a broker that stops reading ---------------------------------------------------------


async def test_a_broker_that_stops_reading_gets_503s_and_holds_no_other_forum(
    gateway_url: str, store: Store, broker_proxy: ProxyProcess
) -> None:
    quiet_forum, quiet_secret = await forum_and_token(store, "watched before the alarm")
    new_forum, new_secret = await forum_and_token(store, "watched during the alarm")
    async with httpx.AsyncClient(base_url=gateway_url, timeout=15) as http:
        watched = f"/v1/forums/{quiet_forum}/stream"
        async with http.stream("GET", watched, headers=bearer(quiet_secret)) as first:
            assert first.status_code == 200
            broker_proxy.freeze()
            try:
                started = time.monotonic()
                posted = await http.post(
                    f"/v1/forums/{new_forum}/messages",
                    json={"author": {"externalId": "ada", "displayName": "Ada"}, "text": "hi"},
                    headers=bearer(new_secret),
                )
                assert posted.status_code == 503, posted.text
                assert posted.json()["error"] and "retry-after" in posted.headers
                assert time.monotonic() - started <= PUBLISH_TIMEOUT + 1 + SLACK

                # A new forum's stream waits for its bind, and answers 503 at its bound ...
                binding = asyncio.create_task(
                    http.get(f"/v1/forums/{new_forum}/stream", headers=bearer(new_secret))
                )
                done, _ = await asyncio.wait({binding}, timeout=0.5)
                assert not done, "the bind cannot have finished: the broker reads nothing"
                # ... while a forum already bound opens another stream at once.
                opened_at = time.monotonic()
                second_secret = await another_token(store, quiet_forum)
                async with http.stream("GET", watched, headers=bearer(second_secret)) as second:
                    assert second.status_code == 200
                    assert time.monotonic() - opened_at < BIND_TIMEOUT
                refused = await binding
                assert refused.status_code == 503 and refused.json()["error"], refused.text
                assert time.monotonic() - started <= PUBLISH_TIMEOUT + BIND_TIMEOUT + 3 * SLACK
            finally:
                broker_proxy.thaw()

        async def streams_again() -> bool:
            stream_path = f"/v1/forums/{new_forum}/stream"
            async with http.stream("GET", stream_path, headers=bearer(new_secret)) as again:
                return again.status_code == 200

        await eventually(streams_again, timeout=20, what="streams to open after the alarm")
    assert await metric(gateway_url, "yoke_gateway_refusals_total", reason="publish_timeout") >= 1
    assert await metric(gateway_url, "yoke_gateway_refusals_total", reason="bind_timeout") >= 1

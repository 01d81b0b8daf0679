"""What keeps one gateway process from being exhausted (docs/architecture.md, invariant 14).

uvicorn bounds neither the connections it holds nor how long a request's head may take (a
client that sends half a request line holds its socket for ever), and answers what h11 cannot
parse in plain text. :func:`gateway_protocol` is its h11 protocol with those bounds, every
refusal a JSON ``{"error", "code"}`` as the API's own. The rest of the limits (streams per
token, a stream's buffer, a response's bytes, publish and bind timeouts) are where they apply,
and every one counts its refusals in :data:`REFUSALS`.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections import OrderedDict

import h11
from prometheus_client import Counter
from uvicorn.protocols.http.h11_impl import H11Protocol

from yoke.store.tokens import SECRET_PREFIX

REFUSALS = Counter(
    "yoke_gateway_refusals",
    "Connections, requests and streams a gateway limit refused, cut short or ended, by reason",
    ["reason"],
)
REFUSAL_REASONS = (
    "connections",
    "header_timeout",
    "header_bytes",
    "body_timeout",
    "client_disconnect",
    "bad_request",
    "invalid_token",
    "streams_per_token",
    "slow_reader",
    "page_trimmed",
    "publish_timeout",
    "bind_timeout",
)
for _reason in REFUSAL_REASONS:
    REFUSALS.labels(_reason)

# A request's head (request line and headers) past this is refused (431); h11's own limit holds
# only while the head is incomplete.
MAX_HEADER_BYTES = 16384
# How long a refused connection is read (and the bytes dropped) before it is closed: closed with
# its request unread, it would be reset, and the client would not read the 503.
REFUSED_LINGER_SECONDS = 1.0
# A token's secret as ``yoke token create`` makes it (yoke.store.tokens: the prefix, then 32 random
# bytes in URL-safe base64): anything else is unknown without a store read.
TOKEN_PATTERN = re.compile(re.escape(SECRET_PREFIX) + r"[A-Za-z0-9_-]{43}")


def raw_error(status: int, code: str, error: str, headers: dict[str, str] | None = None) -> bytes:
    """A whole HTTP/1.1 answer, closing the connection, for where no ASGI response can go."""
    body = json.dumps({"error": error, "code": code}).encode()
    lines = [
        f"HTTP/1.1 {status} {h11_reason(status)}",
        "content-type: application/json",
        f"content-length: {len(body)}",
        "connection: close",
        *(f"{name}: {value}" for name, value in (headers or {}).items()),
    ]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def h11_reason(status: int) -> str:
    return {400: "Bad Request", 408: "Request Timeout", 503: "Service Unavailable"}.get(
        status, "Error"
    )


def gateway_protocol(
    max_connections: int, header_timeout: float, retry_after: int
) -> type[H11Protocol]:
    """uvicorn's h11 protocol, bounded: past ``max_connections`` open ones a new connection gets
    503 at once; a request's head must arrive whole within ``header_timeout`` seconds of the
    connection or of the previous answer; a request h11 refuses gets a JSON 400."""

    class GatewayProtocol(H11Protocol):
        _refused = False
        _head_deadline: asyncio.TimerHandle | None = None
        _head_started = False

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if len(self.connections) > max_connections:
                self._refused = True
                self.connections.discard(self)
                REFUSALS.labels("connections").inc()
                error = f"the gateway holds {max_connections} connections; try again"
                transport.write(
                    raw_error(503, "too_many_connections", error, {"retry-after": str(retry_after)})
                )
                self.loop.call_later(REFUSED_LINGER_SECONDS, transport.close)
                return
            self._arm()

        def data_received(self, data: bytes) -> None:
            if self._refused:
                return
            if self._head_deadline is not None:
                self._head_started = True
            super().data_received(data)

        def handle_events(self) -> None:
            super().handle_events()
            if self.conn.their_state is not h11.IDLE:
                self._disarm()  # the head is in (or the connection is done)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
                self._arm()  # the next request's head has the same bound

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def send_400_response(self, msg: str) -> None:
            REFUSALS.labels("bad_request").inc()
            self.transport.write(raw_error(400, "invalid_request", f"invalid HTTP request: {msg}"))
            self.transport.close()

        def _arm(self) -> None:
            self._disarm()
            self._head_started = False
            self._head_deadline = self.loop.call_later(header_timeout, self._head_too_slow)

        def _disarm(self) -> None:
            if self._head_deadline is not None:
                self._head_deadline.cancel()
                self._head_deadline = None

        def _head_too_slow(self) -> None:
            self._head_deadline = None
            if self.transport.is_closing():
                return
            if self._head_started:  # an idle kept-alive connection just ends
                REFUSALS.labels("header_timeout").inc()
            self.transport.close()

    return GatewayProtocol


class UnknownSecrets:
    """Hashes of secrets recently found to be no token's, so that a flood of one bad token costs
    one store read. Bounded in size (the oldest forgotten first) and in time (a secret made
    later is found: no secret exists before ``yoke token create`` makes it, so this is only a
    safety net)."""

    def __init__(self, size: int = 10_000, seconds: float = 60.0) -> None:
        self.size = size
        self.seconds = seconds
        self._until: OrderedDict[str, float] = OrderedDict()

    def __contains__(self, digest: str) -> bool:
        until = self._until.get(digest)
        if until is None:
            return False
        if until < time.monotonic():
            del self._until[digest]
            return False
        return True

    def add(self, digest: str) -> None:
        self._until[digest] = time.monotonic() + self.seconds
        self._until.move_to_end(digest)
        while len(self._until) > self.size:
            self._until.popitem(last=False)

"""HTTP/1.1 over a bare socket: requests no HTTP client library would send (bad bytes, bad
framing, half a request line), and the server's answer exactly as it came."""

from __future__ import annotations

import asyncio
import contextlib
import json
from dataclasses import dataclass, field
from typing import Any


@dataclass
class RawResponse:
    status: int
    headers: dict[str, str]
    body: bytes = b""
    extra: dict[str, Any] = field(default_factory=dict)

    def json(self) -> Any:
        return json.loads(self.body)


def request_bytes(
    method: str,
    target: bytes | str,
    headers: list[tuple[str, bytes | str]],
    body: bytes | None = None,
    *,
    content_length: bool = True,
) -> bytes:
    """A request with ``Host`` and ``Connection: close`` (so the answer ends with the
    connection), and ``Content-Length`` for a body unless told not to."""
    raw_target = target.encode() if isinstance(target, str) else target
    lines = [method.encode() + b" " + raw_target + b" HTTP/1.1", b"Host: 127.0.0.1"]
    names = {name.lower() for name, _ in headers}
    for name, value in headers:
        lines.append(name.encode() + b": " + (value.encode() if isinstance(value, str) else value))
    if "connection" not in names:
        lines.append(b"Connection: close")
    if body is not None and content_length and "content-length" not in names:
        lines.append(b"Content-Length: " + str(len(body)).encode())
    return b"\r\n".join(lines) + b"\r\n\r\n" + (body or b"")


async def exchange(port: int, request: bytes, *, timeout: float = 15) -> RawResponse:
    """Send ``request`` and read the answer: up to the end of the connection, or only the head
    of an event stream (which does not end)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        async with asyncio.timeout(timeout):
            writer.write(request)
            await writer.drain()
            head = await reader.readuntil(b"\r\n\r\n")
            status_line, *header_lines = head.decode("latin-1").split("\r\n")
            headers = {}
            for line in header_lines:
                if line:
                    name, _, value = line.partition(":")
                    headers[name.strip().lower()] = value.strip()
            response = RawResponse(int(status_line.split()[1]), headers)
            if headers.get("content-type", "").startswith("text/event-stream"):
                return response
            if "content-length" in headers:
                response.body = await reader.readexactly(int(headers["content-length"]))
            else:
                response.body = await reader.read()
            return response
    finally:
        writer.close()
        with contextlib.suppress(Exception):
            await writer.wait_closed()

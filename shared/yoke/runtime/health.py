"""``/healthz`` and ``/metrics`` on a service's metrics port, served by asyncio itself."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from yoke.core.metrics import exposition
from yoke.core.redact import redact

# What keeps the process from serving: an empty list means healthy.
HealthCheck = Callable[[], Awaitable[list[str]]]


class HealthServer:
    """A tiny HTTP/1.1 responder: enough for Prometheus scrapes and container health checks."""

    def __init__(self, port: int, healthy: HealthCheck, host: str = "127.0.0.1") -> None:
        self.port = port
        self.host = host
        self.healthy = healthy
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, self.host, self.port)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with asyncio.timeout(10):
                request = await reader.readline()
                accept: str | None = None
                while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
                    name, _, value = line.decode("latin-1").partition(":")
                    if name.strip().lower() == "accept":
                        accept = value.strip()
            parts = request.decode("latin-1").split()
            path = parts[1].split("?")[0] if len(parts) > 1 else "/"
            if path == "/metrics":
                # OpenMetrics when the scraper asks (Prometheus does): it carries exemplars.
                body, content_type = exposition(accept)
                status = 200
            elif path == "/healthz":
                problems = await self.healthy()
                status, content_type = (503 if problems else 200), "text/plain"
                # Reasons quote errors, and errors may quote connection URLs.
                body = redact("".join(f"{p}\n" for p in problems) or "ok\n").encode()
            else:
                status, content_type, body = 404, "text/plain", b"not found\n"
            reason = {200: "OK", 404: "Not Found", 503: "Service Unavailable"}[status]
            writer.write(
                f"HTTP/1.1 {status} {reason}\r\nContent-Type: {content_type}\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
                + body
            )
            await writer.drain()
        except (TimeoutError, ConnectionError):
            pass
        finally:
            writer.close()

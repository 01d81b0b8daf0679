"""A real HTTP server for webhook tests: records every POST and answers as each path is told.

It runs in the test's event loop on 127.0.0.1, or another loopback address given (the gateway,
a separate process, POSTs to it over TCP). Per path: a list of statuses to answer in turn, then
a default; or ``hang``, which takes the request and never answers until the receiver closes.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Received:
    """One request as it arrived, and the status it was answered (None: left hanging)."""

    path: str
    headers: dict[str, str]
    body: bytes
    at: float
    status: int | None = None

    @property
    def json(self) -> dict[str, Any]:
        data = json.loads(self.body)
        assert isinstance(data, dict)
        return data

    @property
    def delivery_id(self) -> str:
        return self.headers["x-yoke-delivery"]

    @property
    def text(self) -> str:
        parts = self.json["message"]["parts"]
        return "\n".join(part["text"] for part in parts if part["type"] == "text")


@dataclass
class Path:
    statuses: list[int] = field(default_factory=list)
    default: int = 200
    hang: bool = False


class Receiver:
    def __init__(self, host: str = "127.0.0.1") -> None:
        self.host = host
        self.requests: list[Received] = []
        self.paths: dict[str, Path] = {}
        self.hanging = 0
        self._server: asyncio.Server | None = None
        self._closing = asyncio.Event()
        self.port = 0

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, self.host, 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        self._closing.set()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    def url(self, path: str) -> str:
        return f"http://{self.host}:{self.port}{path}"

    def answer(self, path: str, *statuses: int, then: int = 200) -> None:
        """Answer ``path`` with ``statuses`` in turn, then ``then`` for every later request."""
        self.paths[path] = Path(list(statuses), then)

    def hang(self, path: str) -> None:
        self.paths[path] = Path(hang=True)

    def at(self, path: str) -> list[Received]:
        return [request for request in self.requests if request.path == path]

    def delivered(self, path: str) -> list[Received]:
        return [r for r in self.at(path) if r.status is not None and 200 <= r.status < 300]

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request_line = (await reader.readline()).decode("latin-1").split()
            headers: dict[str, str] = {}
            while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
                name, _, value = line.decode("latin-1").partition(":")
                headers[name.strip().lower()] = value.strip()
            body = await reader.readexactly(int(headers.get("content-length", "0")))
            path = request_line[1] if len(request_line) > 1 else "/"
            received = Received(path, headers, body, time.monotonic())
            self.requests.append(received)
            behaviour = self.paths.setdefault(path, Path())
            if behaviour.hang:
                self.hanging += 1
                try:
                    await self._closing.wait()
                finally:
                    self.hanging -= 1
                return
            status = behaviour.statuses.pop(0) if behaviour.statuses else behaviour.default
            received.status = status
            writer.write(
                f"HTTP/1.1 {status} Test\r\nContent-Length: 0\r\nConnection: close\r\n\r\n".encode()
            )
            await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

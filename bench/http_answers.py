"""Where an agent's answer reaches a system that speaks only HTTP: a forum's open ``/stream``
(Server-Sent Events) and a webhook receiver the gateway POSTs to. Both stamp the answer's
arrival by the line it answers (``meta.inReplyTo``), so a turn posted over HTTP can be timed to
each of them; the stream also stamps the first ``delta`` of each answer's draft.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from typing import Any

import httpx


class Arrivals:
    """Arrival times of answers by the line they answer; one that came before anyone waited
    for it is kept (an answer may beat the POST's own 202)."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.seen: dict[str, float] = {}
        self._waiting: dict[str, asyncio.Future[float]] = {}
        self._ended: str | None = None

    def arrived(self, message: dict[str, Any]) -> None:
        meta: dict[str, Any] = message.get("meta") or {}
        line_id = meta.get("inReplyTo")
        if message.get("role") != "agent" or not line_id:
            return
        self.arrived_for(line_id)

    def arrived_for(self, line_id: str) -> None:
        """Something answering ``line_id`` came now (only the first arrival counts)."""
        at = time.perf_counter()
        self.seen.setdefault(line_id, at)
        future = self._waiting.pop(line_id, None)
        if future is not None and not future.done():
            future.set_result(self.seen[line_id])

    def end(self, reason: str) -> None:
        """No more answers will come (the stream closed): waiters fail at once, not at their
        deadline."""
        self._ended = reason
        for future in self._waiting.values():
            if not future.done():
                future.set_exception(RuntimeError(f"{self.what}: {reason}"))
        self._waiting.clear()

    async def wait(self, line_id: str, patience: float) -> float:
        """When the answer to ``line_id`` arrived (perf_counter seconds)."""
        if line_id in self.seen:
            return self.seen[line_id]
        if self._ended is not None:
            raise RuntimeError(f"{self.what}: {self._ended}")
        future = self._waiting.setdefault(line_id, asyncio.get_running_loop().create_future())
        try:
            async with asyncio.timeout(patience):
                return await future
        except TimeoutError:
            raise RuntimeError(
                f"{self.what}: no answer to line {line_id} within {patience:.0f}s"
            ) from None
        finally:
            self._waiting.pop(line_id, None)

    def forget(self) -> None:
        self.seen.clear()


class StreamReader:
    """One open ``GET /v1/forums/{id}/stream``: its ``message`` events fed to :attr:`answers`,
    its ``delta`` events to :attr:`drafts` (the first of each draft) and counted in
    :attr:`deltas`, both by the line answered."""

    def __init__(self, base_url: str, forum_id: str, token: str) -> None:
        self.path = f"/v1/forums/{forum_id}/stream"
        self.headers = {"Authorization": f"Bearer {token}"}
        # A connection of its own (the stream holds it), never timing out between events.
        self.http = httpx.AsyncClient(base_url=base_url, timeout=httpx.Timeout(30, read=None))
        self.answers = Arrivals("the gateway's stream")
        self.drafts = Arrivals("the gateway's stream (deltas)")
        self.deltas: dict[str, int] = {}
        self._opened = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def open(self, within: float) -> None:
        """Once this returns, the gateway has bound the forum: no later line is missed."""
        self._task = asyncio.create_task(self._read())
        opened = asyncio.create_task(self._opened.wait())
        try:
            done, _ = await asyncio.wait(
                {self._task, opened}, timeout=within, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            opened.cancel()
        if self._task in done:
            self._task.result()  # raises what ended it
            raise RuntimeError("the gateway's stream ended as it opened")
        if not done:
            raise RuntimeError(f"the gateway's stream did not open within {within:.0f}s")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        await self.http.aclose()

    async def _read(self) -> None:
        try:
            async with self.http.stream("GET", self.path, headers=self.headers) as response:
                if response.status_code != 200:
                    body = (await response.aread())[:300]
                    raise RuntimeError(f"GET {self.path}: {response.status_code} {body!r}")
                self._opened.set()
                event, data = "message", ""
                async for line in response.aiter_lines():
                    if line == "":
                        if event == "message" and data:
                            self.answers.arrived(json.loads(data))
                        elif event == "delta" and data:
                            self.draft_arrived(json.loads(data))
                        event, data = "message", ""
                    elif line.startswith("event:"):
                        event = line[6:].strip()
                    elif line.startswith("data:"):
                        data = line[5:].strip()
            self.answers.end("the stream ended")
            self.drafts.end("the stream ended")
        except Exception as error:
            self.answers.end(f"the stream failed: {error!r}")
            self.drafts.end(f"the stream failed: {error!r}")
            raise

    def draft_arrived(self, delta: dict[str, Any]) -> None:
        line_id = delta.get("inReplyTo")
        if line_id:
            self.drafts.arrived_for(line_id)
            self.deltas[line_id] = self.deltas.get(line_id, 0) + 1


class WebhookReceiver:
    """A tiny HTTP/1.1 server on 127.0.0.1 that answers every POST 204 on a kept-alive
    connection (as a receiver behind a proxy would) and feeds each delivery to
    :attr:`answers`."""

    def __init__(self) -> None:
        self.answers = Arrivals("the webhook receiver")
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self.port = 0

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = int(self._server.sockets[0].getsockname()[1])

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/bench-hook"

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            for writer in self._writers:  # kept-alive connections would hold wait_closed
                writer.close()
            await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        try:
            while request := await reader.readline():
                length = 0
                while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
                    name, _, value = line.decode("latin-1").partition(":")
                    if name.strip().lower() == "content-length":
                        length = int(value.strip())
                body = await reader.readexactly(length)
                if request.startswith(b"POST "):
                    self.answers.arrived(json.loads(body).get("message") or {})
                writer.write(b"HTTP/1.1 204 No Content\r\n\r\n")
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError, ValueError):
            pass
        finally:
            self._writers.discard(writer)
            writer.close()

"""The pika tool worker (tests/support/pika_worker.py) as a separate process, read line by line."""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
from typing import Any
from urllib.parse import quote, urlsplit, urlunsplit

from tests.support.processes import ROOT


def as_user(amqp_url: str, user: str, password: str) -> str:
    """``amqp_url`` (host, port, vhost) with another user's name and password."""
    parts = urlsplit(amqp_url)
    netloc = f"{quote(user, safe='')}:{quote(password, safe='')}@{parts.hostname}"
    return urlunsplit(parts._replace(netloc=f"{netloc}:{parts.port or 5672}"))


class WorkerProcess:
    """``python -m tests.support.pika_worker ...``; its JSON lines kept as they are printed."""

    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self.process = process
        self.lines: list[dict[str, Any]] = []
        self.stderr = bytearray()
        self._taken: set[int] = set()
        self._changed = asyncio.Event()
        assert process.stdout is not None and process.stderr is not None
        self._readers = [
            asyncio.ensure_future(self._read_lines(process.stdout)),
            asyncio.ensure_future(self._read_stderr(process.stderr)),
        ]

    @classmethod
    async def start(cls, url: str, tool: str, mode: str, *options: str) -> WorkerProcess:
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "tests.support.pika_worker",
            "--url",
            url,
            "--tool",
            tool,
            "--mode",
            mode,
            *options,
            cwd=ROOT,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        return cls(process)

    async def _read_lines(self, stream: asyncio.StreamReader) -> None:
        async for raw in stream:
            self.lines.append(json.loads(raw))
            self._changed.set()
        self._changed.set()

    async def _read_stderr(self, stream: asyncio.StreamReader) -> None:
        async for raw in stream:
            self.stderr += raw

    async def line(self, event: str, *, timeout: float = 30, **fields: object) -> dict[str, Any]:
        """The first line not taken yet with this ``event`` and these fields (then taken)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            for index, line in enumerate(self.lines):
                if index in self._taken or line.get("event") != event:
                    continue
                if all(line.get(key) == value for key, value in fields.items()):
                    self._taken.add(index)
                    return line
            if self.process.returncode is not None and self._readers[0].done():
                raise AssertionError(
                    f"the worker exited ({self.process.returncode}) without a {event} line "
                    f"{fields}; it printed {self.lines}; stderr: {self.stderr.decode()[-2000:]}"
                )
            left = deadline - loop.time()
            if left <= 0:
                raise AssertionError(
                    f"no {event} line {fields} within {timeout} s; it printed {self.lines}; "
                    f"stderr: {self.stderr.decode()[-2000:]}"
                )
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), min(left, 0.5))

    async def exited(self, timeout: float = 30) -> int:
        """Its exit code, once it has exited and all it printed is read."""
        code = await asyncio.wait_for(self.process.wait(), timeout)
        await asyncio.wait_for(asyncio.gather(*self._readers), timeout)
        return code

    async def stop(self) -> None:
        """SIGTERM (it finishes the call in hand), then SIGKILL if it lingers."""
        if self.process.returncode is None:
            self.process.terminate()
            try:
                await asyncio.wait_for(self.process.wait(), 10)
            except TimeoutError:
                self.process.kill()
                await self.process.wait()
        for reader in self._readers:
            reader.cancel()

    async def kill(self) -> None:
        """SIGKILL at once: whatever it held unacked goes back to the queue."""
        if self.process.returncode is None:
            self.process.kill()
            await self.process.wait()

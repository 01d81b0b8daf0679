"""Running services as real OS processes from tests, and polling with deadlines."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


async def eventually(
    check: Callable[[], Awaitable[bool]], *, timeout: float, what: str, interval: float = 0.1
) -> None:
    """Poll ``check`` until it holds; fail naming ``what`` at the deadline."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not await check():
        if loop.time() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(interval)


class ServiceProcess:
    """A service started with ``python <args>``, its output in a log file."""

    def __init__(self, args: list[str], env: dict[str, str], log_path: Path) -> None:
        self.port = free_port()
        self.log_path = log_path
        full_env = {**os.environ, **env, "YOKE_METRICS_PORT": str(self.port)}
        full_env.setdefault("YOKE_LOG_FORMAT", "json")
        self._log = log_path.open("ab")
        self.popen = subprocess.Popen(
            [sys.executable, *args], env=full_env, cwd=ROOT, stdout=self._log, stderr=self._log
        )

    @property
    def pid(self) -> int:
        return self.popen.pid

    async def healthy(self) -> bool:
        try:
            async with httpx.AsyncClient(timeout=2) as client:
                response = await client.get(f"http://127.0.0.1:{self.port}/healthz")
                return response.status_code == 200
        except httpx.HTTPError:
            return False

    async def wait_healthy(self, timeout: float = 60) -> None:
        async def up() -> bool:
            if self.popen.poll() is not None:
                raise AssertionError(
                    f"process exited with {self.popen.returncode}:\n{self.output()[-3000:]}"
                )
            return await self.healthy()

        await eventually(up, timeout=timeout, what=f"{self.popen.args} to be healthy")

    async def metrics(self) -> str:
        async with httpx.AsyncClient(timeout=5) as client:
            response = await client.get(f"http://127.0.0.1:{self.port}/metrics")
            return response.text

    def output(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def kill(self) -> None:
        self.popen.send_signal(signal.SIGKILL)
        self.popen.wait(10)
        self._log.close()

    def stop(self, timeout: float = 30) -> int:
        """SIGTERM, then wait; returns the exit code (kills it past the timeout)."""
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(10)
        self._log.close()
        return self.popen.returncode

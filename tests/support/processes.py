"""Running services as real OS processes from tests, and polling with deadlines."""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]

# What every new httpx client would build for itself (the CA bundle read into a TLS context: tens
# of milliseconds of CPU), made once: start-up polls ask several times a second, on a machine the
# services starting meanwhile need whole.
_TLS = httpx.create_ssl_context()


def local_http(timeout: float) -> httpx.AsyncClient:
    """A client for the HTTP ports of the processes a test starts."""
    return httpx.AsyncClient(timeout=timeout, verify=_TLS)


# A port handed out is bound by whoever asked only later (often a child process). Under
# pytest-xdist each worker (PYTEST_XDIST_WORKER=gwN) takes ports in turn from a block of its own
# below the kernel's ephemeral range (net.ipv4.ip_local_port_range, 32768-60999 by default): no
# other worker, and no connection's ephemeral source port, can be given the same one meanwhile.
# A lone process (no worker) asks the kernel, as before.
PORT_BLOCKS_START = 20000
PORT_BLOCK_SIZE = 1000
PORT_BLOCKS = 12
_next_in_block = itertools.count()


def _bindable(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def free_port() -> int:
    """A local TCP port nobody listens on, and that no other test process is given."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if not worker.startswith("gw"):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            return int(probe.getsockname()[1])
    start = PORT_BLOCKS_START + int(worker[2:]) % PORT_BLOCKS * PORT_BLOCK_SIZE
    for _ in range(PORT_BLOCK_SIZE):
        port = start + next(_next_in_block) % PORT_BLOCK_SIZE
        if _bindable(port):
            return port
    raise RuntimeError(f"no free port left in {start}-{start + PORT_BLOCK_SIZE - 1}")


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

    async def healthy(self, client: httpx.AsyncClient | None = None) -> bool:
        """``/healthz`` answers 200 (asked with ``client`` when given, which a poll reuses)."""
        try:
            if client is None:
                async with local_http(2) as own:
                    return await self.healthy(own)
            response = await client.get(f"http://127.0.0.1:{self.port}/healthz")
            return response.status_code == 200
        except httpx.HTTPError:
            return False

    async def wait_healthy(self, timeout: float = 60) -> None:
        async with local_http(2) as client:

            async def up() -> bool:
                if self.popen.poll() is not None:
                    raise AssertionError(
                        f"process exited with {self.popen.returncode}:\n{self.output()[-3000:]}"
                    )
                return await self.healthy(client)

            await eventually(up, timeout=timeout, what=f"{self.popen.args} to be healthy")

    async def metrics(self) -> str:
        async with local_http(5) as client:
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

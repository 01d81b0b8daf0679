"""The five services as real OS processes (``python -m services.<name>``), each with a metrics
port of its own, so the bench measures turns through the mesh a deployment runs, and can read
each process's RSS and CPU from ``/proc``. The HTTP gateway starts the same way (its API,
/healthz and /metrics share one port).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx

from bench.cpu import process_cpu
from yoke.cli.supervisor import GATEWAY, SERVICES

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def process_rss(pid: int) -> float:
    """Resident set size of ``pid`` in MB (``VmRSS``), NaN when unreadable."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return math.nan
    for line in status.splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return math.nan


class ServiceProcess:
    """One service, its output in a log file (read back when it fails to start)."""

    def __init__(self, name: str, env: dict[str, str], log_dir: Path, replica: int = 0) -> None:
        self.name = name
        self.replica = replica
        self.port = free_port()
        self.log_path = log_dir / (f"{name}.log" if not replica else f"{name}-{replica}.log")
        self._log = self.log_path.open("ab")
        ports = {"YOKE_METRICS_PORT": str(self.port)}
        if name == GATEWAY:  # no metrics port: /healthz and /metrics are on its API's
            ports |= {"YOKE_GATEWAY_PORT": str(self.port), "YOKE_GATEWAY_HOST": "127.0.0.1"}
        self.popen = subprocess.Popen(
            [sys.executable, "-m", f"services.{name}"],
            env={**env, **ports, "YOKE_REPLICA": str(replica)},
            cwd=ROOT,
            stdout=self._log,
            stderr=self._log,
        )

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def url(self) -> str:
        """Its HTTP port's base URL (the gateway's API; the others' /healthz and /metrics)."""
        return f"http://127.0.0.1:{self.port}"

    def cpu(self) -> float:
        return process_cpu(self.pid)

    def rss(self) -> float:
        return process_rss(self.pid)

    def tail(self, chars: int = 2000) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-chars:]

    async def wait_healthy(self, within: float) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + within
        async with httpx.AsyncClient(timeout=2) as client:
            while True:
                if self.popen.poll() is not None:
                    raise RuntimeError(
                        f"{self.name} exited with {self.popen.returncode}:\n{self.tail()}"
                    )
                with contextlib.suppress(httpx.HTTPError):
                    response = await client.get(f"http://127.0.0.1:{self.port}/healthz")
                    if response.status_code == 200:
                        return
                if loop.time() > deadline:
                    raise RuntimeError(f"{self.name} not healthy within {within:.0f}s")
                await asyncio.sleep(0.2)

    async def shards_owned(self) -> int | None:
        """``yoke_shards_owned`` from its /metrics (None while it does not answer)."""
        try:
            async with httpx.AsyncClient(timeout=2) as client:
                response = await client.get(f"http://127.0.0.1:{self.port}/metrics")
        except httpx.HTTPError:
            return None
        for line in response.text.splitlines():
            if line.startswith("yoke_shards_owned{") and f'service="{self.name}"' in line:
                return int(float(line.rsplit(" ", 1)[1]))
        return None

    def stop(self, timeout: float = 30) -> int:
        """SIGTERM, then SIGKILL past ``timeout``; the exit code."""
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(10)
        self._log.close()
        return self.popen.returncode


class Services:
    """All five, started together and stopped together (even when the run fails)."""

    def __init__(self, env: dict[str, str], log_dir: Path) -> None:
        self.env = env
        self.log_dir = log_dir
        self.processes: dict[str, ServiceProcess] = {}

    async def start(self, within: float) -> None:
        for name in SERVICES:
            self.processes[name] = ServiceProcess(name, self.env, self.log_dir)
        for process in self.processes.values():
            await process.wait_healthy(within)

    def cpu(self) -> dict[str, float]:
        """CPU seconds so far of each service process."""
        return {name: process.cpu() for name, process in self.processes.items()}

    def rss(self) -> dict[str, float]:
        """RSS in MB of each service process now."""
        return {name: process.rss() for name, process in self.processes.items()}

    async def stop(self) -> dict[str, int]:
        loop = asyncio.get_running_loop()
        stops = [loop.run_in_executor(None, process.stop) for process in self.processes.values()]
        codes = await asyncio.gather(*stops)
        return dict(zip(self.processes, codes, strict=True))

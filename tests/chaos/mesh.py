"""The five services under the real supervisor (``yoke up``), as chaos sees them from outside.

Children are found through ``/proc`` (the supervisor's children running ``-m services.<name>``),
health through each one's own metrics port, and their logs in the one file they all share. A
service may run as several replicas; each is known by the supervisor's label (``processor#1``).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import httpx

from tests.chaos.faults import children_of, kill_9
from tests.chaos.up import PORTS_VARIABLE, REPLICAS_VARIABLE, format_ports, labels
from tests.support.processes import ROOT, eventually, free_port
from yoke.cli.supervisor import SERVICES

# The supervisor's own lines when a child starts and dies (``yoke.cli.supervisor``).
STARTED = re.compile(r"^\[yoke up\] started ([\w#]+) \(pid (\d+)\)", re.MULTILINE)
EXITED = re.compile(r"^\[yoke up\] ([\w#]+) exited with (-?\d+)", re.MULTILINE)


class SupervisedMesh:
    def __init__(
        self, env: dict[str, str], log_path: Path, replicas: dict[str, int] | None = None
    ) -> None:
        self.labels = labels(replicas or {})
        self.ports = {label: free_port() for label in self.labels}
        replicas_text = ",".join(f"{name}={count}" for name, count in (replicas or {}).items())
        self.env = {
            **os.environ,
            **env,
            PORTS_VARIABLE: format_ports(self.ports),
            REPLICAS_VARIABLE: replicas_text,
        }
        self.env.pop("YOKE_METRICS_PORT", None)
        self.log_path = log_path
        self.popen: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with self.log_path.open("ab") as log:
            self.popen = subprocess.Popen(
                [sys.executable, "-m", "tests.chaos.up"],
                env=self.env,
                cwd=ROOT,
                stdout=log,
                stderr=subprocess.STDOUT,
            )

    def pids(self) -> dict[str, int]:
        """Label -> pid of each running child: the supervisor says which pid it started as
        which label, /proc which of them still run as its children."""
        assert self.popen is not None
        running = children_of(self.popen.pid)
        labelled: dict[str, int] = {}
        for label, pid in STARTED.findall(self.log_path.read_text(errors="replace")):
            if running.get(int(pid)) == label.split("#")[0]:
                labelled[label] = int(pid)
        return labelled

    async def kill(self, name: str, timeout: float = 60) -> int:
        """``kill -9`` the process of the service (or replica) labelled ``name``, waiting for
        the supervisor to have one."""

        async def running() -> bool:
            return name in self.pids()

        await eventually(running, timeout=timeout, what=f"a running {name} process")
        pid = self.pids()[name]
        kill_9(pid)
        return pid

    async def health(self) -> dict[str, str]:
        """Service name -> what its ``/healthz`` said, for every one that is not 200."""
        bad: dict[str, str] = {}
        async with httpx.AsyncClient(timeout=3) as client:
            for name, port in self.ports.items():
                try:
                    response = await client.get(f"http://127.0.0.1:{port}/healthz")
                except httpx.HTTPError as error:
                    bad[name] = f"no answer on :{port} ({type(error).__name__})"
                    continue
                if response.status_code != 200:
                    bad[name] = f"{response.status_code} {response.text.strip()[:200]}"
        return bad

    async def wait_healthy(self, timeout: float) -> dict[str, str]:
        """Poll until every service answers 200; returns the ones that never did."""
        bad: dict[str, str] = {}

        async def all_healthy() -> bool:
            nonlocal bad
            if self.popen is not None and self.popen.poll() is not None:
                bad = {"yoke up": f"the supervisor exited with {self.popen.returncode}"}
                return True
            bad = await self.health()
            return not bad

        with contextlib.suppress(AssertionError):
            await eventually(all_healthy, timeout=timeout, what="healthy services", interval=0.5)
        return bad

    def log_tail(self, name: str, lines: int = 15) -> str:
        """The service's last log lines (JSON lines name their service; the supervisor's too);
        a replica's label reads its service's lines."""
        name = name.split("#")[0]
        mine = []
        for raw in self.log_path.read_text(errors="replace").splitlines():
            try:
                record = json.loads(raw)
            except ValueError:
                if name in raw:
                    mine.append(raw)
                continue
            if isinstance(record, dict) and record.get("service") == name:
                error = str(record.get("error") or "").strip().splitlines()
                mine.append(
                    f"{record.get('time', '')} {record.get('level', '')} "
                    f"{record.get('message', '')}" + (f" | {error[-1]}" if error else "")
                )
        return "\n".join(mine[-lines:])

    def exits(self) -> list[tuple[str, str]]:
        """(service, exit code) of every child death the supervisor reported, in order."""
        found = EXITED.findall(self.log_path.read_text(errors="replace"))
        return [(name, code) for name, code in found]

    def stop(self, timeout: float = 60) -> int | None:
        """SIGTERM the supervisor (it stops its children); kill whatever is left after it."""
        if self.popen is None:
            return None
        children = self.pids()
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(10)
        for name, pid in children.items():
            try:  # still that service (not a reused pid)? then it outlived the supervisor
                argv = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if f"services.{name.split('#')[0]}".encode() in argv:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        return self.popen.returncode


__all__ = ["SERVICES", "SupervisedMesh"]

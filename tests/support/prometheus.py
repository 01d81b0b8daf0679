"""A real Prometheus (Debian's package, as ``make monitoring`` installs it) for tests.

It runs on a port of its own with a data directory of its own, scrapes what the test names and
evaluates the rule files it is given; the test reads it through the HTTP API.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.support.processes import eventually, free_port, local_http


def binary(name: str) -> str:
    """``prometheus`` or ``promtool``; the test fails (it does not skip) when it is missing."""
    found = shutil.which(name)
    if found is None:
        pytest.fail(
            f"{name} is not installed: run 'deploy/local/monitoring.sh install' (make test)"
        )
    return found


class Prometheus:
    def __init__(self, config: dict[str, Any], directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.config_path = directory / "prometheus.yml"
        self.config_path.write_text(yaml.safe_dump(config, sort_keys=False))
        self.port = free_port()
        self.log_path = directory / "prometheus.log"
        self._log = self.log_path.open("ab")
        self.popen = subprocess.Popen(
            [
                binary("prometheus"),
                f"--config.file={self.config_path}",
                f"--storage.tsdb.path={directory / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
            ],
            stdout=self._log,
            stderr=self._log,
        )
        self.url = f"http://127.0.0.1:{self.port}"

    async def wait_ready(self, timeout: float = 60) -> None:
        async with local_http(2) as http:

            async def ready() -> bool:
                if self.popen.poll() is not None:
                    raise AssertionError(f"prometheus exited:\n{self.output()[-3000:]}")
                try:
                    return (await http.get(f"{self.url}/-/ready")).status_code == 200
                except httpx.HTTPError:
                    return False

            await eventually(ready, timeout=timeout, what="prometheus to be ready")

    async def api(self, path: str, **params: str) -> Any:
        async with httpx.AsyncClient(timeout=10) as http:
            response = await http.get(f"{self.url}/api/v1/{path}", params=params)
        body = response.json()
        assert body.get("status") == "success", (path, params, body)
        return body["data"]

    async def query_range(self, expr: str, start: float, end: float, step: str) -> list[Any]:
        data = await self.api("query_range", query=expr, start=str(start), end=str(end), step=step)
        return list(data["result"])

    async def targets(self) -> list[dict[str, Any]]:
        return list((await self.api("targets"))["activeTargets"])

    async def alerts(self) -> list[dict[str, Any]]:
        return list((await self.api("alerts"))["alerts"])

    def output(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(20)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(10)
        self._log.close()

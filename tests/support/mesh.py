"""The five services as real processes against a test vhost and database."""

from __future__ import annotations

from pathlib import Path

from tests.support.processes import ServiceProcess
from yoke.supervisor import SERVICES


class Mesh:
    def __init__(self, amqp_url: str, mongodb_url: str, log_dir: Path) -> None:
        self.env = {
            "YOKE_AMQP_URL": amqp_url,
            "YOKE_MONGODB_URL": mongodb_url,
            "YOKE_SHARDS": "2",
            "YOKE_RETRY_BACKOFF_SECONDS": "0.05",
        }
        self.log_dir = log_dir
        self.processes: dict[str, ServiceProcess] = {}

    def start(self, name: str) -> ServiceProcess:
        process = ServiceProcess(["-m", f"services.{name}"], self.env, self.log_dir / f"{name}.log")
        self.processes[name] = process
        return process

    async def start_all(self) -> None:
        for name in SERVICES:
            self.start(name)
        for process in self.processes.values():
            await process.wait_healthy()

    async def restart(self, name: str) -> ServiceProcess:
        self.processes[name].kill()
        process = self.start(name)
        await process.wait_healthy()
        return process

    def stop_all(self) -> dict[str, int]:
        return {name: process.stop() for name, process in self.processes.items()}

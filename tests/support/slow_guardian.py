"""Run a guardian whose runners are recorded, and slowed down on request.

    python -m tests.support.slow_guardian [NAME]

``NAME`` (default ``guardian``) is the service name it consumes under: another name is a second
guardian deployment with shard queues of its own, so it receives every event too. Each runner
first waits ``YOKE_TEST_GUARDIAN_DELAY`` seconds (default 0) and is recorded, with its start and
end, in the ``test_guardian_runs`` collection. The product modules know nothing of this.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time

from services.guardian.guardian import Guardian, Match, Watched, register
from yoke.core.models import Message
from yoke.runtime.join_config import GuardianConfig
from yoke.runtime.service import Service, run_service

RUNS = "test_guardian_runs"


def main() -> None:
    name = sys.argv[1] if len(sys.argv) > 1 else "guardian"
    delay = float(os.environ.get("YOKE_TEST_GUARDIAN_DELAY", "0"))
    original = Guardian.run_runner

    async def run_runner(
        self: Guardian, watched: Watched, config: GuardianConfig, line: Message, match: Match
    ) -> str | None:
        started = time.time()
        try:
            await asyncio.sleep(delay)
            return await original(self, watched, config, line, match)
        finally:
            await self.store.db[RUNS].insert_one(
                {
                    "name": name,
                    "pid": os.getpid(),
                    "joinKey": watched.join_key,
                    "messageId": line.id,
                    "start": started,
                    "end": time.time(),
                }
            )

    def wire(service: Service) -> None:
        register(service)

    Guardian.run_runner = run_runner  # type: ignore[method-assign]
    run_service(name, wire)


if __name__ == "__main__":
    main()

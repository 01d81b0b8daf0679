"""``yoke up`` with a metrics port of its own for each service.

``YOKE_METRICS_PORT`` sets one process's port, and ``yoke up`` hands its whole environment to all
five children, so a second mesh on this machine would collide on the defaults 9101-9105. This
runs the real supervisor (its restart loop is what chaos exercises) and only sets each child's
port as it is started.

    YOKE_CHAOS_METRICS_PORTS=ingestion=9201,processor=9202,... python -m tests.chaos.up
"""

from __future__ import annotations

import asyncio
import os
import sys

from yoke.cli import supervisor

PORTS_VARIABLE = "YOKE_CHAOS_METRICS_PORTS"


def parse_ports(text: str) -> dict[str, int]:
    pairs = (item.split("=", 1) for item in text.split(",") if item.strip())
    return {name.strip(): int(port) for name, port in pairs}


def format_ports(ports: dict[str, int]) -> str:
    return ",".join(f"{name}={port}" for name, port in ports.items())


def install(ports: dict[str, int]) -> None:
    """Wrap ``supervisor.start`` so each child inherits its own ``YOKE_METRICS_PORT``."""
    original = supervisor.start
    lock = asyncio.Lock()  # the environment is process-wide: one child forks at a time

    async def start(child: supervisor.Child) -> None:
        async with lock:
            os.environ["YOKE_METRICS_PORT"] = str(ports[child.name])
            try:
                await original(child)
            finally:
                del os.environ["YOKE_METRICS_PORT"]

    supervisor.start = start


def main() -> int:
    ports = parse_ports(os.environ.get(PORTS_VARIABLE, ""))
    missing = [name for name in supervisor.SERVICES if name not in ports]
    if missing:
        print(f"{PORTS_VARIABLE} names no port for {', '.join(missing)}", file=sys.stderr)
        return 2
    install(ports)
    # The shard-consuming services only: the gateway would take the shared default HTTP port.
    return asyncio.run(supervisor.run(supervisor.SERVICES))


if __name__ == "__main__":
    sys.exit(main())

"""``yoke up`` with a metrics port of its own for each service.

``YOKE_METRICS_PORT`` sets one process's port, and ``yoke up`` hands its whole environment to all
five children, so a second mesh on this machine would collide on the defaults 9101-9105. This
runs the real supervisor (its restart loop is what chaos exercises) and only sets each child's
port as it is started, by the child's label (``processor#1`` for the second processor replica).

    YOKE_CHAOS_METRICS_PORTS=ingestion=9201,processor=9202,... \
    YOKE_CHAOS_REPLICAS=processor=2 python -m tests.chaos.up
"""

from __future__ import annotations

import asyncio
import os
import sys

from yoke.cli import supervisor

PORTS_VARIABLE = "YOKE_CHAOS_METRICS_PORTS"
REPLICAS_VARIABLE = "YOKE_CHAOS_REPLICAS"


def labels(replicas: dict[str, int]) -> list[str]:
    """The supervisor's children's labels, in its order (``Child.label``)."""
    return [
        supervisor.Child(name, replica).label
        for name in supervisor.SERVICES
        for replica in range(replicas.get(name, 1))
    ]


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
            os.environ["YOKE_METRICS_PORT"] = str(ports[child.label])
            try:
                await original(child)
            finally:
                del os.environ["YOKE_METRICS_PORT"]

    supervisor.start = start


def main() -> int:
    ports = parse_ports(os.environ.get(PORTS_VARIABLE, ""))
    replicas = supervisor.parse_replicas(os.environ.get(REPLICAS_VARIABLE, ""))
    missing = [label for label in labels(replicas) if label not in ports]
    if missing:
        print(f"{PORTS_VARIABLE} names no port for {', '.join(missing)}", file=sys.stderr)
        return 2
    install(ports)
    # The shard-consuming services only: the gateway would take the shared default HTTP port.
    return asyncio.run(supervisor.run(tuple(supervisor.SERVICES), replicas=replicas))


if __name__ == "__main__":
    sys.exit(main())

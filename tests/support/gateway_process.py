"""The HTTP gateway as a real process on a free port (its /healthz is on the API's port)."""

from __future__ import annotations

import re
import signal
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import httpx

from tests.support.processes import ServiceProcess, free_port


def start_gateway(
    amqp_url: str, mongodb_url: str, log_dir: Path, **env: str
) -> tuple[ServiceProcess, str]:
    port = free_port()
    process = ServiceProcess(
        ["-m", "services.gateway"],
        {
            "YOKE_AMQP_URL": amqp_url,
            "YOKE_MONGODB_URL": mongodb_url,
            "YOKE_GATEWAY_PORT": str(port),
            "YOKE_GATEWAY_HOST": "127.0.0.1",
            **env,
        },
        log_dir / f"gateway-{port}.log",
    )
    process.port = port
    return process, f"http://127.0.0.1:{port}"


# uvicorn may re-raise SIGTERM once it has shut down.
CLEAN_EXITS = (0, -signal.SIGTERM)


def assert_stopped_cleanly(
    process: ServiceProcess, code: int, exits: tuple[int, ...] = CLEAN_EXITS
) -> None:
    """A SIGTERM shutdown that ran to its end, streams and all."""
    log = process.log_path.read_text(errors="replace")
    assert code in exits and "Application shutdown complete" in log, log[-3000:]


@asynccontextmanager
async def gateway_process(
    amqp_url: str,
    mongodb_url: str,
    log_dir: Path,
    *,
    exits: tuple[int, ...] = CLEAN_EXITS,
    **env: str,
) -> AsyncIterator[tuple[ServiceProcess, str]]:
    """A healthy gateway and its URL; stopped after with SIGTERM, which must end it cleanly."""
    process, url = start_gateway(amqp_url, mongodb_url, log_dir, **env)
    try:
        await process.wait_healthy()
        yield process, url
    finally:
        code = process.stop()
    assert_stopped_cleanly(process, code, exits)


@asynccontextmanager
async def running_gateway(
    amqp_url: str,
    mongodb_url: str,
    log_dir: Path,
    *,
    exits: tuple[int, ...] = CLEAN_EXITS,
    **env: str,
) -> AsyncIterator[str]:
    """A healthy gateway's URL (see :func:`gateway_process`)."""
    async with gateway_process(amqp_url, mongodb_url, log_dir, exits=exits, **env) as (_, url):
        yield url


async def metric(url: str, name: str, **labels: str) -> float:
    """One sample of a gateway's /metrics (0 when absent)."""
    async with httpx.AsyncClient(timeout=10) as client:
        text = (await client.get(f"{url}/metrics")).text
    wanted = ",".join(f'{key}="{value}"' for key, value in sorted(labels.items()))
    pattern = re.escape(name) + (r"\{" + re.escape(wanted) + r"\}" if labels else "")
    found = re.search(rf"^{pattern} (\S+)$", text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0

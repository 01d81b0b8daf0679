"""The faults chaos injects, and what each needs in order to be injected honestly.

Three kinds of targets: the shared servers that ``make services`` started itself (the full
``make chaos`` restarts them), stand-ins that a bounded run owns alone (the services' own
broker connections, and a TCP proxy in front of the store), because other test runs on the
same machine use the shared servers at the same time, and a RabbitMQ node of the run's own
(tests/support/rabbit_node.py), which it may really restart.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

import httpx

from tests.support.processes import ROOT
from tests.support.rabbit_node import RabbitNode
from tests.support.tcp_proxy import ProxyProcess

SERVICES_SH = ROOT / "deploy" / "local" / "services.sh"
LOCAL = ROOT / ".local"
OWN_CONNECTION_PREFIX = "chaos-"


class NotOurServers(Exception):
    """The servers were found running, not started by ``make services``: not ours to restart."""


@dataclass
class Faults:
    """How to break and heal the broker and the store; each call returns once healed."""

    broker_label: str
    broker: Callable[[], Awaitable[None]]
    freeze_store: Callable[[float], Awaitable[None]]
    stop_store: Callable[[float], Awaitable[None]]


# --- service processes under the supervisor ----------------------------------------------


def children_of(parent: int) -> dict[int, str]:
    """Pid -> service name of the ``python -m services.<name>`` children of ``parent`` (/proc:
    the services make themselves undumpable, but their status and command line stay readable)."""
    found: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            status = (entry / "status").read_text()
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        ppid = next((ln.split()[1] for ln in status.splitlines() if ln.startswith("PPid:")), "0")
        if int(ppid) != parent or b"-m" not in argv[:-1]:
            continue
        module = argv[argv.index(b"-m") + 1].decode()
        if module.startswith("services."):
            found[int(entry.name)] = module.removeprefix("services.")
    return found


def kill_9(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)


# --- the shared servers, only when `make services` started them --------------------------


async def services_sh(*args: str) -> None:
    process = await asyncio.create_subprocess_exec(
        str(SERVICES_SH),
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    output, _ = await process.communicate()
    if process.returncode != 0:
        raise RuntimeError(f"services.sh {' '.join(args)} failed:\n{output.decode()}")


def ferretdb_pid() -> int:
    pid = int((LOCAL / "ferretdb.pid").read_text().strip())
    os.kill(pid, 0)
    return pid


def check_local_servers(environ: dict[str, str]) -> None:
    """Raise :class:`NotOurServers` unless RabbitMQ and FerretDB are ``make services``' own."""
    for variable in ("YOKE_AMQP_URL", "YOKE_MONGODB_URL"):
        if environ.get(variable):
            raise NotOurServers(
                f"{variable} is set: those servers are not ours to restart; "
                "make chaos needs the RabbitMQ and FerretDB that 'make services' starts"
            )
    if not (LOCAL / "rabbitmq.started").exists():
        raise NotOurServers(
            "RabbitMQ on :5672 was found running, not started by 'make services' "
            f"(no {LOCAL / 'rabbitmq.started'}): not ours to restart"
        )
    try:
        pid = ferretdb_pid()
        exe = os.readlink(f"/proc/{pid}/exe")
    except (OSError, ValueError) as error:
        raise NotOurServers(
            "the MongoDB-wire server on :27017 was not started by 'make services' "
            f"(no live FerretDB in {LOCAL / 'ferretdb.pid'}: {error}): not ours to restart"
        ) from error
    if "ferretdb" not in Path(exe).name:
        raise NotOurServers(f"pid {pid} in {LOCAL / 'ferretdb.pid'} is {exe}, not FerretDB")


def local_server_faults(broker_down_seconds: float) -> Faults:
    """Restart the real RabbitMQ; freeze and stop the real FerretDB."""

    async def restart_rabbitmq() -> None:
        await services_sh("rabbitmq-stop-app")
        await asyncio.sleep(broker_down_seconds)
        await services_sh("rabbitmq-start-app")

    async def freeze(seconds: float) -> None:
        pid = ferretdb_pid()
        os.kill(pid, signal.SIGSTOP)
        try:
            await asyncio.sleep(seconds)
        finally:
            os.kill(pid, signal.SIGCONT)

    async def stop(seconds: float) -> None:
        await services_sh("ferretdb-stop")
        try:
            await asyncio.sleep(seconds)
        finally:
            await services_sh("ferretdb-start")

    return Faults("RabbitMQ restarted", restart_rabbitmq, freeze, stop)


# --- stand-ins a bounded run owns alone ---------------------------------------------------


async def close_service_connections(management_url: str, auth: tuple[str, str], vhost: str) -> int:
    """Force-close every connection on ``vhost`` but the harness's own; returns how many."""
    async with httpx.AsyncClient(base_url=management_url, auth=auth, timeout=30) as api:
        response = await api.get(f"/api/vhosts/{quote(vhost, safe='')}/connections")
        response.raise_for_status()
        closed = 0
        for connection in response.json():
            properties = connection.get("client_properties") or {}
            if str(properties.get("connection_name", "")).startswith(OWN_CONNECTION_PREFIX):
                continue
            name = quote(connection["name"], safe="")
            answer = await api.delete(
                f"/api/connections/{name}", headers={"X-Reason": "chaos: connection forced"}
            )
            if answer.status_code in (200, 204):
                closed += 1
        return closed


async def no_store_fault(seconds: float) -> None:
    raise RuntimeError("this run has no store of its own to break")


def own_node_faults(node: RabbitNode, down_seconds: float) -> Faults:
    """Restart the run's own RabbitMQ node (``stop_app``, then ``start_app``); no store faults."""

    async def restart() -> None:
        await asyncio.to_thread(node.ctl, "stop_app")
        await asyncio.sleep(down_seconds)
        await asyncio.to_thread(node.ctl, "start_app")
        await asyncio.to_thread(node.wait_ready)

    return Faults("RabbitMQ restarted (own node)", restart, no_store_fault, no_store_fault)


def stand_in_faults(
    management_url: str, auth: tuple[str, str], vhost: str, proxy: ProxyProcess
) -> Faults:
    """Close the services' broker connections; freeze and kill the store proxy."""

    async def close_connections() -> None:
        if await close_service_connections(management_url, auth, vhost) == 0:
            raise RuntimeError(f"no service connections on vhost {vhost} to close")

    async def freeze(seconds: float) -> None:
        proxy.freeze()
        try:
            await asyncio.sleep(seconds)
        finally:
            proxy.thaw()

    async def stop(seconds: float) -> None:
        proxy.kill()
        try:
            await asyncio.sleep(seconds)
        finally:
            await asyncio.to_thread(proxy.start)

    return Faults("broker connections force-closed", close_connections, freeze, stop)

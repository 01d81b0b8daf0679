"""Worker tools as an operator makes them, and commands sent as an outside RabbitMQ user.

``registered_worker_tool`` runs ``yoke tools add-worker`` (a subprocess, as an operator runs it)
and hands back the tool's name and an AMQP URL as its ``tool-NAME`` user; the user is deleted
afterwards (RabbitMQ users are broker-wide). ``serving`` runs the pika worker for it.
``ask_direct`` publishes one command as any user and reads the door's reply on direct reply-to,
the one reply queue a worker's user may use.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aio_pika
from aio_pika.abc import AbstractIncomingMessage

from tests.support.cli import run_yoke
from tests.support.mesh import service_env
from tests.support.worker_process import WorkerProcess, as_user
from yoke.bus import topology
from yoke.bus.amqp_nodes import amqp_vhost
from yoke.cli.publishers import delete_user, management_of

CLI_SECONDS = 240  # the most a ``yoke`` command may take (its imports, on a loaded machine)


@dataclass(frozen=True)
class WorkerTool:
    name: str
    user: str  # its worker's RabbitMQ user, as ``add-worker`` named it
    url: str  # the module's vhost, as that user


@contextlib.asynccontextmanager
async def registered_worker_tool(
    amqp_url: str,
    mongodb_url: str,
    name: str,
    schema: dict[str, Any],
    folder: Path,
    *,
    description: str | None = None,
    timeout: float = 120,
) -> AsyncIterator[WorkerTool]:
    """``yoke tools add-worker NAME``: the user named on the line before the last, its
    password on the last. The user is deleted after by the name the tool gives it, so that
    one made by a registration that failed half-way goes too."""
    schema_file = folder / f"{name}.schema.json"
    schema_file.write_text(json.dumps(schema))
    try:
        code, out, err = await run_yoke(
            service_env(amqp_url, mongodb_url),
            "tools",
            "add-worker",
            name,
            "--schema",
            str(schema_file),
            "--description",
            description or f"the test tool {name}",
            "--timeout",
            f"{timeout:g}",
            timeout=CLI_SECONDS,
        )
        assert code == 0, err
        *_, named, password = out.splitlines()
        found = re.search(r"RabbitMQ user (\S+) with the password", named)
        assert found is not None, out
        user = found.group(1)
        yield WorkerTool(name, user, as_user(amqp_url, user, password))
    finally:
        await delete_user(management_of(amqp_url), topology.tool_user(name, amqp_vhost(amqp_url)))


@contextlib.asynccontextmanager
async def serving(
    tool: WorkerTool, mode: str, *options: str, ready_within: float = 60
) -> AsyncIterator[WorkerProcess]:
    """The pika worker serving ``tool`` in ``mode``, consuming its queue; stopped after,
    whatever happened."""
    worker = await WorkerProcess.start(tool.url, tool.name, mode, *options)
    try:
        await worker.line("ready", timeout=ready_within)
        yield worker
    finally:
        await worker.stop()


async def ask_direct(
    url: str,
    routing_key: str,
    body: dict[str, Any],
    *,
    user_id: str | None,
    headers: dict[str, Any] | None = None,
    timeout: float = 60,
) -> dict[str, Any]:
    """Publish ``body`` to ``yoke.commands`` as the user of ``url`` (AMQP ``user_id`` and
    ``headers`` as given) and return the door's reply, read on direct reply-to."""
    connection = await aio_pika.connect(url)
    try:
        channel = await connection.channel()
        replies = await channel.get_queue(topology.DIRECT_REPLY_PREFIX, ensure=False)
        answered: asyncio.Future[AbstractIncomingMessage] = (
            asyncio.get_running_loop().create_future()
        )

        async def keep(delivery: AbstractIncomingMessage) -> None:
            if not answered.done():
                answered.set_result(delivery)

        await replies.consume(keep, no_ack=True)  # before the publish names it
        exchange = await channel.get_exchange(topology.COMMANDS_EXCHANGE, ensure=False)
        await exchange.publish(
            aio_pika.Message(
                json.dumps(body).encode(),
                content_type="application/json",
                correlation_id="asked",
                reply_to=replies.name,
                user_id=user_id,
                headers=headers,
            ),
            routing_key=routing_key,
        )
        delivery = await asyncio.wait_for(answered, timeout)
        assert delivery.correlation_id == "asked"
        reply: dict[str, Any] = json.loads(delivery.body)
        return reply
    finally:
        await connection.close()

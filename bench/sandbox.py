"""A throwaway RabbitMQ vhost and MongoDB database, so a bench run never touches anyone's data.

Both are removed afterwards, even when the run fails or is interrupted.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from urllib.parse import quote, unquote, urlsplit, urlunsplit

import httpx
from pymongo import AsyncMongoClient

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Sandbox:
    amqp_url: str
    mongodb_url: str
    vhost: str
    database: str


def management_url_for(amqp_url: str, explicit: str | None) -> str:
    """The management API beside the broker (port 15672) unless one is named explicitly."""
    if explicit:
        return explicit.rstrip("/")
    return f"http://{urlsplit(amqp_url).hostname or '127.0.0.1'}:15672"


def database_url(base: str, database: str) -> str:
    """``base`` naming ``database``; credentials keep authenticating where they did before."""
    parts = urlsplit(base)
    query = parts.query
    if parts.username and "authSource=" not in query:
        source = parts.path.lstrip("/") or "admin"
        query = f"{query}&authSource={source}" if query else f"authSource={source}"
    return urlunsplit(parts._replace(path="/" + database, query=query))


@contextlib.asynccontextmanager
async def sandbox(amqp_base: str, mongodb_base: str, management: str) -> AsyncIterator[Sandbox]:
    token = uuid.uuid4().hex[:12]
    vhost, database = f"yoke-bench-{token}", f"yoke_bench_{token}"
    parts = urlsplit(amqp_base)
    user = unquote(parts.username or "guest")
    auth = (user, unquote(parts.password or "guest"))
    path = quote(vhost, safe="")
    async with httpx.AsyncClient(base_url=management, auth=auth, timeout=30) as api:
        (await api.put(f"/api/vhosts/{path}")).raise_for_status()
        try:
            grant = {"configure": ".*", "write": ".*", "read": ".*"}
            response = await api.put(f"/api/permissions/{path}/{quote(user, safe='')}", json=grant)
            response.raise_for_status()
            yield Sandbox(
                amqp_url=urlunsplit(parts._replace(path="/" + path)),
                mongodb_url=database_url(mongodb_base, database),
                vhost=vhost,
                database=database,
            )
        finally:
            await _remove(api, path, mongodb_base, database)


async def _remove(api: httpx.AsyncClient, vhost_path: str, mongodb_base: str, name: str) -> None:
    """Best effort and bounded: a failed clean-up is reported, never hides the run's outcome."""
    try:
        (await api.delete(f"/api/vhosts/{vhost_path}")).raise_for_status()
    except httpx.HTTPError as error:
        log.warning("could not delete vhost %s: %r", unquote(vhost_path), error)
    client: AsyncMongoClient[dict[str, object]] = AsyncMongoClient(
        mongodb_base, serverSelectionTimeoutMS=10_000, socketTimeoutMS=30_000
    )
    try:
        async with asyncio.timeout(60):
            await client.drop_database(name)
    except Exception as error:
        log.warning("could not drop database %s: %r", name, error)
    finally:
        await client.close()


async def queued_messages(management: str, amqp_base: str, vhost: str) -> dict[str, int]:
    """Messages ready or unacknowledged in each consumed queue of ``vhost`` that holds any
    (the mesh's backlog; a queue nobody consumes, such as a dead-letter queue, never drains)."""
    parts = urlsplit(amqp_base)
    auth = (unquote(parts.username or "guest"), unquote(parts.password or "guest"))
    async with httpx.AsyncClient(base_url=management, auth=auth, timeout=30) as api:
        response = await api.get(
            f"/api/queues/{quote(vhost, safe='')}", params={"columns": "name,messages,consumers"}
        )
        response.raise_for_status()
        return {
            str(queue["name"]): int(queue.get("messages") or 0)
            for queue in response.json()
            if queue.get("messages") and queue.get("consumers")
        }

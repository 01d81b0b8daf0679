"""RabbitMQ from tests: the management API (force-close connections, see who consumes what)
and what a queue holds."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from urllib.parse import quote, unquote, urlsplit, urlunsplit

import aio_pika
import httpx

from yoke.bus import topology
from yoke.cli.publishers import delete_user, management_of


@contextmanager
def fresh_vhost(amqp_url: str, management_url: str, vhost: str) -> Iterator[str]:
    """An AMQP URL on a new vhost where the URL's user may do anything; deleted after."""
    parts = urlsplit(amqp_url)
    auth = (parts.username or "guest", parts.password or "guest")
    with httpx.Client(base_url=management_url, auth=auth, timeout=30) as api:
        api.put(f"/api/vhosts/{vhost}").raise_for_status()
        api.put(
            f"/api/permissions/{vhost}/{auth[0]}",
            json={"configure": ".*", "write": ".*", "read": ".*"},
        ).raise_for_status()
        yield urlunsplit(parts._replace(path="/" + quote(vhost, safe="")))
        api.delete(f"/api/vhosts/{vhost}")


class Management:
    """The management API of the broker behind ``amqp_url``, as its user, scoped to its vhost
    (``get`` and ``delete`` reach the whole API: users are broker-wide)."""

    def __init__(self, management_url: str, amqp_url: str) -> None:
        parts = urlsplit(amqp_url)
        self.vhost = unquote(parts.path[1:]) or "/"
        self.auth = (unquote(parts.username or "guest"), unquote(parts.password or "guest"))
        self.base = management_url
        self.amqp_url = amqp_url

    def _client(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.base, auth=self.auth, timeout=30)

    @property
    def _vhost(self) -> str:
        return quote(self.vhost, safe="")

    async def get(self, path: str) -> httpx.Response:
        async with self._client() as api:
            return await api.get(path)

    async def delete(self, path: str) -> httpx.Response:
        async with self._client() as api:
            return await api.delete(path)

    async def delete_user(self, user: str) -> None:
        """Delete a RabbitMQ user (broker-wide) if it exists, as ``yoke publisher`` does."""
        await delete_user(management_of(self.amqp_url, self.base), user)

    async def connections(self) -> list[dict[str, Any]]:
        async with self._client() as api:
            response = await api.get(f"/api/vhosts/{self._vhost}/connections")
            response.raise_for_status()
            found: list[dict[str, Any]] = response.json()
            return found

    async def close_connections(self, name_prefix: str = "") -> int:
        """Force-close the vhost's connections whose client name starts with ``name_prefix``."""
        closed = 0
        async with self._client() as api:
            response = await api.get(f"/api/vhosts/{self._vhost}/connections")
            response.raise_for_status()
            for connection in response.json():
                client_name = (connection.get("client_properties") or {}).get("connection_name", "")
                if not str(client_name).startswith(name_prefix):
                    continue
                await api.delete(
                    f"/api/connections/{quote(connection['name'], safe='')}",
                    headers={"X-Reason": "test: broker connection closed"},
                )
                closed += 1
        return closed

    async def refuse_connections(self, refuse: bool = True) -> None:
        """Hold the vhost's connection limit at 0 (new connections refused), or lift it."""
        async with self._client() as api:
            path = f"/api/vhost-limits/{self._vhost}/max-connections"
            response = await (api.put(path, json={"value": 0}) if refuse else api.delete(path))
            response.raise_for_status()

    async def queues(self) -> dict[str, dict[str, Any]]:
        async with self._client() as api:
            response = await api.get(f"/api/queues/{self._vhost}")
            response.raise_for_status()
            return {queue["name"]: queue for queue in response.json()}

    async def delete_queue(self, name: str) -> None:
        async with self._client() as api:
            response = await api.delete(f"/api/queues/{self._vhost}/{quote(name, safe='')}")
            response.raise_for_status()


async def dead_letter_count(channel: aio_pika.abc.AbstractChannel) -> int:
    """Letters in the mesh's dead-letter queue now."""
    queue = await channel.declare_queue(topology.DEAD_LETTER_QUEUE, passive=True)
    return queue.declaration_result.message_count or 0

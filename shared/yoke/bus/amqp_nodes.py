"""``YOKE_AMQP_URL`` as one broker or a comma-separated list of a RabbitMQ cluster's nodes.

Every node of a cluster serves every queue (quorum queues are replicated, clients are proxied to
each queue's leader), so a client needs only one live node. aio-pika's ``connect_robust`` takes
one URL and, when it is lost, tries that same URL again forever: a stopped node would keep the
process off the broker while the rest of the cluster runs. :class:`NodeListConnection` is a
robust connection that, on every (re)connect, tries the nodes in turn, starting after the node
it last had (the one that just went away), and fails only when no node answers. Give every node
the same user, vhost and URL options; only host and port should differ.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any
from urllib.parse import unquote, urlsplit

import aio_pika
from aio_pika.abc import AbstractConnection, AbstractRobustConnection
from aio_pika.robust_connection import RobustConnection
from aiormq.exceptions import AMQPError
from yarl import URL

from yoke.core import tls

log = logging.getLogger(__name__)

# RobustConnection's private method for one connect attempt, overridden below.
_CONNECT_ATTEMPT = "_RobustConnection__connect_transport"


def node_urls(url: str) -> list[str]:
    """The node URLs of ``url`` (one, or a comma-separated list), in the order given."""
    nodes = [part.strip() for part in url.split(",") if part.strip()]
    if not nodes:
        raise ValueError("no AMQP URL given")
    return nodes


class NodeListConnection(RobustConnection):
    """A robust connection over several node URLs, tried in turn on each (re)connect."""

    def __init__(self, nodes: Sequence[str], **kwargs: Any) -> None:
        if not nodes:
            raise ValueError("no AMQP node URL given")
        self.nodes = [URL(node) for node in nodes]
        # The node of the current (or last) connection; -1: none yet, so start at the first.
        self.node_index = -1
        super().__init__(self.nodes[0], **kwargs)

    def _order(self) -> list[int]:
        start = self.node_index + 1
        return [(start + step) % len(self.nodes) for step in range(len(self.nodes))]

    async def _RobustConnection__connect_transport(self) -> None:
        """One (re)connect attempt: each node in turn until one connects.

        RobustConnection's reconnect loop calls this private method for every attempt (on
        aio-pika 10.2.1, which pyproject pins; tests/e2e/test_cluster.py checks the behaviour), and
        its connect reads ``self.url``: so choosing the node here covers the first connect and
        every reconnect, and channels and consumers are restored on whichever node answers.
        """
        attempt = getattr(super(), _CONNECT_ATTEMPT)
        error: BaseException | None = None
        for index in self._order():
            self.url = self.nodes[index]
            try:
                await attempt()
            except asyncio.CancelledError:
                raise
            except Exception as failure:
                error = failure
                if len(self.nodes) > 1:
                    log.warning("AMQP node %s did not connect: %r", self, failure)
                continue
            self.node_index = index
            return
        assert error is not None
        raise error


async def connect_robust(
    url: str,
    *,
    name: str | None = None,
    connect_timeout: float = 10,
    reconnect_interval: float = 5,
) -> AbstractRobustConnection:
    """A robust connection to the first node of ``url`` that answers (see the module doc)."""
    connection = NodeListConnection(
        node_urls(url),
        reconnect_interval=reconnect_interval,
        **({"client_properties": {"connection_name": name}} if name else {}),
        **tls.amqp_options(url),
    )
    await connection.connect(timeout=connect_timeout)
    return connection


async def connect(url: str, *, connect_timeout: float = 10) -> AbstractConnection:
    """A plain (not robust) connection to the first node of ``url`` that answers."""
    error: Exception | None = None
    for node in node_urls(url):
        try:
            connection: AbstractConnection = await aio_pika.connect(
                node, timeout=connect_timeout, **tls.amqp_options(node)
            )
            return connection
        except (AMQPError, ConnectionError, OSError, TimeoutError) as failure:
            error = failure
    count = len(node_urls(url))
    raise ConnectionError(f"no AMQP node of the {count} given answers (last: {error!r})") from error


def amqp_user(amqp_url: str) -> str:
    """The RabbitMQ user an AMQP URL connects as (its first node's; guest when none)."""
    parts = urlsplit(amqp_url.split(",")[0].strip())
    return unquote(parts.username) if parts.username else "guest"


def amqp_vhost(amqp_url: str) -> str:
    """The vhost an AMQP URL connects to (its first node's; ``/`` when it names none)."""
    path = urlsplit(amqp_url.split(",")[0].strip()).path
    return unquote(path[1:]) if len(path) > 1 else "/"

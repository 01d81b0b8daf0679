"""Who speaks at the AMQP door: what each RabbitMQ user may say, and where it is answered.

RabbitMQ verifies a command's ``user_id`` and the command router passes it on (it drops every
header a publisher set): that is the only proof of who spoke (docs/architecture.md, invariant
13). There are three kinds of speaker:

- the services' own user (YOKE_AMQP_URL's), the operator's: it speaks as-is (the CLI names its
  people ``cli:NAME``);
- the HTTP gateway's user (YOKE_GATEWAY_AMQP_USER): what it says must already be in a token's
  ``http:<namespace>:`` (the gateway prefixes every external id and key with it);
- every other user is an outside publisher (a bridge): what it says is stored as
  ``amqp:<user>:<value>``, so it can never be a token's person, the CLI's, or another
  bridge's, nor take their idempotency keys; a value already in another door's namespace
  (``http:``, ``amqp:``) is refused rather than quietly nested.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from yoke.bus import topology
from yoke.bus.amqp_nodes import amqp_user, amqp_vhost
from yoke.core.settings import Settings

# What no bridge may start a value with: other doors' namespaces. ``cli:`` is not among them:
# the CLI names its people ``cli:NAME`` whoever runs it, and a bridge user's CLI (compose's
# ``cli`` service) gets them as ``amqp:<user>:cli:NAME``, never the operator's ``cli:NAME``.
RESERVED_NAMESPACES = ("http:", "amqp:", "mcp:", "a2a:")
HTTP_NAMESPACE = "http:"
CALLER_NAMESPACES = ("mcp:", "a2a:")

# Which limit a line counts against (and the label of yoke_lines_rate_limited_total).
LimitedAs = Literal["bridge", "token"]


class ForeignNamespace(Exception):
    """A value in a namespace its speaker may not use (the message says which and why)."""


def token_namespace(value: str) -> str | None:
    """``NS`` of ``http:NS:rest`` (a REST caller's person or key), of ``mcp:NS`` and of
    ``a2a:NS`` (the one caller of the gateway's MCP and A2A doors, a token's own), or None when
    ``value`` is not in a token's namespace."""
    if value.startswith(CALLER_NAMESPACES):
        namespace = value.partition(":")[2]
        return namespace if namespace and ":" not in namespace else None
    if not value.startswith(HTTP_NAMESPACE):
        return None
    namespace, colon, rest = value[len(HTTP_NAMESPACE) :].partition(":")
    return namespace if namespace and colon and rest else None


@dataclass(frozen=True)
class DoorUsers:
    """The two RabbitMQ users the door knows by name, and the tool workers' (by the mesh's
    vhost); every other one is a bridge."""

    operator: str
    gateway: str
    vhost: str = "/"

    @classmethod
    def of(cls, settings: Settings) -> DoorUsers:
        url = settings.amqp_url
        return cls(amqp_user(url), settings.gateway_amqp_user, amqp_vhost(url))

    def tool_of(self, user: str | None) -> str | None:
        """The tool ``user`` is the worker user of (None: no tool's, or no user)."""
        return topology.tool_of_user(user, self.vhost) if user else None

    def is_mesh(self, user: str) -> bool:
        """The services' own user or the gateway's: the ones that name their people."""
        return user in (self.operator, self.gateway)

    @staticmethod
    def is_worker(user: str) -> bool:
        """A tool worker's user (``tool-NAME``): it answers its own tool's calls, nothing else."""
        return user.startswith(topology.TOOL_USER_PREFIX)

    @staticmethod
    def worker_only(user: str) -> str:
        """Why a tool worker's user is refused anything but an answer (invariant 13)."""
        return (
            f"RabbitMQ user {user!r} is a tool worker's: it may only answer its own tool's "
            f"calls ({topology.TOOL_RESULT_COMMAND}), never post lines or decide approvals"
        )

    def own(self, user: str, value: str, what: str) -> str:
        """``value`` (an external id or key) as the door stores it for ``user``; raises
        :class:`ForeignNamespace` for what ``user`` may not say."""
        if user == self.operator:
            return value
        if user == self.gateway:
            if token_namespace(value) is None:
                raise ForeignNamespace(
                    f"{what} {value!r} from the HTTP gateway's RabbitMQ user {user!r} must be "
                    "in a token's namespace (http:NAMESPACE:...)"
                )
            return value
        if value.startswith(RESERVED_NAMESPACES):
            raise ForeignNamespace(
                f"{what} {value!r} starts with a namespace kept for the mesh's own doors "
                f"({', '.join(RESERVED_NAMESPACES)}); RabbitMQ user {user!r} speaks as "
                f"amqp:{user}:<value>, so send the bare value"
            )
        return f"amqp:{user}:{value}"

    def limited_as(self, user: str, idempotency_key: str) -> tuple[LimitedAs, str] | None:
        """Which limit a line counts against and under what name: a bridge's user, or the
        gateway token whose namespace its key is in (the gateway may run as the services'
        user, as in ``make run``); None for the operator's own lines, which are exempt."""
        if self.is_mesh(user):
            namespace = token_namespace(idempotency_key)
            return ("token", namespace) if namespace is not None else None
        return "bridge", user

    def may_answer(self, user: str | None, queue: str) -> bool:
        """``queue`` (a command's reply_to) is one ``user`` owns, so that the door, answering
        as the services' user, never writes into a service's queue or another user's."""
        if queue.startswith(topology.DIRECT_REPLY_PREFIX):
            return True  # the broker hands it to the publisher's own channel only
        if not user:
            return False
        if user == self.operator:
            return queue.startswith(
                (
                    topology.bridge_queue_prefix(user),
                    topology.CLI_REPLY_QUEUE_PREFIX,
                    topology.GATEWAY_REPLY_QUEUE_PREFIX,
                )
            )
        if user == self.gateway:
            return queue.startswith(topology.GATEWAY_REPLY_QUEUE_PREFIX)
        if self.is_worker(user):
            return False  # a worker declares no queue: direct reply-to only
        return queue.startswith(topology.bridge_queue_prefix(user))

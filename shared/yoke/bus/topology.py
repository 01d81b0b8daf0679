"""Names and shapes of everything declared on RabbitMQ: the AMQP half of the public contract."""

from __future__ import annotations

import re
from typing import Any

from pamqp.common import FieldTable

from yoke.core.models import Message, ToolCallPart

EVENTS_EXCHANGE = "yoke.events"
COMMANDS_EXCHANGE = "yoke.commands"
DEAD_LETTER_EXCHANGE = "yoke.dead-letters"
DEAD_LETTER_QUEUE = "yoke.dead-letters"
# Invariant 14 for the dead letters: the queue holds at most so many (its oldest dropped first),
# and each one dropped is dead-lettered in turn to DROPPED_LETTERS_EXCHANGE, whose queue (bounded
# too, and read by nobody but the counter) ingestion reads to count them
# (yoke.bus.dead_letters.count_dropped_letters, yoke_dead_letters_dropped_total).
DEAD_LETTERS_MAX_LENGTH = 10_000
DEAD_LETTERS_MAX_BYTES = 256 * 1024 * 1024
DROPPED_LETTERS_EXCHANGE = "yoke.dead-letters.dropped"
DROPPED_LETTERS_QUEUE = "yoke.dead-letters.dropped"
DROPPED_LETTERS_MAX_LENGTH = 1_000
# The same bound as a RabbitMQ policy, for a dead-letter queue declared before it had one
# (deploy/rabbitmq/definitions.json has it for compose).
DEAD_LETTERS_POLICY = "yoke-dead-letters"

# What outside systems read (a bridge binds its queues here with the same routing keys as on
# yoke.events): forum lines and agent activity, never a monologue's events. yoke.events feeds it
# through FORUM_ROUTE_EXCHANGE, a headers exchange passing only events whose KIND_HEADER is
# PUBLIC_KIND; both are internal (nobody publishes to them but that binding). See
# Bus.declare_core for why an exchange and not RabbitMQ topic permissions.
FORUM_EXCHANGE = "yoke.forum"
FORUM_ROUTE_EXCHANGE = "yoke.forum.route"
PUBLIC_KIND = "forum"

SUBMIT_COMMAND = "conversation.message.submit"
# A tool worker's answer to a call (keyed by its callId: results have no conversationId).
TOOL_RESULT_COMMAND = "tool.result.submit"
# A person's decision on a call that waits for approval (keyed by its callId too).
APPROVAL_COMMAND = "tool.approval.submit"
# A claim, cancel or timeout of an escalation (keyed by its forum, the conversationId).
ESCALATION_COMMAND = "escalation.submit"

# Tool workers: each worker tool NAME has the queue yoke.tool.NAME (quorum, competing consumers,
# declared by the mesh only) and a RabbitMQ user (tool_user: tool-NAME on the default vhost,
# tool-VHOST.NAME on another), which may read only that queue and write only to yoke.commands.
# No other publisher may have a name starting with "tool-".
TOOL_QUEUE_PREFIX = "yoke.tool."
TOOL_USER_PREFIX = "tool-"

# Set by Service's command router (yoke.runtime.service, Service._router) from the AMQP user_id
# that RabbitMQ verified, after it has dropped every x-yoke-* and yoke-* header the publisher
# set: the only name a handler trusts for who spoke.
USER_HEADER = "x-yoke-user"

# The consistent-hash exchanges hash this header: the conversation (or, for agent.* events, the
# forum) a delivery belongs to. Every event we publish carries it.
CONVERSATION_HEADER = "x-yoke-conversation"

# Set by Service's command router on a command it moves from the intake queue to the shards:
# the command's name (the routing key it was submitted with). Deliveries without it are events.
COMMAND_HEADER = "yoke-command"

# Headers every event carries so that each service's route exchange (a headers exchange between
# yoke.events and its shards) delivers it only what it acts on: the event type, and for a posted
# message the kind of conversation, the message's type and role, and whether it calls tools.
# (No "x-" prefix: a headers exchange ignores such headers when it matches.)
EVENT_HEADER = "yoke-event"
KIND_HEADER = "yoke-kind"
TYPE_HEADER = "yoke-type"
ROLE_HEADER = "yoke-role"
CALLS_HEADER = "yoke-calls"
# Set by the processor on lines of joins that have a guardian: only those reach it.
GUARDED_HEADER = "yoke-guarded"
# Set on forum lines of joins that have follow-up (the agent's, by egress from what the processor
# set on its monologue line; people's, by the door, when some join of the forum has it): only
# those reach the follow-up service.
FOLLOWED_HEADER = "yoke-followed"
# "yes" on a person's forum line that ingestion's door copied into the watching monologues as it
# accepted it, "no" on every other line: ingestion's route takes only forum lines marked "no",
# so the door's own lines are not delivered back to it (a line whose copy a crash cut short is
# republished by the outbox sweep unmarked, and copied then).
COPIED_HEADER = "yoke-copied"
# The version of the join configuration the processor stepped with (not bound on): whoever reads
# the configuration for such a line reads it once per version (yoke.runtime.join_config).
CONFIG_VERSION_HEADER = "yoke-config-version"
# On an agent's forum line: the head of the monologue it was forwarded from, sealed under the
# mesh's key (yoke.runtime.head_hints), for whoever writes in that monologue next. Bridges are
# delivered it too and can read nothing of it; the line's own meta says nothing of the monologue.
HEAD_HEADER = "x-yoke-head"

# One binding of a service's route exchange: header values an event must all carry.
Interest = dict[str, str]

# Headers a dead letter carries, so an operator can see why and replay it where it came from.
DEAD_SERVICE_HEADER = "x-yoke-service"
DEAD_ERROR_HEADER = "x-yoke-error"
DEAD_ATTEMPTS_HEADER = "x-yoke-attempts"
DEAD_EXCHANGE_HEADER = "x-yoke-original-exchange"
DEAD_ROUTING_KEY_HEADER = "x-yoke-original-routing-key"

# Broker-side backstop: a delivery that crashed its consumer this many times is dead-lettered
# by RabbitMQ itself (the in-process retries normally dead-letter long before).
DELIVERY_LIMIT = 10


def routing_key(event_type: str, key: str) -> str:
    """``<event type>.<conversation or forum id>``, as outside bindings expect."""
    return f"{event_type}.{key}"


def route_exchange(service: str) -> str:
    """The headers exchange that picks, from yoke.events, what a service acts on."""
    return f"yoke.{service}.route"


def interest(event_type: str, **headers: str) -> Interest:
    """A route binding: ``interest("conversation.message.posted", kind="forum")``."""
    names = {
        "kind": KIND_HEADER,
        "type": TYPE_HEADER,
        "role": ROLE_HEADER,
        "calls": CALLS_HEADER,
        "guarded": GUARDED_HEADER,
        "followed": FOLLOWED_HEADER,
        "copied": COPIED_HEADER,
    }
    return {EVENT_HEADER: event_type, **{names[key]: value for key, value in headers.items()}}


def posted_headers(message: Message, kind: str) -> dict[str, str]:
    """The routing headers of a ``conversation.message.posted`` event."""
    calls = any(isinstance(part, ToolCallPart) for part in message.parts)
    return {
        KIND_HEADER: kind,
        TYPE_HEADER: message.type,
        ROLE_HEADER: message.role,
        CALLS_HEADER: "yes" if calls else "no",
        COPIED_HEADER: "no",
    }


def shard_exchange(service: str) -> str:
    return f"yoke.{service}.shards"


def shard_queue(service: str, index: int) -> str:
    return f"yoke.{service}.shard.{index:03d}"


def intake_queue(service: str) -> str:
    """The single-active-consumer queue outside commands arrive on; a light router moves each
    to the service's shards (keyed by the conversation in its body), where it is handled."""
    return f"yoke.{service}.commands"


def quorum_queue_arguments() -> FieldTable:
    """Shard and intake queues: quorum, single active consumer, bounded redeliveries."""
    return {
        "x-queue-type": "quorum",
        "x-single-active-consumer": True,
        "x-delivery-limit": DELIVERY_LIMIT,
        "x-dead-letter-exchange": DEAD_LETTER_EXCHANGE,
    }


# What an outside publisher (a bridge) NAME may do, as RabbitMQ permission patterns: submit
# commands, declare queues of its own (named ``bridge.NAME.*``, never another bridge's), bind
# them to yoke.forum and read them. Nothing else it may read carries a monologue: not
# yoke.events, the dead letters, or the services' route and shard exchanges and queues.
BRIDGE_QUEUE_PREFIX = "bridge."


def bridge_queue_prefix(user: str) -> str:
    """The names of bridge user ``user``'s queues start so (its replies, its watches)."""
    return f"{BRIDGE_QUEUE_PREFIX}{user}."


def publisher_permissions(user: str) -> dict[str, str]:
    """Bridge user ``user``'s permissions: its own ``bridge.<user>.*`` queues only."""
    own = re.escape(bridge_queue_prefix(user)) + ".*"
    return {
        "configure": f"^{own}",
        "write": rf"^(yoke\.commands|{own})$",
        "read": rf"^(yoke\.forum|{own})$",
    }


def dead_letter_queue_arguments(
    max_length: int = DEAD_LETTERS_MAX_LENGTH, max_bytes: int = DEAD_LETTERS_MAX_BYTES
) -> FieldTable:
    """``yoke.dead-letters``: quorum, bounded, its overflow dead-lettered to be counted."""
    return {
        "x-queue-type": "quorum",
        "x-max-length": max_length,
        "x-max-length-bytes": max_bytes,
        "x-overflow": "drop-head",
        "x-dead-letter-exchange": DROPPED_LETTERS_EXCHANGE,
    }


def dropped_letters_queue_arguments() -> FieldTable:
    """What the dead letters dropped pass through on their way to being counted: bounded, and
    dead-lettered nowhere."""
    return {
        "x-queue-type": "quorum",
        "x-max-length": DROPPED_LETTERS_MAX_LENGTH,
        "x-overflow": "drop-head",
    }


def dead_letters_policy(
    max_length: int = DEAD_LETTERS_MAX_LENGTH, max_bytes: int = DEAD_LETTERS_MAX_BYTES
) -> dict[str, Any]:
    """The bound of :func:`dead_letter_queue_arguments` as a policy's body (management API)."""
    return {
        "pattern": "^" + DEAD_LETTER_QUEUE.replace(".", r"\.") + "$",
        "apply-to": "queues",
        "priority": 1,
        "definition": {
            "max-length": max_length,
            "max-length-bytes": max_bytes,
            "overflow": "drop-head",
            "dead-letter-exchange": DROPPED_LETTERS_EXCHANGE,
        },
    }


# Invariant 14 for bridges' queues: a RabbitMQ policy on every bridge.* queue (applied by
# yoke publisher create; deploy/rabbitmq/definitions.json has it for compose). A slow bridge
# loses its oldest lines (drop-head) rather than the broker's memory, and never blocks the
# mesh's publishes (reject-publish would nack the forum exchange's every publish).
BRIDGE_QUEUE_POLICY = "yoke-bridge-queues"


def bridge_queue_policy(max_length: int, max_bytes: int) -> dict[str, Any]:
    """The policy's body for the management API (``PUT /api/policies/<vhost>/<name>``)."""
    return {
        "pattern": r"^bridge\.",
        "apply-to": "queues",
        "priority": 0,
        "definition": {
            "max-length": max_length,
            "max-length-bytes": max_bytes,
            "overflow": "drop-head",
        },
    }


# Where the door may answer a command (its reply_to), besides RabbitMQ's direct reply-to: the
# HTTP gateway's reply queues, and the CLI's when it runs as the services' own user.
DIRECT_REPLY_PREFIX = "amq.rabbitmq.reply-to"
GATEWAY_REPLY_QUEUE_PREFIX = "yoke.gateway.replies."
CLI_REPLY_QUEUE_PREFIX = "yoke.cli."

# What the services' own RabbitMQ user may do (deploy/rabbitmq/definitions.json gives it exactly
# this, and no tag: it never uses the management API): everything named yoke.*, and publish
# through the default exchange, which is how ingestion answers a command on its reply_to queue
# (a bridge's own queue) and how a dead letter goes back to the queue it died in.
SERVICE_PERMISSIONS = {
    "configure": r"^yoke\..*",
    "write": r"^(yoke\..*|amq\.default)$",
    "read": r"^yoke\..*",
}


def tool_queue(tool: str) -> str:
    """Where a worker tool's calls wait for its workers."""
    return f"{TOOL_QUEUE_PREFIX}{tool}"


def tool_user(tool: str, vhost: str) -> str:
    """The RabbitMQ user a worker of ``tool`` connects as, in the mesh on ``vhost``.

    Users are the broker's, not a vhost's: on a broker shared by several meshes (a vhost each)
    the name carries the vhost, ``tool-VHOST.NAME``, so that two meshes' workers of one tool
    never collide; a tool's name has no dot, so the name is the pair's alone. The default
    vhost's keep ``tool-NAME``, the name they always had.
    """
    if vhost == "/":
        return f"{TOOL_USER_PREFIX}{tool}"
    return f"{TOOL_USER_PREFIX}{vhost}.{tool}"


def tool_of_user(user: str, vhost: str) -> str | None:
    """The tool whose worker RabbitMQ user ``user`` is, in the mesh on ``vhost`` (None: no
    tool's): :func:`tool_user`'s exact inverse, and a ``tool-NAME`` made on another vhost
    before names carried it (the broker lets it in only where it was given permissions)."""
    if not user.startswith(TOOL_USER_PREFIX):
        return None
    name = user[len(TOOL_USER_PREFIX) :]
    own = f"{vhost}."
    if vhost != "/" and name.startswith(own):
        name = name[len(own) :]
    return name if name and "." not in name else None


def tool_worker_permissions(tool: str) -> dict[str, str]:
    """Read its own call queue, write commands, configure nothing (it never declares)."""
    return {
        "configure": "^$",
        "write": r"^yoke\.commands$",
        "read": f"^{re.escape(tool_queue(tool))}$",
    }


def tool_queue_arguments() -> FieldTable:
    """Quorum, competing consumers (no single active consumer); each call expires at its
    deadline (per-message expiration), and a call that crashed workers this many times is
    dropped (its deadline ends it in the store)."""
    return {"x-queue-type": "quorum", "x-delivery-limit": DELIVERY_LIMIT}


# Every declaration of a shard or intake queue uses exactly these (a mismatch is refused).
QUORUM_QUEUE: dict[str, Any] = {"durable": True, "arguments": quorum_queue_arguments()}

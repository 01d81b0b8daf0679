"""Upgrades of a broker that an earlier build set up: run at every start, idempotent.

Each undoes or reads past what a 0.1.0 build made before the change named beside it; where
there is nothing to undo it costs a few calls that change nothing. All of it may be removed in
:data:`REMOVABLE_IN`: a deployment upgrading to that version must first have run a 0.1.0 build
with this module once (every service started, so every binding and index is done). What stays
compatible with older documents as they are read (``tools.catalog.OLD_SCHEMA_FIELD``, tokens
without a random namespace) is part of those documents' shape, not an upgrade: it stays.
"""

from __future__ import annotations

from aio_pika.abc import AbstractExchange

from yoke.bus.topology import EVENT_HEADER, KIND_HEADER, TYPE_HEADER, Interest

REMOVABLE_IN = "0.2.0"

# Bindings of shard exchanges to yoke.events made before route exchanges existed: each
# delivered every event twice.
LEGACY_SHARD_BINDINGS = (
    "conversation.message.posted.#",
    "agent.forum.joined.#",
    "agent.monologue.compacted.#",
)

# Route bindings of earlier versions, by service: each delivered more than it acts on now.
LEGACY_INTERESTS: dict[str, tuple[Interest, ...]] = {
    # Follow-up took every forum line; now only those of joins that have it (FOLLOWED_HEADER).
    "followup": (
        {EVENT_HEADER: "conversation.message.posted", KIND_HEADER: "forum", TYPE_HEADER: "message"},
    ),
    # Ingestion took every forum line; now not those its door copied as it accepted them.
    "ingestion": (
        {EVENT_HEADER: "conversation.message.posted", KIND_HEADER: "forum", TYPE_HEADER: "message"},
    ),
}


async def unbind_legacy_routes(
    shards: AbstractExchange,
    events: AbstractExchange,
    route: AbstractExchange,
    service: str,
    interests: list[Interest],
) -> None:
    """Unbind from a service's shard exchange what earlier versions bound to it, before
    ``Bus.declare_shards`` binds this version's ``interests``."""
    for legacy in LEGACY_SHARD_BINDINGS:
        await shards.unbind(events, routing_key=legacy)
    for stale in LEGACY_INTERESTS.get(service, ()):
        if stale not in interests:
            await shards.unbind(route, routing_key="", arguments={"x-match": "all", **stale})

"""The store: MongoDB, and nothing of the broker.

``Store`` (collections, indexes, seq allocation, history reads, instance state: ``database``),
the outbox behind "no lost events", set-aside failures, the retention sweep, the gateway's
tokens, published agents, webhook subscriptions, the door's rate limits and the forum list.
It may import ``yoke.core`` only; ``_upgrades`` is its own.
"""

__all__ = [
    "database",
    "failures",
    "forum_list",
    "outbox",
    "publishing",
    "rate_limit",
    "retention",
    "tokens",
    "webhooks",
]

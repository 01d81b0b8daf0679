"""Upgrades of a store that an earlier build set up: run at every start, idempotent.

Each undoes or reads past what a 0.1.0 build made before the change named beside it; all of it
may be removed with the broker's upgrades (``yoke.bus.broker.upgrades.REMOVABLE_IN``).
"""

from __future__ import annotations

from typing import Any

from pymongo.asynchronous.collection import AsyncCollection
from pymongo.errors import OperationFailure

Doc = dict[str, Any]
INDEX_NOT_FOUND = 27


async def drop_conversation_bucket_index(messages: AsyncCollection[Doc]) -> None:
    """Drop ``conv_bucket``, the ``(conversationId, bucket)`` index that ``conv_bucket_key``
    replaced: its presence misleads FerretDB's planner (see ``yoke.store.database.bucket_key``)."""
    try:
        await messages.drop_index("conv_bucket")
    except OperationFailure as error:
        if error.code != INDEX_NOT_FOUND:  # gone already, or another service dropped it
            raise


async def lines_before_buckets(
    messages: AsyncCollection[Doc], conversation_id: str, after_seq: int, up_to_seq: int
) -> list[Doc]:
    """A range read the slow way (FerretDB reads the whole conversation for it), for when its
    buckets held fewer lines than the range: lines written before ``convBucket`` have none."""
    return await messages.find(
        {"conversationId": conversation_id, "seq": {"$gt": after_seq, "$lte": up_to_seq}}
    ).to_list()

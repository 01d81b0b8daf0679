"""A stand-in for an AMQP delivery, for the dispatcher's pure-logic tests."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from yoke.bus import topology


@dataclass
class Delivery:
    """Just what the dispatcher reads of a delivery, and whether it was acked."""

    message_id: str
    conversation: str
    acked: bool = False
    headers: dict[str, Any] = field(default_factory=dict)
    routing_key: str = "conversation.message.posted.x"
    exchange: str = "yoke.test.shards"
    body: bytes = b"{}"
    reply_to: str | None = None
    correlation_id: str | None = None

    def __post_init__(self) -> None:
        self.headers[topology.CONVERSATION_HEADER] = self.conversation

    async def ack(self) -> None:
        self.acked = True

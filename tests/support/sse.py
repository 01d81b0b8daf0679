"""A test client's view of the gateway's ``/stream``: Server-Sent Events, one at a time."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any

import httpx


@dataclass
class Event:
    event: str
    data: dict[str, Any]
    id: str | None


@dataclass
class EventReader:
    """Events from an open response, each awaited with a deadline.

    ``delta`` events (drafts) are set aside in :attr:`deltas` unless asked for, so a test of
    lines and activity reads the same whether or not its model streams.
    """

    response: httpx.Response
    deltas: list[Event] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.lines = self.response.aiter_lines()

    async def next(self, timeout: float = 30, *, deltas: bool = False) -> Event:
        async with asyncio.timeout(timeout):
            while True:
                event = await self._read()
                if event.event != "delta" or deltas:
                    return event
                self.deltas.append(event)

    async def _read(self) -> Event:
        fields: dict[str, str] = {}
        async for line in self.lines:
            if line == "":
                if "data" in fields:
                    return Event(
                        fields.get("event", "message"), json.loads(fields["data"]), fields.get("id")
                    )
                fields.clear()
                continue
            if line.startswith(":"):
                continue
            name, _, value = line.partition(":")
            fields[name] = value[1:] if value.startswith(" ") else value
        raise AssertionError("the stream ended")

    async def messages(self, count: int, timeout: float = 30) -> tuple[list[Event], list[Event]]:
        """The next ``count`` message events, and the activity events among them."""
        messages: list[Event] = []
        activity: list[Event] = []
        while len(messages) < count:
            event = await self.next(timeout)
            (messages if event.event == "message" else activity).append(event)
        return messages, activity

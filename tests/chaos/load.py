"""People typing: one sender per forum submits numbered lines through ``yoke.commands``.

A sender behaves like a careful bridge: it retries a line with the same idempotency key until
the door answers, and only then types the next one, so each forum's lines have one intended
order. Faults make submits time out or fail; that is expected and only delays the person.
Given ``answered``, a person also waits for the agent's answer before typing on (as one does
with an agent that needs tools: a line typed during a tool round is answered with the round's
results, by one answer for both), for up to ``answer_timeout``.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from urllib.parse import urlsplit, urlunsplit

from yoke.client import Client
from yoke.core.ids import new_id

TEXT_PATTERN = re.compile(r"^chaos forum (\d+) line (\d+)$")


def line_text(forum: int, index: int) -> str:
    return f"chaos forum {forum} line {index}"


def parse_text(text: str) -> tuple[int, int] | None:
    """(forum number, line number) of a line this load typed, else None."""
    found = TEXT_PATTERN.match(text)
    return (int(found.group(1)), int(found.group(2))) if found else None


def named(amqp_url: str, name: str) -> str:
    """The URL (each node's of a list) with a connection name, so the harness can tell its own
    connections apart."""
    named_nodes = []
    for node in amqp_url.split(","):
        parts = urlsplit(node)
        query = f"{parts.query}&name={name}" if parts.query else f"name={name}"
        named_nodes.append(urlunsplit(parts._replace(query=query)))
    return ",".join(named_nodes)


@dataclass
class Line:
    forum: int
    forum_id: str
    index: int
    key: str
    first_try: float  # time.monotonic() of the first attempt
    attempts: int = 0
    message_id: str | None = None
    accepted_at: float | None = None
    rejected: str | None = None

    @property
    def text(self) -> str:
        return line_text(self.forum, self.index)

    def describe(self) -> str:
        return f"forum {self.forum} line {self.index} (id {self.message_id or '?'})"


@dataclass
class Load:
    amqp_url: str
    forum_ids: list[str]
    interval: float  # seconds between one forum's lines
    reply_timeout: float = 5.0
    answered: Callable[[str], bool] | None = None  # by the line's message id
    answer_timeout: float = 60.0
    max_lines: int | None = None  # per forum
    lines: list[Line] = field(default_factory=list)
    errors: dict[str, int] = field(default_factory=dict)
    stopping: asyncio.Event = field(default_factory=asyncio.Event)
    giving_up: asyncio.Event = field(default_factory=asyncio.Event)

    async def run(self) -> None:
        """Until ``stopping``: type lines. After it, finish the line in hand (or give up)."""
        await asyncio.gather(*(self._person(n) for n in range(len(self.forum_ids))))

    async def _person(self, forum: int) -> None:
        client: Client | None = None
        index = 0
        try:
            while not self.stopping.is_set() and index != self.max_lines:
                index += 1
                line = Line(forum, self.forum_ids[forum], index, new_id(), time.monotonic())
                self.lines.append(line)
                client = await self._deliver(line, client)
                await self._await_answer(line)
                pause = line.first_try + self.interval - time.monotonic()
                if pause > 0:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self.stopping.wait(), pause)
        finally:
            if client is not None:
                with contextlib.suppress(Exception):
                    await client.__aexit__(None, None, None)

    async def _deliver(self, line: Line, client: Client | None) -> Client | None:
        """Submit until accepted or rejected; a broken client is replaced."""
        silent = 0
        while not self.giving_up.is_set():
            line.attempts += 1
            try:
                if client is None:
                    client = await self._open(line.forum)
                # A publish on a connection that is coming back may hang: bound it too.
                async with asyncio.timeout(self.reply_timeout + 5):
                    reply = await client.submit(
                        line.forum_id,
                        line.text,
                        external_id=f"chaos:person-{line.forum}",
                        display_name=f"person {line.forum}",
                        idempotency_key=line.key,
                        reply_timeout=self.reply_timeout,
                    )
            except Exception as error:
                silent = silent + 1 if isinstance(error, TimeoutError) else 3
                self._count(
                    "no answer from the door in time"
                    if isinstance(error, TimeoutError)
                    else type(error).__name__
                )
                if silent < 3:
                    continue
                silent = 0
                if client is not None:
                    with contextlib.suppress(Exception):
                        await client.__aexit__(None, None, None)
                client = None
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.giving_up.wait(), 0.5)
            else:
                if reply.status == "accepted":
                    line.message_id = reply.message_id
                    line.accepted_at = time.monotonic()
                else:
                    line.rejected = reply.error or "rejected"
                return client
        return client

    async def _await_answer(self, line: Line) -> None:
        if self.answered is None or line.message_id is None:
            return
        answered = self.answered
        deadline = time.monotonic() + self.answer_timeout
        while not answered(line.message_id) and not self.giving_up.is_set():
            if time.monotonic() > deadline:
                self._count(f"no answer within {self.answer_timeout:.0f} s: typed on")
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.giving_up.wait(), 0.2)

    async def _open(self, forum: int) -> Client:
        client = Client(named(self.amqp_url, f"chaos-person-{forum}"))
        try:
            async with asyncio.timeout(15):
                await client.__aenter__()
        except BaseException:
            with contextlib.suppress(Exception):
                await client.__aexit__(None, None, None)
            raise
        return client

    def _count(self, what: str) -> None:
        self.errors[what] = self.errors.get(what, 0) + 1

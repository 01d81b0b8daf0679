"""Calling a published agent: what the gateway's MCP and A2A doors both stand on.

A call is a person's line in the forum kept for the caller (:mod:`yoke.runtime.kept_forums`:
the door makes the forum and joins the agent with the first line, as the gateway may not), and
its answer is the agent's line in reply to it. Both are in the store, so how a call ended is
always read from there (:func:`turn_outcome`): a door that restarts, or another replica, finds
it as well as the one that waited. While waiting, the forum's events (the gateway's
:class:`~services.gateway.stream.Hub`) bring the agent's deltas and approval requests and wake
the reader when a line lands; the store is read again after every line event and now and then,
so a lost event delays an answer, never loses it (invariant 1).

The caller speaks as its token only (invariant 13): the line's author is ``<door>:<token
namespace>`` and its idempotency key is in the token's namespace, so it counts against the
token's lines per minute like a REST line.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass

from services.gateway.deps import Gateway, unavailable
from services.gateway.limits import REFUSALS
from services.gateway.stream import BindTimeout
from services.gateway.submitting import line_command, submit_line
from yoke.core.models import (
    AgentDelta,
    ApprovalRequested,
    CallerDoor,
    CommandAuthor,
    KeptForum,
    Message,
    MessagePosted,
)
from yoke.store import publishing
from yoke.store.database import Store
from yoke.store.publishing import PublishedAgent, find_published, published_agents
from yoke.store.tokens import Token

# How far past the caller's line a turn's outcome is looked for (a kept forum is one caller's:
# its lines are the caller's and the agent's replies).
OUTCOME_LINES = 200
# ... a window at a time, this many at most before it looks at the newest lines only.
OUTCOME_WINDOWS = 10
# A caller waiting for its answer reads the store this often when no event comes.
POLL_SECONDS = 2.0


@dataclass(frozen=True)
class Delta:
    """A piece of the agent's reply, as the model writes it (``index`` from 0)."""

    index: int
    text: str


@dataclass(frozen=True)
class Waiting:
    """A tool call of the turn waits for a person's approval."""

    tool: str
    call_id: str | None = None


@dataclass(frozen=True)
class Answered:
    """The agent's reply line."""

    message: Message


@dataclass(frozen=True)
class Failed:
    """The turn gave up: the forum notice's plain words (no ids, no stack traces)."""

    text: str
    reason: str | None = None


TurnEvent = Delta | Waiting | Answered | Failed
Outcome = Answered | Failed


async def callable_agent(state: Gateway, token: Token, name: str) -> PublishedAgent | None:
    """The agent published as ``name``, if the token may call it (else None: to the caller,
    an unpublished name and one it may not call look alike)."""
    if not token.may_call(name):
        return None
    return await find_published(state.store, name)


async def callable_agents(state: Gateway, token: Token) -> list[PublishedAgent]:
    if not token.can_call:
        return []
    return [agent for agent in await published_agents(state.store) if token.may_call(agent.id)]


def caller_id(token: Token, door: CallerDoor) -> str:
    """The external id a door's lines are written as: one caller per token and door."""
    return f"{door}:{token.namespace or token.id}"


def kept_forum_id(token: Token, door: CallerDoor, agent: PublishedAgent, key: str) -> str:
    """The forum kept for this token's ``key`` (an MCP ``conversation``, an A2A contextId)."""
    return publishing.kept_forum_id(door, token.namespace or token.id, agent, key)


async def post_line(
    state: Gateway,
    token: Token,
    door: CallerDoor,
    agent: PublishedAgent,
    key: str,
    text: str,
    idempotency_key: str | None = None,
) -> Message:
    """The caller's line in its kept forum, as stored (its seq is where the answer is looked
    for after); the door's refusal as an :class:`ApiError` (429 with Retry-After past the
    token's lines per minute, 413, 503 when the mesh does not answer)."""
    command = line_command(
        token,
        kept_forum_id(token, door, agent, key),
        caller_author(token, door),
        text,
        idempotency_key,
        KeptForum(door=door, agent=agent.id, key=key),
    )
    reply = await submit_line(state, command)
    assert reply.message_id is not None
    line = await state.store.get_message(reply.message_id)
    if line is None:  # accepted means stored: only a store that lost it comes here
        raise unavailable("the line was accepted but cannot be read back; try again")
    return line


def caller_author(token: Token, door: CallerDoor) -> CommandAuthor:
    """Who a door's caller speaks as: the token, one caller per token and door."""
    return CommandAuthor(external_id=caller_id(token, door), display_name=token.id)


def outcome_of(line: Message, candidate: Message) -> TurnEvent | None:
    """What ``candidate`` (a forum line) says of ``line``'s turn: its answer, its end, a wait
    for an approver (the approval notice: the turn goes on), or nothing.

    An agent line ends the turn when it replies to ``line`` or covers it (``coversSeq``): a
    reply that answered ``line`` together with newer lines (a burst under ``coalesce`` or
    ``interrupt``, lines held through a tool round) is its answer, a stop's notice its end."""
    if candidate.role != "agent":
        return None
    replies = candidate.meta.in_reply_to == line.id
    covers = candidate.meta.covers_seq is not None and candidate.meta.covers_seq >= line.seq
    if not (replies or covers):
        return None
    if candidate.type == "message":
        return Answered(candidate)
    reason = candidate.meta.notice_reason
    if reason == "approval":
        return Waiting(tool=candidate.text) if replies else None
    return Failed(candidate.text, reason)


async def turn_outcome(
    store: Store, forum_id: str, line: Message, *, through: int | None = None
) -> Outcome | None:
    """How ``line``'s turn ended (None while it runs), from the store alone: the same from any
    gateway, after any restart. A head lookup and bounded range reads: the lines after
    ``line`` a window at a time (its end is the first that ends it), at most
    :data:`OUTCOME_WINDOWS` of them, then the newest window (a caller that flooded its own
    conversation still learns that its turn ended). ``through``: only an end at or before that
    seq counts (a push's cursor), read in place of the head."""
    head = await store.last_seq(forum_id) if through is None else through
    after = line.seq
    for _ in range(OUTCOME_WINDOWS):
        if after >= head:
            return None
        found = _ended(
            line,
            await store.history(
                forum_id, after_seq=after, up_to_seq=min(head, after + OUTCOME_LINES)
            ),
        )
        if found is not None:
            return found
        after += OUTCOME_LINES
    if after >= head:
        return None
    newest = max(after, head - OUTCOME_LINES)
    return _ended(line, await store.history(forum_id, after_seq=newest, up_to_seq=head))


def _ended(line: Message, lines: list[Message]) -> Outcome | None:
    for candidate in lines:
        found = outcome_of(line, candidate)
        if isinstance(found, Answered | Failed):
            return found
    return None


async def follow_turn(
    state: Gateway, forum_id: str, line: Message, *, deadline: float | None = None
) -> AsyncGenerator[TurnEvent]:
    """The turn of ``line`` as it goes: deltas and approval waits as they come, then its
    answer or its end (the generator stops after it). Past ``deadline`` (``time.monotonic``)
    it stops without one: the turn goes on in the mesh, and the store has its end later."""
    settings = state.settings
    async with contextlib.AsyncExitStack() as stack:
        try:
            subscriber = await stack.enter_async_context(
                state.hub.subscribe(
                    forum_id,
                    buffer_bytes=settings.gateway_stream_buffer_bytes,
                    bind_timeout=settings.gateway_bind_timeout_seconds,
                )
            )
        except BindTimeout as error:
            REFUSALS.labels("bind_timeout").inc()
            raise unavailable(f"{error}; try again") from error
        # Subscribed first: an answer stored before this read is found here, one after it has
        # its event on the way.
        ended = await turn_outcome(state.store, forum_id, line)
        while ended is None:
            wait = POLL_SECONDS
            if deadline is not None:
                wait = min(wait, deadline - time.monotonic())
                if wait <= 0:
                    return
            try:
                item = await asyncio.wait_for(subscriber.take(), wait)
            except TimeoutError:
                item = None  # quiet: read the store (an event may have been lost)
            if subscriber.overflowed:
                await asyncio.sleep(POLL_SECONDS)  # its events are dropped: the store alone
            elif isinstance(item, AgentDelta):
                if item.in_reply_to == line.id:
                    yield Delta(item.index, item.text)
                continue
            elif isinstance(item, ApprovalRequested):
                yield Waiting(item.tool, item.call_id)  # the caller's forum: its turn's call
                continue
            elif isinstance(item, MessagePosted):
                found = outcome_of(line, item.message)
                if isinstance(found, Answered | Failed):
                    ended = found
                    break
                if found is not None or item.seq <= line.seq:
                    continue  # an approval notice (its request came as an event) or an old line
            elif item is not None:
                continue  # activity, a decision
            ended = await turn_outcome(state.store, forum_id, line)
        yield ended

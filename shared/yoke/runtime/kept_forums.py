"""The forums kept for outside callers of a published agent (the gateway's MCP and A2A doors).

A caller names a conversation by a key of its own; the forum is derived from it
(:func:`yoke.store.publishing.kept_forum_id`) and made, with the published agent joined, by the door
when the first line arrives: the gateway may not write forums or joins (its store user is
read-mostly), and one command makes the forum, the join and the line in order, so the line is
the join's first to answer. Known-joined forums are remembered per process: later lines cost
nothing here.
"""

from __future__ import annotations

from dataclasses import dataclass

from yoke.core.lru import LRUCache
from yoke.core.models import KeptForum, RejectCode
from yoke.runtime.joins import create_forum, join_conversation, participant_id
from yoke.runtime.posting import Poster
from yoke.store.database import Store
from yoke.store.publishing import PublishedAgent, find_published, kept_forum_id


class KeptForumRefused(Exception):
    """The line cannot open its forum (the message says why, in the caller's words)."""

    def __init__(self, message: str, code: RejectCode = "unknown_conversation") -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class Opening:
    """A kept forum found to be the caller's, to make and join."""

    forum_id: str
    title: str
    published: PublishedAgent
    seen: str
    namespace: str


class KeptForums:
    def __init__(self, store: Store, poster: Poster, per_token: int = 10_000) -> None:
        self.store = store
        self.poster = poster
        # Bounded (invariant 14): each key is a forum and a join, kept as long as the forum.
        self.per_token = per_token
        self._joined: LRUCache[str, bool] = LRUCache()

    async def check(self, forum_id: str, kept: KeptForum, namespace: str) -> Opening | None:
        """What opening ``forum_id`` takes (None: nothing, this process saw it joined); raises
        :class:`KeptForumRefused` when ``forum_id`` is not the forum ``kept`` names for
        ``namespace`` (no line from the gateway joins an agent to any other forum) or nothing
        is published under its name."""
        seen = "\x1f".join((forum_id, namespace, kept.door, kept.agent, kept.key))
        if seen in self._joined:
            return None
        published = await find_published(self.store, kept.agent)
        if published is None:
            raise KeptForumRefused(f"no agent is published as {kept.agent!r}")
        if kept_forum_id(kept.door, namespace, published, kept.key) != forum_id:
            raise KeptForumRefused(
                f"conversation {forum_id!r} is not the forum kept for this caller's "
                f"{kept.door} key with {kept.agent!r}"
            )
        if await self.store.get_conversation(forum_id) is None:
            kept_now = await self.store.conversations.count_documents({"keptFor": namespace})
            if kept_now >= self.per_token:
                raise KeptForumRefused(
                    f"this caller keeps {kept_now} conversations, the most "
                    f"YOKE_KEPT_FORUMS_PER_TOKEN ({self.per_token}) allows: go on in one of "
                    "them, or ask the operator for more",
                    "too_many_conversations",
                )
        title = f"{kept.door} caller of {published.id}"
        return Opening(forum_id, title, published, seen, namespace)

    async def open(self, opening: Opening) -> None:
        """Make the forum and join its agent where they are not yet (idempotent)."""
        forum = await self.store.get_conversation(opening.forum_id)
        if forum is None:
            forum = await create_forum(
                self.store, opening.title, forum_id=opening.forum_id, kept_for=opening.namespace
            )
        elif forum.kept_for is None:  # kept before forums said whose they are
            await self.store.mark_kept(forum.id, opening.namespace)
        agent = opening.published.agent_actor_id
        # Joined again if a crash came between the forum and its join.
        participant = await self.store.get_participant(participant_id(forum.id, agent))
        if participant is None or participant.left_at is not None:
            await join_conversation(self.store, self.poster, agent, forum.id)
        self._joined[opening.seen] = True

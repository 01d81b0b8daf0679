"""Egress's handlers: joins learned from ``agent.forum.joined`` (kept in MongoDB, followed
through ``agent.monologue.compacted``), and agent monologue lines forwarded, text parts only,
as the agent's forum participant. The forum line's id derives from the monologue line's, so a
redelivery posts nothing twice.
"""

from __future__ import annotations

import json
import logging

from aio_pika.abc import AbstractIncomingMessage

from yoke.bus import topology
from yoke.bus.consumer import key_from_header
from yoke.core import tracing
from yoke.core.ids import derive_id, forwarded_line_id
from yoke.core.lru import LRUCache
from yoke.core.models import (
    AgentForumJoined,
    Message,
    MessageMeta,
    MessagePosted,
    MonologueCompacted,
    TextPart,
)
from yoke.runtime.chain import chain_of
from yoke.runtime.joins import Join, join_id, participant_id
from yoke.runtime.service import Service, delivery_headers
from yoke.store.database import Store

log = logging.getLogger(__name__)

JOINS = "egress_joins"


class Egress:
    def __init__(self, service: Service) -> None:
        self.service = service
        self.store: Store = service.store
        self.joins = service.store.db[JOINS]
        # Monologues whose predecessors are known to be fully forwarded.
        self._settled: LRUCache[str, bool] = LRUCache()
        self._joins: LRUCache[str, Join] = LRUCache()

    async def remember_join(self, event: AgentForumJoined) -> None:
        join = Join(**event.model_dump())
        await self.joins.replace_one(
            {"_id": join_id(event.agent_actor_id, event.forum_id)},
            join.model_dump(mode="json", by_alias=True),
            upsert=True,
        )

    async def follow_compaction(self, event: MonologueCompacted) -> None:
        await self.joins.update_one(
            {"_id": join_id(event.agent_actor_id, event.forum_id)},
            {"$set": {"monologueId": event.monologue_id}},
        )

    async def find_join(self, agent_actor_id: str, forum_id: str) -> Join | None:
        """The join an agent line belongs to; what egress uses of it (the forum and the agent's
        participant there) never changes, so each is read once per process."""
        key = join_id(agent_actor_id, forum_id)
        if (known := self._joins.get(key)) is not None:
            return known
        join = await self._read_join(agent_actor_id, forum_id)
        if join is not None:
            self._joins[key] = join
        return join

    async def _read_join(self, agent_actor_id: str, forum_id: str) -> Join | None:
        document = await self.joins.find_one({"_id": join_id(agent_actor_id, forum_id)})
        if document is not None:
            document.pop("_id")
            return Join.model_validate(document)
        # agent.forum.joined travels on the forum's shard and may arrive after the first reply:
        # the participants written by the join say the same.
        forum_participant = await self.store.get_participant(
            participant_id(forum_id, agent_actor_id)
        )
        if forum_participant is None:
            return None
        monologue_id = str(forum_participant.metadata.get("monologueId") or "")
        return Join(
            agent_actor_id=agent_actor_id,
            forum_id=forum_id,
            forum_participant_id=forum_participant.id,
            monologue_id=monologue_id,
            monologue_participant_id=participant_id(monologue_id, agent_actor_id),
        )

    async def forward_agent_text(self, event: MessagePosted) -> None:
        """The agent's monologue line into its forum (a ``forward`` span)."""
        line = event.message
        with tracing.span(
            "forward",
            attributes={
                tracing.FORUM_ID: str(line.meta.source_conversation_id or ""),
                tracing.CONVERSATION_ID: line.conversation_id,
                tracing.MESSAGE_ID: line.id,
            },
        ):
            await self._forward(line)

    async def _forward(self, line: Message) -> None:
        if line.type == "notice":
            await self.forward_notice(line)
            return
        if not forwardable(line):
            return
        forum_id = str(line.meta.source_conversation_id)
        join = await self.find_join(line.author_actor_id, forum_id)
        if join is None:
            log.warning(
                "agent line names a forum the agent never joined",
                extra={"conversationId": line.conversation_id, "messageId": line.id},
            )
            return
        route = join_route()
        await self.forward_backlog(join, line.conversation_id, route)
        await self.post_to_forum(join, line, route)

    async def forward_backlog(
        self, join: Join, monologue_id: str, route: dict[str, str] | None = None
    ) -> None:
        """Replies still in flight from the monologue a compaction left go out first.

        Their events travel on another shard, perhaps another replica's, and may arrive after
        the new monologue's first reply; forwarding them here keeps the forum in the order the
        agent wrote (the late copies are no-ops: derived ids).
        """
        if monologue_id in self._settled:
            return
        participant = await self.store.get_participant(join.forum_participant_id)
        chain = chain_of(participant) if participant else []
        link = next((x for x in chain if x.to_monologue_id == monologue_id), None)
        if link is not None:
            await self.forward_backlog(join, link.from_monologue_id, route)
            pending: list[Message] = []
            # The swap ended the old monologue: nothing is written to it after this check.
            for line in reversed(await self.store.history(link.from_monologue_id)):
                if not forwardable(line):
                    continue
                if await self.store.get_message(forwarded_line_id(line.id)) is not None:
                    break
                pending.append(line)
            for line in reversed(pending):
                await self.post_to_forum(join, line, route)
        self._settled[monologue_id] = True

    async def forward_notice(self, notice: Message) -> None:
        """A monologue notice that concerns the forum's people (the agent could not answer):
        told there in its plain words, as a ``notice`` line of the agent's."""
        told = notice.meta.forum_notice
        forum_id = notice.meta.source_conversation_id
        if told is None or not forum_id or forum_id == notice.conversation_id:
            return
        join = await self.find_join(told.agent_actor_id, forum_id)
        if join is None:
            return
        await self.service.poster.post(
            Message(
                # One forum line for one event's notices, however many agents write them.
                id=derive_id("forum-notice", told.once_for)
                if told.once_for
                else forwarded_line_id(notice.id),
                conversation_id=join.forum_id,
                author_actor_id=told.agent_actor_id,
                participant_id=join.forum_participant_id,
                role="agent",
                type="notice",
                parts=[TextPart(text=told.text)],
                meta=MessageMeta(
                    causation_id=notice.id,
                    in_reply_to=notice.meta.in_reply_to,
                    agent_hops=notice.meta.agent_hops + 1,
                    notice_reason=told.reason,
                    covers_seq=notice.meta.covers_seq,
                ),
            )
        )

    async def post_to_forum(
        self, join: Join, line: Message, route: dict[str, str] | None = None
    ) -> None:
        await self.service.poster.post(
            Message(
                id=forwarded_line_id(line.id),
                conversation_id=join.forum_id,
                author_actor_id=line.author_actor_id,
                participant_id=join.forum_participant_id,
                role="agent",
                parts=[part for part in line.parts if isinstance(part, TextPart)],
                meta=MessageMeta(
                    # The monologue line it forwards, whose seq tells ingestion that monologue's
                    # head before its next copy there (yoke.runtime.service observes it).
                    source_conversation_id=line.conversation_id,
                    source_seq=line.seq,
                    causation_id=line.id,
                    in_reply_to=line.meta.in_reply_to,
                    agent_hops=line.meta.agent_hops + 1,
                    covers_seq=line.meta.covers_seq,
                ),
                usage=line.usage,
            ),
            route=route,
        )


def join_route() -> dict[str, str]:
    """What the processor said of the join on the monologue line (follow-up wanted, and the
    configuration's version), said again on its forum line: egress never reads the join's
    configuration itself."""
    headers = delivery_headers()
    return {
        name: str(headers[name])
        for name in (topology.FOLLOWED_HEADER, topology.CONFIG_VERSION_HEADER)
        if name in headers
    }


def forwardable(line: Message) -> bool:
    """Agent text written in a monologue for a forum; never context carried by compaction."""
    forum_id = line.meta.source_conversation_id
    return (
        line.role == "agent"
        and line.type == "message"
        and not line.meta.carried_from
        and bool(forum_id)
        and forum_id != line.conversation_id
        and any(isinstance(part, TextPart) for part in line.parts)
    )


def forum_lane(message: AbstractIncomingMessage) -> str:
    """Lanes per forum, not per monologue: after a compaction, replies from the old and the new
    monologue of one join must still reach the forum in the order they were written."""
    key = key_from_header(message)
    try:
        body = json.loads(message.body)
        forum = body["payload"]["message"]["meta"]["sourceConversationId"]
    except (ValueError, KeyError, TypeError):
        return key
    return forum if isinstance(forum, str) and forum else key


def register(service: Service) -> None:
    egress = Egress(service)
    service.lane_key = forum_lane
    service.on_event(AgentForumJoined, egress.remember_join)
    service.on_event(MonologueCompacted, egress.follow_compaction)
    service.on_event(
        MessagePosted,
        egress.forward_agent_text,
        where=[
            {"kind": "monologue", "type": "message", "role": "agent"},
            {"kind": "monologue", "type": "notice"},
        ],
    )

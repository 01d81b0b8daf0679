"""Egress's handlers: joins learned from ``agent.forum.joined`` (kept in MongoDB, followed
through ``agent.monologue.compacted``), and agent monologue lines forwarded, text parts only,
as the agent's forum participant. The forum line's id derives from the monologue line's, so a
redelivery posts nothing twice.
"""

from __future__ import annotations

import json
import logging

from aio_pika.abc import AbstractIncomingMessage

from yoke.consumer import key_from_header
from yoke.ids import derive_id
from yoke.joins import Join, join_id, participant_id
from yoke.models import (
    AgentForumJoined,
    Message,
    MessageMeta,
    MessagePosted,
    MonologueCompacted,
    TextPart,
)
from yoke.service import Service
from yoke.store import Store

log = logging.getLogger(__name__)

JOINS = "egress_joins"


class Egress:
    def __init__(self, service: Service) -> None:
        self.service = service
        self.store: Store = service.store
        self.joins = service.store.db[JOINS]

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
        line = event.message
        forum_id = line.meta.source_conversation_id
        if (
            line.role != "agent"
            or line.type != "message"
            or line.meta.carried_from  # context carried by compaction: forwarded already
            or not forum_id
            or forum_id == line.conversation_id
        ):
            return
        texts = [part for part in line.parts if isinstance(part, TextPart)]
        if not texts:
            return
        join = await self.find_join(line.author_actor_id, forum_id)
        if join is None:
            log.warning(
                "agent line names a forum the agent never joined",
                extra={"conversationId": line.conversation_id, "messageId": line.id},
            )
            return
        await self.service.poster.post(
            Message(
                id=derive_id("egress", line.id),
                conversation_id=forum_id,
                author_actor_id=line.author_actor_id,
                participant_id=join.forum_participant_id,
                role="agent",
                parts=list(texts),
                meta=MessageMeta(
                    causation_id=line.id,
                    in_reply_to=line.meta.in_reply_to,
                    agent_hops=line.meta.agent_hops + 1,
                ),
                usage=line.usage,
            )
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
    service.on_event(MessagePosted, egress.forward_agent_text)

"""Notices: what a step that ends without an answer leaves, so nobody waits in silence.

A notice is a monologue line for operators, never a trigger; its ``meta.forumNotice`` is what
egress tells the forum's people, in plain words (docs/architecture.md, "Failure policy").
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from services.processor.step import Context, carried_meta
from yoke.core.ids import SYSTEM_ACTOR_ID
from yoke.core.metrics import NOTICES
from yoke.core.models import ForumNotice, Message, MessageMeta, TextPart
from yoke.runtime.instances import ProcessorConfig

log = logging.getLogger(__name__)

# What the forum's people are told when a step ends without an answer, by notice reason (the
# monologue's notice keeps the details for operators).
FORUM_NOTICES: Mapping[str, str] = {
    "provider": "I could not answer: the model did not respond in time. Please try again.",
    "budget": "I could not answer: my budget for this conversation is spent.",
    "unpriced": "I could not answer: my model's price is unknown, so my cost budget cannot be "
    "kept. An operator can add its price to YOKE_PRICES.",
    "model": "I cannot switch to {model}: allowed: {allowed}. An operator can allow more models "
    "with allowedModels in this join's configuration.",
    "doom_loop": "I stopped: I kept asking for the same tool call. Ask again and I will try "
    "another way.",
    "failed": "I could not answer that: something went wrong on my side, and it was set aside "
    "for an operator.",
    "approval": "I will answer once a person decides whether I may use {tools}.",
    "held": "{name} has taken over this conversation; I will not answer here until it is "
    "handed back.",
    "handed_back": "{name} handed this conversation back to me.",
    "handoff": "I have asked a person to join.",
    "nobody_came": "No one could join right now. I am here again: write to me when you like.",
}


def forum_notice(config: ProcessorConfig, reason: str, text: str | None = None) -> ForumNotice:
    """What egress posts in the forum for a notice of ``reason`` (``text`` instead, if given)."""
    return ForumNotice(
        agent_actor_id=config.agent_actor_id, text=text or FORUM_NOTICES[reason], reason=reason
    )


async def post_notice(
    context: Context,
    trigger: Message,
    reason: str,
    text: str,
    *,
    forum_text: str | None = None,
    covers: int | None = None,
    once_for: str | None = None,
) -> None:
    """A line for operators in the monologue, never a trigger; egress tells the forum's people
    in plain words (:data:`FORUM_NOTICES`, or ``forum_text``), so nobody waits for an answer in
    silence. A step that gives up on the lines it was shown settles them (``covers``); the
    notices every agent of the forum writes of one line are one forum line (``once_for``)."""
    NOTICES.labels(reason).inc()
    log.warning(text, extra={"conversationId": trigger.conversation_id, "messageId": trigger.id})
    meta = carried_meta(context, trigger)
    meta.forum_notice = forum_notice(context.config, reason, forum_text)
    meta.forum_notice.once_for = once_for
    meta.covers_seq = covers
    await context.post(
        Message(
            id=context.effect_id("notice", reason),
            conversation_id=trigger.conversation_id,
            author_actor_id=SYSTEM_ACTOR_ID,
            role="user",
            type="notice",
            parts=[TextPart(text=text)],
            meta=meta,
        )
    )


def failure_meta(config: ProcessorConfig, line: Message) -> MessageMeta:
    """The routing of the notice of a line set aside: to the forum whose line went unanswered."""
    in_reply_to = line.meta.in_reply_to
    if line.meta.source_conversation_id == config.source_conversation_id:
        in_reply_to = line.meta.source_message_id or in_reply_to
    return MessageMeta(
        source_conversation_id=config.source_conversation_id,
        causation_id=line.id,
        in_reply_to=in_reply_to,
        agent_hops=line.meta.agent_hops,
        forum_notice=forum_notice(config, "failed"),
    )

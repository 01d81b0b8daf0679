"""When an A2A task's push subscription is over: once its cursor has passed the line that ended
the task's turn, however many lines came between the task's line and that end (a caller that
flooded its conversation), and not before."""

from __future__ import annotations

import types

from services.gateway import calling
from services.gateway.a2a.push import TaskPushRunner
from yoke.core.ids import new_id
from yoke.core.models import Message, MessageMeta, TextPart
from yoke.runtime.joins import create_forum
from yoke.store.database import Store
from yoke.store.webhooks import CURSORS, WebhookSubscription


async def test_a_push_ends_once_its_cursor_passed_an_end_far_after_its_line(store: Store) -> None:
    forum = await create_forum(store, "flooded")

    async def line(text: str, role: str = "user", meta: MessageMeta | None = None) -> Message:
        stored, _ = await store.insert_message(
            Message(
                id=new_id(),
                conversation_id=forum.id,
                author_actor_id="agent" if role == "agent" else "caller",
                role=role,  # type: ignore[arg-type]
                parts=[TextPart(text=text)],
                meta=meta or MessageMeta(),
            )
        )
        return stored

    asked = await line("the task's question")
    for index in range(calling.OUTCOME_LINES + 20):
        await line(f"the caller's flood, line {index}")
    answer = await line("the answer", "agent", MessageMeta(in_reply_to=asked.id))
    subscription = WebhookSubscription(
        id=new_id(), forum_id=forum.id, url="https://example.org/hook", secret="s", task_id="t"
    )
    runner = TaskPushRunner(types.SimpleNamespace(store=store), subscription, tasks=None)  # type: ignore[arg-type]

    async def follows() -> tuple[None, Message]:
        return None, asked

    runner._follows = follows  # type: ignore[method-assign,assignment]
    cursors = store.db[CURSORS]
    await cursors.insert_one({"_id": subscription.id, "forumId": forum.id, "seq": answer.seq - 1})
    assert not await runner._ended_before_cursor()  # the end is not delivered yet

    await cursors.update_one({"_id": subscription.id}, {"$set": {"seq": answer.seq}})
    assert await runner._ended_before_cursor()

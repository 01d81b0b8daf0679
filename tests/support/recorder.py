"""A test service: records every ``conversation.message.posted`` it handles, in a real process.

Lines steer it: ``sleep:<seconds>`` sleeps in the handler, ``poison`` always raises. Each
handled line also posts one effect message (id derived from the line) into ``effects-<conv>``,
so a redelivery that wrote twice would show.
"""

from __future__ import annotations

import asyncio
import os
import time

from yoke.core.ids import derive_id
from yoke.core.models import Message, MessagePosted, TextPart
from yoke.runtime.service import Service, run_service

EFFECTS_PREFIX = "effects-"


def register(service: Service) -> None:
    handled = service.store.db["handled"]
    pid = os.getpid()
    delay = float(os.environ.get("RECORDER_DELAY", "0"))

    async def on_posted(event: MessagePosted) -> None:
        if event.conversation_id.startswith(EFFECTS_PREFIX):
            return
        started = time.time()
        text = event.message.text
        if text == "poison":
            raise RuntimeError("poison line refused")
        if text.startswith("sleep:"):
            await asyncio.sleep(float(text.split(":", 1)[1]))
        elif delay:
            await asyncio.sleep(delay)
        await service.poster.post(
            Message(
                id=derive_id("effect", event.message_id),
                conversation_id=EFFECTS_PREFIX + event.conversation_id,
                author_actor_id="recorder",
                parts=[TextPart(text=event.message_id)],
            )
        )
        await handled.insert_one(
            {
                "conversationId": event.conversation_id,
                "seq": event.seq,
                "messageId": event.message_id,
                "pid": pid,
                "startedAt": started,
                "endedAt": time.time(),
            }
        )

    service.on_event(MessagePosted, on_posted)


if __name__ == "__main__":
    run_service(os.environ.get("RECORDER_SERVICE", "recorder"), register)

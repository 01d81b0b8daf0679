"""What the people-take-over tests share: a bridge's publisher and what it says, HTTP tokens,
an agent that asks for a person, the forum's escalations and events, and the forum's lines
sorted the way those tests read them (tests/e2e/test_takeover*.py,
tests/ingestion/test_door_holds.py)."""

from __future__ import annotations

import contextlib
import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

import aio_pika
import httpx

from tests.support.mesh import agent_lines
from tests.support.processes import eventually
from tests.support.worker_process import as_user
from yoke.cli.publishers import create_publisher, management_of
from yoke.client import Client
from yoke.core.ids import new_id
from yoke.core.models import Envelope, Message, SubmitReply
from yoke.core.slash import HANDBACK, TAKEOVER, slash_command
from yoke.llm.base import ScriptedCall, ScriptedOutput
from yoke.runtime.escalations import Escalation, Escalations, EscalationState
from yoke.runtime.join_config import JoinConfig
from yoke.store.database import Store
from yoke.store.tokens import create_token, ensure_token_indexes

EVERY: tuple[EscalationState, ...] = ("open", "claimed", "ended")


@contextlib.asynccontextmanager
async def publisher_bridge(amqp_url: str, management_url: str) -> AsyncIterator[Client]:
    """An outside publisher, made as ``yoke publisher create`` makes one, connected; its
    RabbitMQ user is deleted afterwards so test runs leave no users behind."""
    management = management_of(amqp_url, management_url)
    name = f"bridge-{uuid.uuid4().hex[:8]}"
    password = await create_publisher(management, name)
    try:
        async with Client(as_user(amqp_url, name, password)) as client:
            yield client
    finally:
        async with httpx.AsyncClient(base_url=management.url, auth=management.auth) as api:
            await api.delete(f"/api/users/{name}")


async def bridge_says(
    bridge: Client,
    forum_id: str,
    who: str,
    text: str,
    *,
    key: str | None = None,
    name: str | None = None,
) -> SubmitReply:
    """A line of the bridge's person ``who`` (stored as ``amqp:<bridge>:<who>``); a fresh
    idempotency key unless a test reuses one on purpose."""
    body: dict[str, Any] = {
        "conversationId": forum_id,
        "author": {"externalId": who, "displayName": name or who.title()},
        "text": text,
        "idempotencyKey": key or uuid.uuid4().hex,
    }
    return await bridge.submit_raw(json.dumps(body).encode())


async def token(
    store: Store,
    forums: list[str] | None,
    *,
    can_take_over: bool = False,
    can_call: list[str] | None = None,
) -> tuple[str, str]:
    """A new HTTP token's name and secret (``forums`` None: every forum)."""
    await ensure_token_indexes(store)
    name = f"t{new_id()[:10]}"
    _, secret = await create_token(
        store, name, forums, can_take_over=can_take_over, can_call=can_call
    )
    return name, secret


def bearer(secret: str, key: str | None = None) -> dict[str, str]:
    """The headers of a request made with ``secret``, with an idempotency key if given."""
    headers = {"Authorization": f"Bearer {secret}"}
    if key is not None:
        headers["Idempotency-Key"] = key
    return headers


def handoff_call(reason: str) -> ScriptedOutput:
    """A ``fixture-script`` turn that asks for a person."""
    return ScriptedOutput(tool_calls=[ScriptedCall(name="handoff", input={"reason": reason})])


def handing_off(reason: str, **options: object) -> JoinConfig:
    """A join whose agent asks for a person at its first line, then answers plainly;
    ``options`` are further join settings (field names)."""
    return JoinConfig.model_validate(
        {
            "model": "fixture-script",
            "handoff": True,
            "hop_cap": 1,
            "script": [
                handoff_call(reason),
                ScriptedOutput(text="back at your service", repeat=True),
            ],
            **options,
        }
    )


async def escalations_of(store: Store, forum_id: str) -> list[Escalation]:
    """Every escalation of the forum, whatever its state."""
    return await Escalations(store).listed(states=EVERY, forum_ids=[forum_id])


async def the_escalation(store: Store, forum_id: str, *, timeout: float = 30) -> Escalation:
    """The forum's one escalation, once it is open (or later); a second one fails the wait."""

    async def opened() -> bool:
        return len(await escalations_of(store, forum_id)) == 1

    await eventually(opened, timeout=timeout, what="the agent's escalation")
    (escalation,) = await escalations_of(store, forum_id)
    return escalation


@contextlib.asynccontextmanager
async def forum_events(amqp_url: str, forum_id: str) -> AsyncIterator[list[Envelope]]:
    """Every event of the forum on ``yoke.forum``, as a helpdesk bridge bound there receives
    them; the list grows while the context is open."""
    seen: list[Envelope] = []
    connection = await aio_pika.connect(amqp_url)
    try:
        channel = await connection.channel()
        queue = await channel.declare_queue(exclusive=True, auto_delete=True)
        await queue.bind("yoke.forum", routing_key=f"#.{forum_id}")

        async def take(message: aio_pika.abc.AbstractIncomingMessage) -> None:
            async with message.process():
                seen.append(Envelope.model_validate_json(message.body))

        await queue.consume(take)
        yield seen
    finally:
        await connection.close()


def notices(lines: list[Message]) -> list[Message]:
    """The agent's notices in the forum (handoff, held, handed_back, nobody_came)."""
    return [line for line in agent_lines(lines) if line.type == "notice"]


def answers(lines: list[Message]) -> list[Message]:
    """The agent's replies in the forum, notices left out."""
    return [line for line in agent_lines(lines) if line.type == "message"]


def holds_of(lines: list[Message]) -> list[str]:
    """The forum's /takeover and /handback lines, by command name."""
    found = []
    for line in lines:
        command = slash_command(line.text) if line.role == "user" else None
        if command is not None and command.name in (TAKEOVER, HANDBACK):
            found.append(command.name)
    return found

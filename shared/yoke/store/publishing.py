"""Published agents: the names under which systems outside the mesh call an agent (MCP, A2A).

Publishing is the operator's choice of which agents a door shows, and under what name; who may
call one is the token's right (``--can-call NAME``), so a name is never reachable just because
it exists. Stored (one document per name, ``_id`` the name) and read by the gateway at request
time: ``yoke agent publish`` takes effect without a restart.
"""

from __future__ import annotations

import re
from datetime import datetime

from pydantic import Field
from pymongo.asynchronous.collection import AsyncCollection

from yoke.core.ids import derive_id
from yoke.core.models import CallerDoor, Document, utcnow
from yoke.store.database import Doc, Store

COLLECTION = "published_agents"
# An MCP tool's name and a URL path segment at once: what the OpenAI API accepts as a tool name.
NAME_PATTERN = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
MAX_DESCRIPTION_CHARS = 1024


class PublishingError(Exception):
    """A publishing command that cannot be carried out (the message says why)."""


class PublishedAgent(Document):
    """A published name (``id``) and the agent it calls."""

    agent_actor_id: str
    description: str = ""
    published_at: datetime = Field(default_factory=utcnow)


def collection(store: Store) -> AsyncCollection[Doc]:
    return store.db[COLLECTION]


def check_name(name: str) -> str:
    if not NAME_PATTERN.match(name):
        raise PublishingError(
            f"invalid published name {name[:80]!r}: use 1-64 letters, digits, '-' or '_'"
        )
    return name


async def publish_agent(
    store: Store, name: str, agent_actor_id: str, description: str | None = None
) -> PublishedAgent:
    """Publish (or publish again, replacing) ``agent_actor_id`` under ``name``."""
    check_name(name)
    if description is not None and len(description) > MAX_DESCRIPTION_CHARS:
        raise PublishingError(f"the description is over {MAX_DESCRIPTION_CHARS} characters")
    agent = await store.get_actor(agent_actor_id)
    if agent is None or agent.kind != "agent":
        raise PublishingError(f"unknown agent {agent_actor_id!r}")
    published = PublishedAgent(
        id=name,
        agent_actor_id=agent.id,
        description=description if description is not None else f"Ask {agent.name}.",
    )
    await collection(store).replace_one({"_id": name}, published.to_document(), upsert=True)
    return published


async def unpublish_agent(store: Store, name: str) -> bool:
    """False when nothing was published under ``name``. Takes effect at the next call."""
    result = await collection(store).delete_one({"_id": name})
    return result.deleted_count > 0


async def published_agents(store: Store) -> list[PublishedAgent]:
    """Every published agent by name (an operator publishes a handful)."""
    found = await collection(store).find({}).sort("_id", 1).to_list()
    return [PublishedAgent.from_document(document) for document in found]


def kept_forum_id(door: CallerDoor, namespace: str, published: PublishedAgent, key: str) -> str:
    """The forum a caller's ``key`` (an MCP ``conversation``, an A2A ``contextId``) names: one
    per token namespace, door, published name and agent, so no caller reaches another's forum
    and a name published anew starts afresh. The gateway and the door derive it alike."""
    return derive_id("kept-forum", door, namespace, published.id, published.agent_actor_id, key)


async def find_published(store: Store, name: str) -> PublishedAgent | None:
    if not NAME_PATTERN.match(name):
        return None
    document = await collection(store).find_one({"_id": name})
    return PublishedAgent.from_document(document) if document else None

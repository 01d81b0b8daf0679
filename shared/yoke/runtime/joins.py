"""Bootstrap: agents, forums and joins (the seeds' ``createAgent`` / ``joinConversation``).

A join creates the agent's monologue and its participants, points the forum participant's
``metadata.monologueId`` at the monologue, seeds the ingestion and processor instances, and
announces ``agent.forum.joined``. Every id is derived, so joining twice returns the same join.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import Any

from pydantic import Field, JsonValue

from yoke.ids import derive_id, new_id
from yoke.llm.base import ScriptedCall as ScriptedCall
from yoke.llm.base import ScriptedOutput
from yoke.models import (
    Actor,
    AgentForumJoined,
    Conversation,
    Participant,
    WireModel,
)
from yoke.runtime.actor import SYSTEM_ACTOR_ID as SYSTEM_ACTOR_ID
from yoke.runtime.actor import create_instance_document, instance_state_id
from yoke.runtime.join_config import JoinConfig, load_versioned_join_config, save_join_config
from yoke.runtime.posting import Poster
from yoke.store import Store

DEFAULT_MODEL = "fixture-echo"
DEFAULT_HOP_CAP = 4

INGESTION = "ingestion"
PROCESSOR = "processor"


class ProcessorConfig(WireModel):
    """The processor's config, as in the seed's schema.

    The join seeds the ids and the agent's defaults in the instance document; the tunables a
    join sets (:class:`JoinConfig`) are read from the join's own document at every step and
    win (:func:`load_processor_config`), so a later join changes them without touching the
    state its lane saves.
    """

    source_conversation_id: str
    forum_participant_id: str
    agent_actor_id: str
    monologue_id: str
    agent_participant_id: str
    model: str = DEFAULT_MODEL
    tools: list[str] = Field(default_factory=list)
    instructions: str = ""
    hop_cap: int = Field(default=DEFAULT_HOP_CAP, ge=1)
    script: list[ScriptedOutput] = Field(default_factory=list)
    # Compaction: past this many estimated tokens, continue in a new monologue that holds a
    # summary and the last ``compaction_keep`` lines. None: never.
    compaction_threshold_tokens: int | None = Field(default=None, ge=1)
    compaction_keep: int = Field(default=6, ge=0)
    # Checked before each model call; None means no limit.
    budget_tokens: int | None = Field(default=None, ge=0)
    budget_usd: float | None = Field(default=None, ge=0)
    # The join has a guardian: the agent's lines are routed to it (else it is not bothered).
    guarded: bool = False

    def with_join(self, join: JoinConfig | None) -> ProcessorConfig:
        """This config with what the join sets; None fields of the join keep the defaults."""
        if join is None:
            return self
        tunables = {name: getattr(join, name) for name in JOIN_TUNABLES}
        update = {name: value for name, value in tunables.items() if value is not None}
        return self.model_copy(update={**update, "guarded": join.guardian is not None})


# JoinConfig fields that are the processor's (the rest belongs to follow-up and guardian).
JOIN_TUNABLES = (
    "model",
    "tools",
    "instructions",
    "hop_cap",
    "compaction_threshold_tokens",
    "compaction_keep",
    "budget_tokens",
    "budget_usd",
    "script",
)


# The instance document's note of its join configuration's version (see join_conversation).
CONFIG_VERSION = "configVersion"
# A cached join configuration is read again after this long whatever its version says.
CONFIG_CACHE_SECONDS = 60.0


async def load_processor_config(store: Store, document: dict[str, Any]) -> ProcessorConfig:
    """The processor's config for one step: its instance's, overlaid with the join's.

    The join's is read only when the version noted on the instance document (read anyway)
    differs from the cached one's, or the cached one is old.
    """
    config = ProcessorConfig.model_validate(document["config"])
    key = str(document["instanceId"])
    version = document.get(CONFIG_VERSION)
    cached = store.memo.get(f"join-config:{key}")
    now = time.monotonic()
    if (
        version
        and isinstance(cached, tuple)
        and cached[0] == version
        and now - cached[2] < CONFIG_CACHE_SECONDS
    ):
        return config.with_join(cached[1])
    found = await load_versioned_join_config(store, key)
    join = found[1] if found is not None else None
    if found is not None and found[0]:
        store.memo[f"join-config:{key}"] = (found[0], join, now)
    return config.with_join(join)


class ProcessorState(WireModel):
    monologue_id: str
    agent_participant_id: str
    # Running totals of the join's model usage.
    tokens_used: int = 0
    cost_usd: float = 0.0
    # Set by the /model slash command; wins over the configured model.
    model: str | None = None
    # Set by /reset: the model sees only lines from this seq on.
    context_from_seq: int = 0


class IngestionConfig(WireModel):
    forum_id: str
    agent_actor_id: str
    forum_participant_id: str


class IngestionState(WireModel):
    pass


class Join(WireModel):
    """What ``yoke join`` prints, plus the ids that name the join."""

    agent_actor_id: str
    forum_id: str
    forum_participant_id: str
    monologue_id: str
    monologue_participant_id: str


def join_id(agent_actor_id: str, forum_id: str) -> str:
    return derive_id("join", agent_actor_id, forum_id)


def participant_id(conversation_id: str, actor_id: str) -> str:
    return derive_id("participant", conversation_id, actor_id)


async def ensure_participant(
    store: Store,
    conversation_id: str,
    actor_id: str,
    metadata: dict[str, JsonValue] | None = None,
) -> Participant:
    """The actor's participant in the conversation (created once; its id is derived)."""
    return await store.save_participant(
        Participant(
            id=participant_id(conversation_id, actor_id),
            conversation_id=conversation_id,
            actor_id=actor_id,
            metadata=metadata or {},
        )
    )


async def ensure_participant_id(store: Store, conversation_id: str, actor_id: str) -> str:
    """The id of the actor's participant, made if needed: written once per process."""
    return await store.save_participant_once(
        Participant(
            id=participant_id(conversation_id, actor_id),
            conversation_id=conversation_id,
            actor_id=actor_id,
        )
    )


async def create_agent(
    store: Store,
    name: str,
    *,
    model: str | None = None,
    tools: list[str] | None = None,
    instructions: str | None = None,
    actor_id: str | None = None,
) -> Actor:
    """A new agent actor; its id is the ``authorActorId`` of its lines."""
    meta: dict[str, JsonValue] = {}
    if model:
        meta["model"] = model
    if tools:
        meta["tools"] = list(tools)
    if instructions:
        meta["instructions"] = instructions
    return await store.save_actor(
        Actor(id=actor_id or new_id(), kind="agent", name=name, meta=meta)
    )


async def create_forum(store: Store, title: str, *, forum_id: str | None = None) -> Conversation:
    return await store.save_conversation(
        Conversation(id=forum_id or new_id(), kind="forum", title=title)
    )


async def ensure_system_actor(store: Store) -> Actor:
    """The author of tool results and other lines the mesh itself writes."""
    return await store.save_actor(Actor(id=SYSTEM_ACTOR_ID, kind="system", name="system"))


async def join_conversation(
    store: Store,
    poster: Poster,
    agent_actor_id: str,
    forum_id: str,
    config: JoinConfig | None = None,
    *,
    model: str | None = None,
    tools: list[str] | None = None,
    hop_cap: int | None = None,
    script: list[ScriptedOutput] | None = None,
    budget_tokens: int | None = None,
    budget_usd: float | None = None,
    compaction_threshold_tokens: int | None = None,
    compaction_keep: int | None = None,
) -> Join:
    """Join the agent to the forum (idempotent); join options override the agent's.

    ``config`` and the keyword shortcuts (which win over it) are the join's whole
    configuration: joining again with them replaces what the join had. A call with neither
    keeps the stored configuration (re-running a bootstrap changes nothing).
    """
    shortcuts: dict[str, Any] = {
        "model": model,
        "tools": tools,
        "hop_cap": hop_cap,
        "script": script,
        "budget_tokens": budget_tokens,
        "budget_usd": budget_usd,
        "compaction_threshold_tokens": compaction_threshold_tokens,
        "compaction_keep": compaction_keep,
    }
    given = {name: value for name, value in shortcuts.items() if value is not None}
    if given:
        # Validated as a whole, so a bad shortcut is refused like a bad file.
        base = (config or JoinConfig()).model_dump(exclude_none=True, by_alias=False)
        config = JoinConfig.model_validate({**base, **given})
    agent = await store.get_actor(agent_actor_id)
    if agent is None or agent.kind != "agent":
        raise LookupError(f"unknown agent {agent_actor_id}")
    forum = await store.get_conversation(forum_id)
    if forum is None or forum.kind != "forum":
        raise LookupError(f"unknown forum {forum_id}")
    await ensure_system_actor(store)
    key = join_id(agent.id, forum.id)
    if config is not None:
        # First, so the processor finds it from its first step; written only here.
        version: str | None = await save_join_config(store, key, config)
    else:
        stored = await load_versioned_join_config(store, key)
        version = stored[0] if stored else await save_join_config(store, key, JoinConfig())
    monologue = await store.save_conversation(
        Conversation(
            id=derive_id("monologue", key), kind="monologue", title=f"{agent.name} in {forum.title}"
        )
    )
    forum_participant = await ensure_participant(
        store, forum.id, agent.id, {"monologueId": monologue.id}
    )
    if forum_participant.left_at is not None:  # joining again after a leave
        await store.participants.update_one(
            {"_id": forum_participant.id}, {"$set": {"leftAt": None}}
        )
    monologue_participant = await ensure_participant(store, monologue.id, agent.id)
    # The participant's metadata is the truth for the active monologue (compaction moves it).
    active_monologue = str(forum_participant.metadata.get("monologueId") or monologue.id)
    agent_tools = agent.meta.get("tools")
    default_tools = [str(t) for t in agent_tools] if isinstance(agent_tools, list) else []
    # The agent's defaults; the join's own configuration overlays them at every step.
    processor_config = ProcessorConfig(
        source_conversation_id=forum.id,
        forum_participant_id=forum_participant.id,
        agent_actor_id=agent.id,
        monologue_id=active_monologue,
        agent_participant_id=monologue_participant.id,
        model=str(agent.meta.get("model") or DEFAULT_MODEL),
        tools=default_tools,
        instructions=str(agent.meta.get("instructions") or ""),
    )
    state = ProcessorState(
        monologue_id=active_monologue, agent_participant_id=monologue_participant.id
    )
    # Start both instances at the current end of what they watch: a new join answers new lines.
    processor_document = create_instance_document(
        PROCESSOR,
        key,
        watch=active_monologue,
        config=processor_config,
        state=state,
        watermark=await store.last_seq(active_monologue),
    )
    processor_document[CONFIG_VERSION] = version
    if not await store.insert_if_absent(store.states, processor_document):
        # Joined before: tell the processor its join's configuration changed.
        await store.states.update_one(
            {"_id": processor_document["_id"]}, {"$set": {CONFIG_VERSION: version}}
        )
    await store.insert_if_absent(
        store.states,
        create_instance_document(
            INGESTION,
            key,
            watch=forum.id,
            config=IngestionConfig(
                forum_id=forum.id,
                agent_actor_id=agent.id,
                forum_participant_id=forum_participant.id,
            ),
            state=IngestionState(),
            watermark=await store.last_seq(forum.id),
        ),
    )
    joined = AgentForumJoined(
        agent_actor_id=agent.id,
        forum_id=forum.id,
        forum_participant_id=forum_participant.id,
        monologue_id=active_monologue,
        monologue_participant_id=monologue_participant.id,
    )
    await poster.emit(joined, event_id=derive_id("joined", key, active_monologue))
    return Join(**joined.model_dump())


async def leave_conversation(store: Store, agent_actor_id: str, forum_id: str) -> bool:
    """End the join: no more lines are copied to the agent, so it stops answering there."""
    key = join_id(agent_actor_id, forum_id)
    removed = await store.states.delete_many(
        {"_id": {"$in": [instance_state_id(INGESTION, key), instance_state_id(PROCESSOR, key)]}}
    )
    await store.participants.update_one(
        {"_id": participant_id(forum_id, agent_actor_id)},
        {"$set": {"leftAt": datetime.now(UTC)}},
    )
    return removed.deleted_count > 0

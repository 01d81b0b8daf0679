"""Bootstrap: agents, forums and joins.

A join creates the agent's monologue and its participants, points the forum participant's
``metadata.monologueId`` at the monologue, creates the ingestion and processor instances
(:mod:`yoke.runtime.instances`) and announces ``agent.forum.joined``. Every id is derived, so
joining twice returns the same join.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from pydantic import JsonValue

from yoke.core.ids import SYSTEM_ACTOR_ID, derive_id, new_id
from yoke.core.models import (
    Actor,
    AgentForumJoined,
    Conversation,
    Participant,
    WireModel,
)
from yoke.llm.base import ScriptedOutput
from yoke.runtime.actor import create_instance_document, instance_state_id
from yoke.runtime.instances import (
    CONFIG_VERSION,
    DEFAULT_MODEL,
    INGESTION,
    PROCESSOR,
    IngestionConfig,
    IngestionState,
    ProcessorConfig,
    ProcessorState,
)
from yoke.runtime.join_config import (
    ApprovalConfig,
    JoinConfig,
    WhileBusy,
    load_versioned_join_config,
    save_join_config,
)
from yoke.runtime.posting import Poster
from yoke.store.database import Store
from yoke.store.forum_list import ForumList


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
    approval: ApprovalConfig | None = None,
    while_busy: WhileBusy | None = None,
) -> Actor:
    """A new agent actor; its id is the ``authorActorId`` of its lines."""
    meta: dict[str, JsonValue] = {}
    if model:
        meta["model"] = model
    if tools:
        meta["tools"] = list(tools)
    if instructions:
        meta["instructions"] = instructions
    if approval is not None:
        meta["approval"] = approval.to_wire()
    if while_busy is not None:
        meta["whileBusy"] = while_busy
    return await store.save_actor(
        Actor(id=actor_id or new_id(), kind="agent", name=name, meta=meta)
    )


def agent_while_busy(agent: Actor) -> WhileBusy:
    """The agent's ``whileBusy`` default (``queue`` unless ``yoke agent create`` set one)."""
    modes: dict[object, WhileBusy] = {"coalesce": "coalesce", "interrupt": "interrupt"}
    return modes.get(agent.meta.get("whileBusy"), "queue")


async def create_forum(
    store: Store, title: str, *, forum_id: str | None = None, kept_for: str | None = None
) -> Conversation:
    forum = await store.save_conversation(
        Conversation(id=forum_id or new_id(), kind="forum", title=title, kept_for=kept_for)
    )
    await ForumList.of(store).add(forum)  # listed newest first, page by page (the console)
    return forum


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
    while_busy: WhileBusy | None = None,
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
        "while_busy": while_busy,
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
        while_busy=agent_while_busy(agent),
        approval=(
            ApprovalConfig.model_validate(agent.meta["approval"])
            if isinstance(agent.meta.get("approval"), dict)
            else None
        ),
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

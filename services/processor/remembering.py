"""Memory in the processor (docs/memory.md): the built-in tools ``remember``, ``recall`` and
``forget``, run in the step as ``handoff`` is, and the memory every prompt carries.

What a step may read or write follows from the step alone, never from the model's arguments:
the join's agent, its forum, and the person whose forum line it answers (that line's author,
when a human). So no call reaches another person's or another forum's memories, and a memory
the step may not see is answered exactly like one that does not exist. What the model is shown
of a memory is only what it may say: its text, its scope and the day it was learned, never
where or from whom.

A ``remember`` call's memory takes its id from the call (a retried step writes it once and
counts it once); a refusal (a bound, an erasure, a bad argument) is the call's error result,
never a failed step.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from services.processor.step import Context
from yoke.core import tracing
from yoke.core.metrics import (
    MEMORIES_FORGOTTEN,
    MEMORIES_STORED,
    MEMORY_RECALL_SECONDS,
    MEMORY_RECALLS,
)
from yoke.core.models import Actor, Message, ToolCallPart, ToolResultPart, utcnow
from yoke.core.text import printable
from yoke.llm.base import PromptMemory, ProviderFailed
from yoke.llm.embeddings import embedder_for
from yoke.runtime.instances import ProcessorConfig, Progress
from yoke.runtime.join_config import MEMORY_SCOPES, MemoryConfig, MemoryScope
from yoke.runtime.memories import (
    FORGET_TOOL,
    MAX_MEMORY_CHARS,
    MAX_QUERY_CHARS,
    MAX_RECALL_LIMIT,
    MEMORY_TOOLS,
    RECALL_TOOL,
    REMEMBER_TOOL,
    Memories,
    Memory,
    MemoryRefused,
    MemorySource,
    MemoryStep,
    Recalled,
    memory_id_of_call,
    scope_key,
)
from yoke.runtime.while_busy import is_person_line
from yoke.tools.base import ToolSpec

log = logging.getLogger(__name__)

# What the prompt names a memory's subject by (a person's is their display name).
ABOUT = {"forum": "this conversation", "agent": "all your conversations"}
# A prompt's memory section: about this many characters a token (yoke.llm.base.estimate_tokens).
CHARS_PER_TOKEN = 4
# The longest memory id an error result quotes back.
MAX_QUOTED_ID = 100


# --- the tools as the model is shown them ------------------------------------------------------


@dataclass(frozen=True)
class MemoryTool:
    """A built-in memory tool as the model is shown it (run by the processor itself)."""

    name: str
    description: str
    schema: dict[str, Any]

    def json_schema(self) -> dict[str, Any]:
        return self.schema


def writable(memory: MemoryConfig) -> list[MemoryScope]:
    """The scopes ``remember`` may write: those the join reads, ``agent`` only with
    ``agentWrites`` (agent-wide facts are an operator's)."""
    return [s for s in memory.scopes if s != "agent" or memory.agent_writes]


def default_scope(memory: MemoryConfig) -> MemoryScope | None:
    """What ``remember`` writes when no scope is named: the person, if the join writes theirs."""
    scopes = writable(memory)
    return "person" if "person" in scopes else (scopes[0] if scopes else None)


def memory_tools(config: ProcessorConfig) -> dict[str, ToolSpec]:
    """The built-in memory tools this join offers (none without ``memory`` or its ``tools``;
    no ``remember`` when it writes no scope)."""
    memory = config.memory
    if memory is None or not memory.tools:
        return {}
    scopes = writable(memory)
    remember = MemoryTool(
        REMEMBER_TOOL,
        "Remember something worth knowing next time, in your own words: about the person you "
        "are answering (scope person), this conversation (forum), or everyone (agent). It is "
        "kept across conversations; never remember what someone would not want repeated.",
        {
            "type": "object",
            "properties": {
                "text": {"type": "string", "minLength": 1, "maxLength": MAX_MEMORY_CHARS},
                "scope": {"type": "string", "enum": scopes, "default": default_scope(memory)},
            },
            "required": ["text"],
        },
    )
    recall = MemoryTool(
        RECALL_TOOL,
        "Search what you remember about the person you are answering, this conversation and "
        "everyone. Returns a JSON list of {id, text, scope, learnedAt}, most relevant first.",
        {
            "type": "object",
            "properties": {
                "query": {"type": "string", "minLength": 1, "maxLength": MAX_QUERY_CHARS},
                "scope": {"type": "string", "enum": list(memory.scopes)},
                "limit": {"type": "integer", "minimum": 1, "maximum": MAX_RECALL_LIMIT},
            },
            "required": ["query"],
        },
    )
    forget = MemoryTool(
        FORGET_TOOL,
        "Forget a memory by the id remember or recall gave (when it is wrong, or someone asks).",
        {
            "type": "object",
            "properties": {"id": {"type": "string", "minLength": 1}},
            "required": ["id"],
        },
    )
    offered = (remember, recall, forget) if scopes else (recall, forget)
    return {tool.name: tool for tool in offered}


def memory_calls(config: ProcessorConfig, calls: Sequence[ToolCallPart]) -> list[ToolCallPart]:
    """The calls the processor runs itself as memory tools: only when the join's memory offers
    them (otherwise a catalog tool of the same name is the one called)."""
    if config.memory is None or not config.memory.tools:
        return []
    return [call for call in calls if call.name in MEMORY_TOOLS]


# --- whose memory a step reaches -----------------------------------------------------------


@dataclass(frozen=True)
class Reach:
    """What a step's memory is about: the agent, its forum, and the person it answers (None:
    the line answered is no human's, so there is no person scope in this step)."""

    agent_actor_id: str
    forum_id: str
    person: Actor | None

    def subject(self, scope: MemoryScope) -> str | None:
        if scope == "person":
            return self.person.id if self.person is not None else None
        return self.forum_id if scope == "forum" else ""

    def keys(self, scopes: Sequence[MemoryScope]) -> dict[MemoryScope, str]:
        """The scope keys of ``scopes`` this step reaches (the only keys it ever queries)."""
        found: dict[MemoryScope, str] = {}
        for scope in scopes:
            subject = self.subject(scope)
            if subject is not None:
                found[scope] = scope_key(self.agent_actor_id, scope, subject)
        return found

    def about(self, memory: Memory) -> str:
        if memory.scope == "person" and self.person is not None:
            return self.person.name
        return ABOUT.get(memory.scope, "you")


async def person_of(context: Context, author_actor_id: str | None) -> Actor | None:
    """The person an author is, when a human (actors are cached: no store read once seen)."""
    if author_actor_id is None:
        return None
    actor = await context.store.get_actor(author_actor_id)
    return actor if actor is not None and actor.kind == "human" else None


def reach_of(context: Context, person: Actor | None) -> Reach:
    config = context.config
    return Reach(config.agent_actor_id, config.source_conversation_id, person)


def as_scope(value: object) -> MemoryScope | None:
    """A scope the model named, when it is one."""
    for scope in MEMORY_SCOPES:
        if value == scope:
            return scope
    return None


# --- the tools, run in the step ------------------------------------------------------------


async def run_memory_calls(
    context: Context, trigger: Message, calls: list[ToolCallPart]
) -> dict[str, ToolResultPart]:
    """A round's memory calls, each answered here (the round's results line carries them).
    ``trigger`` is the agent's call line: it answers the forum line it replies to, whose
    author is the person this round's memory is about."""
    forum_line = await answered_forum_line(context, trigger)
    person = None
    if forum_line is not None and forum_line.meta.agent_hops == 0 and forum_line.role == "user":
        person = await person_of(context, forum_line.author_actor_id)
    reach = reach_of(context, person)
    results: dict[str, ToolResultPart] = {}
    for call in calls:
        output, error = await run_one(context, trigger, call, reach, forum_line)
        results[call.call_id] = ToolResultPart(
            call_id=call.call_id, name=call.name, output=output, is_error=error
        )
    return results


async def answered_forum_line(context: Context, trigger: Message) -> Message | None:
    """The forum line the agent's call line answers (one store read, for a memory round)."""
    line_id = trigger.meta.in_reply_to
    if line_id is None:
        return None
    line = await context.store.get_message(line_id)
    if line is None or line.conversation_id != context.config.source_conversation_id:
        return None
    return line


async def run_one(
    context: Context,
    trigger: Message,
    call: ToolCallPart,
    reach: Reach,
    forum_line: Message | None,
) -> tuple[str, bool]:
    """One memory call's output, and whether it is an error."""
    memory = context.config.memory
    assert memory is not None
    if call.input_error is not None:
        return f"{call.name}: the arguments are not valid JSON ({call.input_error})", True
    if call.name == REMEMBER_TOOL:
        return await remember(context, trigger, call, reach, forum_line, memory)
    if call.name == RECALL_TOOL:
        return await recall_call(context, call, reach, memory)
    return await forget(context, call, reach, memory)


async def remember(
    context: Context,
    trigger: Message,
    call: ToolCallPart,
    reach: Reach,
    forum_line: Message | None,
    memory: MemoryConfig,
) -> tuple[str, bool]:
    text, scope = call.input.get("text"), as_scope(call.input.get("scope", default_scope(memory)))
    if not isinstance(text, str) or not text.strip():
        return "remember needs a text: what to remember, in your own words", True
    text = text.strip()
    if len(text) > MAX_MEMORY_CHARS:
        return f"a memory is at most {MAX_MEMORY_CHARS} characters; say it shorter", True
    if scope is None or scope not in memory.scopes:
        return f"scope is one of {', '.join(memory.scopes)}", True
    if scope not in writable(memory):
        return "only an operator writes what all your conversations remember (scope agent)", True
    subject = reach.subject(scope)
    if subject is None:
        return (
            "there is no person to remember this about: the line you answer is not a person's; "
            "use scope forum",
            True,
        )
    source = MemorySource(forum_id=reach.forum_id, at=utcnow())
    if forum_line is not None:
        author = await context.store.get_actor(forum_line.author_actor_id)
        source = MemorySource(
            forum_id=forum_line.conversation_id,
            message_id=forum_line.id,
            author_actor_id=forum_line.author_actor_id,
            author_name=author.name if author is not None else None,
            at=forum_line.created_at,
        )
    fields: dict[str, Any] = {
        "step": MemoryStep(
            join_key=context.instance_id,
            monologue_id=context.state.monologue_id,
            line_id=trigger.id,
            call_id=call.call_id,
        )
    }
    vector = await embedded(context, memory, text)
    if vector is not None:
        fields |= {"vector": vector, "embeddingModel": memory.embedding_model}
    the_id = memory_id_of_call(context.effect_id("tool", call.call_id))
    made = Memory.new(the_id, reach.agent_actor_id, scope, subject, text, source, **fields)
    try:
        stored, created = await Memories(context.store).remember(made)
    except MemoryRefused as refused:
        return f"not remembered: {refused}", True
    if created:
        MEMORIES_STORED.labels(scope).inc()
    return f"remembered {stored.id}", False


async def recall_call(
    context: Context, call: ToolCallPart, reach: Reach, memory: MemoryConfig
) -> tuple[str, bool]:
    query, asked = call.input.get("query"), call.input.get("scope")
    scope = as_scope(asked)
    limit = call.input.get("limit", memory.recall_limit)
    if not isinstance(query, str) or not query.strip():
        return "recall needs a query: what to look for", True
    if len(query) > MAX_QUERY_CHARS:
        return f"a query is at most {MAX_QUERY_CHARS} characters", True
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_RECALL_LIMIT:
        return f"limit is a whole number from 1 to {MAX_RECALL_LIMIT}", True
    if asked is not None and (scope is None or scope not in memory.scopes):
        return f"scope is one of {', '.join(memory.scopes)}", True
    scopes: list[MemoryScope] = [scope] if scope is not None else list(memory.scopes)
    keys = reach.keys(scopes)
    if not keys:
        return "there is no person here to recall anything about: the line is not a person's", True
    found = await recalled(context, memory, keys, query, limit, scope or "all")
    return json.dumps(
        [
            {
                "id": item.memory.id,
                "text": item.memory.text,
                "scope": item.memory.scope,
                "learnedAt": item.memory.created_at.date().isoformat(),
            }
            for item in found
        ],
        ensure_ascii=False,
    ), False


async def forget(
    context: Context, call: ToolCallPart, reach: Reach, memory: MemoryConfig
) -> tuple[str, bool]:
    the_id = call.input.get("id")
    if not isinstance(the_id, str) or not the_id.strip():
        return "forget needs the id of a memory (remember and recall give them)", True
    memories = Memories(context.store)
    found = await memories.get(the_id)
    # One the step may not see is answered as one that does not exist: nothing leaks.
    if found is None or found.scope_key not in reach.keys(memory.scopes).values():
        return f"no memory {printable(the_id[:MAX_QUOTED_ID])}", True
    if await memories.forget(found.id):
        MEMORIES_FORGOTTEN.inc()
    return f"forgotten {found.id}", False


async def recalled(
    context: Context,
    memory: MemoryConfig,
    keys: dict[MemoryScope, str],
    query: str,
    limit: int,
    label: str,
) -> list[Recalled]:
    """A recall over ``keys``, counted (``label``: the scope asked, or all) and timed, in a
    ``recall`` span of the step's trace."""
    started = time.perf_counter()
    with tracing.span("recall", attributes={"yoke.memory.scope": label}):
        vector = await embedded(context, memory, query)
        found = await Memories(context.store).recall(
            keys.values(), query[:MAX_QUERY_CHARS], limit, query_vector=vector
        )
        tracing.annotate({"yoke.memory.found": len(found)})
    MEMORY_RECALLS.labels(label).inc()
    MEMORY_RECALL_SECONDS.observe(time.perf_counter() - started)
    return found


async def embedded(context: Context, memory: MemoryConfig, text: str) -> list[float] | None:
    """``text``'s vector under the join's embedding model (None: no model, or it failed: the
    memory is still stored and recall still ranks by words; a turn never waits on a retry)."""
    if memory.embedding_model is None:
        return None
    try:
        (vector,) = await embedder_for(memory.embedding_model, context.settings).embed([text])
    except ProviderFailed as error:
        log.warning(
            "no embedding, words only: %s",
            error,
            extra={"conversationId": context.trigger.conversation_id},
        )
        return None
    return vector


# --- always in mind --------------------------------------------------------------------------


async def in_mind(
    context: Context,
    trigger: Message,
    transcript: list[Message],
    answered: Progress | None,
    answering: Message | None,
) -> list[PromptMemory]:
    """What the prompt carries of the agent's memory: a recall, over the scopes the join reads,
    of the person lines being answered, filled to ``promptTokens`` (nothing without memory, or
    with ``promptTokens`` 0: no store read)."""
    memory = context.config.memory
    if memory is None or memory.prompt_tokens <= 0:
        return []
    since = (
        answered.seq
        if answered is not None and answered.conversation_id == trigger.conversation_id
        else 0
    )
    lines = [line for line in transcript if line.seq > since and is_person_line(line)]
    person_line = answered_person_line(context, transcript, answering or trigger)
    if not lines and person_line is not None:
        lines = [person_line]  # a round's results: the line that started the round
    query = "\n".join(line.text for line in lines)[-MAX_QUERY_CHARS:]
    if not query.strip():
        return []
    person = None
    if person_line is not None:
        person = await person_of(context, person_line.meta.source_actor_id)
    reach = reach_of(context, person)
    found = await recalled(
        context, memory, reach.keys(memory.scopes), query, MAX_RECALL_LIMIT, "all"
    )
    budget = memory.prompt_tokens * CHARS_PER_TOKEN
    carried: list[PromptMemory] = []
    for item in found:
        about = reach.about(item.memory)
        cost = len(item.memory.text) + len(about) + 32  # the line's marks and its date
        if cost > budget:
            continue
        budget -= cost
        carried.append(PromptMemory(item.memory.text, about, item.memory.created_at))
    return carried


def answered_person_line(
    context: Context, transcript: list[Message], answering: Message
) -> Message | None:
    """The copy of the person's forum line a step answers: ``answering`` itself, or (a tool
    round's results) the line the round answers, found in the window by its forum id."""
    if is_person_line(answering):
        return answering
    forum_line_id = answering.meta.in_reply_to
    if answering.meta.source_conversation_id == context.config.source_conversation_id:
        forum_line_id = answering.meta.source_message_id or forum_line_id
    if forum_line_id is None:
        return None
    for line in reversed(transcript):
        if line.meta.source_message_id == forum_line_id and is_person_line(line):
            return line
    return None

"""Everything a join can tune, as one model: what ``yoke join --config FILE.json`` accepts.

camelCase like the wire, every field optional (an absent field keeps the agent's or the
mesh's default). Stored in a document of its own (written only by joins), so that joining
again with other options never races a step's state save (an update is safe only on a
document with one writer: docs/architecture.md, invariant 8).
"""

from __future__ import annotations

import re
import time
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, field_validator

from yoke.bus import topology
from yoke.core.ids import new_id
from yoke.core.lru import LRUCache
from yoke.core.metrics import JOIN_CONFIG_READS
from yoke.core.models import WireModel
from yoke.core.safe_regex import compile_safe
from yoke.llm.base import ScriptedOutput
from yoke.runtime.catalog_store import matches
from yoke.runtime.service import delivery_headers
from yoke.store.database import Store
from yoke.tools.catalog import TOOL_NAME, is_tool_pattern


class StrictWireModel(WireModel):
    """Unknown fields are an error: a typo in a configuration file must not pass silently."""

    model_config = ConfigDict(extra="forbid")


class FollowUpConfig(StrictWireModel):
    """Nudge the agent when it spoke last in the forum and nobody answered."""

    after_seconds: float = Field(gt=0, le=7 * 24 * 3600)
    text: str = Field(
        default="Nobody has answered your last message; follow up briefly if it helps.",
        min_length=1,
        max_length=4000,
    )
    # Follow-ups in a row without a human line in between.
    max_consecutive: int = Field(default=1, ge=1, le=100)


class RulePolicy(StrictWireModel):
    """A regular expression over agent text or tool-call names/arguments; a fixed steer."""

    kind: Literal["rule"]
    pattern: str = Field(min_length=1, max_length=1000)
    steer: str = Field(min_length=1, max_length=4000)

    @field_validator("pattern")
    @classmethod
    def compiles(cls, pattern: str) -> str:
        compile_safe(pattern)  # its ValueError says why: invalid, or exponential to match
        return pattern


class NoProgressPolicy(StrictWireModel):
    """The same tool call repeating, or agent steps in a row without text for people."""

    kind: Literal["noProgress"]
    repeated_calls: int | None = Field(default=3, ge=2, le=100)
    steps_without_text: int | None = Field(default=5, ge=2, le=100)
    steer: str = Field(
        default="You seem to be stuck; stop repeating yourself and ask the person.",
        min_length=1,
        max_length=4000,
    )


class LlmPolicy(StrictWireModel):
    """An ephemeral runner asks the guardian's model; its ``steer`` tool call intervenes."""

    kind: Literal["llm"]


DEFAULT_APPROVAL_SECONDS = 86400.0


def tool_list_problem(tools: list[str] | None) -> str | None:
    """Why a tool list's names are not names the catalog writes (None: they are)."""
    bad = [name for name in tools or [] if not is_tool_pattern(name)]
    if not bad:
        return None
    return (
        f"not a tool name: {', '.join(bad)} (names match {TOOL_NAME.pattern}, "
        "or SERVER__* for every tool of an MCP server)"
    )


# A model id as a join names it: what an API accepts, never blank or with spaces in it.
MODEL_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,199}$")


def model_list_problem(models: list[str] | None) -> str | None:
    """Why a list of model ids holds something that is not one (None: it does not)."""
    bad = [repr(name) for name in models or [] if not MODEL_ID.match(name)]
    if not bad:
        return None
    return f"not a model id: {', '.join(bad)} (ids match {MODEL_ID.pattern})"


class ApprovalConfig(StrictWireModel):
    """Tools whose calls wait for a person's decision before they run (docs/approvals.md)."""

    tools: list[str] = Field(min_length=1, max_length=100)
    # How long a person has to decide; then the call ends in "no decision within N s".
    timeout_seconds: float = Field(default=DEFAULT_APPROVAL_SECONDS, gt=0, le=30 * 86400)

    @field_validator("tools")
    @classmethod
    def tool_names(cls, tools: list[str]) -> list[str]:
        problem = tool_list_problem(tools)
        if problem is not None:
            raise ValueError(problem)
        return tools

    def gates(self, tool: str) -> bool:
        """Whether a call of ``tool`` waits for a decision (``SERVER__*`` gates a server)."""
        return any(matches(pattern, tool) for pattern in self.tools)


# What a person's line does while the agent has a step pending (docs/architecture.md, "While
# the agent is busy"): wait its turn, be answered with the others of its burst, or cancel the
# model call in flight.
WhileBusy = Literal["queue", "coalesce", "interrupt"]

# Once people hand a held forum back (docs/people-take-over.md): the agent waits for the next
# line, or speaks first with a summary of what was said meanwhile.
AfterHandback = Literal["wait", "summarize"]
# What ends an escalation nobody claimed in time: the agent resumes, told that nobody came, or
# the forum is told so and the agent waits for the next line.
HandoffFallback = Literal["resume", "notice"]
DEFAULT_HANDOFF_SECONDS = 900.0


GuardianPolicy = Annotated[RulePolicy | NoProgressPolicy | LlmPolicy, Field(discriminator="kind")]


class GuardianConfig(StrictWireModel):
    """Watch the join's monologue; steer the agent when a policy matches."""

    cooldown_seconds: float = Field(default=30.0, ge=0, le=24 * 3600)
    model: str = Field(default="fixture-echo", min_length=1, max_length=200)
    instructions: str = Field(
        default="You watch another agent's work. If it is going wrong, call steer with a "
        "short instruction for it; otherwise answer without calling any tool.",
        max_length=8000,
    )
    policies: list[GuardianPolicy] = Field(default_factory=list, max_length=50)
    # The replies of the ``fixture-script`` model when it is the guardian's (tests and demos).
    script: list[ScriptedOutput] | None = Field(default=None, max_length=1000)


MemoryScope = Literal["person", "forum", "agent"]
MEMORY_SCOPES: tuple[MemoryScope, ...] = ("person", "forum", "agent")


class MemoryConfig(StrictWireModel):
    """What the agent remembers across forums (docs/memory.md); absent: nothing, at no cost."""

    # The built-in tools remember, recall and forget are offered.
    tools: bool = True
    # The scopes the agent reads (and writes, but ``agent`` only with ``agentWrites``).
    scopes: list[MemoryScope] = Field(default_factory=lambda: list(MEMORY_SCOPES), max_length=3)
    agent_writes: bool = False
    # How much memory every prompt carries (estimated tokens; 0: none).
    prompt_tokens: int = Field(default=400, ge=0, le=8000)
    recall_limit: int = Field(default=5, ge=1, le=20)
    # An embedding model (``fixture-embed``, or one an OpenAI-compatible server serves):
    # recall then blends similarity into the lexical rank.
    embedding_model: str | None = Field(default=None, min_length=1, max_length=200)

    @field_validator("scopes")
    @classmethod
    def distinct(cls, scopes: list[MemoryScope]) -> list[MemoryScope]:
        return list(dict.fromkeys(scopes))


class JoinConfig(StrictWireModel):
    """A join's whole configuration. None means "not set here": the default applies."""

    model: str | None = Field(default=None, min_length=1, max_length=200)
    tools: list[str] | None = Field(default=None, max_length=100)
    instructions: str | None = Field(default=None, max_length=32000)
    hop_cap: int | None = Field(default=None, ge=1, le=100)
    compaction_threshold_tokens: int | None = Field(default=None, ge=1)
    compaction_keep: int | None = Field(default=None, ge=0, le=1000)
    budget_tokens: int | None = Field(default=None, ge=0)
    budget_usd: float | None = Field(default=None, ge=0)
    # How long a step retries a failing or silent model before it gives up (a slow local model
    # wants more than the mesh's YOKE_PROVIDER_GIVE_UP_SECONDS, 30 s by default).
    model_give_up_seconds: float | None = Field(default=None, gt=0, le=3600)
    # What a person's ``/model NAME`` may switch to besides the join's own model (None: only
    # that one), so that nobody in the forum can pick a dearer model than the operator chose.
    allowed_models: list[str] | None = Field(default=None, max_length=100)
    while_busy: WhileBusy | None = None
    follow_up: FollowUpConfig | None = None
    guardian: GuardianConfig | None = None
    approval: ApprovalConfig | None = None
    # People (external ids as the door names them: cli:ana, a bridge's person, a token's) who
    # may type /takeover and /handback in the forum; the CLI and tokens made with
    # --can-take-over may anyway.
    takeover_by: list[Annotated[str, Field(min_length=1, max_length=400)]] | None = Field(
        default=None, max_length=100
    )
    after_handback: AfterHandback | None = None
    # The built-in handoff tool: the agent may ask for a person (an escalation).
    handoff: bool | None = None
    handoff_timeout_seconds: float | None = Field(default=None, gt=0, le=30 * 86400)
    handoff_fallback: HandoffFallback | None = None
    memory: MemoryConfig | None = None
    # The replies of the ``fixture-script`` model, in order (tests and demos).
    script: list[ScriptedOutput] | None = Field(default=None, max_length=1000)

    @field_validator("tools")
    @classmethod
    def tool_names(cls, tools: list[str] | None) -> list[str] | None:
        """Names as the catalog writes them (``SERVER__*`` for all of a server's); whether a
        tool exists is checked against the catalog by ``yoke join``, which has the store."""
        problem = tool_list_problem(tools)
        if problem is not None:
            raise ValueError(problem)
        return tools

    @field_validator("allowed_models")
    @classmethod
    def model_ids(cls, models: list[str] | None) -> list[str] | None:
        problem = model_list_problem(models)
        if problem is not None:
            raise ValueError(problem)
        return models


# --- storage: one document per join, written only by joins ------------------------------------

JOIN_CONFIGS = "join_configs"
VERSION_FIELD = "_version"


async def load_join_config(store: Store, join_key: str) -> JoinConfig | None:
    """The join's configuration (``join_key`` from ``joins.join_id``), if it has one."""
    found = await load_versioned_join_config(store, join_key)
    return found[1] if found is not None else None


async def load_versioned_join_config(
    store: Store, join_key: str
) -> tuple[str | None, JoinConfig] | None:
    """The join's configuration and the version its last save gave it."""
    JOIN_CONFIG_READS.inc()
    document = await store.db[JOIN_CONFIGS].find_one({"_id": join_key})
    if document is None:
        return None
    document.pop("_id")
    version = document.pop(VERSION_FIELD, None)
    return (str(version) if version else None), JoinConfig.model_validate(document)


async def save_join_config(store: Store, join_key: str, config: JoinConfig) -> str:
    """Replace the join's configuration; only a join (``yoke join``) writes it.

    Each save has a version of its own: whoever caches a configuration (the processor) knows
    by it that the cached one is still the join's.
    """
    version = new_id()
    await store.db[JOIN_CONFIGS].replace_one(
        {"_id": join_key},
        {"_id": join_key, **config.to_wire(), VERSION_FIELD: version},
        upsert=True,
    )
    return version


# --- reading it on the hot path: once per version ---------------------------------------------


def delivered_version() -> str | None:
    """The join configuration's version the line being handled says it was written with
    (topology.CONFIG_VERSION_HEADER), if any."""
    version = delivery_headers().get(topology.CONFIG_VERSION_HEADER)
    return str(version) if version else None


class VersionedConfigs:
    """Join configurations memoized by the version their line says (topology.
    CONFIG_VERSION_HEADER, set by the processor from the one it steps with): a service reads
    a join's configuration once per version, never per line; a line without a version (an
    outbox republish) reads it again."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self._known: LRUCache[str, tuple[str, JoinConfig | None]] = LRUCache()

    async def get(self, join_key: str, version: str | None) -> JoinConfig | None:
        known = self._known.get(join_key)
        if version and known is not None and known[0] == version:
            return known[1]
        found = await load_versioned_join_config(self.store, join_key)
        config = found[1] if found is not None else None
        saved = found[0] if found is not None else None
        if saved:
            self._known[join_key] = (saved, config)
        return config


async def forum_join_configs(
    store: Store, forum_id: str, field: str, instances: str = "ingestion"
) -> list[dict[str, Any]]:
    """``field`` of the configuration of every join of a forum (found by the ``instances``
    that watch the forum): one read of the instances, one of their configurations."""
    keys = [
        str(document["instanceId"]) for document in await store.states_watching(instances, forum_id)
    ]
    if not keys:
        return []
    JOIN_CONFIG_READS.inc()
    cursor = store.db[JOIN_CONFIGS].find({"_id": {"$in": keys}}, {field: 1})
    return await cursor.to_list()


# A forum's "some join follows up here" is read again after this long whatever it heard (a
# shard handed away and back may have missed a join's change meanwhile).
FOLLOWED_SECONDS = 60.0


class FollowedForums:
    """Whether some join of a forum has follow-up: the door routes people's lines there to the
    follow-up service only then (topology.FOLLOWED_HEADER).

    Read once per forum and kept until the forum's ``agent.forum.joined`` (every join and
    re-join publishes it, on the forum's shard: the one whose commands this process handles)
    says a join changed, or FOLLOWED_SECONDS pass.
    """

    def __init__(self, store: Store, instances: str = "ingestion") -> None:
        self.store = store
        self.instances = instances
        self._known: LRUCache[str, tuple[float, bool]] = LRUCache()

    async def followed(self, forum_id: str) -> bool:
        known = self._known.get(forum_id)
        now = time.monotonic()
        if known is not None and now - known[0] < FOLLOWED_SECONDS:
            return known[1]
        configs = await forum_join_configs(self.store, forum_id, "followUp", self.instances)
        followed = any(document.get("followUp") for document in configs)
        self._known[forum_id] = (now, followed)
        return followed

    def forget(self, forum_id: str) -> None:
        """A join of the forum changed: its next line reads again."""
        self._known.pop(forum_id, None)

"""What a join's actor instances are configured with and keep: the processor's and ingestion's.

A join writes one instance document per actor (:mod:`yoke.runtime.joins`); each holds its
config (the ids of the join and the agent's defaults) and its state (what the lane saves after
a step). The tunables a join sets live in the join's own document (:mod:`yoke.runtime.join_config`)
and are overlaid on the processor's config at every step, so joining again never races a
step's state save.
"""

from __future__ import annotations

import time
from datetime import datetime
from typing import Any, Literal

from pydantic import Field

from yoke.core.models import Message, WireModel
from yoke.llm.base import ScriptedOutput
from yoke.runtime.join_config import (
    DEFAULT_HANDOFF_SECONDS,
    AfterHandback,
    ApprovalConfig,
    HandoffFallback,
    JoinConfig,
    MemoryConfig,
    WhileBusy,
    load_versioned_join_config,
)
from yoke.store.database import Store

DEFAULT_MODEL = "fixture-echo"
DEFAULT_HOP_CAP = 4

# The actor names of the instances a join makes.
INGESTION = "ingestion"
PROCESSOR = "processor"


class ProcessorConfig(WireModel):
    """The processor's config: the join's ids and the agent's defaults, written by the join.

    The tunables a join sets (:class:`JoinConfig`) are read from the join's own document at
    every step and win (:func:`load_processor_config`), so a later join changes them without
    touching the state its lane saves.
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
    # None: the mesh's YOKE_PROVIDER_GIVE_UP_SECONDS.
    model_give_up_seconds: float | None = Field(default=None, gt=0)
    # The join has a guardian: the agent's lines are routed to it (else it is not bothered).
    guarded: bool = False
    # The join has follow-up: the forum lines of the agent's text are routed to it.
    followed: bool = False
    # The version of the join configuration this config holds (lines say it: whoever reads
    # the configuration for them reads it once per version).
    config_version: str | None = None
    # What a line arriving while a step is pending does (the agent's default, or the join's).
    while_busy: WhileBusy = "queue"
    # Tools whose calls wait for a person's decision (the agent's, or the join's).
    approval: ApprovalConfig | None = None
    # What ``/model NAME`` may switch to besides ``model`` (the join's ``allowedModels``).
    allowed_models: list[str] = Field(default_factory=list)
    # A held forum handed back (docs/people-take-over.md): speak first, or wait.
    after_handback: AfterHandback = "wait"
    # The built-in handoff tool offered, how long its escalation waits, and what ends it then.
    handoff: bool = False
    handoff_timeout_seconds: float = DEFAULT_HANDOFF_SECONDS
    handoff_fallback: HandoffFallback = "resume"
    # What the agent remembers across forums (None: no memory, and a step reads none).
    memory: MemoryConfig | None = None

    def allowed(self) -> list[str]:
        """The models this join may run: its own, then those it allows."""
        return [self.model, *(name for name in self.allowed_models if name != self.model)]

    def model_for(self, state: ProcessorState) -> str:
        """The model a step calls: the one ``/model`` chose while the join still allows it
        (a join configured again may have taken it away), else the join's own."""
        return state.model if state.model in self.allowed() else self.model

    def with_join(self, join: JoinConfig | None, version: str | None = None) -> ProcessorConfig:
        """This config with what the join sets (of ``version``); None fields of the join keep
        the defaults."""
        if join is None:
            return self
        tunables = {name: getattr(join, name) for name in JOIN_TUNABLES}
        update = {name: value for name, value in tunables.items() if value is not None}
        return self.model_copy(
            update={
                **update,
                "guarded": join.guardian is not None,
                "followed": join.follow_up is not None,
                "config_version": version,
            }
        )


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
    "model_give_up_seconds",
    "script",
    "while_busy",
    "approval",
    "allowed_models",
    "after_handback",
    "handoff",
    "handoff_timeout_seconds",
    "handoff_fallback",
    "memory",
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
        return config.with_join(cached[1], version)
    found = await load_versioned_join_config(store, key)
    join = found[1] if found is not None else None
    if found is not None and found[0]:
        store.memo[f"join-config:{key}"] = (found[0], join, now)
    return config.with_join(join, found[0] if found is not None else None)


class Progress(WireModel):
    """A place in one of the join's monologues (seqs start again in a new one)."""

    conversation_id: str
    seq: int

    def covers(self, line: Message) -> bool:
        return line.conversation_id == self.conversation_id and line.seq <= self.seq


class StopMark(Progress):
    """A person's ``/stop``: the rounds it ended are not answered by a model call of their own
    (only people's lines after it are)."""

    by: str
    # Call lines whose step had not run yet when the stop's step ran (answered with "stopped").
    rounds: list[str] = Field(default_factory=list, max_length=100)


class RoundMark(Progress):
    """The join's tool round still open: its call line, found by this record, not by the
    window, however many lines a long wait (an approval's, a worker's) brings meanwhile."""

    call_line_id: str


class WaitTold(WireModel):
    """The forum was told what the open round waits for (a person's decision), and when: once
    a wait, again only after :data:`WAIT_TOLD_AGAIN_SECONDS`, so a person who writes on during a
    long wait does not fill the monologue's window with notices."""

    call_line_id: str
    at: datetime


WAIT_TOLD_AGAIN_SECONDS = 300.0


class HoldMark(Progress):
    """The forum is held (docs/people-take-over.md): from this monologue line on the agent
    steps on nothing. ``person``: someone took it over (``line_id``, the forum's ``/takeover``);
    ``escalation``: the agent asked for a person and waits for the escalation to end."""

    kind: Literal["person", "escalation"]
    by: str  # who holds it (a person's name; the agent's own for an escalation)
    line_id: str | None = None
    escalation_id: str | None = None


class HeldSpan(WireModel):
    """Monologue lines said while the forum was held: shown to the model as what happened, not
    as lines to answer one by one."""

    conversation_id: str
    from_seq: int
    to_seq: int
    by: str

    def holds(self, line: Message) -> bool:
        return (
            line.conversation_id == self.conversation_id
            and self.from_seq <= line.seq <= self.to_seq
        )


MAX_HELD_SPANS = 20


class ProcessorState(WireModel):
    """What the processor's lane saves after a step (one writer: the lane)."""

    monologue_id: str
    agent_participant_id: str
    # Running totals of the join's model usage.
    tokens_used: int = 0
    cost_usd: float = 0.0
    # Set by the /model slash command; wins over the configured model.
    model: str | None = None
    # Set by /reset: the model sees only lines from this seq on.
    context_from_seq: int = 0
    # The newest line a model call was shown (whileBusy coalesce and interrupt answer up to the
    # newest line: the steps of the lines it covered call no model), and the last stop.
    answered: Progress | None = None
    stopped: StopMark | None = None
    # Set by a round's step, cleared once its results are answered (or it is found lost).
    open_round: RoundMark | None = None
    wait_told: WaitTold | None = None
    # The forum is held: the agent steps on nothing until it is handed back.
    held: HoldMark | None = None
    # Where the last escalation ended unclaimed: the agent asks for a person again only once a
    # person has written after it (a request for a person per person's line, not a loop).
    escalation_ended: Progress | None = None
    # The last holds' lines, for the prompt (the newest MAX_HELD_SPANS).
    held_spans: list[HeldSpan] = Field(default_factory=list, max_length=MAX_HELD_SPANS)


class IngestionConfig(WireModel):
    """Which forum ingestion copies from, for which agent, as which forum participant."""

    forum_id: str
    agent_actor_id: str
    forum_participant_id: str


class IngestionState(WireModel):
    """Ingestion keeps its watermark (on the instance document) and whether the forum is held
    (between a ``/takeover`` and a ``/handback`` line, which it copies in order)."""

    held: bool = False

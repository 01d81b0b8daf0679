"""The guardian: watches a join's monologue and steers the agent when a policy matches.

Off unless the join's configuration has ``guardian``. Each agent line of a guarded monologue is
checked against the join's policies in order; the first that matches runs an *ephemeral
runner*: a rule or no-progress policy yields its fixed steering text, an LLM policy asks the
guardian's model (:func:`~yoke.llm.loop.run_inference_loop`, a ``steer`` tool). A steer
becomes one instruction line in the agent's active monologue (``meta.instruction =
"guardian"``), which the processor answers like any other line and knows nothing more about.

- Never two runners per join at once (its old and new monologue after a compaction, other guardian
  processes): a runner holds a lease made of two unique inserts, one per time bucket
  (docs/architecture.md, invariant 8), and is bounded well inside one bucket, so two holders never
  overlap; a check waits for the holder to finish; a crashed holder's lease lapses with its buckets.
- The cooldown is durable: written only under the lease, so it has one writer at a time.
- A check finishes with a unique "checked" record: a redelivery, or another guardian that got
  the same event, does not ask the model twice. Steering and notice ids derive from the
  trigger line and the policy, so each is written once.
- Nothing a model does makes the handler fail: a failing runner leaves a ``notice`` and the
  agent goes on. The agent's answer to a steering line is never checked (no steering loops).
- Reads stay small (docs/architecture.md, invariant 11): lines are read back one ``seq`` at a time
  by equality, through a bounded per-monologue cache, never by a range or a sort.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from pydantic import BaseModel, Field, ValidationError

from yoke.core import tracing
from yoke.core.ages import BUCKET_FIELD, day_bucket, hour_bucket
from yoke.core.errors import Stopping
from yoke.core.ids import derive_id, new_id
from yoke.core.lru import LRUCache
from yoke.core.metrics import (
    GUARDIAN_CHECKS,
    GUARDIAN_INTERVENTIONS,
    GUARDIAN_RUNNER_SECONDS,
    NOTICES,
)
from yoke.core.models import (
    Actor,
    Message,
    MessageMeta,
    MessagePosted,
    TextPart,
    ToolCallPart,
    ToolResultPart,
    as_utc,
    call_signature,
)
from yoke.core.safe_regex import compile_safe, search
from yoke.core.settings import Settings
from yoke.llm.base import InferenceRequest
from yoke.llm.loop import MAX_ROUNDS, run_inference_loop
from yoke.llm.providers import provider_for
from yoke.runtime.actor import instance_state_id
from yoke.runtime.instances import PROCESSOR
from yoke.runtime.join_config import (
    GuardianConfig,
    GuardianPolicy,
    LlmPolicy,
    NoProgressPolicy,
    RulePolicy,
    VersionedConfigs,
    delivered_version,
)
from yoke.runtime.joins import join_id
from yoke.runtime.service import Service
from yoke.store.database import Store
from yoke.store.retention import Rule
from yoke.tools.base import Tool, ToolContext

log = logging.getLogger(__name__)

GUARDIAN = "guardian"
GUARDIAN_ACTOR_ID = derive_id("actor", "system", GUARDIAN)
# Leases, cooldowns and "checked" records, told apart by ``kind``.
COLLECTION = "guardian"

# A runner (model rounds and the steering post) ends well inside one lease bucket.
LEASE_BUCKET_SECONDS = 120.0
RUNNER_TIMEOUT_SECONDS = 90.0
# A check waits this long for another runner of its join to finish, polling.
LEASE_WAIT_SECONDS = RUNNER_TIMEOUT_SECONDS + 15.0
LEASE_POLL_SECONDS = 0.2
# Lines of the monologue the guardian's model sees, up to its trigger.
TRANSCRIPT_LINES = 20
# Lines kept per monologue, and monologues kept, in the read-back cache.
RECENT_LINES = 64
RECENT_MONOLOGUES = 2000
MAX_SHOWN_CHARS = 1000


# --- which join a monologue belongs to -----------------------------------------------------


@dataclass(frozen=True)
class Watched:
    """The join whose processor answers a monologue."""

    join_key: str
    agent_actor_id: str
    forum_id: str


class RecentLines:
    """The latest lines of each monologue, read back by ``seq`` equality on a miss.

    FerretDB 1.x reads a whole conversation for a ``seq`` range or a sort, so a check that
    needs the few lines before its trigger asks for each by ``(conversationId, seq)`` instead,
    and events fill the cache as they pass.
    """

    def __init__(self, store: Store) -> None:
        self.store = store
        self._lines: LRUCache[str, dict[int, Message]] = LRUCache(RECENT_MONOLOGUES)

    def remember(self, line: Message) -> None:
        lines = self._lines.get(line.conversation_id)
        if lines is None:
            lines = self._lines[line.conversation_id] = {}
        lines[line.seq] = line
        while len(lines) > RECENT_LINES:
            del lines[min(lines)]

    async def at(self, conversation_id: str, seq: int) -> Message | None:
        lines = self._lines.get(conversation_id)
        if lines is not None and seq in lines:
            return lines[seq]
        document = await self.store.messages.find_one(
            {"conversationId": conversation_id, "seq": seq}
        )
        if document is None:
            return None
        line = Message.from_document(document)
        self.remember(line)
        return line

    async def by_id(self, conversation_id: str, message_id: str) -> Message | None:
        lines = self._lines.get(conversation_id) or {}
        for line in lines.values():
            if line.id == message_id:
                return line
        return await self.store.get_message(message_id)

    async def before(self, line: Message, count: int) -> list[Message]:
        """Up to ``count`` lines before ``line``, newest first."""
        found = []
        for seq in range(line.seq - 1, max(0, line.seq - 1 - count), -1):
            earlier = await self.at(line.conversation_id, seq)
            if earlier is not None:
                found.append(earlier)
        return found


# --- policies ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Match:
    """A policy that matched a line: ``steer`` is fixed text, or None for the model to decide."""

    key: str
    kind: str
    steer: str | None


def rule_text(line: Message) -> str:
    """What a rule looks at: the agent's text, and each tool call's name and arguments."""
    pieces = [part.text for part in line.parts if isinstance(part, TextPart)]
    pieces += [
        f"{part.name} {json.dumps(part.input, sort_keys=True)}"
        for part in line.parts
        if isinstance(part, ToolCallPart)
    ]
    return "\n".join(pieces)


def is_new_input(line: Message) -> bool:
    """A line that gives the agent something new (a person, an instruction): a fresh start."""
    return (
        line.role == "user"
        and line.type == "message"
        and bool(line.text)
        and not any(isinstance(part, ToolResultPart) for part in line.parts)
    )


async def repeats_call(recent: RecentLines, line: Message, times: int) -> bool:
    """The line's last tool call is the ``times``-th identical call in a row since new input."""
    calls = [part for part in line.parts if isinstance(part, ToolCallPart)]
    if not calls:
        return False
    signature = call_signature(calls[-1])
    seen = 0
    for call in reversed(calls):
        if call_signature(call) != signature:
            return False
        seen += 1
    if seen >= times:
        return True
    for earlier in await recent.before(line, 4 * times + 8):
        if is_new_input(earlier):
            return False
        if earlier.role != "agent":
            continue
        for call in reversed([p for p in earlier.parts if isinstance(p, ToolCallPart)]):
            if call_signature(call) != signature:
                return False
            seen += 1
            if seen >= times:
                return True
    return False


async def steps_without_text(recent: RecentLines, line: Message, steps: int) -> bool:
    """The line ends ``steps`` agent steps in a row, since new input, with no text for people."""
    if line.text:
        return False
    count = 1
    if count >= steps:
        return True
    for earlier in await recent.before(line, 4 * steps + 8):
        if is_new_input(earlier):
            return False
        if earlier.role != "agent" or earlier.type != "message":
            continue
        if earlier.text:
            return False
        count += 1
        if count >= steps:
            return True
    return False


# --- the steer tool ------------------------------------------------------------------------


class SteerInput(BaseModel):
    text: str = Field(
        min_length=1, max_length=4000, description="A short instruction for the watched agent"
    )


def steer_tool(steers: list[str]) -> Tool:
    """The LLM runner's one tool: calling it is the intervention (``steers`` collects texts)."""

    async def steer(arguments: SteerInput, _: ToolContext) -> str:
        steers.append(arguments.text.strip())
        return "The agent will be steered with this instruction."

    return Tool(
        "steer",
        "Steer the watched agent: your text reaches it as an instruction. Call it only when "
        "the agent's work is going wrong.",
        SteerInput,
        steer,
    )


# --- the guardian --------------------------------------------------------------------------


class Guardian:
    """The guardian service's handler of ``conversation.message.posted``."""

    def __init__(self, service: Service) -> None:
        self.service = service
        self.store: Store = service.store
        self.recent = RecentLines(service.store)
        self.documents = service.store.db[COLLECTION]
        # A lease's holder: this process (leases are released by whoever holds them).
        self.holder = new_id()
        self.checked_for = timedelta(days=service.settings.retention_decision_days)
        self._kinds: LRUCache[str, str] = LRUCache()
        self._watched: LRUCache[str, Watched] = LRUCache()
        # Read once per version: a guarded line says its join configuration's.
        self._configs = VersionedConfigs(service.store)
        self._patterns: LRUCache[str, re.Pattern[str] | None] = LRUCache(1000)
        self._ready = False
        self._ready_lock = asyncio.Lock()

    async def on_posted(self, event: MessagePosted) -> None:
        line = event.message
        self.recent.remember(line)
        if line.role != "agent" or line.type != "message" or line.meta.carried_from:
            return  # only the agent's own steps are checked; compaction's copies were already
        if _now() - as_utc(line.created_at) > self.checked_for:
            return  # a redelivery older than its "checked" record's retention: checked then
        watched = await self.watched(line.conversation_id)
        if watched is None:
            return
        config = await self.config_of(watched.join_key, delivered_version())
        if config is None or not config.policies:
            return
        with tracing.span(
            "check",
            attributes={
                tracing.CONVERSATION_ID: line.conversation_id,
                tracing.MESSAGE_ID: line.id,
                "yoke.policies": len(config.policies),
            },
        ):
            await self.check(watched, config, line)

    async def check(self, watched: Watched, config: GuardianConfig, line: Message) -> None:
        """The guardian's check of one agent step under its join's policies (a ``check``
        span): the first policy that matches steers, unless cooling down."""
        await self.ready()
        if await self.answers_guardian(line):
            return
        match = await self.first_match(line, config)
        if match is None:
            return
        tracing.annotate({"yoke.policy": match.kind})
        if await self.cooling_down(watched.join_key):
            log.info(
                "guardian %s policy matched during the cooldown: not steering",
                match.kind,
                extra={"conversationId": line.conversation_id, "messageId": line.id},
            )
            return
        await self.intervene(watched, config, line, match)

    # --- lookups (cached: the hot path costs a few equality reads) ----------------------------

    async def watched(self, conversation_id: str) -> Watched | None:
        """The join whose processor watches this monologue (None: a forum, or no join)."""
        if (known := self._watched.get(conversation_id)) is not None:
            return known
        kind = self._kinds.get(conversation_id)
        if kind is None:
            conversation = await self.store.get_conversation(conversation_id)
            if conversation is None:
                return None
            kind = self._kinds[conversation_id] = conversation.kind
        if kind != "monologue":
            return None
        # Not cached when absent: a compaction's new monologue is watched only from its repoint.
        for document in await self.store.states_watching(PROCESSOR, conversation_id):
            config = document.get("config") or {}
            agent, forum = config.get("agentActorId"), config.get("sourceConversationId")
            if isinstance(agent, str) and isinstance(forum, str):
                found = Watched(join_id(agent, forum), agent, forum)
                self._watched[conversation_id] = found
                return found
        return None

    async def config_of(self, join_key: str, version: str | None = None) -> GuardianConfig | None:
        """The join's guardian configuration of ``version`` (its line's), read once per version."""
        try:
            join_config = await self._configs.get(join_key, version)
        except ValidationError as error:
            # Written by something other than a join: the guardian stays off, and says why.
            log.warning("join %s has an invalid configuration: %s", join_key, error)
            join_config = None
        return join_config.guardian if join_config is not None else None

    async def active_monologue(self, watched: Watched) -> str | None:
        """Where the join's processor answers now (a compaction moves it); None once left."""
        document = await self.store.load_state(instance_state_id(PROCESSOR, watched.join_key))
        if document is None:
            return None
        return str(document["watch"])

    async def ready(self) -> None:
        """The guardian's collection and actor, made once per process when first needed."""
        if self._ready:
            return
        async with self._ready_lock:
            if self._ready:
                return
            await self.store.create_collections(COLLECTION)
            await self.store.save_actor(Actor(id=GUARDIAN_ACTOR_ID, kind="system", name=GUARDIAN))
            self._ready = True

    async def answers_guardian(self, line: Message) -> bool:
        """Whether the agent line answers a steering line: checking it would steer in a loop."""
        cause_id = line.meta.causation_id
        if not cause_id:
            return False
        cause = await self.recent.by_id(line.conversation_id, cause_id)
        return cause is not None and cause.meta.instruction == GUARDIAN

    # --- policies ----------------------------------------------------------------------------

    def pattern(self, policy: RulePolicy) -> re.Pattern[str] | None:
        if policy.pattern not in self._patterns:
            try:
                self._patterns[policy.pattern] = compile_safe(policy.pattern)
            except ValueError as error:
                log.warning("guardian rule %r not used: %s", policy.pattern, error)
                self._patterns[policy.pattern] = None
        return self._patterns[policy.pattern]

    async def first_match(self, line: Message, config: GuardianConfig) -> Match | None:
        for index, policy in enumerate(config.policies):
            GUARDIAN_CHECKS.labels(policy.kind).inc()
            if await self.matches(line, policy):
                steer = None if isinstance(policy, LlmPolicy) else policy.steer
                return Match(f"{index}-{policy.kind}", policy.kind, steer)
        return None

    async def matches(self, line: Message, policy: GuardianPolicy) -> bool:
        if isinstance(policy, RulePolicy):
            pattern = self.pattern(policy)
            return pattern is not None and search(pattern, rule_text(line))
        if isinstance(policy, NoProgressPolicy):
            return bool(
                policy.repeated_calls
                and await repeats_call(self.recent, line, policy.repeated_calls)
            ) or bool(
                policy.steps_without_text
                and await steps_without_text(self.recent, line, policy.steps_without_text)
            )
        return True  # an LLM check looks at every agent step

    # --- the runner ----------------------------------------------------------------------------

    async def intervene(
        self, watched: Watched, config: GuardianConfig, line: Message, match: Match
    ) -> None:
        """Run the match's runner under the join's lease, once per trigger and policy."""
        check_id = derive_id("guardian-check", line.id, match.key)
        if await self.was_checked(check_id):
            return
        lease = await self.wait_for_lease(watched.join_key, check_id)
        if lease is None:
            return
        try:
            # Someone may have finished it, or steered, while this one was getting the lease.
            if await self.was_checked(check_id) or await self.cooling_down(watched.join_key):
                return
            started = time.perf_counter()
            try:
                async with asyncio.timeout(RUNNER_TIMEOUT_SECONDS):
                    steer = await self.run_runner(watched, config, line, match)
            except Exception as error:
                await self.post_notice(watched, line, match, error)
                steer = None
            finally:
                GUARDIAN_RUNNER_SECONDS.labels(match.kind).observe(
                    time.perf_counter() - started, tracing.exemplar()
                )
            if steer and await self.post_steer(watched, line, match, steer):
                GUARDIAN_INTERVENTIONS.labels(match.kind).inc()
                await self.start_cooldown(watched.join_key, config.cooldown_seconds)
            await self.store.insert_if_absent(
                self.documents,
                {
                    "_id": check_id,
                    "kind": "checked",
                    "messageId": line.id,
                    "at": _now(),
                    BUCKET_FIELD: day_bucket(),
                },
            )
        finally:
            await self.release_lease(lease)

    async def run_runner(
        self, watched: Watched, config: GuardianConfig, line: Message, match: Match
    ) -> str | None:
        """The ephemeral runner: the steering text, or None when all is well."""
        if match.steer is not None:
            return match.steer
        steers: list[str] = []
        tool = steer_tool(steers)
        request = InferenceRequest(
            transcript=[
                Message(
                    id=derive_id("guardian-prompt", line.id, match.key),
                    conversation_id=line.conversation_id,
                    author_actor_id=GUARDIAN_ACTOR_ID,
                    role="user",
                    parts=[TextPart(text=await self.describe(line))],
                )
            ],
            tools={tool.name: tool},
            call_id_prefix=derive_id("guardian-call", line.id, match.key),
            instructions=config.instructions,
        )
        provider = provider_for(config.model, list(config.script or []), self.service.settings)
        await run_inference_loop(
            provider,
            request,
            agent_actor_id=GUARDIAN_ACTOR_ID,
            conversation_id=line.conversation_id,
            max_rounds=MAX_ROUNDS,
        )
        return "\n".join(steers) or None

    async def describe(self, line: Message) -> str:
        """The recent transcript as text for the guardian's model, its trigger last."""
        lines = [*reversed(await self.recent.before(line, TRANSCRIPT_LINES - 1)), line]
        shown = []
        for each in lines:
            if each.type == "notice":
                continue
            if each.role == "agent":
                who = "AGENT"
            elif each.meta.instruction:
                who = f"INSTRUCTION ({each.meta.instruction})"
            else:
                who = await self.name_of(each.author_actor_id)
            for part in each.parts:
                if isinstance(part, TextPart):
                    shown.append(f"{who}: {part.text[:MAX_SHOWN_CHARS]}")
                elif isinstance(part, ToolCallPart):
                    arguments = json.dumps(part.input, sort_keys=True)[:MAX_SHOWN_CHARS]
                    shown.append(f"{who} calls tool {part.name} with {arguments}")
                else:
                    shown.append(f"TOOL RESULT of {part.name}: {part.output[:MAX_SHOWN_CHARS]}")
        return (
            "The watched agent's latest lines, oldest first. Decide whether it needs "
            "steering.\n\n" + "\n".join(shown)
        )

    async def name_of(self, actor_id: str) -> str:
        actor = await self.store.get_actor(actor_id)
        return actor.name if actor is not None else "someone"

    # --- posting -------------------------------------------------------------------------------

    async def post_steer(self, watched: Watched, line: Message, match: Match, text: str) -> bool:
        """The steering line, in the join's active monologue; False when the join is gone."""
        monologue = await self.active_monologue(watched)
        if monologue is None:
            return False
        await self.service.poster.post(
            Message(
                id=derive_id("guardian-steer", line.id, match.key),
                conversation_id=monologue,
                author_actor_id=GUARDIAN_ACTOR_ID,
                role="user",
                parts=[TextPart(text=text)],
                meta=self.meta_for(watched, line),
            )
        )
        log.info(
            "guardian steered the agent (%s policy)",
            match.kind,
            extra={"conversationId": monologue, "messageId": line.id},
        )
        return True

    async def post_notice(
        self, watched: Watched, line: Message, match: Match, error: BaseException
    ) -> None:
        """A failed runner leaves a notice for people and operators; the agent goes on."""
        reason = "timed out" if isinstance(error, TimeoutError) else str(error) or repr(error)
        log.warning(
            "guardian check failed: %s",
            reason,
            extra={"conversationId": line.conversation_id, "messageId": line.id},
        )
        monologue = await self.active_monologue(watched)
        if monologue is None:
            return
        NOTICES.labels(GUARDIAN).inc()
        await self.service.poster.post(
            Message(
                id=derive_id("guardian-notice", line.id, match.key),
                conversation_id=monologue,
                author_actor_id=GUARDIAN_ACTOR_ID,
                role="user",
                type="notice",
                parts=[TextPart(text=f"the guardian's {match.kind} check failed: {reason}"[:2000])],
                meta=self.meta_for(watched, line),
            )
        )

    @staticmethod
    def meta_for(watched: Watched, line: Message) -> MessageMeta:
        # agentHops as the trigger's: the hop cap still bounds agents steered by agents.
        return MessageMeta(
            source_conversation_id=watched.forum_id,
            causation_id=line.id,
            in_reply_to=line.meta.in_reply_to,
            agent_hops=line.meta.agent_hops,
            instruction=GUARDIAN,
        )

    # --- lease, cooldown, checked: unique inserts and single-writer updates -----------------

    async def claim_lease(self, join_key: str) -> list[str] | None:
        """The join's lease: this bucket and the next, both claimed by unique inserts.

        A runner lasts less than one bucket, so two runners that overlap in time would need a
        bucket in common: the second one's insert fails and it stands down.
        """
        bucket = int(time.time() // LEASE_BUCKET_SECONDS)
        taken: list[str] = []
        for each in (bucket, bucket + 1):
            lease_id = derive_id("guardian-lease", join_key, str(each))
            document = {
                "_id": lease_id,
                "kind": "lease",
                "joinKey": join_key,
                "holder": self.holder,
                "at": _now(),
                # A holder that crashed leaves its buckets; they lapse, then retention goes.
                BUCKET_FIELD: hour_bucket(),
            }
            if not await self.store.insert_if_absent(self.documents, document):
                await self.release_lease(taken)
                return None
            taken.append(lease_id)
        return taken

    async def wait_for_lease(self, join_key: str, check_id: str) -> list[str] | None:
        """The join's lease once the runner holding it is done; None if it did this check.

        Gives up after a runner's longest run: the holder is then most likely gone, and its
        lease lapses with its buckets; the check is left to a later line.
        """
        deadline = time.monotonic() + LEASE_WAIT_SECONDS
        while (lease := await self.claim_lease(join_key)) is None:
            if await self.was_checked(check_id):
                return None
            if time.monotonic() > deadline:
                log.warning("guardian check skipped: the join's lease stayed taken")
                return None
            try:
                await asyncio.wait_for(self.service.stopping.wait(), timeout=LEASE_POLL_SECONDS)
            except TimeoutError:
                continue
            raise Stopping  # the delivery stays unacked for whoever consumes next
        return lease

    async def release_lease(self, lease: list[str]) -> None:
        for lease_id in lease:
            await self.documents.delete_one({"_id": lease_id, "holder": self.holder})

    async def was_checked(self, check_id: str) -> bool:
        return await self.documents.find_one({"_id": check_id}, {"_id": 1}) is not None

    async def cooling_down(self, join_key: str) -> bool:
        document = await self.documents.find_one({"_id": derive_id("guardian-cooldown", join_key)})
        return document is not None and as_utc(document["until"]) > _now()

    async def start_cooldown(self, join_key: str, seconds: float) -> None:
        """Written only under the join's lease: one writer at a time, so the update is safe."""
        cooldown_id = derive_id("guardian-cooldown", join_key)
        await self.documents.replace_one(
            {"_id": cooldown_id},
            {
                "_id": cooldown_id,
                "kind": "cooldown",
                "joinKey": join_key,
                "until": _now() + timedelta(seconds=seconds),
                BUCKET_FIELD: day_bucket(),
            },
            upsert=True,
        )


def _now() -> datetime:
    return datetime.now(UTC)


async def _cooling(document: dict[str, Any]) -> bool:
    """A cooldown still running is live (a checked record never is, once old)."""
    until = document.get("until")
    return isinstance(until, datetime) and as_utc(until) > _now()


def retention_rules(settings: Settings) -> list[Rule]:
    """The guardian's records: "checked" ones and cooldowns for days, lapsed leases for hours."""
    return [
        Rule(
            "guardian checks",
            COLLECTION,
            "day",
            settings.retention_decision_days,
            where={"kind": "checked"},
        ),
        Rule(
            "guardian cooldowns",
            COLLECTION,
            "day",
            settings.retention_decision_days,
            where={"kind": "cooldown"},
            live=_cooling,
        ),
        # A lease lasts two buckets of LEASE_BUCKET_SECONDS: hours old, its holder is gone.
        Rule(
            "guardian leases",
            COLLECTION,
            "hour",
            settings.retention_lease_hours,
            where={"kind": "lease"},
        ),
    ]


def register(service: Service) -> Guardian:
    """Wire the guardian into a service: it consumes ``conversation.message.posted``."""
    guardian = Guardian(service)
    for rule in retention_rules(service.settings):
        service.retention.add(rule)
    # The agent's own steps: the lines around them are read by seq when a policy needs them.
    service.on_event(
        MessagePosted,
        guardian.on_posted,
        where=[{"kind": "monologue", "type": "message", "role": "agent", "guarded": "yes"}],
    )
    return guardian

"""The Prometheus series the services share (``yoke_`` prefix; never a conversation id label).

A part's own series are defined beside it: shard ownership's in :mod:`yoke.coordination.ownership`,
the gateway's in ``services/gateway/deps.py``, its streams' in ``services/gateway/stream.py`` and
its webhooks' in ``services/gateway/webhooks.py``.
"""

from __future__ import annotations

from collections.abc import Container, Iterable
from contextvars import ContextVar

from prometheus_client import REGISTRY, Counter, Gauge, Histogram
from prometheus_client.exposition import choose_encoder

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)

EVENTS_HANDLED = Counter(
    "yoke_events_handled",
    "Deliveries handled, by service, event type and outcome (ok, retried, dead_lettered).",
    ["service", "event_type", "outcome"],
)
HANDLING_SECONDS = Histogram(
    "yoke_event_handling_seconds",
    "Time spent in a handler per delivery.",
    ["service", "event_type"],
    buckets=LATENCY_BUCKETS,
)
EVENT_LAG_SECONDS = Histogram(
    "yoke_event_lag_seconds",
    "From an event's occurredAt to the start of its handling.",
    ["service", "event_type"],
    buckets=LATENCY_BUCKETS,
)
# True while a task handles a delivery: store operations are counted by origin.
IN_DELIVERY: ContextVar[bool] = ContextVar("yoke_in_delivery", default=False)
# The background task a store operation outside a delivery comes from (its own beat: "ownership"
# for replica beats and live-set reads, "outbox" for writer beats and the dead-writer sweep), so
# what an idle process asks of the store can be told apart by cause.
STORE_ORIGIN: ContextVar[str] = ContextVar("yoke_store_origin", default="background")

STORE_OPERATIONS = Counter(
    "yoke_store_operations",
    "MongoDB commands sent, by service, command and origin (delivery: while handling a "
    "delivery; ownership: replica beats and live-set reads; outbox: writer beats and the "
    "dead-writer sweep; token-watch: the gateway's look-ups of its open streams' tokens; "
    "background: the rest, start-up, health).",
    ["service", "command", "origin"],
)
STORE_DOCUMENTS_READ = Counter(
    "yoke_store_documents_read",
    "Documents MongoDB returned (find and getMore batches), by service, command and origin.",
    ["service", "command", "origin"],
)
# yoke.runtime.tails: what a processor step's window took from memory and from the store.
TAIL_LINES = Counter(
    "yoke_tail_lines",
    "Lines of step windows, by where they came from (tail: this process's memory; store).",
    ["source"],
)
TAIL_DROPS = Counter(
    "yoke_tail_drops",
    "Conversation tails forgotten, by reason (handover, failed, compacted, gap).",
    ["reason"],
)
DEAD_LETTERS = Counter(
    "yoke_dead_letters",
    "Deliveries dead-lettered, by service and reason (malformed, failed).",
    ["service", "reason"],
)
DEAD_LETTERS_DROPPED = Counter(
    "yoke_dead_letters_dropped",
    "Dead letters the bounded dead-letter queue dropped (its oldest first), by the service that "
    "dead-lettered them.",
    ["service"],
)
MESSAGES_POSTED = Counter(
    "yoke_messages_posted",
    "Messages written and published, by service and message type.",
    ["service", "message_type"],
)
OUTBOX_REPUBLISHED = Counter(
    "yoke_outbox_republished",
    "Messages the outbox sweep found unpublished and published.",
    ["service"],
)
# Set by :mod:`yoke.store.outbox` from each writer's in-memory unconfirmed messages.
OUTBOX_UNPUBLISHED = Gauge(
    "yoke_outbox_unpublished",
    "Messages this process stored whose event the broker has not confirmed yet.",
    ["service"],
)
OUTBOX_OLDEST_UNPUBLISHED_SECONDS = Gauge(
    "yoke_outbox_oldest_unpublished_seconds",
    "Age of the oldest message this process stored whose event is not confirmed (0: none).",
    ["service"],
)
LANES_ACTIVE = Gauge(
    "yoke_lanes_active", "Conversations with work in flight in this process.", ["service"]
)
COMMANDS = Counter(
    "yoke_commands",
    "Outside commands answered, by outcome (accepted, duplicate, rejected).",
    ["outcome"],
)
LINES_RATE_LIMITED = Counter(
    "yoke_lines_rate_limited",
    "Lines the door refused as rate_limited, by who sent them (bridge, token).",
    ["door"],
)
LLM_REQUESTS = Counter(
    "yoke_llm_requests", "Model requests by model and outcome.", ["model", "outcome"]
)
LLM_LATENCY = Histogram(
    "yoke_llm_latency_seconds", "Model request latency.", ["model"], buckets=LATENCY_BUCKETS
)
LLM_TOKENS = Counter(
    "yoke_llm_tokens", "Tokens used by model and kind (input, output).", ["model", "kind"]
)
LLM_COST = Counter("yoke_llm_cost_usd", "Model cost in USD from the price table.", ["model"])
LLM_UNPRICED_CALLS = Counter(
    "yoke_llm_unpriced_calls",
    "Model calls of a model without a price in YOKE_PRICES: their cost is unknown and is not in "
    "yoke_llm_cost_usd (a join with a cost budget refuses such a model instead).",
    ["model"],
)
LLM_COST_ESTIMATED = Counter(
    "yoke_llm_cost_estimated_usd",
    "Estimated cost in USD of model calls cancelled before their answer (no usage report comes "
    "for them: input and output tokens counted from the prompt and the text streamed so far).",
    ["model"],
)
MODEL_CALLS_CANCELLED = Counter(
    "yoke_model_calls_cancelled",
    "Model calls cancelled before their answer was posted, by why (interrupt: a person's line "
    "under whileBusy interrupt; stop: a /stop in the forum).",
    ["reason"],
)
STOPS = Counter(
    "yoke_stops", "Stops carried out (a person's /stop in a forum, once per agent there)."
)
TOOL_CALLS = Counter(
    "yoke_tool_calls",
    "Tool calls by tool, source (builtin, plugin, mcp, worker; none: not in the catalog) and "
    "outcome (ok, error, timeout, stopped, rejected).",
    ["tool", "source", "outcome"],
)
TOOL_CALL_SECONDS = Histogram(
    "yoke_tool_call_seconds",
    "From a tool call's start to its result, by source.",
    ["source"],
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 1800, 3600, 86400),
)
OPEN_TOOL_CALLS = Gauge(
    "yoke_tool_calls_open",
    "Tool calls waiting in the store for their answer (before deadline), as the processor "
    "replica that sweeps the open calls counted them (the others 0: aggregate with max).",
)
OVERDUE_TOOL_CALLS = Gauge(
    "yoke_tool_calls_overdue",
    "Open tool calls found past their deadline at the last check, each then ended (above 0 "
    "check after check: they cannot be ended).",
)
APPROVALS_REQUESTED = Counter(
    "yoke_tool_approvals_requested",
    "Calls of gated tools that waited for a person's decision, by tool.",
    ["tool"],
)
APPROVALS_DECIDED = Counter(
    "yoke_tool_approvals_decided",
    "Approvals decided, by decision (approve, reject, expired, stopped).",
    ["decision"],
)
APPROVAL_SECONDS = Histogram(
    "yoke_tool_approval_seconds",
    "From a gated call's request to its decision.",
    buckets=(1, 5, 15, 30, 60, 300, 900, 1800, 3600, 4 * 3600, 12 * 3600, 86400, 7 * 86400),
)
PENDING_APPROVALS = Gauge(
    "yoke_tool_approvals_pending",
    "Calls waiting for a person's decision, as stored (the processor replica that sweeps the "
    "open calls reports it, the others 0: aggregate with max).",
)
# People take over (docs/people-take-over.md).
HOLDS = Counter(
    "yoke_forum_holds",
    "Takeovers and hand-backs the door carried out, by what (takeover, handback).",
    ["what"],
)
FORUMS_HELD = Gauge(
    "yoke_forums_held",
    "Forums a person holds, as stored (the follow-up replica that sweeps escalations reports "
    "it, the others 0: aggregate with max).",
)
ESCALATIONS_OPEN = Gauge(
    "yoke_escalations_open",
    "Escalations waiting for a person to claim them, as stored (reported like yoke_forums_held).",
)
ESCALATION_OLDEST_OPEN_SECONDS = Gauge(
    "yoke_escalation_oldest_open_seconds",
    "Age of the oldest unclaimed escalation (0 when none), as stored (reported like "
    "yoke_forums_held).",
)
ESCALATIONS_OPENED = Counter("yoke_escalations_opened", "Escalations agents opened (handoff).")
ESCALATIONS_ENDED = Counter(
    "yoke_escalations_ended",
    "Escalations by how they ended: claimed (a person took over), timed_out, canceled.",
    ["outcome"],
)
ESCALATION_CLAIM_SECONDS = Histogram(
    "yoke_escalation_claim_seconds",
    "From an escalation's opening to its claim.",
    buckets=(5, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 4 * 3600, 86400),
)
MEMORIES_STORED = Counter(
    "yoke_memories_stored",
    "Memories agents stored (remember, or an operator's), by scope; a retried step counts once.",
    ["scope"],
)
MEMORY_RECALLS = Counter(
    "yoke_memory_recalls",
    "Recalls of memory, by scope (all: every scope the join reads, as the prompt's own does).",
    ["scope"],
)
MEMORY_RECALL_SECONDS = Histogram(
    "yoke_memory_recall_seconds",
    "How long a recall took (the store's candidates, their ranking, an embedding if any).",
    buckets=(0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5),
)
MEMORIES_FORGOTTEN = Counter(
    "yoke_memories_forgotten", "Memories forgotten one by one (forget, yoke memory forget)."
)
MEMORY_ERASURES = Counter(
    "yoke_memory_erasures", "Memories erased with a person (yoke memory erase, its HTTP route)."
)
DOOM_LOOPS = Counter(
    "yoke_doom_loops", "Tool calls refused as a repeat of the same call.", ["tool"]
)
NOTICES = Counter("yoke_notices", "Notices left in monologues, by reason.", ["reason"])
COMPACTIONS = Counter("yoke_compactions", "Monologues compacted into a fresh one.")
# yoke.runtime.join_config: a join's configuration is read once per version, not per line.
JOIN_CONFIG_READS = Counter(
    "yoke_join_config_reads",
    "Join configurations read from the store (a first, or a new version).",
)
FOLLOWUPS_SCHEDULED = Counter(
    "yoke_followups_scheduled", "Follow-ups scheduled after an agent's forum line."
)
FOLLOWUPS_CANCELLED = Counter(
    "yoke_followups_cancelled",
    "Pending follow-ups cancelled (a person spoke, the agent spoke again, the join ended).",
)
FOLLOWUPS_FIRED = Counter(
    "yoke_followups_fired", "Follow-up nudges posted into an agent's monologue."
)
FOLLOWUPS_PENDING = Gauge(
    "yoke_followups_pending",
    "Follow-ups scheduled and not yet fired or cancelled, as stored (every follow-up "
    "replica reports the same number: aggregate with max).",
)
GUARDIAN_CHECKS = Counter(
    "yoke_guardian_checks", "Guardian policy checks of agent steps, by policy kind.", ["policy"]
)
GUARDIAN_INTERVENTIONS = Counter(
    "yoke_guardian_interventions", "Steering lines the guardian posted, by policy kind.", ["policy"]
)
# yoke.store.retention: records its sweeps deleted, by rule (what grows is bounded: invariant 14).
RETENTION_DELETED = Counter(
    "yoke_retention_deleted",
    "Records the retention sweep deleted as expired (live ones are kept), by rule.",
    ["rule"],
)
# yoke.core.tracing: spans sent to the collector, and those lost (the queue full, the collector
# away).
TRACE_SPANS_EXPORTED = Counter(
    "yoke_trace_spans_exported", "Spans the OTLP collector took (tracing on only)."
)
TRACE_SPANS_DROPPED = Counter(
    "yoke_trace_spans_dropped",
    "Spans lost, by reason (queue_full: ended while the export queue was full, the oldest "
    "dropped; export_failed: the collector refused them or could not be reached; held_full: "
    "past the most a door request not yet answered holds).",
    ["reason"],
)
GUARDIAN_RUNNER_SECONDS = Histogram(
    "yoke_guardian_runner_seconds",
    "Time a guardian runner took (model rounds included), by policy kind.",
    ["policy"],
    buckets=LATENCY_BUCKETS,
)


def exposition(accept: str | None) -> tuple[bytes, str]:
    """Every series and its content type, as the scraper's ``Accept`` asks (prometheus_client
    chooses): OpenMetrics shows the latency histograms' exemplars (their trace ids), the older
    text format does not."""
    encode, content_type = choose_encoder(accept or "")
    return encode(REGISTRY), content_type


# --- bounded label values ----------------------------------------------------------------------
# A person's ``/model ANYTHING`` and a model's invented tool names would otherwise become label
# values, one series each, for as long as the process lives.

OTHER = "other"
# The built-in fixture providers' models (``yoke.llm.fixtures``): the only ``fixture-`` names that
# ever reach a label, since any other ``fixture-`` model fails before a request is made.
FIXTURE_MODELS = frozenset({"fixture-echo", "fixture-script"})
SPARE_MODELS = 50
# yoke.tools.builtin's tools (named here: metrics sits below the tools layer).
BUILTIN_TOOL_NAMES = ("clock", "calculator", "wait")
SPARE_TOOLS = 200


class BoundedLabel:
    """Known values as they are, then the first ``spare`` others as seen; the rest ``other``."""

    def __init__(self, known: Iterable[str], *, spare: int = 0) -> None:
        self.known = frozenset(known)
        self.spare = spare
        self._seen: set[str] = set()

    def __call__(self, value: str, *, also: Container[str] = ()) -> str:
        """``also``: values the caller knows are bounded (configuration, e.g. the price table)."""
        if value in self.known or value in also or value in self._seen:
            return value
        if len(self._seen) < self.spare:
            self._seen.add(value)
            return value
        return OTHER


_MODELS = BoundedLabel(FIXTURE_MODELS, spare=SPARE_MODELS)
# Tools come from the catalog (an operator's choice, so bounded); names a model invents are
# ``other`` (the caller knows which is which).
_TOOLS = BoundedLabel(BUILTIN_TOOL_NAMES, spare=SPARE_TOOLS)


def model_label(model: str, prices: Container[str] = ()) -> str:
    """A model as a label value: fixtures, priced models (``Settings.prices``), 50 more seen."""
    return _MODELS(model, also=prices)


def tool_label(name: str, *, known: bool = True) -> str:
    """A tool as a label value: catalog tools (the first 200 seen past the built-ins);
    anything a model invents (``known=False``) is ``other``."""
    return _TOOLS(name) if known else OTHER


# --- series that start at zero -----------------------------------------------------------------
# A counter first exported at 1 never shows in rate() or increase(): Prometheus sees no increase
# from a value it never saw. So each service exports, from the start, the bounded label sets it
# may write (a first dead letter, tool call or doom loop then shows on the dashboard).

DEAD_LETTER_REASONS = ("malformed", "failed")
LLM_OUTCOMES = ("ok", "error", "retryable_error")
TOOL_OUTCOMES = ("ok", "error")
# Notice reasons: the processor's (services/processor: post_notice) and the guardian's.
PROCESSOR_NOTICES = (
    "budget",
    "provider",
    "doom_loop",
    "approval",
    "unpriced",
    "model",
    "held",
    "handed_back",
    "handoff",
    "nobody_came",
)
APPROVAL_DECISIONS = ("approve", "reject", "expired", "stopped")
GUARDIAN_NOTICES = ("guardian",)
CANCEL_REASONS = ("interrupt", "stop")
ESCALATION_ENDS = ("claimed", "timed_out", "canceled")
HOLD_CHANGES = ("takeover", "handback")
TRACE_DROP_REASONS = ("queue_full", "export_failed", "held_full")
MODEL_SERVICES = frozenset({"processor", "guardian"})


def initialize(service: str, prices: Iterable[str] = ()) -> None:
    """Create at zero the series ``service`` may write: fixture and priced models, tools."""
    for reason in DEAD_LETTER_REASONS:
        DEAD_LETTERS.labels(service, reason)
    if service in MODEL_SERVICES:
        for model in sorted(FIXTURE_MODELS | set(prices)):
            for outcome in LLM_OUTCOMES:
                LLM_REQUESTS.labels(model, outcome)
            LLM_LATENCY.labels(model)
            for kind in ("input", "output"):
                LLM_TOKENS.labels(model, kind)
            LLM_COST.labels(model)
    if service == "processor":
        for tool in BUILTIN_TOOL_NAMES:
            DOOM_LOOPS.labels(tool)
            for outcome in TOOL_OUTCOMES:
                TOOL_CALLS.labels(tool, "builtin", outcome)
        for source in ("builtin", "plugin", "mcp", "worker"):
            TOOL_CALL_SECONDS.labels(source)
        for reason in PROCESSOR_NOTICES:
            NOTICES.labels(reason)
        for cancel in CANCEL_REASONS:
            MODEL_CALLS_CANCELLED.labels(cancel)
    if service in ("processor", "ingestion"):  # the reaper decides expiries, the door the rest
        for decision in APPROVAL_DECISIONS:
            APPROVALS_DECIDED.labels(decision)
    if service == "ingestion":  # the door carries out holds and escalations' decisions
        for what in HOLD_CHANGES:
            HOLDS.labels(what)
        for outcome in ESCALATION_ENDS:
            ESCALATIONS_ENDED.labels(outcome)
    if service == "guardian":
        for reason in GUARDIAN_NOTICES:
            NOTICES.labels(reason)
    for reason in TRACE_DROP_REASONS:
        TRACE_SPANS_DROPPED.labels(reason)

"""Process configuration from the environment (the names are part of the public contract)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

# The mesh's services (those that consume shard queues), each with its default metrics port
# (replica k: + 10·k): the one list of them, which `yoke up`, its --replicas and the local
# Prometheus configuration read too. The HTTP gateway is not one: its port is gateway_port.
SERVICES = {
    "ingestion": 9101,
    "processor": 9102,
    "egress": 9103,
    "followup": 9104,
    "guardian": 9105,
}


class Settings(BaseSettings):
    """``YOKE_*`` environment variables with the defaults docs/configuration.md promises."""

    model_config = SettingsConfigDict(env_prefix="YOKE_", extra="ignore")

    amqp_url: str = "amqp://guest:guest@127.0.0.1:5672/"
    # RabbitMQ's management API, for `yoke publisher create` (default http://<AMQP host>:15672,
    # as the AMQP URL's user; a user in this URL, say an operator, is used instead).
    management_url: str | None = None
    mongodb_url: str = "mongodb://127.0.0.1:27017/yoke"
    # TLS (yoke.core.tls): the CA that signed an amqps:// server's certificate, and this client's
    # own certificate and key when the broker asks for one (PEM files).
    amqp_ca_file: str | None = None
    amqp_cert_file: str | None = None
    amqp_key_file: str | None = None
    # The same for MongoDB (also possible in the URL: tls=true&tlsCAFile=...); the client
    # certificate is one PEM file holding the certificate and its key, as pymongo takes it.
    mongodb_ca_file: str | None = None
    mongodb_cert_file: str | None = None
    # Concurrent MongoDB operations per process. Keep the sum over all processes below the
    # server's own pool (FerretDB: 250 as `make services` starts it; see deploy/local).
    mongodb_pool_size: int = Field(default=16, ge=1)
    shards: int = Field(default=16, ge=1, le=1024)
    metrics_port: int | None = None
    # Where /metrics and /healthz listen: loopback unless told (compose says 0.0.0.0 so that
    # Prometheus reaches them over the compose network).
    metrics_host: str = "127.0.0.1"
    # Which replica of its service this process is (``yoke up --replicas`` numbers them from 0):
    # replica k serves /metrics on the service's port + 10·k.
    replica: int = Field(default=0, ge=0, le=99)
    max_text_bytes: int = Field(default=65536, ge=1)
    log_format: Literal["json", "text"] | None = None
    log_level: str = "INFO"
    # Tracing (yoke.core.tracing, on when OTEL_EXPORTER_OTLP_ENDPOINT is set): model-call spans
    # carry the prompt and the completion only when this says so.
    trace_content: bool = False
    # The services' event loop: uvloop (less CPU per delivery) or the standard library's.
    event_loop: Literal["uvloop", "asyncio"] = "uvloop"
    # How long a written message may stay unpublished before the outbox sweep republishes it.
    outbox_grace_seconds: float = Field(default=3.0, gt=0)
    prefetch: int = Field(default=64, ge=1)
    # In-process attempts of a failing handler before its delivery is dead-lettered.
    handler_attempts: int = Field(default=3, ge=1)
    retry_backoff_seconds: float = Field(default=0.2, ge=0)
    # Lines of its monologue a processor step reads at most (the model's context window).
    context_lines: int = Field(default=200, ge=2)
    # Conversations whose newest lines a processor keeps (~0.5 MB each at 200 lines); 0: none.
    tail_cache_conversations: int = Field(default=256, ge=0)
    # Longest wait between retries while a dependency (store, broker) is unavailable.
    retry_cap_seconds: float = Field(default=5.0, gt=0)

    # Model providers (OPENAI_API_KEY / OPENAI_BASE_URL are read by the openai client itself).
    provider_request_timeout_seconds: float = Field(default=20.0, gt=0)
    provider_give_up_seconds: float = Field(default=30.0, gt=0)
    provider_retry_after_cap_seconds: float = Field(default=10.0, ge=0)
    # USD per million tokens by model: {"gpt-4o-mini": [0.15, 0.6]} (input, output).
    prices: dict[str, tuple[float, float]] = Field(default_factory=dict)

    # Lines a minute the door takes from one bridge user / one gateway token (0: no limit);
    # counted in the store, so the limit holds across ingestion replicas.
    bridge_lines_per_minute: int = Field(default=120, ge=0)
    token_lines_per_minute: int = Field(default=60, ge=0)
    # The RabbitMQ policy on every bridge.* queue (yoke publisher create applies it): at most
    # this many lines / bytes wait in one, the oldest dropped first.
    bridge_queue_max_length: int = Field(default=10_000, ge=1)
    bridge_queue_max_bytes: int = Field(default=64 * 1024 * 1024, ge=1)
    # Who a stdio MCP server runs as when the processor runs as root (yoke.tools.stdio_user):
    # unset, nobody; "root" keeps root, and lets the server read the mesh's secrets.
    mcp_stdio_user: str | None = None
    # The most dead letters yoke.dead-letters holds (its oldest dropped first, and counted):
    # the bound it is declared with (topology.dead_letter_queue_arguments).
    dead_letters_max_length: int = Field(default=10_000, ge=1)

    # The HTTP gateway (services/gateway): its API, console, /healthz and /metrics.
    gateway_port: int = Field(default=8080, ge=0, le=65535)
    gateway_host: str = "127.0.0.1"  # compose says 0.0.0.0 (its port is published on loopback)
    # The gateway's own RabbitMQ user (compose's; make run's gateway runs as the services').
    gateway_amqp_user: str = "yoke-gateway"
    # Where callers reach the gateway (scheme://host[:port], comma-separated): /mcp refuses a
    # request whose Host or Origin names another (403: DNS rebinding). Empty: where it listens,
    # http://127.0.0.1:PORT and http://localhost:PORT.
    gateway_public_origins: str = ""
    # How long a POST waits for the door's answer before it says 503 (Retry-After).
    gateway_submit_timeout_seconds: float = Field(default=10.0, gt=0)
    # The gateway's bounds (invariant 14): open connections (more get 503 at once), seconds for a
    # request's head and for its body, streams one token holds open, what one stream may buffer
    # for a slow reader, the bytes of one response, and how long a publish (a broker in alarm
    # reads none) and a stream's bind may take before 503.
    gateway_max_connections: int = Field(default=1000, ge=1)
    gateway_header_timeout_seconds: float = Field(default=10.0, gt=0)
    gateway_streams_per_token: int = Field(default=20, ge=1)
    gateway_stream_buffer_bytes: int = Field(default=4 * 1024 * 1024, ge=65536)
    gateway_max_response_bytes: int = Field(default=8 * 1024 * 1024, ge=65536)
    gateway_publish_timeout_seconds: float = Field(default=5.0, gt=0)
    gateway_bind_timeout_seconds: float = Field(default=5.0, gt=0)
    # How long an MCP tools/call waits for the agent's answer before it names the conversation.
    mcp_call_timeout_seconds: float = Field(default=120.0, gt=0)
    # How long a gateway follows an A2A task's turn for a caller (the process running it, a
    # resubscriber); a turn that outlasts it (a person's approval) leaves the task working, and
    # tasks/get, a resubscribe and its push notifications bring its end from the store.
    a2a_follow_seconds: float = Field(default=900.0, gt=0)
    # The A2A door's bounds (invariant 14): the tasks one token keeps (past it, its oldest are
    # forgotten), the push notification configs one task may hold and one token holds at most.
    a2a_tasks_per_token: int = Field(default=1000, ge=1)
    a2a_push_configs_per_task: int = Field(default=4, ge=1)
    a2a_push_configs_per_token: int = Field(default=1000, ge=1)
    # The conversations one caller's token keeps (an MCP conversation, an A2A contextId: a
    # forum and a join each); past it a new key is refused and the ones it has go on.
    kept_forums_per_token: int = Field(default=10_000, ge=1)
    # Hosts a URL set on an outsider's word (an A2A push) may reach although they are inside
    # the operator's network (yoke.core.outbound): host names, IPs or CIDRs, comma-separated.
    push_allowed_hosts: str = ""
    # Outgoing webhooks: one POST's timeout; a failing receiver is retried with backoff from
    # the first wait up to the cap, for up to the window, then its lines are dead-lettered.
    webhook_timeout_seconds: float = Field(default=10.0, gt=0)
    webhook_backoff_seconds: float = Field(default=1.0, gt=0)
    webhook_backoff_cap_seconds: float = Field(default=300.0, gt=0)
    webhook_retry_window_seconds: float = Field(default=3600.0, ge=0)
    # The dead letters kept per subscription (its newest; older ones are deleted as more come).
    webhook_dead_letters_kept: int = Field(default=1000, ge=1)
    # Agents the console's forum view lists at most (newest joins first; it says when it cut).
    console_max_agents: int = Field(default=100, ge=1)
    # /docs (Swagger UI, loaded from a CDN into the gateway's origin): off unless asked for.
    gateway_docs: bool = False
    # A gateway replica holds a subscription in leases of this long (one delivers it at a time).
    webhook_lease_seconds: float = Field(default=10.0, gt=0)
    # The MCP door's answers owed to one token (calls that ran out of time) at most: past it,
    # its oldest debts are dropped (their answers stay in their conversations).
    mcp_owed_answers_per_token: int = Field(default=100, ge=1)

    # Retention (yoke.store.retention): how often each process sweeps what it owns, how far back
    # its first round looks, and how many records of a bucket one round reads for liveness.
    retention_sweep_seconds: float = Field(default=600.0, gt=0)
    retention_lookback_days: int = Field(default=7, ge=1)
    retention_batch: int = Field(default=1000, ge=1)
    # Days kept: follow-up decisions, guardian "checked" records and done procedure intents.
    retention_decision_days: float = Field(default=7.0, gt=0)
    # Days kept: failure records once handled (an open one stays while it can be replayed).
    retention_failure_days: float = Field(default=14.0, gt=0)
    # Days kept: webhook dead letters (the console and `yoke webhook list` show them).
    retention_webhook_dead_letter_days: float = Field(default=14.0, gt=0)
    # Days kept: A2A tasks (tasks/get finds one until then, if its token's cap kept it).
    retention_a2a_task_days: float = Field(default=7.0, gt=0)
    # Hours kept: lapsed leases, stale outbox claims and silent replicas' documents.
    retention_lease_hours: float = Field(default=6.0, gt=0)

    def metrics_port_for(self, service: str) -> int:
        if self.metrics_port is not None:
            return self.metrics_port
        return SERVICES.get(service, 9100) + 10 * self.replica

"""Monitoring proven against a real Prometheus (Debian's 2.42, as ``make monitoring`` runs it).

A Prometheus of the test's own scrapes the mesh's five processes, a second followup replica,
the HTTP gateway and RabbitMQ every second while a scenario exercises every dashboard panel
(webhooks delivered to a receiver here; the second replica stopped, its shard handed back);
then every PromQL expression of the Grafana dashboard runs through the HTTP API (windows
shortened) and must show data. The alert rules pass ``promtool check rules`` and their unit
tests, and one alert is checked live: a killed service's YokeServiceDown fires once its
``for`` (shortened here) has passed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import re
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

import httpx
import pytest
import yaml
from prometheus_client import REGISTRY

from bench.callers import A2aCaller, McpCaller
from tests.support.fake_openai import FakeOpenAI, completion, failure, openai_env
from tests.support.gateway_process import gateway_process
from tests.support.mesh import JoinFactory, Launch, Mesh, agent_lines, lines_until, say
from tests.support.processes import ServiceProcess, eventually, free_port
from tests.support.prometheus import Prometheus, binary
from tests.support.webhook_receiver import Receiver
from yoke.cli.monitoring import local_config
from yoke.client import Client
from yoke.core.ids import new_id
from yoke.core.models import CommandAuthor, Message, TextPart
from yoke.llm.base import ScriptedCall, ScriptedOutput
from yoke.runtime.catalog_store import ToolCatalog
from yoke.runtime.escalations import Escalation, Escalations
from yoke.runtime.join_config import JoinConfig
from yoke.runtime.joins import create_agent
from yoke.store.database import Store
from yoke.store.outbox import Outbox
from yoke.store.publishing import publish_agent
from yoke.store.tokens import create_token, ensure_token_indexes
from yoke.store.webhooks import add_webhook, ensure_webhook_indexes
from yoke.tools.catalog import CatalogEntry

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
PROMETHEUS_DIR = ROOT / "deploy/prometheus"
ALERTS = PROMETHEUS_DIR / "alerts.yml"
ALERT_TESTS = PROMETHEUS_DIR / "tests/alerts_test.yml"
DASHBOARD = ROOT / "deploy/grafana/dashboards/yoke.json"
RABBITMQ_PROMETHEUS_PORT = 15692

SCRAPE = "1s"
# Every range in the dashboard becomes this: the scenario lasts about a minute, not an hour.
WINDOW = "[1m]"
# YokeServiceDown's `for` in the live check (1m in alerts.yml).
SERVICE_DOWN_FOR = 5.0
# Panels whose healthy reading is 0: a series at all is data. Every other panel needs a value > 0.
ZERO_IS_DATA = {"Outbox: oldest unpublished message (s)", "Tool calls past their deadline"}
# What fills each panel (the issue's closing note lists these).
FILLED_BY = {
    "Events handled by service and outcome": "every turn (echo turns first)",
    "Event lag p99 (s)": "every turn",
    "Handling latency p99 (s)": "every turn",
    "LLM latency p95 (s)": "echo turns (fixture-echo), the OpenAI agent (gpt-test)",
    "LLM requests by outcome": "echo turns; the OpenAI agent's ok and failed requests",
    "Tokens per second": "echo turns (estimated tokens), the OpenAI agent (reported usage)",
    "Cost (USD/hour)": "the OpenAI agent (gpt-test is in YOKE_PRICES)",
    "Tool calls by tool, source and outcome": "the OpenAI agent's calculator call, the doom "
    "loop's clock calls (builtin ok), the worker call nobody answers (worker timeout)",
    "Tool call latency p50 / p95 by source (s)": "the built-in calls; the worker call, ended "
    "by its deadline",
    "Tool calls waiting in the store": "the worker call, until its deadline",
    "Tool calls past their deadline": "the reaper (0 but for the moment it ends the worker call)",
    "Dead letters": "the poison line",
    "Queue depth (ready messages)": "the poison line, waiting in yoke.dead-letters",
    "Compactions and notices (last hour)": "the compaction; the doom loop's and the failing "
    "model's notices",
    "Doom loops refused": "the doom loop (a fixture-script agent repeating one clock call)",
    "Outbox: oldest unpublished message (s)": "every writer (0 while publishes are confirmed)",
    "Webhook deliveries by outcome": "the webhook forum's echo answers, delivered to a receiver",
    "Webhook delivery latency p95 (s)": "the webhook forum's deliveries",
    "Shards owned per replica": "every sharded service; the followup replicas 0 and 1",
    "Shard hand-overs": "followup replica 1 stopped: replica 0 gains its shard",
    "Agents called from outside: MCP calls and A2A tasks": "the published echo agent, called "
    "once over MCP and sent one A2A task (mcp answered; a2a submitted, working, completed)",
    "Agents called from outside: latency p95 (s)": "the same MCP call and A2A task",
    "Forums held": "the claimed escalation's forum, held until its hand-back",
    "Escalations waiting for a person": "both handoffs, until one is claimed and one times out",
    "Oldest unclaimed escalation (s)": "the same, as they wait",
    "Time to claim an escalation p50 / p95 (s)": "the claim through the door",
    "Escalations opened and ended by outcome (last hour)": "the two handoffs; the claim "
    "(claimed) and the follow-up sweep's timeout (timed_out)",
    "Takeovers and hand-backs (last hour)": "the claim's /takeover and the /handback",
}
# Panels a demo's echo agent must fill too: fixture models are recorded like any model.
ECHO_PANELS = {"LLM latency p95 (s)", "LLM requests by outcome", "Tokens per second"}
POISON = "POISON"
# The service with a second replica, stopped during the scenario (its shard handed back).
REPLICATED = "followup"
# The gateway's webhook worker looks for new subscriptions every 2 s; short leases as in
# tests/gateway/test_webhooks.py.
GATEWAY_ENV = {"YOKE_WEBHOOK_LEASE_SECONDS": "2", "YOKE_WEBHOOK_BACKOFF_SECONDS": "0.2"}
WEBHOOK_PATH = "/monitoring"
# A worker tool nobody serves: its call waits in the store until its deadline ends it.
WORKER_TOOL = f"unserved-{uuid.uuid4().hex[:8]}"
WORKER_TIMEOUT_SECONDS = 5.0


def load(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def panel_queries() -> list[tuple[str, str, str]]:
    """(panel title, refId, expression) of every query of the dashboard."""
    dashboard = json.loads(DASHBOARD.read_text())
    return [
        (panel["title"], target["refId"], target["expr"])
        for panel in dashboard["panels"]
        for target in panel.get("targets", [])
    ]


def shortened(expr: str) -> str:
    return re.sub(r"\[\d+[smhdw]\]", WINDOW, expr)


# --- rules and configuration, without a mesh -------------------------------------------------


def test_alert_rules_pass_promtool_and_every_alert_has_unit_tests() -> None:
    promtool = binary("promtool")
    check = subprocess.run(
        [promtool, "check", "rules", str(ALERTS)], capture_output=True, text=True
    )
    assert check.returncode == 0, check.stdout + check.stderr
    tests = subprocess.run(
        [promtool, "test", "rules", ALERT_TESTS.name],
        cwd=ALERT_TESTS.parent,
        capture_output=True,
        text=True,
    )
    assert tests.returncode == 0, tests.stdout + tests.stderr
    alerts = {rule["alert"] for group in load(ALERTS)["groups"] for rule in group["rules"]}
    cases = [case for test in load(ALERT_TESTS)["tests"] for case in test["alert_rule_test"]]
    fired = {case["alertname"] for case in cases if case.get("exp_alerts")}
    quiet = {case["alertname"] for case in cases if not case.get("exp_alerts")}
    assert alerts == fired == quiet, (alerts, fired, quiet)  # each one fires and stays quiet
    assert {
        "YokeServiceDown",
        "YokeServiceRestarting",
        "YokeQueueBackingUp",
        "YokeOutboxUnpublished",
        "YokeModelFailing",
        "YokeEscalationUnclaimed",
    } <= alerts


def test_the_outbox_gauges_show_what_waits_for_a_confirm_and_how_long() -> None:
    outbox = Outbox("monitoring-test")
    message = Message(
        id=new_id(),
        conversation_id="c",
        author_actor_id="a",
        parts=[TextPart(text="x")],
        created_at=datetime.now(UTC) - timedelta(seconds=90),
    )

    def gauge(name: str) -> float:
        value = REGISTRY.get_sample_value(name, {"service": "monitoring-test"})
        assert value is not None, name
        return value

    assert gauge("yoke_outbox_unpublished") == 0
    assert gauge("yoke_outbox_oldest_unpublished_seconds") == 0
    outbox.written(message)
    assert gauge("yoke_outbox_unpublished") == 1
    assert 90 <= gauge("yoke_outbox_oldest_unpublished_seconds") < 120  # past the alert's 60 s
    outbox.confirmed(message.id)
    assert gauge("yoke_outbox_unpublished") == 0
    assert gauge("yoke_outbox_oldest_unpublished_seconds") == 0


def test_the_local_configuration_passes_promtool(tmp_path: Path) -> None:
    out = tmp_path / "prometheus.yml"
    subprocess.run(
        [
            *(sys.executable, "-m", "yoke.cli.monitoring"),
            *("--source", str(PROMETHEUS_DIR / "prometheus.yml"), "--rules", str(ALERTS)),
            *("--out", str(out), "--replicas", "2"),
        ],
        check=True,
        cwd=ROOT,
    )
    config = load(out)
    [yoke] = [job for job in config["scrape_configs"] if job["job_name"] == "yoke"]
    targets = yoke["static_configs"][0]["targets"]
    assert "127.0.0.1:9102" in targets and "127.0.0.1:9112" in targets  # replica 1: port + 10
    assert "127.0.0.1:8080" in targets and "127.0.0.1:8090" not in targets  # one gateway
    check = subprocess.run(
        [binary("promtool"), "check", "config", str(out)], capture_output=True, text=True
    )
    assert check.returncode == 0, check.stdout + check.stderr


def test_make_monitoring_starts_prometheus_with_the_rules_and_prints_its_url(
    tmp_path: Path,
) -> None:
    port = free_port()
    env = {**os.environ, "YOKE_PROMETHEUS_PORT": str(port), "YOKE_PROMETHEUS_DIR": str(tmp_path)}
    script = str(ROOT / "deploy/local/monitoring.sh")
    started = subprocess.run(
        [script, "start"], env=env, capture_output=True, text=True, timeout=120
    )
    try:
        assert started.returncode == 0, started.stdout + started.stderr
        assert f"http://127.0.0.1:{port}" in started.stdout
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as http:
            rules = http.get("/api/v1/rules").json()["data"]["groups"]
            loaded = {rule["name"] for group in rules for rule in group["rules"]}
            alerts = {rule["alert"] for g in load(ALERTS)["groups"] for rule in g["rules"]}
            assert alerts == loaded
            scraped: set[tuple[str, str]] = set()
            deadline = time.monotonic() + 30
            jobs = load(tmp_path / "prometheus.yml")["scrape_configs"]
            expected = sum(len(s["targets"]) for job in jobs for s in job["static_configs"])
            while len(scraped) < expected and time.monotonic() < deadline:
                time.sleep(0.2)
                targets = http.get("/api/v1/targets").json()["data"]["activeTargets"]
                scraped = {(t["labels"]["job"], t["scrapeUrl"]) for t in targets}
        assert ("yoke", "http://127.0.0.1:9102/metrics") in scraped
        assert ("yoke", "http://127.0.0.1:8080/metrics") in scraped  # the gateway
        assert (
            "rabbitmq-queues",
            f"http://127.0.0.1:{RABBITMQ_PROMETHEUS_PORT}/metrics/detailed"
            "?family=queue_coarse_metrics",
        ) in scraped
    finally:
        stopped = subprocess.run([script, "stop"], env=env, capture_output=True, text=True)
    assert stopped.returncode == 0, stopped.stderr
    assert not (tmp_path / "prometheus.pid").exists()


# --- a mesh under a real Prometheus ----------------------------------------------------------


@pytest.fixture(scope="module")
def mesh_env(fake_openai: FakeOpenAI) -> dict[str, str]:
    return openai_env(
        fake_openai.base_url,
        api_key="sk-test",
        YOKE_PRICES='{"gpt-test": [1000, 2000]}',
        YOKE_HANDLER_ATTEMPTS="2",
    )


@pytest.fixture(scope="module")
async def worker_tool(store: Store) -> str:
    """In the catalog before the mesh starts, so the processor's copy of it offers the tool."""
    entry = CatalogEntry(
        id=WORKER_TOOL,
        source="worker",
        origin=WORKER_TOOL,
        timeout_seconds=WORKER_TIMEOUT_SECONDS,
    )
    await ToolCatalog(store).register(entry)
    return WORKER_TOOL


@pytest.fixture(scope="module")
def before_mesh(worker_tool: str) -> None:
    """The worker tool is in the catalog when the services start."""


@pytest.fixture(scope="module")
def mesh_launch() -> Launch:
    """The processor failing for good on any line holding POISON."""
    return {
        "processor": (["-m", "tests.support.poison", "processor"], {"YOKE_TEST_POISON": POISON})
    }


@pytest.fixture(scope="module")
async def gateway(
    amqp_url: str, module_mongodb_url: str, mesh: Mesh, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[ServiceProcess]:
    """The HTTP gateway beside the mesh: its webhook worker fills the webhook panels."""
    log_dir = Path(tmp_path_factory.mktemp("gateway"))
    running = gateway_process(amqp_url, module_mongodb_url, log_dir, **GATEWAY_ENV)
    async with running as (process, _):
        yield process


async def shards_owned(process: ServiceProcess) -> float:
    return sample(await process.metrics(), "yoke_shards_owned", service=REPLICATED)


@pytest.fixture(scope="module")
async def second_replica(mesh: Mesh) -> AsyncIterator[ServiceProcess]:
    """Replica 1 of REPLICATED, owning one of its two shards; the scenario stops it."""
    process = ServiceProcess(
        ["-m", f"services.{REPLICATED}"],
        {**mesh.env, "YOKE_REPLICA": "1"},
        mesh.log_dir / f"{REPLICATED}-1.log",
    )
    try:
        await process.wait_healthy()
        first = mesh.processes[REPLICATED]

        async def shared() -> bool:
            return await shards_owned(first) == 1 and await shards_owned(process) == 1

        await eventually(shared, timeout=30, what=f"{REPLICATED}'s two shards, one each")
        yield process
    finally:
        process.stop()


@pytest.fixture(scope="module")
async def prometheus(
    mesh: Mesh,
    gateway: ServiceProcess,
    second_replica: ServiceProcess,
    servers: tuple[str, str, str],
    amqp_url: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> AsyncIterator[Prometheus]:
    """Prometheus on the checked-in configuration, pointed at this module's processes."""
    directory = Path(tmp_path_factory.mktemp("prometheus"))
    rules = load(ALERTS)
    for group in rules["groups"]:
        for rule in group["rules"]:
            if rule["alert"] == "YokeServiceDown":
                rule["for"] = f"{SERVICE_DOWN_FOR:g}s"
    (directory / "alerts.yml").write_text(yaml.safe_dump(rules, sort_keys=False))
    rabbitmq = f"{urlsplit(servers[2]).hostname}:{RABBITMQ_PROMETHEUS_PORT}"
    config = local_config(
        load(PROMETHEUS_DIR / "prometheus.yml"),
        rule_files=[str(directory / "alerts.yml")],
        scrape_interval=SCRAPE,
        targets={
            "yoke": [
                f"127.0.0.1:{process.port}"
                for process in (*mesh.processes.values(), gateway, second_replica)
            ],
            "rabbitmq": [rabbitmq],
            "rabbitmq-queues": [rabbitmq],
        },
    )
    vhost = unquote(urlsplit(amqp_url).path.removeprefix("/"))
    for job in config["scrape_configs"]:
        if job["job_name"] == "rabbitmq-queues":  # this module's queues only
            job["params"] = {**job.get("params", {}), "vhost": [vhost]}
    server = Prometheus(config, directory)
    try:
        await server.wait_ready()
        expected = len(mesh.processes) + 4  # the gateway, replica 1, RabbitMQ twice

        async def all_up() -> bool:
            targets = await server.targets()
            return len(targets) == expected and all(t["health"] == "up" for t in targets)

        await eventually(all_up, timeout=30, what="every target scraped", interval=0.5)
        yield server
    finally:
        server.stop()


def sample(metrics: str, name: str, **labels: str) -> float:
    """The sum of a series' samples whose labels include ``labels`` (0 if none)."""
    total = 0.0
    for line in metrics.splitlines():
        if not line.startswith(name):
            continue
        head, _, value = line.rpartition(" ")
        if all(f'{key}="{wanted}"' in head for key, wanted in labels.items()):
            total += float(value)
    return total


async def metric_reaches(process: Any, name: str, at_least: float, **labels: str) -> None:
    async def reached() -> bool:
        return sample(await process.metrics(), name, **labels) >= at_least

    await eventually(reached, timeout=60, what=f"{name}{labels} >= {at_least}", interval=0.3)


async def echo_turns(store: Store, client: Client, new_join: JoinFactory) -> None:
    forum_id, _ = await new_join()
    for index in range(5):
        await say(client, forum_id, f"echo turn {index}")
        await lines_until(store, forum_id, lambda lines, n=index + 1: len(agent_lines(lines)) == n)


async def openai_agent(
    store: Store, client: Client, new_join: JoinFactory, fake_openai: FakeOpenAI
) -> None:
    """A tool call and its answer, then a model that refuses: a failed request and a notice."""
    fake_openai.script(
        completion(
            None,
            [("call-a", "calculator", '{"expression": "6*7"}')],
            prompt_tokens=50,
            completion_tokens=5,
        ),
        completion("six times seven is 42", prompt_tokens=60, completion_tokens=6),
    )
    forum_id, _ = await new_join(model="gpt-test", tools=["calculator"])
    await say(client, forum_id, "what is 6*7?")
    forum = await lines_until(store, forum_id, lambda lines: len(agent_lines(lines)) == 1)
    assert forum[-1].text == "six times seven is 42"
    fake_openai.script()
    fake_openai.default = failure(400)
    try:
        forum_id, join = await new_join(model="gpt-test")
        await say(client, forum_id, "are you there?")
        await lines_until(
            store, join.monologue_id, lambda lines: any(m.type == "notice" for m in lines)
        )
    finally:
        fake_openai.default = None


async def doom_loop(store: Store, client: Client, new_join: JoinFactory) -> None:
    loop = ScriptedOutput(tool_calls=[ScriptedCall(name="clock")], repeat=True)
    forum_id, join = await new_join(model="fixture-script", tools=["clock"], script=[loop])
    await say(client, forum_id, "what time is it, forever?")
    await lines_until(
        store, join.monologue_id, lambda lines: any(m.type == "notice" for m in lines)
    )


async def unanswered_worker_call(
    store: Store, client: Client, new_join: JoinFactory, mesh: Mesh
) -> None:
    """A worker call nobody serves: open in the store until its deadline, then a timeout."""
    script = [
        ScriptedOutput(tool_calls=[ScriptedCall(name=WORKER_TOOL)]),
        ScriptedOutput(text="the worker never answered"),
    ]
    forum_id, _ = await new_join(model="fixture-script", tools=[WORKER_TOOL], script=script)
    await say(client, forum_id, "ask the worker")
    processor = mesh.processes["processor"]
    await metric_reaches(processor, "yoke_tool_calls_open", 1)
    forum = await lines_until(
        store, forum_id, lambda lines: len(agent_lines(lines)) == 1, timeout=60
    )
    assert forum[-1].text == "the worker never answered"
    await metric_reaches(
        processor, "yoke_tool_calls_total", 1, tool=WORKER_TOOL, source="worker", outcome="timeout"
    )


async def poisoned_line(client: Client, new_join: JoinFactory, mesh: Mesh) -> None:
    forum_id, _ = await new_join()
    await say(client, forum_id, f"{POISON}: the processor fails on this line for good")
    await metric_reaches(mesh.processes["processor"], "yoke_dead_letters_total", 1, reason="failed")


async def compaction(store: Store, client: Client, new_join: JoinFactory, mesh: Mesh) -> None:
    forum_id, _ = await new_join(compaction_threshold_tokens=120, compaction_keep=2)
    processor = mesh.processes["processor"]
    padding = "a line long enough to fill the context window soon " * 2
    for index in range(15):
        await say(client, forum_id, f"compaction line {index:02d}: {padding}")
        await lines_until(
            store, forum_id, lambda lines, n=index + 1: len(agent_lines(lines)) == n, timeout=60
        )
        if sample(await processor.metrics(), "yoke_compactions_total") >= 1:
            return
    raise AssertionError("no compaction after 15 long lines")


async def webhook_deliveries(
    store: Store, client: Client, new_join: JoinFactory, receiver: Receiver
) -> None:
    """A forum with a webhook: its echo answers are POSTed to the receiver."""
    forum_id, _ = await new_join()
    await ensure_webhook_indexes(store)
    await add_webhook(store, forum_id, receiver.url(WEBHOOK_PATH))
    for index in range(3):
        await say(client, forum_id, f"webhook turn {index}")
        await lines_until(store, forum_id, lambda lines, n=index + 1: len(agent_lines(lines)) == n)

    async def delivered() -> bool:
        return len(receiver.delivered(WEBHOOK_PATH)) >= 3

    await eventually(delivered, timeout=60, what="3 webhook deliveries", interval=0.2)


async def published_agent_called(store: Store, gateway: ServiceProcess) -> None:
    """The echo agent, published, called once through each of the gateway's caller doors with
    the official clients (bench/callers.py's, as a user's program would)."""
    agent = await create_agent(store, "published echo")
    await publish_agent(store, "monitored", agent.id)
    await ensure_token_indexes(store)
    _, secret = await create_token(store, "monitoring-caller", can_call=["monitored"])
    url = f"http://127.0.0.1:{gateway.port}"
    for caller in (
        McpCaller(url, secret, "monitored", 60),
        A2aCaller(url, secret, "monitored", 60),
    ):
        await caller.open()
        try:
            await caller.call("called from outside")
        finally:
            await caller.close()


async def reported(processes: list[ServiceProcess], name: str, at_least: float) -> None:
    """A follow-up replica reports ``name`` >= ``at_least`` (one sweeps; the other may stop)."""

    async def reached() -> bool:
        for process in processes:
            with contextlib.suppress(httpx.HTTPError):
                if sample(await process.metrics(), name) >= at_least:
                    return True
        return False

    await eventually(reached, timeout=60, what=f"{name} >= {at_least}", interval=0.3)


async def people_take_over(
    store: Store, client: Client, new_join: JoinFactory, mesh: Mesh, replica: ServiceProcess
) -> None:
    """Two agents ask for a person (their handoff tool): one escalation is claimed once the
    follow-up sweep reports it waiting, and handed back; nobody claims the other, whose
    deadline the sweep ends."""
    handoff = ScriptedOutput(tool_calls=[ScriptedCall(name="handoff", input={"reason": "help"})])
    carry_on = ScriptedOutput(text="nobody came; I answer on")
    escalations = Escalations(store)
    forums: list[str] = []
    for timeout in (900, 3):
        config = JoinConfig(
            model="fixture-script",
            script=[handoff, carry_on],
            handoff=True,
            handoff_timeout_seconds=timeout,
        )
        forum_id, _ = await new_join(config=config)
        await say(client, forum_id, "a person, please")
        forums.append(forum_id)
    found: list[Escalation] = []

    async def opened() -> bool:
        found[:] = await escalations.listed(forum_ids=forums[:1])
        return bool(found)

    await eventually(opened, timeout=60, what="the first agent's escalation")
    followups = [mesh.processes[REPLICATED], replica]
    await reported(followups, "yoke_escalations_open", 1)
    await reported(followups, "yoke_escalation_oldest_open_seconds", 1)
    (claimed,) = found
    ada = CommandAuthor(external_id="cli:ada", display_name="ada")
    reply = await client.submit_escalation(forums[0], claimed.id, "claim", ada)
    assert reply.status == "accepted", reply
    await reported(followups, "yoke_forums_held", 1)
    reply = await client.submit(
        forums[0], "/handback", external_id="cli:ada", display_name="ada", hold_granted=True
    )
    assert reply.status == "accepted", reply
    ingestion = mesh.processes["ingestion"]
    await metric_reaches(ingestion, "yoke_escalations_ended_total", 1, outcome="claimed")
    await metric_reaches(ingestion, "yoke_escalations_ended_total", 1, outcome="timed_out")


async def shard_handed_back(mesh: Mesh, second_replica: ServiceProcess) -> None:
    """Replica 1 stops (SIGTERM, cleanly): replica 0 gains its shard."""
    first = mesh.processes[REPLICATED]

    def gained(metrics: str) -> float:
        return sample(metrics, "yoke_shard_handovers_total", direction="gained")

    before = gained(await first.metrics())
    # Off the event loop: the receiver and the other scenario parts run in it meanwhile.
    code = await asyncio.to_thread(second_replica.stop)
    assert code == 0, second_replica.log_path.read_text(errors="replace")[-3000:]

    async def handed_back() -> bool:
        metrics = await first.metrics()
        return gained(metrics) > before and await shards_owned(first) == 2

    await eventually(handed_back, timeout=30, what=f"{REPLICATED} replica 0 owning both shards")


async def test_every_dashboard_panel_shows_data(
    prometheus: Prometheus,
    store: Store,
    client: Client,
    new_join: JoinFactory,
    fake_openai: FakeOpenAI,
    mesh: Mesh,
    receiver: Receiver,
    second_replica: ServiceProcess,
    gateway: ServiceProcess,
) -> None:
    started = time.time()
    await asyncio.gather(
        echo_turns(store, client, new_join),
        openai_agent(store, client, new_join, fake_openai),
        doom_loop(store, client, new_join),
        unanswered_worker_call(store, client, new_join, mesh),
        poisoned_line(client, new_join, mesh),
        compaction(store, client, new_join, mesh),
        webhook_deliveries(store, client, new_join, receiver),
        shard_handed_back(mesh, second_replica),
        published_agent_called(store, gateway),
        people_take_over(store, client, new_join, mesh, second_replica),
    )
    queries = panel_queries()
    assert {title for title, _, _ in queries} == set(FILLED_BY)  # every panel is accounted for
    # Per query: its highest value and the labels of the series that reached it.
    found: dict[str, tuple[float, dict[str, str]]] = {}
    echoed: set[str] = set()  # panels with a fixture-echo series above 0

    async def every_panel_has_data() -> bool:
        for title, ref, expr in queries:
            result = await prometheus.query_range(shortened(expr), started - 5, time.time(), "1s")
            values = [
                (float(value), series["metric"])
                for series in result
                for _, value in series["values"]
                if not math.isnan(float(value))
            ]
            if values:
                highest = max(values, key=lambda pair: pair[0])
                if title in ZERO_IS_DATA or highest[0] > 0:
                    found[f"{title} [{ref}]"] = highest
            if any(v > 0 and labels.get("model") == "fixture-echo" for v, labels in values):
                echoed.add(title)
        return len(found) == len(queries) and echoed >= ECHO_PANELS

    try:
        await eventually(every_panel_has_data, timeout=30, what="every panel", interval=1)
    except AssertionError:
        empty = [f"{t} [{r}]: {e}" for t, r, e in queries if f"{t} [{r}]" not in found]
        empty += [f"{title}: nothing for model fixture-echo" for title in ECHO_PANELS - echoed]
        raise AssertionError("panels without data:\n" + "\n".join(empty)) from None
    for title, ref, expr in queries:
        value, labels = found[f"{title} [{ref}]"]
        print(f"{title} [{ref}] max {value:.4g} {labels}: {FILLED_BY[title]}")
        assert expr  # (printed with -s: the closing note's table)


async def test_a_killed_service_fires_service_down_once_its_for_has_passed(
    prometheus: Prometheus, mesh: Mesh
) -> None:
    victim = mesh.processes["guardian"]
    instance = f"127.0.0.1:{victim.port}"

    def ours(alert: dict[str, Any]) -> bool:
        labels = alert["labels"]
        return labels["alertname"] == "YokeServiceDown" and labels.get("instance") == instance

    assert not [alert for alert in await prometheus.alerts() if ours(alert)]
    loop = asyncio.get_running_loop()
    mesh.killed.add("guardian")
    killed_at = loop.time()
    victim.kill()
    seen: dict[str, float] = {}

    async def firing() -> bool:
        for alert in await prometheus.alerts():
            if ours(alert):
                seen.setdefault(alert["state"], loop.time() - killed_at)
        return "firing" in seen

    await eventually(
        firing, timeout=SERVICE_DOWN_FOR + 20, what="YokeServiceDown firing", interval=0.2
    )
    print(f"YokeServiceDown after the kill: {seen}")
    # Pending first, firing once `for` has passed: one scrape and an evaluation or two later.
    assert "pending" in seen, seen
    assert SERVICE_DOWN_FOR <= seen["firing"] <= SERVICE_DOWN_FOR + 5, seen

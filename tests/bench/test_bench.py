"""``make bench`` cannot rot: its smallest form runs every phase through the real mesh and
writes every section of the results."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.support.processes import ROOT

# Every phase, each as small as it goes: a smoke run, not a measurement.
SMALLEST = [
    "--quick",
    "--events=30",
    "--warmup=5",
    "--serial=10",
    "--conversations=5",
    "--turns=5",
    "--turn-warmup=1",
    "--gateway-turns=3",
    "--stream-turns=3",
    "--tool-turns=3",
    "--forums=3",
    "--forum-turns=1",
    "--growth-lines=20",
    "--growth-turns=2",
    "--isolation-forums=2",
    "--isolation-turns=2",
    "--slow-seconds=1",
    "--joins=50",
    "--scale-turns=1",
    "--tracing-turns=3",
]
SECTIONS = (
    "rawRelay",
    "busHop",
    "turnLatency",
    "gateway",
    "streaming",
    "tools",
    "throughput",
    "replicas",
    "growth",
    "isolation",
    "scale",
    "tracing",
    "ratios",
    "targets",
)
# About 70 s on a quiet machine (the tool rounds' and streaming's share about 10 each; 90 s at
# load average 4); the deadline leaves room for a shared one (it took 225 s at load average 20
# on 2 cpus); the tracing phase restarts the services twice (about 20 s more).
DEADLINE = 360


def test_the_smallest_bench_measures_every_phase(
    servers: tuple[str, str, str], tmp_path: Path
) -> None:
    amqp, mongodb, management = servers
    results = tmp_path / "results.json"
    env = {
        **os.environ,
        "YOKE_AMQP_URL": amqp,
        "YOKE_MONGODB_URL": mongodb,
        "YOKE_RABBITMQ_MANAGEMENT_URL": management,
    }
    done = subprocess.run(
        [sys.executable, "-m", "bench", *SMALLEST, f"--results={results}"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=DEADLINE,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    figures = json.loads(results.read_text())
    assert [s for s in SECTIONS if figures.get(s, {"skipped": True}) == {"skipped": True}] == []
    assert figures["turnLatency"]["turns"] == 5
    assert figures["throughput"]["turns"] == 3
    gateway = figures["gateway"]  # each door's series, every answer seen where it goes
    series = (
        *("post", "amqpSubmit", "postToStream", "amqpTurn", "postToWebhook"),
        *("mcpCall", "a2aTask"),
    )
    assert [gateway[name]["count"] for name in series] == [3] * len(series), gateway
    assert gateway["exitCode"] == 0 and set(gateway["ratios"]) == {"accept", "answer", "mcp", "a2a"}
    streaming = figures["streaming"]  # the draft shows long before its line (2 s of writing)
    assert [streaming[name]["count"] for name in ("postToFirstDelta", "postToLine")] == [3, 3]
    assert streaming["postToFirstDelta"]["maxMs"] < streaming["postToLine"]["p50Ms"], streaming
    assert streaming["postToLine"]["p50Ms"] >= 2000 and streaming["deltasPerAnswer"]["min"] >= 2
    assert streaming["exitCode"] == 0
    tools = figures["tools"]  # each kind's turns and rounds, every call answered, no error
    kinds = ("inline", "worker", "mcp")
    counts = [tools[kind][series]["count"] for kind in kinds for series in ("turn", "round")]
    assert counts == [3] * 6, tools
    assert all(tools[kind]["round"]["p50Ms"] < tools[kind]["turn"]["p50Ms"] for kind in kinds)
    assert tools["workerExitCode"] == 0 and set(tools["ratios"]) == {"worker", "mcp"}
    replicas = figures["replicas"]  # 1 vs 2 processor replicas over the bench's 4 shards
    assert replicas["one"]["turns"] == 3 and replicas["two"]["turns"] == 3, replicas
    assert sorted(replicas["shardsOwnedWithTwo"]) == [2, 2] and replicas["secondExitCode"] == 0
    assert figures["growth"]["long"]["turns"] == 2 and figures["growth"]["monologuePrefilled"]
    assert figures["isolation"]["besideSlow"]["turns"] == 4
    assert set(figures["scale"]["rssMbAfter"]) == {
        "ingestion",
        "processor",
        "egress",
        "followup",
        "guardian",
    }
    assert figures["scale"]["joins"] == 50
    tracing = figures["tracing"]  # the services restarted untraced, then tracing every span
    assert tracing["off"]["turns"] == 3 and tracing["on"]["turns"] == 3, tracing
    assert tracing["off"]["spansPerTurn"] == 0 and tracing["on"]["spansPerTurn"] > 10, tracing
    assert tracing["on"]["collectorBatches"] > 0 and tracing["servicesCpuRatio"] is not None
    assert len(figures["targets"]) == 5
    assert all(target["pass"] in (True, False) for target in figures["targets"])
    assert "pass" in done.stdout or "miss" in done.stdout  # the table, with its verdicts
    # Before and after: every measure with the baseline's figure (bench/baseline.json has them
    # all but the counts, which it predates) and today's, printed as the table's rows.
    comparison = figures["comparison"]
    rows = comparison["rows"]
    assert comparison["baseline"].endswith("baseline.json") and len(rows) == 9, comparison
    assert all(row["todayValue"] is not None for row in rows), rows
    assert all(row["baselineValue"] is not None for row in rows[:7]), rows
    assert "| measure | baseline | today | target | result |" in done.stdout
    for row in rows:
        printed = f"| {row['measure']} | {row['baseline']} | {row['today']} | {row['target']} |"
        assert printed in done.stdout, printed
    assert figures["turnLatency"]["perTurn"]["deliveries"] > 0  # counted from the services

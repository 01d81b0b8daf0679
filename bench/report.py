"""The turn figures as a table beside the raw relay, the targets with pass/miss (never
asserted), and ``bench/results.json`` with every section (``{"skipped": true}`` for a phase
left out), so runs can be compared by eye and by script.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.stats import Run

Figures = dict[str, Any]
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
SKIPPED: Figures = {"skipped": True}


def run_figures(run: Run | None) -> Figures:
    if run is None:
        return dict(SKIPPED)
    return {
        "label": run.label,
        "events": run.events,
        "inFlight": run.in_flight,
        "eventsPerSecond": round(run.rate, 1),
        "p50Ms": round(run.ms(0.5), 3),
        "p99Ms": round(run.ms(0.99), 3),
    }


@dataclass
class Target:
    name: str
    wanted: str
    value: float
    limit: float
    at_most: bool

    @property
    def met(self) -> bool | None:
        if math.isnan(self.value):
            return None
        return self.value <= self.limit if self.at_most else self.value >= self.limit

    def figures(self) -> Figures:
        return {
            "name": self.name,
            "target": self.wanted,
            "value": None if math.isnan(self.value) else round(self.value, 3),
            "pass": self.met,
        }


def number(section: Figures, *path: str) -> float:
    value: Any = section
    for key in path:
        if not isinstance(value, dict) or key not in value:
            return math.nan
        value = value[key]
    return float(value) if isinstance(value, int | float) else math.nan


def targets(results: Figures, hop_p50_ms: float) -> list[Target]:
    rss = results["scale"].get("rssMbAfterTurns") or {}
    forums = results["throughput"].get("forums", "N")
    joins = results["scale"].get("joins", "N")
    return [
        Target(
            "turn p50 / raw hop p50",
            "<= 8x",
            number(results, "turnLatency", "p50Ms") / hop_p50_ms,
            8.0,
            True,
        ),
        Target(
            f"turns/s with {forums} forums",
            ">= 60",
            number(results, "throughput", "turnsPerSecond"),
            60.0,
            False,
        ),
        Target(
            "growth ratio (p50 long / fresh)",
            "<= 1.3",
            number(results, "growth", "ratio"),
            1.3,
            True,
        ),
        Target(
            "isolation ratio (p99 beside slow / alone)",
            "<= 1.5",
            number(results, "isolation", "ratio"),
            1.5,
            True,
        ),
        Target(
            f"max service RSS at {joins} joins (MB)",
            "<= 150",
            max(rss.values()) if rss else math.nan,
            150.0,
            True,
        ),
    ]


def turn_rows(results: Figures) -> list[Figures]:
    rows: list[Figures] = []
    for key in ("turnLatency", "throughput"):
        if "turns" in results[key]:
            rows.append(results[key])
    replicas = results["replicas"]
    rows += [replicas[k] for k in ("one", "two") if k in replicas]
    growth, isolation = results["growth"], results["isolation"]
    rows += [growth[k] for k in ("fresh", "long") if k in growth]
    rows += [isolation[k] for k in ("alone", "besideSlow") if k in isolation]
    if "turnsAfter" in results["scale"]:
        rows.append(results["scale"]["turnsAfter"])
    return rows


def gateway_lines(gateway: Figures) -> list[str]:
    """The HTTP door's series, each beside the AMQP door's it is compared with."""
    if "post" not in gateway:
        return []
    title = f"HTTP gateway, {gateway['turns']} turns one at a time (ms)"
    header = f"{title:<44}{'p50':>7}{'p90':>9}{'p99':>9}{'max':>9}{'x AMQP p50':>12}"
    lines = ["", header]
    rows = (
        ("POST -> 202 (httpx, kept alive)", "post", "accept"),
        ("  AMQP Client.submit -> accepted", "amqpSubmit", None),
        ("POST -> answer on /stream", "postToStream", "answer"),
        ("  AMQP submit -> answer on yoke.events", "amqpTurn", None),
        ("POST -> webhook delivery", "postToWebhook", None),
        ("MCP tools/call -> its answer (mcp client)", "mcpCall", "mcp"),
        ("A2A message/send -> completed (a2a-sdk)", "a2aTask", "a2a"),
    )
    for label, key, ratio_name in rows:
        if key not in gateway:  # results of a run before the door existed
            continue
        figures = gateway[key]
        ratio = gateway["ratios"].get(ratio_name) if ratio_name else None
        lines.append(
            f"  {label:<42}{figures['p50Ms']:>7.1f}{figures['p90Ms']:>9.1f}"
            f"{figures['p99Ms']:>9.1f}{figures['maxMs']:>9.1f}"
            + (f"{ratio:>11.2f}x" if ratio is not None else "")
        )
    return lines


def streaming_lines(streaming: Figures) -> list[str]:
    """How soon a streamed answer shows, and how soon its line is there."""
    if "postToLine" not in streaming:
        return []
    title = f"Streaming, {streaming['turns']} turns of {streaming['model']}, one at a time (ms)"
    lines = ["", f"{title:<62}{'p50':>8}{'p99':>9}{'max':>9}"]
    writing = f"{streaming['modelSeconds']} s of writing"
    for label, key in (
        ("POST -> first delta on /stream", "postToFirstDelta"),
        (f"POST -> finished line on /stream ({writing})", "postToLine"),
    ):
        figures = streaming[key]
        lines.append(
            f"  {label:<60}{figures['p50Ms']:>8.1f}{figures['p99Ms']:>9.1f}{figures['maxMs']:>9.1f}"
        )
    deltas = streaming["deltasPerAnswer"]
    lines.append(f"  deltas per answer: {deltas['min']} to {deltas['max']}, p50 {deltas['p50']:g}")
    return lines


def tool_lines(tools: Figures) -> list[str]:
    """Each kind's whole turn and tool round, each against the inline built-in's."""
    if "inline" not in tools:
        return []
    title = f"Tool rounds, {tools['rounds']} turns of each kind, one at a time (ms)"
    header = f"{title:<62}{'p50':>7}{'p99':>9}{'max':>9}{'x inline p50':>14}{'p99':>6}"
    lines = ["", header]
    kinds = (
        ("inline", "inline built-in (clock, in the processor's step)"),
        ("worker", "worker (yoke.tools.worker.serve, a process of its own)"),
        ("mcp", "MCP over stdio (echo of tests/support/mcp_server.py)"),
    )
    for kind, label in kinds:
        lines.append(f"  {label}")
        ratios = tools["ratios"].get(kind, {})
        for series, what in (
            ("turn", "line -> answer in the forum"),
            ("round", "call line -> result line (store)"),
        ):
            figures = tools[kind][series]
            p50, p99 = ratios.get(f"{series}P50"), ratios.get(f"{series}P99")
            shown = f"{p50:>13.2f}x{p99:>5.2f}x" if p50 is not None and p99 is not None else ""
            lines.append(
                f"    {what:<58}{figures['p50Ms']:>7.1f}{figures['p99Ms']:>9.1f}"
                f"{figures['maxMs']:>9.1f}" + shown
            )
    return lines


def tracing_lines(tracing: Figures) -> list[str]:
    """CPU per turn with tracing off and with every span sampled (bench/tracing_cost.py)."""
    if "on" not in tracing:
        return []
    off, on = tracing["off"], tracing["on"]
    title = f"Tracing, {tracing['turns']} turns one at a time, CPU per turn (ms)"
    lines = ["", f"{title:<58}{'off':>10}{'on':>10}"]
    for name in sorted(set(off["cpuMsPerTurn"]) | set(on["cpuMsPerTurn"])):
        lines.append(
            f"  {name:<56}{off['cpuMsPerTurn'].get(name, math.nan):>10.2f}"
            f"{on['cpuMsPerTurn'].get(name, math.nan):>10.2f}"
        )
    lines.append(
        f"  {'the five services':<56}{off['servicesCpuMsPerTurn']:>10.2f}"
        f"{on['servicesCpuMsPerTurn']:>10.2f}"
    )
    ratio = tracing.get("servicesCpuRatio")
    lines.append(
        f"  every span sampled: {on['spansPerTurn']:g} spans a turn"
        + (f", the services' CPU x{ratio:.2f}" if ratio is not None else "")
        + f"; turn p50 {off['p50Ms']:.1f} -> {on['p50Ms']:.1f} ms"
    )
    return lines


def render(results: Figures) -> str:
    lines: list[str] = []
    header = (
        f"{'whole turns through the mesh':<40}{'forums':>7}{'turns':>7}{'turns/s':>9}"
        f"{'p50 ms':>9}{'p90 ms':>9}{'p99 ms':>9}{'max ms':>9}"
    )
    lines += [header, "-" * len(header)]
    for row in turn_rows(results):
        lines.append(
            f"{row['label']:<40}{row['forums']:>7}{row['turns']:>7}{row['turnsPerSecond']:>9.1f}"
            f"{row['p50Ms']:>9.1f}{row['p90Ms']:>9.1f}{row['p99Ms']:>9.1f}{row['maxMs']:>9.1f}"
        )
    for key, label in (("rawRelay", "raw relay hop"), ("busHop", "bus hop")):
        run = results[key].get("serial") or results[key].get("load") or {}
        if "p50Ms" in run:
            lines.append(
                f"{label + ' (' + str(run['inFlight']) + ' in flight)':<40}{'':>7}"
                f"{run['events']:>7}{run['eventsPerSecond']:>9.1f}{run['p50Ms']:>9.2f}"
                f"{'':>9}{run['p99Ms']:>9.2f}"
            )
    stages = results["turnLatency"].get("stages") or {}
    if stages:
        lines += ["", "Where a turn's time goes (one at a time; ms, p50 / p99):"]
        for name, figures in stages.items():
            lines.append(f"  {name:<48}{figures['p50Ms']:>9.1f}{figures['p99Ms']:>9.1f}")
    lines += gateway_lines(results["gateway"])
    lines += streaming_lines(results["streaming"])
    lines += tool_lines(results["tools"])
    lines += tracing_lines(results.get("tracing", {}))  # absent from runs before the phase
    cpu_latency = results["turnLatency"].get("cpuMsPerTurn") or {}
    cpu_load = results["throughput"].get("cpuMsPerTurn") or {}
    if cpu_latency or cpu_load:
        lines += ["", f"CPU per turn (ms)  {'one at a time':>16}{'many forums':>14}"]
        for name in sorted(set(cpu_latency) | set(cpu_load)):
            one = cpu_latency.get(name, math.nan)
            many = cpu_load.get(name, math.nan)
            lines.append(f"  {name:<17}{one:>16.2f}{many:>14.2f}")
        total_one = sum(cpu_latency.values())
        total_many = sum(cpu_load.values())
        lines.append(f"  {'total':<17}{total_one:>16.2f}{total_many:>14.2f}")
    scale = results["scale"]
    if "rssMbAfter" in scale:
        lines += [
            "",
            f"Scale: {scale['joins']} joins in {scale['joinSeconds']}s"
            f" ({scale['joinsPerSecond']}/s), mesh settled {scale['settleSeconds']}s later",
            f"  {'RSS MB':<12}{'before':>9}{'after joins':>13}{'after turns':>13}",
        ]
        for name, before in scale["rssMbBefore"].items():
            lines.append(
                f"  {name:<12}{before:>9.1f}{scale['rssMbAfter'].get(name, math.nan):>13.1f}"
                f"{scale['rssMbAfterTurns'].get(name, math.nan):>13.1f}"
            )
    replicas = results["replicas"]
    if "two" in replicas:
        lines.append(
            f"\nProcessor replicas, {replicas['shards']} shards: 1 -> 2 replicas"
            f" {replicas['one']['turnsPerSecond']} -> {replicas['two']['turnsPerSecond']}"
            f" turns/s ({replicas['ratio']}x), p99 {replicas['one']['p99Ms']:.0f} ->"
            f" {replicas['two']['p99Ms']:.0f} ms; shards owned {replicas['shardsOwnedWithTwo']},"
            f" split {replicas['splitSeconds']}s after the second started, all back on the"
            f" first {replicas['backSeconds']}s after it stopped"
        )
    growth = results["growth"]
    if "ratio" in growth:
        lines.append(
            f"\nGrowth: {growth['historyLines']} lines of history written in"
            f" {growth['historySeconds']}s (monologue too: {growth['monologuePrefilled']})"
        )
    ratios = results["ratios"]
    lines += [
        "",
        "Ratios: "
        + ", ".join(f"{name} {value:.2f}x" for name, value in ratios.items() if value is not None),
        "",
        f"{'target':<46}{'wanted':>9}{'measured':>11}  result",
    ]
    for target in results["targets"]:
        value = target["value"]
        shown = f"{value:.2f}" if value is not None else "n/a"
        verdict = {True: "pass", False: "miss", None: "n/a"}[target["pass"]]
        lines.append(f"{target['name']:<46}{target['target']:>9}{shown:>11}  {verdict}")
    return "\n".join(lines)


def finish(results: Figures, hop_p50_ms: float, hop_p99_ms: float, hop_rate: float) -> Figures:
    """Fill the ratios and targets, and mark every phase that did not run as skipped."""
    for key in SECTIONS:
        results.setdefault(key, dict(SKIPPED))
    turn = results["turnLatency"]
    results["ratios"] = {
        "turn p50 / raw hop p50": _ratio(number(turn, "p50Ms"), hop_p50_ms),
        "turn p99 / raw hop p99": _ratio(number(turn, "p99Ms"), hop_p99_ms),
        "turns/s with many forums / raw hops/s": _ratio(
            number(results, "throughput", "turnsPerSecond"), hop_rate
        ),
    }
    results["targets"] = [target.figures() for target in targets(results, hop_p50_ms)]
    return results


def _ratio(value: float, base: float) -> float | None:
    if math.isnan(value) or math.isnan(base) or base == 0:
        return None
    return round(value / base, 3)


def write(results: Figures, path: Path) -> None:
    path.write_text(json.dumps(results, indent=2, sort_keys=False) + "\n")

"""Before and after in one run: today's figures beside a baseline's (``bench/baseline.json``,
the last full ``make bench`` kept when the work on a turn's cost began), each with its target
and pass/miss, and the latency and rate also as ratios to the raw hop each run measured.

Every figure is read from a results dict of the shape ``python -m bench`` writes, so the same
code reads the baseline and today's run; a figure a run lacks shows as n/a and decides nothing.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.report import Figures, number

BASELINE = Path(__file__).resolve().parent / "baseline.json"
SERVICES = {
    "ingestion": "ingestion",
    "processor": "processor",
    "egress": "egress",
    "followup": "follow-up",
    "guardian": "guardian",
}
SERVERS = {"rabbitmq": "RabbitMQ", "postgres": "PostgreSQL", "ferretdb": "FerretDB"}


def load_baseline(path: Path) -> Figures | None:
    """The baseline's figures, or None when there is none to compare with."""
    try:
        figures = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return figures if isinstance(figures, dict) else None


def _cpu(results: Figures, phase: str, names: dict[str, str]) -> dict[str, float]:
    cpu = results.get(phase, {}).get("cpuMsPerTurn") or {}
    return {name: float(cpu[name]) for name in names if isinstance(cpu.get(name), int | float)}


def _sum(values: dict[str, float], names: dict[str, str]) -> float:
    """Their sum; NaN unless every one named was measured (a part is no whole)."""
    return sum(values.values()) if values and len(values) == len(names) else math.nan


def hop_p50(results: Figures) -> float:
    """The raw relay's p50 one at a time (its loaded p50 when it ran no serial phase)."""
    raw = results.get("rawRelay", {})
    serial = number(raw, "serial", "p50Ms")
    return serial if not math.isnan(serial) else number(raw, "load", "p50Ms")


def _div(value: float, base: float) -> float:
    return value / base if base and not math.isnan(base) else math.nan


def _ms(value: float) -> str:
    return "n/a" if math.isnan(value) else f"{value:.1f} ms"


@dataclass
class Measure:
    """One row: how to read its figure from a run, show it, and judge today's."""

    name: str
    target: str
    value: Callable[[Figures], float]
    show: Callable[[Figures], str]
    judge: Callable[[float, float], bool | None]  # (today, baseline) -> met (None: not judged)

    def row(self, today: Figures, baseline: Figures | None) -> Figures:
        now = self.value(today)
        before = self.value(baseline) if baseline is not None else math.nan
        met = None if math.isnan(now) else self.judge(now, before)
        return {
            "measure": self.name,
            "baseline": self.show(baseline) if baseline is not None else "n/a",
            "today": self.show(today),
            "target": self.target,
            "baselineValue": None if math.isnan(before) else round(before, 3),
            "todayValue": None if math.isnan(now) else round(now, 3),
            "pass": met,
        }


def _at_most(limit: float) -> Callable[[float, float], bool | None]:
    return lambda now, _: now <= limit


def _fewer(now: float, before: float) -> bool | None:
    # Only a baseline that has the figure can say; without it the row is shown, not judged.
    return None if math.isnan(before) else now < before


def measures(today: Figures) -> list[Measure]:
    throughput = today.get("throughput", {})
    forums = throughput.get("forums", "N")
    lines = today.get("options", {}).get("forum_turns", "N")
    growth_lines = today.get("growth", {}).get("historyLines", "N")

    def every_process(run: Figures) -> float:
        return _sum(_cpu(run, "throughput", SERVICES | SERVERS), SERVICES | SERVERS)

    def show_every_process(run: Figures) -> str:
        shown = _ms(every_process(run))
        hop_cpu = number(run, "rawRelay", "load", "cpuMsPerEvent")
        ratio = _div(every_process(run), hop_cpu)
        return shown if math.isnan(ratio) else f"{shown}, {ratio:.0f}x a raw hop's"

    def rate(run: Figures) -> float:
        return number(run, "throughput", "turnsPerSecond")

    def show_rate(run: Figures) -> str:
        ratio = _div(rate(run), number(run, "rawRelay", "load", "eventsPerSecond"))
        if math.isnan(rate(run)):
            return "n/a"
        return f"{rate(run):.1f}" + ("" if math.isnan(ratio) else f", {ratio:.3f}x raw hops/s")

    def latency_ratio(run: Figures) -> float:
        return _div(number(run, "turnLatency", "p50Ms"), hop_p50(run))

    def show_latency(run: Figures) -> str:
        p50 = number(run, "turnLatency", "p50Ms")
        if math.isnan(p50):
            return "n/a"
        ratio = latency_ratio(run)
        return f"{p50:.0f} ms" + ("" if math.isnan(ratio) else f", {ratio:.1f}x")

    def growth(run: Figures) -> float:
        return number(run, "growth", "ratio")

    def show_growth(run: Figures) -> str:
        fresh, long = (number(run, "growth", key, "p50Ms") for key in ("fresh", "long"))
        if math.isnan(growth(run)):
            return "n/a"
        return f"{fresh:.0f} -> {long:.0f} ms, {growth(run):.2f}x"

    def services(run: Figures) -> float:
        return _sum(_cpu(run, "throughput", SERVICES), SERVICES)

    def show_services(run: Figures) -> str:
        cpu = _cpu(run, "throughput", SERVICES)
        if not cpu:
            return "n/a"
        parts = " + ".join(
            f"{label} {cpu[name]:.1f}" for name, label in SERVICES.items() if name in cpu
        )
        return f"{parts} = {_ms(services(run))}"

    def servers(run: Figures) -> float:
        return _sum(_cpu(run, "throughput", SERVERS), SERVERS)

    def show_servers(run: Figures) -> str:
        cpu = _cpu(run, "throughput", SERVERS)
        if not cpu:
            return "n/a"
        parts = ", ".join(
            f"{label} {cpu[name]:.1f}" for name, label in SERVERS.items() if name in cpu
        )
        return f"{parts} ms (sum {_ms(servers(run))})"

    def ferretdb_alone(run: Figures) -> float:
        return number(run, "turnLatency", "cpuMsPerTurn", "ferretdb")

    def counted(key: str) -> Callable[[Figures], float]:
        return lambda run: number(run, "turnLatency", "perTurn", key)

    def show_counted(key: str, by: str) -> Callable[[Figures], str]:
        def show(run: Figures) -> str:
            value = counted(key)(run)
            if math.isnan(value):
                return "n/a"
            parts = run["turnLatency"]["perTurn"].get(by) or {}
            shown = ", ".join(f"{SERVICES.get(n, n)} {v:g}" for n, v in parts.items() if v)
            return f"{value:g} ({shown})" if shown else f"{value:g}"

        return show

    return [
        Measure(
            f"CPU per turn at {forums} forums, every process (services + servers)",
            "<= 33 ms",
            every_process,
            show_every_process,
            _at_most(33.0),
        ),
        Measure(
            f"turns/s, {forums} forums x {lines} lines",
            ">= 60",
            rate,
            show_rate,
            lambda now, _: now >= 60.0,
        ),
        Measure("turn p50 / raw hop p50", "<= 8x", latency_ratio, show_latency, _at_most(8.0)),
        Measure(
            f"growth p50, fresh -> {growth_lines} lines",
            "<= 1.3x",
            growth,
            show_growth,
            _at_most(1.3),
        ),
        Measure(
            f"CPU per turn at {forums} forums, the services (each and sum)",
            "<= 15 ms",
            services,
            show_services,
            _at_most(15.0),
        ),
        Measure(
            f"CPU per turn at {forums} forums, the servers",
            "fewer operations (less CPU)",
            servers,
            show_servers,
            _fewer,
        ),
        Measure(
            "CPU per turn one at a time, FerretDB",
            "<= 30 ms",
            ferretdb_alone,
            lambda run: _ms(ferretdb_alone(run)),
            _at_most(30.0),
        ),
        Measure(
            "store operations per turn, one at a time (in deliveries)",
            "fewer",
            counted("storeOperations"),
            show_counted("storeOperations", "storeOperationsByService"),
            _fewer,
        ),
        Measure(
            "deliveries per turn, one at a time",
            "fewer",
            counted("deliveries"),
            show_counted("deliveries", "deliveriesByService"),
            _fewer,
        ),
    ]


def compare(today: Figures, baseline: Figures | None) -> list[Figures]:
    """Each measure's row: baseline, today, target and pass/miss (None: not judged)."""
    return [measure.row(today, baseline) for measure in measures(today)]


def render(rows: list[Figures], source: str) -> str:
    """The rows as a Markdown table (it pastes into a commit message or the docs as is)."""
    verdicts = {True: "pass", False: "miss", None: "n/a"}
    lines = [
        f"Before and after (baseline: {source})",
        "",
        "| measure | baseline | today | target | result |",
        "|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['measure']} | {row['baseline']} | {row['today']} | {row['target']}"
            f" | {verdicts[row['pass']]} |"
        )
    return "\n".join(lines)


def comparison(today: Figures, baseline_path: Path) -> tuple[Figures, str]:
    """The comparison as JSON-ready figures and as the printed table."""
    baseline = load_baseline(baseline_path)
    source: Any = baseline.get("source") if baseline is not None else None
    described = str(source or baseline_path) if baseline is not None else "none found"
    rows = compare(today, baseline)
    figures = {"baseline": str(baseline_path), "baselineSource": source, "rows": rows}
    text = render(rows, f"{baseline_path.name}, {described}")
    sizes = [_sizes(run) for run in (baseline, today) if run is not None]
    if len(sizes) == 2 and sizes[0] != sizes[1]:  # a --quick run against a full one, say
        text += f"\nnote: the baseline ran {sizes[0]}, today {sizes[1]}: figures compare loosely"
    return figures, text


def _sizes(run: Figures) -> str:
    options = run.get("options", {})
    return (
        f"{options.get('forums')} forums x {options.get('forum_turns')} lines,"
        f" {options.get('turns')} turns one at a time"
    )

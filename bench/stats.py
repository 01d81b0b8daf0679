"""Percentiles and the printed table: plain figures, so two runs can be compared by eye."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in 0..1); NaN for no values, so a gap shows as ``nan``."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = max(1, math.ceil(q * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


@dataclass
class Run:
    """One closed-loop phase of one side: every event's latency and the phase's wall time."""

    label: str
    in_flight: int
    latencies: list[float]
    wall: float
    driver_cpu: float = math.nan
    relay_cpu: float = math.nan

    @property
    def events(self) -> int:
        return len(self.latencies)

    @property
    def rate(self) -> float:
        return self.events / self.wall if self.wall > 0 else math.nan

    def ms(self, q: float) -> float:
        return percentile(self.latencies, q) * 1000

    def cpu_per_event_ms(self, seconds: float) -> float:
        return seconds / self.events * 1000 if self.events else math.nan


@dataclass
class Samples:
    """Named series of durations in seconds, grouped by phase (``load``, ``serial``...)."""

    series: dict[str, dict[str, list[float]]] = field(
        default_factory=lambda: defaultdict(lambda: defaultdict(list))
    )

    def add(self, phase: str, name: str, seconds: float) -> None:
        self.series[phase][name].append(seconds)

    def get(self, phase: str, name: str) -> list[float]:
        return list(self.series.get(phase, {}).get(name, []))

    def to_json(self) -> dict[str, dict[str, list[float]]]:
        return {phase: dict(named) for phase, named in self.series.items()}

    @classmethod
    def from_json(cls, data: dict[str, dict[str, list[float]]]) -> Samples:
        samples = cls()
        for phase, named in data.items():
            for name, values in named.items():
                samples.series[phase][name].extend(float(v) for v in values)
        return samples


def table(runs: Sequence[Run]) -> str:
    header = (
        f"{'':<22}{'events':>8}{'in flight':>11}{'ev/s':>9}{'p50 ms':>9}{'p90 ms':>9}"
        f"{'p99 ms':>9}{'max ms':>9}{'driver cpu':>12}{'relay cpu':>11}"
    )
    lines = [header, "-" * len(header)]
    for run in runs:
        lines.append(
            f"{run.label:<22}{run.events:>8}{run.in_flight:>11}{run.rate:>9.0f}"
            f"{run.ms(0.5):>9.2f}{run.ms(0.9):>9.2f}{run.ms(0.99):>9.2f}{run.ms(1.0):>9.2f}"
            f"{run.cpu_per_event_ms(run.driver_cpu):>9.3f} ms"
            f"{run.cpu_per_event_ms(run.relay_cpu):>8.3f} ms"
        )
    lines.append("(cpu columns: process CPU time per event, driver = this process, relay = child)")
    return "\n".join(lines)


def summary(bus: Run, raw: Run) -> str:
    return (
        f"bus hop: {bus.rate:.0f} ev/s p50 {bus.ms(0.5):.1f} ms p99 {bus.ms(0.99):.1f} ms"
        f" | raw relay: {raw.rate:.0f} ev/s p50 {raw.ms(0.5):.1f} ms p99 {raw.ms(0.99):.1f} ms"
        f" | ratio (bus/raw): throughput {bus.rate / raw.rate:.2f}x,"
        f" p50 {bus.ms(0.5) / raw.ms(0.5):.1f}x, p99 {bus.ms(0.99) / raw.ms(0.99):.1f}x"
    )

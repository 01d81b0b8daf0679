"""The benchmark figures of docs/bench.md, written by ``make bench`` rather than quoted by hand.

A run that writes ``bench/results.json`` (the default ``--results``) also rewrites docs/bench.md's
text between :data:`BEGIN` and :data:`END`: how it ran, its report as it printed it, and its
before/after table. ``python -m bench.readme`` writes that text again from
``bench/results.json``, for when how it is shown changes; it measures nothing.
"""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

from bench import compare, report
from bench.report import Figures

RESULTS = Path(__file__).resolve().parent / "results.json"
# The documentation page with the figures (the README itself once held them; the name stayed).
README = Path(__file__).resolve().parents[1] / "docs" / "bench.md"
BEGIN = "<!-- make bench writes what follows, up to the end marker (bench/readme.py) -->"
END = "<!-- end of make bench's figures -->"
# The phases a run may leave out, as the report names them.
PHASES = {
    "busHop": "the bus hop",
    "gateway": "the gateway",
    "streaming": "streaming",
    "tools": "tool rounds",
    "replicas": "replicas",
    "growth": "growth",
    "isolation": "isolation",
    "scale": "scale",
    "tracing": "tracing",
}


def described(results: Figures) -> str:
    """How the run went: its sizes, its machine, and the phases it left out."""
    options = results.get("options", {})
    machine = results.get("machine", {})
    sizes = "`--quick` sizes" if options.get("quick") else "full sizes"
    said = [
        f"The last run written to `bench/results.json`, at {sizes} ({options.get('forums')}"
        f" forums x {options.get('forum_turns')} lines at once, {options.get('turns')} turns"
        f" one at a time) on {machine.get('cpus')} CPUs"
    ]
    if machine.get("note"):
        said.append(f" ({machine['note']})")
    left_out = [name for key, name in PHASES.items() if results.get(key) == report.SKIPPED]
    if left_out:
        said.append(f"; left out: {', '.join(left_out)}")
    return textwrap.fill("".join(said) + ".", width=95)


def section(results: Figures) -> str:
    """The README's text for ``results``, its markers included."""
    printed = ["    " + line if line else "" for line in report.render(results).splitlines()]
    lines = [BEGIN, "", described(results), "", *printed, ""]
    comparison = results.get("comparison")
    if comparison:
        baseline = Path(str(comparison["baseline"])).name
        source = comparison.get("baselineSource") or "none found"
        lines += [compare.render(comparison["rows"], f"{baseline}, {source}"), ""]
    return "\n".join([*lines, END])


def write(results: Figures, readme: Path = README) -> bool:
    """Put ``results`` between the README's markers; False when it has none (nothing written)."""
    text = readme.read_text()
    start = text.find(BEGIN)
    end = text.find(END, start)
    if start < 0 or end < 0:
        return False
    readme.write_text(text[:start] + section(results) + text[end + len(END) :])
    return True


def main() -> int:
    results = json.loads(RESULTS.read_text())
    if not write(results):
        print(f"{README} has no figures section ({BEGIN})", file=sys.stderr)
        return 1
    print(f"figures of bench/results.json written to {README}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The benchmark figures in docs/bench.md are what ``make bench`` wrote (bench/readme.py), never
quoted by hand: the section between its markers is the one ``bench/results.json`` renders to."""

from __future__ import annotations

import json
from pathlib import Path

from bench import readme, report
from tests.support.processes import ROOT


def results() -> report.Figures:
    figures: report.Figures = json.loads(readme.RESULTS.read_text())
    return figures


def test_the_figures_page_is_where_a_run_writes() -> None:
    assert readme.README == ROOT / "docs" / "bench.md"


def test_the_pages_figures_are_those_of_bench_results_json() -> None:
    text = readme.README.read_text()

    assert text.count(readme.BEGIN) == 1 and text.count(readme.END) == 1
    assert readme.section(results()) in text


def test_a_run_replaces_only_the_text_between_the_markers(tmp_path: Path) -> None:
    page = tmp_path / "README.md"
    page.write_text(f"# before\n\n{readme.BEGIN}\nold figures\n{readme.END}\n\n## after\n")
    figures = results()

    assert readme.write(figures, page)
    once = page.read_text()
    assert readme.write(figures, page)

    assert page.read_text() == once  # a second run of the same figures changes nothing
    assert once.startswith("# before\n\n" + readme.BEGIN)
    assert once.endswith(readme.END + "\n\n## after\n")
    assert "old figures" not in once
    assert "| measure | baseline | today | target | result |" in once
    for line in report.render(figures).splitlines():
        assert ("    " + line if line else "") in once.splitlines()


def test_the_run_says_how_it_ran_and_what_it_left_out() -> None:
    figures = results()
    figures["options"] = {**figures["options"], "quick": True, "forums": 10, "forum_turns": 2}
    figures["machine"] = {"cpus": 2, "note": "load average 9.5 on 2 cpus"}
    figures["growth"] = dict(report.SKIPPED)

    said = " ".join(readme.described(figures).split())

    assert said.startswith("The last run written to `bench/results.json`, at `--quick` sizes")
    assert "(10 forums x 2 lines at once," in said
    assert "on 2 CPUs (load average 9.5 on 2 cpus)" in said
    assert "left out:" in said and "growth" in said


def test_a_readme_without_the_markers_is_left_as_it_was(tmp_path: Path) -> None:
    page = tmp_path / "README.md"
    page.write_text("# no figures here\n")

    assert not readme.write(results(), page)
    assert page.read_text() == "# no figures here\n"

"""The official MCP conformance suite (npm's ``@modelcontextprotocol/conformance``, run by
deploy/local/conformance-mcp.sh as ``make conformance-mcp`` runs it) against the gateway's /mcp
on a mesh of its own: every server scenario the door can meet passes, and each one it cannot
fails only for the reason written down here (and in deploy/local/mcp-conformance-baseline.yml).

``make test`` installs Node 22 and the suite first (``make conformance-mcp-install``); run alone,
the script installs them itself (npm's registry, about 20 s once).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
from pathlib import Path
from typing import Any

import pytest

from tests.support.processes import ROOT
from tests.support.published import Agents

pytestmark = pytest.mark.slow

SCRIPT = ROOT / "deploy/local/conformance-mcp.sh"
BASELINE = ROOT / "deploy/local/mcp-conformance-baseline.yml"
# The whole active suite takes seconds; installing it (when make test has not) well under this.
RUN_SECONDS = 300

# What the door serves: initialisation, ping, its tools (the published agents), and the
# transport's guard against DNS rebinding (Host and Origin, YOKE_GATEWAY_PUBLIC_ORIGINS).
PASSING = {"server-initialize", "ping", "tools-list", "dns-rebinding-protection"}

NO_CAPABILITY = "Method not found"  # a method of a capability the door does not declare
REFERENCE_TOOL = "unknown tool"  # a tool of the suite's reference server, with scripted results
# What each scenario the door does not pass fails on, and why it is not the door's to pass.
NOT_OURS: dict[str, tuple[str, str]] = {
    "logging-set-level": (NO_CAPABILITY, "no logging capability: logging/setLevel"),
    "completion-complete": (NO_CAPABILITY, "no completions capability: completion/complete"),
    "tools-call-with-logging": (NO_CAPABILITY, "sets a log level first: no logging capability"),
    **{
        f"resources-{name}": (NO_CAPABILITY, "no resources capability: the door serves tools")
        for name in ("list", "read-text", "read-binary", "templates-read", "subscribe")
    },
    "resources-unsubscribe": (NO_CAPABILITY, "no resources capability"),
    **{
        f"prompts-{name}": (NO_CAPABILITY, "no prompts capability: the door serves tools")
        for name in ("list", "get-simple", "get-with-args", "get-embedded-resource")
    },
    "prompts-get-with-image": (NO_CAPABILITY, "no prompts capability"),
    "tools-call-simple-text": (REFERENCE_TOOL, "the reference server's test_simple_text"),
    "tools-call-image": (REFERENCE_TOOL, "the reference server's test_image_content"),
    "tools-call-audio": (REFERENCE_TOOL, "the reference server's test_audio_content"),
    "tools-call-embedded-resource": (REFERENCE_TOOL, "the reference's test_embedded_resource"),
    "tools-call-mixed-content": (REFERENCE_TOOL, "the reference's test_multiple_content_types"),
    "tools-call-error": (REFERENCE_TOOL, "the reference server's test_error_handling"),
    "tools-call-with-progress": (REFERENCE_TOOL, "the reference's test_tool_with_progress"),
    "tools-call-sampling": (REFERENCE_TOOL, "test_sampling: the door never asks to sample"),
    "tools-call-elicitation": (REFERENCE_TOOL, "test_elicitation: the door never elicits"),
    "elicitation-sep1034-defaults": (REFERENCE_TOOL, "the reference's elicitation tool"),
    "elicitation-sep1330-enums": (REFERENCE_TOOL, "the reference's elicitation tool"),
    # A WARNING only: stateless (any replica answers any POST), the door gives no session id,
    # and the scenario stops before it opens its concurrent streams.
    "server-sse-multiple-streams": ("did not provide session ID", "stateless: no session id"),
}
FINE = {"SUCCESS", "INFO"}


def results_by_scenario(results: Path) -> dict[str, list[dict[str, Any]]]:
    """Each scenario's checks, from the suite's ``server-<scenario>-<time>/checks.json``."""
    found = {}
    for checks in results.glob("server-*/checks.json"):
        named = re.fullmatch(r"server-(.+)-\d{4}-\d\d-\d\dT.*", checks.parent.name)
        assert named, checks
        found[named.group(1)] = json.loads(checks.read_text())
    return found


def said(check: dict[str, Any]) -> str:
    """What a check that did not succeed says of why."""
    return " ".join(
        str(part)
        for part in (check.get("errorMessage"), (check.get("details") or {}).get("message"))
        if part
    )


async def test_the_mcp_door_passes_the_official_conformance_suite(
    gateway_url: str, agents: Agents, tmp_path: Path
) -> None:
    echo = await agents.publish(description="Says back what it is told.")
    caller = await agents.caller(echo.id)
    results = tmp_path / "results"
    env = {
        **os.environ,
        "YOKE_GATEWAY_URL": gateway_url,
        "YOKE_TOKEN": caller.secret,
        "YOKE_CONFORMANCE_RESULTS": str(results),
    }
    run = await asyncio.create_subprocess_exec(
        "bash",
        str(SCRIPT),
        "run",
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    try:
        out, _ = await asyncio.wait_for(run.communicate(), RUN_SECONDS)
    finally:
        if run.returncode is None:
            run.kill()
            await run.wait()
    printed = out.decode(errors="replace")
    start = printed.find("=== SUMMARY ===")
    summary = printed[start:] if start >= 0 else printed[-4000:]
    print(summary)

    scenarios = results_by_scenario(results)
    assert set(scenarios) == PASSING | set(NOT_OURS), summary
    for scenario in sorted(PASSING):
        checks = scenarios[scenario]
        assert checks and all(check["status"] in FINE for check in checks), (scenario, checks)
    for scenario, (reason, _why) in sorted(NOT_OURS.items()):
        failed = [check for check in scenarios[scenario] if check["status"] not in FINE]
        assert failed, f"{scenario} passes now: take it off NOT_OURS and the baseline"
        assert all(reason in said(check) for check in failed), (scenario, failed)
    # The suite's own verdict against the baseline agrees: no unexpected failure, no stale entry.
    assert run.returncode == 0, summary
    listed = set(re.findall(r"^  - ([a-z0-9-]+)", BASELINE.read_text(), re.MULTILINE))
    assert listed == set(NOT_OURS)

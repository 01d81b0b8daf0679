"""What make compose-check found running docker-compose.yml, pinned where no engine runs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
ONE_SHOTS = {"rabbitmq-init", "cli"}


def services() -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    return loaded


def test_every_long_running_container_comes_back_after_a_daemon_restart() -> None:
    lacking = [
        name
        for name, service in services().items()
        if name not in ONE_SHOTS and service.get("restart") not in ("always", "unless-stopped")
    ]
    assert lacking == []


def test_rabbitmq_is_the_same_node_with_the_same_data_when_recreated() -> None:
    rabbitmq = services()["rabbitmq"]
    assert rabbitmq["hostname"] == "rabbitmq"  # the node is rabbit@<hostname>
    named = [v.split(":")[0] for v in rabbitmq["volumes"] if v.split(":")[1] == "/var/lib/rabbitmq"]
    assert named == ["rabbitmq-data"]
    top_level = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["volumes"]
    assert "rabbitmq-data" in top_level


def test_the_build_context_leaves_out_secrets_and_the_virtualenv() -> None:
    rules = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    # Everything out, then only what deploy/Dockerfile copies back in.
    assert rules[0] == "*"
    allowed = {rule[1:].rstrip("/") for rule in rules if rule.startswith("!")}
    assert allowed == {"pyproject.toml", "README.md", "shared", "services"}
    copied = {
        line.split()[1].rstrip("/")
        for line in (ROOT / "deploy/Dockerfile").read_text().splitlines()
        if line.startswith("COPY ")
    }
    assert copied <= allowed


def test_one_shots_run_no_health_check_and_mongosh_has_time() -> None:
    compose = services()
    for name in ONE_SHOTS:
        assert compose[name]["healthcheck"] == {"disable": True}, name
    timeout = compose["mongodb"]["healthcheck"]["timeout"]
    assert timeout.endswith("s") and int(timeout[:-1]) >= 20


def test_the_cli_service_posts_as_the_publisher_and_only_on_demand() -> None:
    cli = services()["cli"]
    assert cli["profiles"] == ["cli"]
    assert cli["environment"]["YOKE_AMQP_URL"].startswith("amqp://publisher:")
    assert cli["entrypoint"] == ["yoke"]

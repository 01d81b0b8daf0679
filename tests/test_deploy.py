"""docker-compose.yml, the image and the monitoring files agree with what the code expects."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import yaml
from prometheus_client import REGISTRY

import yoke.metrics  # noqa: F401  (registers every yoke_ series)
from yoke import topology
from yoke.settings import DEFAULT_METRICS_PORTS, Settings
from yoke.supervisor import GATEWAY, SERVICES

ROOT = Path(__file__).resolve().parents[1]


def load(path: str) -> Any:
    return yaml.safe_load((ROOT / path).read_text())


def known_environment() -> set[str]:
    return {f"YOKE_{name.upper()}" for name in Settings.model_fields} | {
        "OPENAI_API_KEY",
        "OPENAI_BASE_URL",
    }


def test_every_service_runs_from_the_image_with_the_settings_the_code_reads() -> None:
    compose = load("docker-compose.yml")["services"]
    for name in SERVICES:
        service = compose[name]
        assert service["command"] == ["python", "-m", f"services.{name}"]
        assert service["build"]["dockerfile"] == "deploy/Dockerfile"
        assert service["restart"] == "unless-stopped"
        environment = service["environment"]
        assert set(environment) <= known_environment(), set(environment) - known_environment()
        port = DEFAULT_METRICS_PORTS[name]
        assert environment["YOKE_METRICS_PORT"] == str(port)
        assert f"{port}:{port}" in service["ports"]
        assert environment["YOKE_AMQP_URL"].startswith("amqp://")
        assert environment["YOKE_MONGODB_URL"].startswith("mongodb://")
        for server in ("rabbitmq", "mongodb"):
            assert service["depends_on"][server]["condition"] == "service_healthy"
            assert "healthcheck" in compose[server]
    assert compose["rabbitmq"]["image"].startswith("rabbitmq:3.13")
    assert compose["mongodb"]["image"].startswith("mongo:7")
    plugins = (ROOT / "deploy/rabbitmq/enabled_plugins").read_text()
    for plugin in (
        "rabbitmq_management",
        "rabbitmq_prometheus",
        "rabbitmq_consistent_hash_exchange",
    ):
        assert plugin in plugins


def test_rabbitmq_definitions_give_bridges_least_privilege() -> None:
    definitions = json.loads((ROOT / "deploy/rabbitmq/definitions.json").read_text())
    permissions = {p["user"]: p for p in definitions["permissions"]}
    publisher = {k: permissions["publisher"][k] for k in ("configure", "write", "read")}
    assert publisher == topology.PUBLISHER_PERMISSIONS
    assert {u["name"] for u in definitions["users"]} == {"yoke", "publisher"}
    conf = (ROOT / "deploy/rabbitmq/rabbitmq.conf").read_text()
    assert "load_definitions = /etc/rabbitmq/definitions.json" in conf
    mounts = load("docker-compose.yml")["services"]["rabbitmq"]["volumes"]
    assert any(m.endswith(":/etc/rabbitmq/definitions.json:ro") for m in mounts)


def test_the_image_runs_as_a_user_with_a_health_check() -> None:
    dockerfile = (ROOT / "deploy/Dockerfile").read_text()
    assert re.search(r"^USER (?!root)\w+", dockerfile, re.MULTILINE)
    assert "HEALTHCHECK" in dockerfile and "/healthz" in dockerfile


def test_prometheus_scrapes_every_service_and_rabbitmq() -> None:
    config = load("deploy/prometheus/prometheus.yml")
    targets = {
        target
        for job in config["scrape_configs"]
        for static in job["static_configs"]
        for target in static["targets"]
    }
    expected = {f"{name}:{DEFAULT_METRICS_PORTS[name]}" for name in SERVICES}
    gateway = f"{GATEWAY}:{Settings().gateway_port}"
    assert expected | {gateway, "rabbitmq:15692"} == targets


def test_dashboards_and_alerts_use_only_series_that_exist() -> None:
    exported = {
        sample.name
        for metric in REGISTRY.collect()
        if metric.name.startswith("yoke_")
        for sample in metric.samples
    } | {m.name for m in REGISTRY.collect() if m.name.startswith("yoke_")}
    dashboard = (ROOT / "deploy/grafana/dashboards/yoke.json").read_text()
    alerts = (ROOT / "deploy/prometheus/alerts.yml").read_text()
    used = set(re.findall(r"yoke_[a-z_]+", dashboard + alerts))

    # Series only appear once labelled; compare names without the _bucket/_total/... suffixes.
    def base(name: str) -> str:
        return re.sub(r"_(total|bucket|count|sum|created)$", "", name)

    assert {base(name) for name in used} <= {base(name) for name in exported}, used
    assert {"yoke_dead_letters_total", "yoke_event_lag_seconds_bucket"} <= used


def test_docker_compose_accepts_the_file_where_it_exists() -> None:
    docker = shutil.which("docker")
    has_compose = (
        docker is not None
        and subprocess.run([docker, "compose", "version"], capture_output=True).returncode == 0
    )
    if has_compose:
        assert docker is not None
        result = subprocess.run(
            [docker, "compose", "-f", str(ROOT / "docker-compose.yml"), "config", "-q"],
            capture_output=True,
            text=True,
        )
        assert result.returncode == 0, result.stderr
    else:
        # No compose plugin here: the YAML at least parses into the services above.
        assert set(SERVICES) <= set(load("docker-compose.yml")["services"])

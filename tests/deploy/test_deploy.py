"""docker-compose.yml, the image and the monitoring files agree with what the code expects."""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import yaml
from prometheus_client import REGISTRY

# Imported to register their yoke_ series: the gateway's webhooks and caller doors, the
# services' metrics and shard ownership.
import services.gateway.a2a.task_store
import services.gateway.mcp_door
import services.gateway.webhooks  # noqa: F401
from tests.support.processes import ServiceProcess, free_port
from yoke.bus import topology
from yoke.cli.supervisor import GATEWAY, SERVICES
from yoke.core.metrics import initialize as initialize_metrics
from yoke.core.settings import Settings

ROOT = Path(__file__).resolve().parents[2]


def load(path: str) -> Any:
    return yaml.safe_load((ROOT / path).read_text())


# ${VAR}, ${VAR:-default}, ${VAR-default}, ${VAR:?error}, ${VAR?error}, as compose reads them.
INTERPOLATION = re.compile(r"\$\{(\w+)(?:(:?[-?])([^}]*))?\}")


def interpolate(text: str, env: dict[str, str]) -> str:
    """``text`` as compose would see it with ``env`` as its .env (an unset :? fails)."""

    def value(match: re.Match[str]) -> str:
        name, operator, argument = match[1], match[2] or "", match[3] or ""
        found = env.get(name)
        empty = found is None or (found == "" and operator.startswith(":"))
        if operator.endswith("?") and empty:
            raise LookupError(f"{name}: {argument}")
        return argument if empty and operator.endswith("-") else (found or "")

    return INTERPOLATION.sub(value, text)


def published(spec: str, env: dict[str, str] | None = None) -> tuple[str, str, str]:
    """A short ``ports:`` entry as (host address, host port, container port); an entry without
    an address is published on every interface: ("0.0.0.0", ...)."""
    parts = interpolate(str(spec), env or {}).split(":")
    if len(parts) == 2:
        return ("0.0.0.0", parts[0], parts[1])
    assert len(parts) == 3, spec
    return (parts[0], parts[1], parts[2])


def make_env(path: Path) -> tuple[dict[str, str], str]:
    """Runs ``make env``'s script on ``path``: the variables it holds and what it printed."""
    result = subprocess.run(
        [sys.executable, str(ROOT / "deploy/make_env.py"), str(path)],
        capture_output=True,
        text=True,
        check=True,
    )
    values = {}
    for line in path.read_text().splitlines():
        name, sep, value = line.partition("=")
        if sep and not name.startswith("#"):
            values[name] = value
    return values, result.stdout + result.stderr


def known_environment() -> set[str]:
    return {f"YOKE_{name.upper()}" for name in Settings.model_fields} | {
        "OPENAI_API_KEY",
        "OPENAI_BASE_URL",
        "HOME",  # the processor's, on a tmpfs (stdio MCP servers need a writable home)
        # OpenTelemetry's own (yoke.core.tracing: off unless the endpoint is set).
        "OTEL_EXPORTER_OTLP_ENDPOINT",
        "OTEL_SERVICE_NAME",
        "OTEL_TRACES_SAMPLER",
        "OTEL_TRACES_SAMPLER_ARG",
        "OTEL_RESOURCE_ATTRIBUTES",
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
        port = SERVICES[name]
        assert environment["YOKE_METRICS_PORT"] == str(port)
        if service.get("deploy", {}).get("replicas", 1) > 1:
            assert "ports" not in service  # replicas would collide on a host port
        else:
            assert ("127.0.0.1", str(port), str(port)) in {published(p) for p in service["ports"]}
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
    assert publisher == topology.publisher_permissions("publisher")
    assert {u["name"] for u in definitions["users"]} == {"yoke", "publisher", "yoke-gateway"}
    # compose's one-shot rabbitmq-init imports the file with passwords from .env (a node that
    # loads definitions at boot would not create the operator, its default user).
    conf = (ROOT / "deploy/rabbitmq/rabbitmq.conf").read_text()
    assert not re.search(r"^\s*load_definitions", conf, re.MULTILINE)
    init = load("docker-compose.yml")["services"]["rabbitmq-init"]
    assert init["command"][:3] == ["python", "-m", "yoke.bus.provisioning"]
    assert init["depends_on"]["rabbitmq"]["condition"] == "service_healthy"
    mount = next(m for m in init["volumes"] if m.startswith("./deploy/rabbitmq/definitions.json:"))
    assert mount.split(":")[1] == init["command"][3]


def test_the_services_rabbitmq_user_is_no_administrator_and_reaches_only_yoke() -> None:
    definitions = json.loads((ROOT / "deploy/rabbitmq/definitions.json").read_text())
    [services] = [u for u in definitions["users"] if u["name"] == "yoke"]
    assert services["tags"] in ([], "")
    [granted] = [p for p in definitions["permissions"] if p["user"] == "yoke"]
    assert {k: granted[k] for k in ("configure", "write", "read")} == topology.SERVICE_PERMISSIONS
    for pattern in topology.SERVICE_PERMISSIONS.values():
        assert re.match(pattern, "yoke.processor.shard.000")
        assert not re.match(pattern, "bridge.anything") and not re.match(pattern, "amq.topic")
    compose = load("docker-compose.yml")["services"]
    for name in (*SERVICES, GATEWAY):
        # The gateway has a user of its own (tests/deploy/test_compose_config.py).
        user = "yoke-gateway" if name == GATEWAY else "yoke"
        assert compose[name]["environment"]["YOKE_AMQP_URL"].startswith(f"amqp://{user}:${{")
        assert compose[name]["depends_on"]["rabbitmq-init"] == {
            "condition": "service_completed_successfully"
        }
    # The operator is the node's default user: the only administrator.
    rabbitmq = compose["rabbitmq"]["environment"]
    assert rabbitmq["RABBITMQ_DEFAULT_USER"] == "operator"
    assert rabbitmq["RABBITMQ_DEFAULT_PASS"].startswith("${YOKE_RABBITMQ_OPERATOR_PASSWORD")


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
    } | {  # replicated services: each replica, found by DNS on the compose network
        f"{name}:{found['port']}"
        for job in config["scrape_configs"]
        for found in job.get("dns_sd_configs", [])
        for name in found["names"]
    }
    expected = {f"{name}:{SERVICES[name]}" for name in SERVICES}
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
    used = set(re.findall(r"yoke_[a-z0-9_]+", dashboard + alerts))

    # Series only appear once labelled; compare names without the _bucket/_total/... suffixes.
    def base(name: str) -> str:
        return re.sub(r"_(total|bucket|count|sum|created)$", "", name)

    assert {base(name) for name in used} <= {base(name) for name in exported}, used
    assert {"yoke_dead_letters_total", "yoke_event_lag_seconds_bucket"} <= used


# The tool-call panels and the series each reads.
TOOL_PANELS = {
    "Tool calls by tool, source and outcome": {"yoke_tool_calls_total"},
    "Tool call latency p50 / p95 by source (s)": {"yoke_tool_call_seconds_bucket"},
    "Tool calls waiting in the store": {"yoke_tool_calls_open"},
    "Tool calls past their deadline": {"yoke_tool_calls_overdue"},
}


def test_the_tool_call_panels_read_what_the_processor_exports_as_they_group_it() -> None:
    """The processor exports these series from its start (at zero: ``initialize``), with the
    labels the panels group them by (grouping by a label a series lacks draws one line for
    everything) and that a scrape adds (instance, job)."""
    initialize_metrics("processor")
    labels: dict[str, set[str]] = {}
    for metric in REGISTRY.collect():
        for sample in metric.samples:
            labels.setdefault(sample.name, set()).update(sample.labels)
    panels = json.loads((ROOT / "deploy/grafana/dashboards/yoke.json").read_text())["panels"]
    reads = {
        panel["title"]: {
            name
            for target in panel["targets"]
            for name in re.findall(r"yoke_[a-z0-9_]+", target["expr"])
        }
        for panel in panels
    }
    assert {title: reads.get(title) for title in TOOL_PANELS} == TOOL_PANELS
    assert labels["yoke_tool_calls_total"] >= {"tool", "source", "outcome"}
    assert labels["yoke_tool_call_seconds_bucket"] >= {"source", "le"}
    for panel in panels:
        for target in panel["targets"]:
            grouped = {
                label.strip()
                for group in re.findall(r"by \(([^)]*)\)", target["expr"])
                for label in group.split(",")
            }
            for name in re.findall(r"yoke_[a-z0-9_]+", target["expr"]):
                if panel["title"] in TOOL_PANELS or name in labels:  # labelled here: checkable
                    assert name in labels, f"{panel['title']}: the processor exports no {name}"
                    missing = grouped - labels[name] - {"instance", "job"}
                    assert not missing, f"{panel['title']}: {name} has no label {missing}"


def test_docker_compose_accepts_the_file_where_it_exists(tmp_path: Path) -> None:
    docker = shutil.which("docker")
    has_compose = (
        docker is not None
        and subprocess.run([docker, "compose", "version"], capture_output=True).returncode == 0
    )
    if has_compose:
        assert docker is not None
        env_file = tmp_path / ".env"
        make_env(env_file)  # compose refuses to run without the passwords
        compose = str(ROOT / "docker-compose.yml")
        result = subprocess.run(
            [docker, "compose", "-f", compose, "--env-file", str(env_file), "config", "-q"],
            capture_output=True,
            text=True,
        )
        assert result.returncode == 0, result.stderr
    else:
        # No compose plugin here: the YAML at least parses into the services above.
        assert set(SERVICES) <= set(load("docker-compose.yml")["services"])


# --- secure by default (docs/security.md) -----------------------------------------------------


def test_no_port_is_published_beyond_loopback_unless_env_says_so(tmp_path: Path) -> None:
    env, _ = make_env(tmp_path / ".env")
    compose = load("docker-compose.yml")["services"]
    specs = [(name, spec) for name, service in compose.items() for spec in service.get("ports", [])]
    assert len(specs) >= 10
    for name, spec in specs:
        assert published(spec)[0] == "127.0.0.1", (name, spec)  # no .env at all
        assert published(spec, env)[0] == "127.0.0.1", (name, spec)  # the one make env writes
        opened = published(spec, {**env, "YOKE_BIND_ADDRESS": "0.0.0.0"})
        assert opened[0] == "0.0.0.0", (name, spec)  # the switch


def deploy_files() -> list[Path]:
    files = [ROOT / "docker-compose.yml", *sorted((ROOT / "deploy").rglob("*"))]
    return [path for path in files if path.is_file() and "__pycache__" not in path.parts]


# ``scheme://user:password@`` whose password is not a ${VARIABLE} from .env. RabbitMQ's own
# guest:guest is no secret of ours: the local broker lets guest in from loopback only.
URL_PASSWORD = re.compile(r"[a-z][a-z0-9+.-]*://(?P<user>[^:@/\s\"']+):(?P<password>[^@/\s\"']+)@")
# A setting named like a secret (YAML, conf, env, shell), and an SQL role's password.
SECRET_SETTING = re.compile(r"(?i)^[\s\-\"]*(\w*(?:PASS|PASSWORD|SECRET|TOKEN))\"?\s*[:=]\s*(.*)$")
SQL_PASSWORD = re.compile(r"(?i)\bPASSWORD\s+'[^']*'")


def password_literals(name: str, text: str) -> list[str]:
    """What in a deploy file looks like a usable password rather than a ${VARIABLE}."""
    found = []
    for match in URL_PASSWORD.finditer(text):
        password = match["password"]
        if not password.startswith("$") and (match["user"], password) != ("guest", "guest"):
            found.append(match[0])
    if not name.endswith(".py"):  # code names its variables; settings would hold values
        for line in text.splitlines():
            setting = SECRET_SETTING.match(line)
            value = setting[2].strip().strip("\"'") if setting else ""
            if setting and value and not value.startswith("$"):
                found.append(line.strip())
    found += SQL_PASSWORD.findall(text)
    return found


def test_no_password_or_hash_is_written_in_deploy_or_compose() -> None:
    problems = [
        f"{path.relative_to(ROOT)}: {literal}"
        for path in deploy_files()
        for literal in password_literals(path.name, path.read_text(errors="replace"))
    ]
    definitions = json.loads((ROOT / "deploy/rabbitmq/definitions.json").read_text())
    for user in definitions["users"]:
        if user.get("password_hash") or user.get("password"):
            problems.append(f"definitions.json: user {user['name']} has a password or hash")
    assert not problems, "\n".join(problems)


def test_the_password_check_catches_what_it_should() -> None:
    for text in (
        "    YOKE_AMQP_URL: amqp://yoke:yoke@rabbitmq:5672/",
        '--postgresql-url="postgres://ferretdb:s3cret@127.0.0.1:5432/ferretdb"',
        "      GF_SECURITY_ADMIN_PASSWORD: admin",
        '      - "RABBITMQ_DEFAULT_PASS=guest"',
        """psql -qc "CREATE ROLE ferretdb LOGIN PASSWORD 'ferretdb'\"""",
    ):
        assert password_literals("docker-compose.yml", text), text
    for text in (
        "    YOKE_AMQP_URL: amqp://yoke:${YOKE_RABBITMQ_SERVICES_PASSWORD:?run make env}@rabbitmq/",
        "      RABBITMQ_DEFAULT_PASS: ${YOKE_RABBITMQ_OPERATOR_PASSWORD:?run make env first}",
        "    wait_for RabbitMQ amqp amqp://guest:guest@127.0.0.1:5672/",
        'password="$(cat "$local_dir/postgres.password")"',
    ):
        assert not password_literals("services.sh", text), text


def test_mongodb_runs_with_authentication_and_the_services_have_their_own_user() -> None:
    compose = load("docker-compose.yml")["services"]
    mongodb = compose["mongodb"]["environment"]
    # With a root user the mongo image starts mongod with --auth.
    assert mongodb["MONGO_INITDB_ROOT_USERNAME"] == "root"
    assert mongodb["MONGO_INITDB_ROOT_PASSWORD"].startswith("${YOKE_MONGODB_ROOT_PASSWORD")
    [mount] = [v for v in compose["mongodb"]["volumes"] if "docker-entrypoint-initdb.d" in v]
    script = (ROOT / mount.split(":")[0]).read_text()
    assert "process.env.YOKE_MONGODB_PASSWORD" in script
    assert re.search(r'"roles":\s*\[\{\s*"role":\s*"readWrite",\s*"db":\s*"yoke"\s*\}\]', script)
    assert mongodb["YOKE_MONGODB_PASSWORD"].startswith("${YOKE_MONGODB_PASSWORD")
    for name in (*SERVICES, GATEWAY):
        url = compose[name]["environment"]["YOKE_MONGODB_URL"]
        own = (
            "yoke-gateway:${YOKE_MONGODB_GATEWAY_PASSWORD"
            if name == GATEWAY
            else "yoke:${YOKE_MONGODB_PASSWORD"
        )
        assert url.startswith(f"mongodb://{own}") and "/yoke?" in url


def test_grafana_lets_no_anonymous_visitor_in() -> None:
    grafana = load("docker-compose.yml")["services"]["grafana"]["environment"]
    assert grafana["GF_AUTH_ANONYMOUS_ENABLED"] == "false"
    assert grafana["GF_SECURITY_ADMIN_PASSWORD"].startswith("${YOKE_GRAFANA_ADMIN_PASSWORD")


def test_make_env_writes_random_passwords_once_and_prints_none(tmp_path: Path) -> None:
    path = tmp_path / ".env"
    path.write_text("YOKE_MONGODB_ROOT_PASSWORD=chosen-by-hand\n")
    first, printed = make_env(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert first["YOKE_MONGODB_ROOT_PASSWORD"] == "chosen-by-hand"  # never overwritten
    assert first["YOKE_BIND_ADDRESS"] == "127.0.0.1"
    compose = (ROOT / "docker-compose.yml").read_text()
    wanted = set(re.findall(r"\$\{(\w+):\?", compose))
    assert wanted <= set(first), wanted - set(first)
    generated = [v for k, v in first.items() if k.endswith("PASSWORD") and v != "chosen-by-hand"]
    assert len(generated) == len(set(generated)) >= 5
    for value in generated:
        assert re.fullmatch(r"[A-Za-z0-9_-]{32}", value)  # URL-safe: compose puts it in URLs
        assert value not in printed
    again, printed = make_env(path)
    assert again == first and printed == ""
    interpolate(compose, first)  # every ${VAR:?} is satisfied
    ignored = subprocess.run(["git", "check-ignore", "-q", ".env"], cwd=ROOT)
    assert ignored.returncode == 0, ".env is not git-ignored"


def test_provisioning_refuses_to_run_without_the_passwords() -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "yoke.bus.provisioning",
            str(ROOT / "deploy/rabbitmq/definitions.json"),
        ],
        capture_output=True,
        text=True,
        env={"PATH": "/usr/bin:/bin", "YOKE_MANAGEMENT_URL": "http://op:pw@127.0.0.1:1"},
        cwd=ROOT,
    )
    assert result.returncode == 1
    assert "YOKE_RABBITMQ_SERVICES_PASSWORD is not set" in result.stderr


def listening(port: int) -> set[str]:
    """The local addresses of this machine's listening TCP sockets on ``port`` (from /proc)."""
    found = set()
    for table, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                address, port_hex = local.split(":")
                if state != "0A" or int(port_hex, 16) != port:
                    continue
                raw = bytes.fromhex(address)
                # The kernel prints each 32-bit word of the address in host (little-endian) order.
                words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
                found.add(socket.inet_ntop(family, words))
    return found


LOOPBACK = {"127.0.0.1", "::1"}
RABBITMQ_LOOPBACK = (
    "listeners.tcp.default = 127.0.0.1:5672",
    "management.tcp.ip = 127.0.0.1",
    "prometheus.tcp.ip = 127.0.0.1",
)


def test_make_services_keeps_rabbitmq_ferretdb_and_postgresql_on_loopback() -> None:
    script = (ROOT / "deploy/local/services.sh").read_text()
    for line in RABBITMQ_LOOPBACK:
        assert f'"{line}"' in script  # in what configure_rabbitmq writes
    assert "--listen-addr=127.0.0.1:27017" in script
    assert "listen_addresses = 'localhost'" in script
    local = ROOT / ".local"
    # The servers this script runs: FerretDB and PostgreSQL listen as it says right now.
    if (local / "ferretdb.pid").exists():
        assert listening(27017) and listening(27017) <= LOOPBACK, listening(27017)
    if (local / "postgresql.started").exists():
        assert listening(5432) and listening(5432) <= LOOPBACK, listening(5432)
    # RabbitMQ reads its listeners at boot: check them once it started with this configuration.
    conf = Path("/etc/rabbitmq/rabbitmq.conf")
    if (local / "rabbitmq.started").exists() and conf.exists():
        written = conf.read_text().splitlines()
        uptime = rabbitmq_uptime_seconds()
        booted_after = uptime is not None and time.time() - uptime > conf.stat().st_mtime
        if all(line in written for line in RABBITMQ_LOOPBACK) and booted_after:
            for port in (5672, 15672, 15692):
                assert listening(port) and listening(port) <= LOOPBACK, (port, listening(port))


def rabbitmq_uptime_seconds() -> float | None:
    """How long the local broker has run, from its management API (None: no answer)."""
    try:
        nodes = httpx.get("http://127.0.0.1:15672/api/nodes", auth=("guest", "guest"), timeout=5)
        return float(nodes.json()[0]["uptime"]) / 1000
    except (httpx.HTTPError, ValueError, LookupError, KeyError):
        return None


def test_listening_reads_the_kernels_tables() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        probe.listen()
        port = probe.getsockname()[1]
        assert listening(port) == {"127.0.0.1"}
    with socket.socket() as probe:
        probe.bind(("0.0.0.0", 0))
        probe.listen()
        assert listening(probe.getsockname()[1]) == {"0.0.0.0"}


async def test_services_and_the_gateway_listen_on_loopback_unless_told(
    amqp_url: str, mongodb_url: str, tmp_path: Path
) -> None:
    """A service's /metrics and the gateway's API are not on every interface by default; the
    containers (where Prometheus scrapes over the compose network) say 0.0.0.0 themselves."""
    env = {"YOKE_AMQP_URL": amqp_url, "YOKE_MONGODB_URL": mongodb_url, "YOKE_SHARDS": "2"}
    gateway_port = free_port()
    egress = ServiceProcess(["-m", "services.egress"], env, tmp_path / "egress.log")
    gateway = ServiceProcess(
        ["-m", "services.gateway"],
        {**env, "YOKE_GATEWAY_PORT": str(gateway_port)},
        tmp_path / "gateway.log",
    )
    gateway.port = gateway_port  # its /healthz is on the API's port
    try:
        await egress.wait_healthy()
        await gateway.wait_healthy()
        assert listening(egress.port) == {"127.0.0.1"}, listening(egress.port)
        assert listening(gateway_port) == {"127.0.0.1"}, listening(gateway_port)
    finally:
        assert egress.stop() == 0
        assert gateway.stop() == 0

    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    for name in (*SERVICES, GATEWAY):
        environment = compose["services"][name]["environment"]
        host = "YOKE_GATEWAY_HOST" if name == GATEWAY else "YOKE_METRICS_HOST"
        assert environment.get(host) == "0.0.0.0", (name, host)

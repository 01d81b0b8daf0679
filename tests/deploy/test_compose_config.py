"""docker-compose.yml gives each container only what it needs, read from the files themselves.

Static on purpose: FerretDB (the MongoDB-wire server here and in make compose-check) enforces no
roles, so the MongoDB users' roles can only be checked by reading deploy/mongodb's init script;
the RabbitMQ permission patterns are matched here as RabbitMQ matches them (an unanchored
regular-expression search), and make compose-check proves them on a real broker.
"""

from __future__ import annotations

import json
import re
import runpy
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.compose.check import EXPECTED, STAND_INS
from yoke.bus import provisioning
from yoke.core.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
OUR_IMAGE = "deploy/Dockerfile"
OPENAI_KEY = "OPENAI_API_KEY"
# Who needs which secret: only processor (agents' turns, compaction) and guardian (its
# runners) call a model; the gateway has users of its own on both servers.
SERVICES_AMQP = "YOKE_RABBITMQ_SERVICES_PASSWORD"
SERVICES_MONGODB = "YOKE_MONGODB_PASSWORD"
GATEWAY_AMQP = "YOKE_RABBITMQ_GATEWAY_PASSWORD"
GATEWAY_MONGODB = "YOKE_MONGODB_GATEWAY_PASSWORD"
SECRETS = {
    "rabbitmq": {"YOKE_RABBITMQ_OPERATOR_PASSWORD"},
    "rabbitmq-init": {
        "YOKE_RABBITMQ_OPERATOR_PASSWORD",
        SERVICES_AMQP,
        "YOKE_RABBITMQ_PUBLISHER_PASSWORD",
        GATEWAY_AMQP,
    },
    "mongodb": {"YOKE_MONGODB_ROOT_PASSWORD", SERVICES_MONGODB, GATEWAY_MONGODB},
    "ingestion": {SERVICES_AMQP, SERVICES_MONGODB},
    "processor": {SERVICES_AMQP, SERVICES_MONGODB, OPENAI_KEY},
    "egress": {SERVICES_AMQP, SERVICES_MONGODB},
    "followup": {SERVICES_AMQP, SERVICES_MONGODB},
    "guardian": {SERVICES_AMQP, SERVICES_MONGODB, OPENAI_KEY},
    "gateway": {GATEWAY_AMQP, GATEWAY_MONGODB},
    "cli": {"YOKE_RABBITMQ_PUBLISHER_PASSWORD", SERVICES_MONGODB},
    "prometheus": set(),
    "grafana": {"YOKE_GRAFANA_ADMIN_PASSWORD"},
    "jaeger": set(),
}
# Services whose processes start MCP servers (stdio ones need a writable home).
MCP_HOSTS = {"processor"}


def compose() -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    return loaded


def services() -> dict[str, Any]:
    found: dict[str, Any] = compose()["services"]
    return found


def environment(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.partition("=")[::2] for item in env)
    return {str(key): str(value) for key, value in env.items()}


def secret_names() -> set[str]:
    """Every generated password make env writes, and the model provider's key."""
    variables = runpy.run_path(str(ROOT / "deploy/make_env.py"))["VARIABLES"]
    return {name for name, (_, default) in variables.items() if default is None} | {OPENAI_KEY}


def secrets_of(service: dict[str, Any]) -> set[str]:
    referenced = set()
    for value in environment(service).values():
        referenced |= set(re.findall(r"\$\{([A-Za-z_][A-Za-z0-9_]*)", value))
    return referenced & secret_names()


def definitions() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads((ROOT / "deploy/rabbitmq/definitions.json").read_text())
    return loaded


def permissions_of(user: str) -> dict[str, str]:
    [found] = [p for p in definitions()["permissions"] if p["user"] == user and p["vhost"] == "/"]
    return {kind: found[kind] for kind in ("configure", "write", "read")}


def gateway_user() -> str:
    return str(Settings.model_fields["gateway_amqp_user"].default)


def url_user(url: str) -> str:
    return url.split("://", 1)[1].split(":", 1)[0]


def test_every_container_gets_only_its_own_secrets() -> None:
    found = {name: secrets_of(service) for name, service in services().items()}
    assert found == SECRETS


def test_only_the_services_that_call_a_model_get_its_address_too() -> None:
    given = {name for name, s in services().items() if "OPENAI_BASE_URL" in environment(s)}
    assert given == {"processor", "guardian"}


def test_the_gateway_connects_to_both_servers_as_its_own_user() -> None:
    env = environment(services()["gateway"])
    assert gateway_user() == "yoke-gateway"
    assert url_user(env["YOKE_AMQP_URL"]) == gateway_user()
    assert f"${{{GATEWAY_AMQP}" in env["YOKE_AMQP_URL"]
    assert url_user(env["YOKE_MONGODB_URL"]) == "yoke-gateway"
    assert f"${{{GATEWAY_MONGODB}" in env["YOKE_MONGODB_URL"]
    assert "authSource=yoke" in env["YOKE_MONGODB_URL"]
    # The door tells the gateway's submissions apart by this name; compose keeps the default.
    assert env.get("YOKE_GATEWAY_AMQP_USER", gateway_user()) == gateway_user()


def test_the_gateway_user_is_provisioned_with_its_own_password() -> None:
    users = {user["name"]: user for user in definitions()["users"]}
    assert users[gateway_user()]["tags"] == []  # no management API, no UI
    assert provisioning.PASSWORD_VARIABLES[gateway_user()] == GATEWAY_AMQP
    variables = runpy.run_path(str(ROOT / "deploy/make_env.py"))["VARIABLES"]
    assert {GATEWAY_AMQP, GATEWAY_MONGODB} <= set(variables)
    init = environment(services()["rabbitmq-init"])
    assert GATEWAY_AMQP in init


def allowed(pattern: str, name: str) -> bool:
    """RabbitMQ's check: the pattern found anywhere in the resource's name (re:run)."""
    return re.search(pattern, name) is not None


# What the gateway does on the bus: Client's reply queues, the stream hub's queue bound to
# yoke.forum, the webhook worker's route exchange (from yoke.forum) and its queue; commands go
# to yoke.commands. Binding needs read on the source and write on the destination.
GATEWAY_NEEDS = {
    "configure": ["yoke.gateway.replies.x1", "yoke.gateway.stream.x1", "yoke.gateway.webhooks.x1"],
    "write": ["yoke.commands", "yoke.gateway.replies.x1", "yoke.gateway.stream.x1"],
    "read": ["yoke.forum", "yoke.gateway.replies.x1", "yoke.gateway.stream.x1"],
}
# Nothing of the services', nothing a monologue goes through, nobody else's queues.
GATEWAY_NEVER = [
    "yoke.events",
    "yoke.events.x",
    "yoke.forum.route",
    "yoke.dead-letters",
    "yoke.processor.shard.000",
    "yoke.processor.shards",
    "yoke.processor.route",
    "yoke.ingestion.commands",
    "yoke.egress.shard.003",
    "yoke.tool.calculator",
    "yoke.store.webhooks.route",
    "bridge.someone.replies",
    "amq.default",
    "amq.topic",
]


@pytest.mark.parametrize("kind", ["configure", "write", "read"])
def test_the_gateway_user_may_touch_only_what_the_gateway_uses(kind: str) -> None:
    pattern = permissions_of(gateway_user())[kind]
    assert [name for name in GATEWAY_NEEDS[kind] if not allowed(pattern, name)] == []
    assert [name for name in GATEWAY_NEVER if allowed(pattern, name)] == []
    if kind != "read":
        assert not allowed(pattern, "yoke.forum")  # internal, and fed by the mesh only
    if kind == "configure":
        assert not allowed(pattern, "yoke.commands")


def test_the_forum_exchanges_exist_before_any_service_starts() -> None:
    """The gateway may not declare yoke.forum (configure): provisioning does, as the bus does."""
    exchanges = {e["name"]: e for e in definitions()["exchanges"]}
    assert exchanges["yoke.forum"]["type"] == "topic" and exchanges["yoke.forum"]["internal"]
    assert exchanges["yoke.forum.route"]["type"] == "headers"
    assert exchanges["yoke.forum.route"]["internal"]
    bindings = {(b["source"], b["destination"]): b for b in definitions()["bindings"]}
    assert bindings["yoke.events", "yoke.forum.route"]["routing_key"] == "#"
    assert bindings["yoke.forum.route", "yoke.forum"]["arguments"] == {
        "x-match": "all",
        "yoke-kind": "forum",
    }


def mongodb_users() -> dict[str, dict[str, Any]]:
    """The users and roles deploy/mongodb/init-yoke-user.js creates, read from its JSON
    literals (``const name = {`` then a quoted key)."""
    script = (ROOT / "deploy/mongodb/init-yoke-user.js").read_text()
    found = {}
    for literal in re.findall(r'^const \w+ = (\{\n  ".*?\});$', script, flags=re.S | re.M):
        value = json.loads(literal)
        found[value.get("user") or value["role"]] = value
    return found


def test_the_gateway_mongodb_user_reads_and_writes_only_what_it_must() -> None:
    users = mongodb_users()
    assert users["yoke"]["roles"] == [{"role": "readWrite", "db": "yoke"}]
    gateway = users["yoke-gateway"]
    assert gateway["roles"] == [{"role": "yokeGateway", "db": "yoke"}]
    role = users["yokeGateway"]
    assert role["roles"] == []  # inherits nothing
    writes = {"insert", "update", "remove"}
    written = {
        privilege["resource"]["collection"]
        for privilege in role["privileges"]
        if writes & set(privilege["actions"])
    }
    # Only bookkeeping: the webhook worker's, its retention sweep's progress, the console's
    # forum list, the MCP door's owed answers and the token line count a collecting call takes
    # one of, the A2A door's tasks and push configs; never a line, an actor, a token or a call.
    assert written == {
        "webhook_cursors",
        "webhook_leases",
        "webhook_dead_letters",
        "retention",
        "forum_list",
        "mcp_owed_answers",
        "line_limits",
        "a2a_tasks",
        "a2a_push_configs",
    }
    for privilege in role["privileges"]:
        assert privilege["resource"]["db"] == "yoke"
        assert not {"dropCollection", "dropDatabase", "createUser", "grantRole"} & set(
            privilege["actions"]
        )


def test_our_image_runs_without_privileges_and_on_a_read_only_root() -> None:
    ours = {
        name: service
        for name, service in services().items()
        if (service.get("build") or {}).get("dockerfile") == OUR_IMAGE
    }
    assert set(ours) == {*SECRETS} - {"rabbitmq", "mongodb", "prometheus", "grafana", "jaeger"}
    for name, service in ours.items():
        assert service.get("cap_drop") == ["ALL"], name
        assert service.get("read_only") is True, name
        assert "no-new-privileges:true" in service.get("security_opt", []), name
        assert any(str(mount).split(":")[0] == "/tmp" for mount in service.get("tmpfs", [])), name
    for name in MCP_HOSTS:
        home = environment(ours[name])["HOME"]
        assert home in {str(mount).split(":")[0] for mount in ours[name]["tmpfs"]}, name


# The mesh's long-running services (our image, not the one-shot, not the CLI on demand).
TRACED = {"ingestion", "processor", "egress", "followup", "guardian", "gateway"}


def test_every_service_exports_its_traces_to_the_jaeger_service() -> None:
    found = services()
    exporting = {
        name for name, s in found.items() if "OTEL_EXPORTER_OTLP_ENDPOINT" in environment(s)
    }
    assert exporting == TRACED
    # OTLP/HTTP's base address (the SDK adds /v1/traces), on the port Jaeger receives it.
    assert {environment(found[name])["OTEL_EXPORTER_OTLP_ENDPOINT"] for name in TRACED} == {
        "http://jaeger:4318"
    }


def tracing_script_value(name: str) -> str:
    [value] = re.findall(
        rf'^{name}="([^"]+)"$', (ROOT / "deploy/local/tracing.sh").read_text(), re.M
    )
    return value


def test_jaeger_is_the_official_image_of_the_release_make_tracing_builds() -> None:
    jaeger = services()["jaeger"]
    assert jaeger["image"] == f"jaegertracing/jaeger:{tracing_script_value('jaeger_version')[1:]}"
    assert tracing_script_value("module_version") == "v1.75.0"  # the module list's approved one
    assert jaeger["restart"] == "unless-stopped"
    # Nothing written but memory and /tmp; no capability; published on the bind address only.
    assert jaeger.get("cap_drop") == ["ALL"] and jaeger.get("read_only") is True
    assert "no-new-privileges:true" in jaeger.get("security_opt", [])
    published = {port.rsplit(":", 1)[-1] for port in jaeger["ports"]}
    assert published == {"16686", "4317", "4318"}
    assert all(port.startswith("${YOKE_BIND_ADDRESS:-127.0.0.1}:") for port in jaeger["ports"])
    # make compose-check's stand-in takes the name the file gives.
    assert STAND_INS["jaeger"] == jaeger["image"] and EXPECTED["jaeger"] == 1


def test_grafana_reads_jaeger_and_links_exemplars_to_it() -> None:
    folder = ROOT / "deploy/grafana/provisioning/datasources"
    sources = {
        source["uid"]: source
        for path in sorted(folder.glob("*.yml"))
        for source in yaml.safe_load(path.read_text())["datasources"]
    }
    assert sources["jaeger"]["type"] == "jaeger"
    assert sources["jaeger"]["url"] == "http://jaeger:16686"
    destinations = sources["prometheus"]["jsonData"]["exemplarTraceIdDestinations"]
    assert destinations == [{"name": "trace_id", "datasourceUid": "jaeger"}]
    # Prometheus keeps exemplars only when told to; its command keeps the image's flags.
    command = services()["prometheus"]["command"]
    assert "--enable-feature=exemplar-storage" in command
    assert "--config.file=/etc/prometheus/prometheus.yml" in command
    # Every latency panel asks for them.
    dashboard = json.loads((ROOT / "deploy/grafana/dashboards/yoke.json").read_text())
    latency = [
        target
        for panel in dashboard["panels"]
        for target in panel.get("targets", [])
        if "_seconds_bucket" in target["expr"]
    ]
    assert latency and all(target.get("exemplar") is True for target in latency)

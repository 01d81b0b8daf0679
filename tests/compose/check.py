"""``make compose-check``: the project's docker-compose.yml, run for real on a Docker engine.

Where no image can be pulled, the images the file names are built first as stand-ins from a
Debian base made with debootstrap (tests/compose/images/*/Dockerfile say how each differs
from the official one). Then the real file runs (plus tests/compose/compose.override.yml,
which only leaves out Grafana) and every check below must pass: a table says what was checked
and how long each step took. Engine data, the Debian base and mongosh live under
``YOKE_COMPOSE_CACHE`` (default /var/cache/yoke-compose), outside the checkout, so a second run
on the same machine reuses the built images.

Run as root on Debian: ``python -m tests.compose.check`` (``make compose-check``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import aio_pika
import httpx
import yaml
from aiormq.exceptions import ChannelAccessRefused
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor

HERE = Path(__file__).resolve().parent
CACHE = Path(os.environ.get("YOKE_COMPOSE_CACHE", "/var/cache/yoke-compose"))
RUN_DIR = Path("/run/yoke-compose")
SOCKET = RUN_DIR / "docker.sock"
PROJECT = "yokecheck"
# Ports are published on a loopback address of the check's own: the machine's own servers
# (make services) hold 127.0.0.1's 5672, 15672, 27017 and 9090.
BIND = os.environ.get("YOKE_COMPOSE_BIND_ADDRESS", "127.0.0.77")
BASE_IMAGE = "yoke-compose/bookworm:base"
STAND_IN_LABEL = "org.yoke.compose.stand-in"
# Stand-in directory -> the image docker-compose.yml (or the Dockerfile) names.
STAND_INS = {
    "python": "python:3.11-slim",
    "rabbitmq": "rabbitmq:3.13.7-management",
    "mongo": "mongo:7.0",
    "prometheus": "prom/prometheus:v2.54.1",
    "jaeger": "jaegertracing/jaeger:2.12.0",
}
# The engine's settings on this kind of host: runc (crun fails on hybrid cgroups), ulimits no
# higher than the host allows, overlay2.
DOCKERD_FLAGS = [
    "--storage-driver=overlay2",
    "--default-runtime=runc",
    "--default-ulimit=nofile=20000:20000",
    "--default-ulimit=nproc=32768:32768",
]
# Long-running containers of the file, and how many of each (deploy.replicas).
EXPECTED = {
    "rabbitmq": 1,
    "mongodb": 1,
    "ingestion": 2,
    "processor": 2,
    "egress": 1,
    "followup": 1,
    "guardian": 1,
    "gateway": 1,
    "prometheus": 1,
    "jaeger": 1,
}
ONE_SHOTS = {"rabbitmq-init"}
T = TypeVar("T")


class CheckFailed(Exception):
    """A check saw the wrong thing; its message says what."""


@dataclass
class Row:
    step: str
    ok: bool | None  # None: skipped
    seconds: float
    note: str


@dataclass
class Engine:
    host: str  # a DOCKER_HOST value
    ours: bool  # started by this check (so it may restart it)
    started_now: bool = False
    installed: str = ""  # the Debian packages this run installed for it


@dataclass
class Run:
    root: Path
    env_file: Path
    engine: Engine
    rows: list[Row] = field(default_factory=list)
    values: dict[str, str] = field(default_factory=dict)

    # --- recording -------------------------------------------------------------------------

    def step(self, name: str, action: Callable[[], str], *, essential: bool = False) -> bool:
        """Run one timed step; a failure is recorded (and ends the run if ``essential``)."""
        print(f"[compose-check] {name} ...", file=sys.stderr, flush=True)
        start = time.monotonic()
        try:
            note = action()
            ok: bool | None = True
        except Skipped as skipped:
            note, ok = str(skipped), None
        except Aborted:
            raise
        except Exception as error:  # any failure is this step's, with what it said
            note, ok = describe(error), False
        row = Row(name, ok, time.monotonic() - start, note)
        self.rows.append(row)
        print(f"[compose-check]   {verdict(row)} {row.seconds:.0f} s  {note}", file=sys.stderr)
        if ok is False and essential:
            raise Aborted(name)
        return ok is not False

    # --- the engine and compose --------------------------------------------------------------

    def docker_env(self) -> dict[str, str]:
        return {**os.environ, "DOCKER_HOST": self.engine.host, "COMPOSE_DOCKER_CLI_BUILD": "0"}

    def docker(self, *args: str, check: bool = True, timeout: float = 600) -> str:
        return run_command([docker_cli(), *args], self.docker_env(), check=check, timeout=timeout)

    def compose(self, *args: str, check: bool = True, timeout: float = 900) -> str:
        files = [
            "-f",
            str(self.root / "docker-compose.yml"),
            "-f",
            str(HERE / "compose.override.yml"),
        ]
        command = ["docker-compose", "-p", PROJECT, *files, "--env-file", str(self.env_file)]
        return run_command(
            [*command, *args], self.docker_env(), check=check, timeout=timeout, cwd=self.root
        )

    def containers(self) -> list[dict[str, Any]]:
        """Every container of the project, as ``docker inspect`` describes it."""
        ids = self.docker(
            "ps", "-aq", "--filter", f"label=com.docker.compose.project={PROJECT}"
        ).split()
        return json.loads(self.docker("inspect", *ids)) if ids else []

    def env_value(self, name: str) -> str:
        for line in self.env_file.read_text().splitlines():
            key, _, value = line.partition("=")
            if key.strip() == name:
                return value.strip()
        raise CheckFailed(f"{name} is not in {self.env_file}")

    def amqp_url(self, user: str, password_variable: str) -> str:
        return f"amqp://{user}:{self.env_value(password_variable)}@{BIND}:5672/"

    def mongodb_url(self) -> str:
        password = self.env_value("YOKE_MONGODB_ROOT_PASSWORD")
        return f"mongodb://root:{password}@{BIND}:27017/yoke?authSource=admin"

    def host_yoke(self, *args: str, amqp_url: str | None = None, timeout: float = 60) -> str:
        """The yoke CLI of this checkout's virtualenv, against the compose mesh's ports."""
        env = {
            **os.environ,
            "YOKE_AMQP_URL": amqp_url
            or self.amqp_url("operator", "YOKE_RABBITMQ_OPERATOR_PASSWORD"),
            "YOKE_MONGODB_URL": self.mongodb_url(),
        }
        return run_command([sys.executable, "-m", "yoke.cli", *args], env, timeout=timeout)


class Skipped(Exception):
    """The step cannot run here (it says why); neither a pass nor a failure."""


class Aborted(Exception):
    """An essential step failed: nothing after it can mean anything."""


def describe(error: BaseException) -> str:
    if isinstance(error, subprocess.CalledProcessError):
        said = (error.stderr or error.stdout or "").strip().splitlines()
        return f"exit {error.returncode}: {' | '.join(said[-3:])[:300]}"
    if isinstance(error, CheckFailed):
        return str(error)[:400]
    return f"{type(error).__name__}: {error}"[:400]


def verdict(row: Row) -> str:
    return {True: "ok  ", False: "FAIL", None: "skip"}[row.ok]


def run_command(
    command: list[str],
    env: dict[str, str],
    *,
    check: bool = True,
    timeout: float = 600,
    cwd: Path | None = None,
) -> str:
    done = subprocess.run(
        command, env=env, capture_output=True, text=True, timeout=timeout, cwd=cwd, check=False
    )
    if check and done.returncode != 0:
        raise subprocess.CalledProcessError(done.returncode, command, done.stdout, done.stderr)
    return done.stdout


def poll(what: str, probe: Callable[[], T | None], deadline: float, every: float = 2) -> T:
    """``probe()``'s first non-None answer within ``deadline`` seconds."""
    give_up = time.monotonic() + deadline
    last: object = None
    while True:
        try:
            found = probe()
            if found is not None:
                return found
        except (CheckFailed, subprocess.CalledProcessError, httpx.HTTPError, OSError) as error:
            last = describe(error)
        if time.monotonic() > give_up:
            raise CheckFailed(f"{what}: not within {deadline:g} s" + (f" ({last})" if last else ""))
        time.sleep(every)


# --- the engine ----------------------------------------------------------------------------


def docker_cli() -> str:
    """Debian's docker client, of the same release as its dockerd, before any other on PATH."""
    return "/usr/bin/docker" if Path("/usr/bin/docker").exists() else "docker"


def engine_answers(host: str) -> bool:
    env = {**os.environ, "DOCKER_HOST": host}
    try:
        run_command([docker_cli(), "version", "--format", "{{.Server.Version}}"], env, timeout=20)
        return True
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired, FileNotFoundError):
        return False


def install_engine() -> str:
    """Debian's docker.io and docker-compose, when missing; returns what it installed."""
    missing = [
        package
        for package, binary in (("docker.io", "dockerd"), ("docker-compose", "docker-compose"))
        if shutil.which(binary) is None
    ]
    if missing:
        if os.geteuid() != 0 or shutil.which("apt-get") is None:
            raise CheckFailed(f"needs {', '.join(missing)}: run as root on Debian")
        apt_install(missing)
    return ", ".join(missing)


# The dockerd this process started, if any: it is reaped when it stops.
started_dockerd: subprocess.Popen[bytes] | None = None


def apt_install(packages: list[str]) -> None:
    """Debian's packages; the package lists are fetched first only if the install needs them."""
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-q", *packages]
    try:
        run_command(install, env, timeout=900)
    except subprocess.CalledProcessError:
        run_command(["apt-get", "update", "-q"], env, timeout=900)
        run_command(install, env, timeout=900)


def start_dockerd() -> None:
    RUN_DIR.mkdir(parents=True, exist_ok=True)
    (CACHE / "docker").mkdir(parents=True, exist_ok=True)
    log = (CACHE / "dockerd.log").open("ab")
    global started_dockerd
    started_dockerd = subprocess.Popen(
        [
            "dockerd",
            f"--data-root={CACHE / 'docker'}",
            f"--exec-root={RUN_DIR / 'exec'}",
            f"--pidfile={RUN_DIR / 'dockerd.pid'}",
            f"--host=unix://{SOCKET}",
            *DOCKERD_FLAGS,
        ],
        stdout=log,
        stderr=log,
        start_new_session=True,
    )
    poll("dockerd answers", lambda: True if engine_answers(f"unix://{SOCKET}") else None, 90, 1)


def stop_dockerd() -> None:
    pid_file = RUN_DIR / "dockerd.pid"
    pid = int(pid_file.read_text()) if pid_file.exists() else None
    if pid is None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)

    def gone() -> bool | None:
        if started_dockerd is not None and started_dockerd.pid == pid:
            # Our own child: reaped here (a zombie would still answer kill(pid, 0)).
            return True if started_dockerd.poll() is not None else None
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        return None

    poll("dockerd stops", gone, 120, 0.5)


def stop_own_dockerd() -> str:
    stop_dockerd()
    return "stopped (its data stays in the cache)"


def find_engine() -> Engine:
    given = os.environ.get("DOCKER_HOST")
    if given and engine_answers(given):
        return Engine(given, ours=False)
    ours = f"unix://{SOCKET}"
    if engine_answers(ours):
        return Engine(ours, ours=True)
    if not given and engine_answers("unix:///var/run/docker.sock"):
        return Engine("unix:///var/run/docker.sock", ours=False)
    installed = install_engine()
    start_dockerd()
    return Engine(ours, ours=True, started_now=True, installed=installed)


# --- images --------------------------------------------------------------------------------


def image_labels(run: Run, image: str) -> dict[str, str] | None:
    """The image's labels, or None when the engine has no such image."""
    out = run.docker("image", "inspect", image, "--format", "{{json .Config.Labels}}", check=False)
    return (json.loads(out) or {}) if out.strip() else None


def ensure_base(run: Run) -> str:
    if image_labels(run, BASE_IMAGE) is not None:
        return "cached"
    tarball = CACHE / "bookworm-minbase.tar"
    made = "from the cached tarball"
    if not tarball.exists():
        if shutil.which("debootstrap") is None:
            apt_install(["debootstrap"])
        rootfs = CACHE / "rootfs.tmp"
        shutil.rmtree(rootfs, ignore_errors=True)
        run_command(
            ["debootstrap", "--variant=minbase", "bookworm", str(rootfs), debian_mirror()],
            dict(os.environ),
            timeout=1800,
        )
        run_command(["tar", "-C", str(rootfs), "-cf", f"{tarball}.tmp", "."], dict(os.environ))
        os.replace(f"{tarball}.tmp", tarball)
        shutil.rmtree(rootfs, ignore_errors=True)
        made = "debootstrap --variant=minbase bookworm"
    with tarball.open("rb") as data:
        subprocess.run(
            [docker_cli(), "import", "-", BASE_IMAGE],
            stdin=data,
            env=run.docker_env(),
            check=True,
            capture_output=True,
        )
    return made


def debian_mirror() -> str:
    """The Debian archive this host's apt uses (so the base comes from where the host's
    packages do): a ``URIs:`` or ``deb`` line's address ending in /debian, comments skipped."""
    for path in [Path("/etc/apt/sources.list"), *sorted(Path("/etc/apt/sources.list.d").glob("*"))]:
        with contextlib.suppress(OSError):
            for line in path.read_text().splitlines():
                found = re.match(
                    r"\s*(?:URIs:|deb(?:\s+\[[^]]*\])?)\s+(\S+/debian)/?\s*(?:\s|$)", line
                )
                if found:
                    return found.group(1)
    return "http://deb.debian.org/debian"


def build_context(name: str, root: Path) -> Path:
    """The stand-in's files, plus what it takes from this host, in a context under the cache."""
    context = CACHE / "contexts" / name
    shutil.rmtree(context, ignore_errors=True)
    shutil.copytree(HERE / "images" / name, context)
    if name == "python":
        shutil.copy("/etc/ssl/certs/ca-certificates.crt", context / "host-ca-certificates.crt")
    if name == "mongo":
        ferretdb = root / ".local/bin/ferretdb"
        if not ferretdb.exists():
            raise CheckFailed(f"{ferretdb} is missing: `make services` builds it")
        shutil.copy(ferretdb, context / "ferretdb")
    if name == "jaeger":
        jaeger = root / ".local/bin/jaeger"
        if not jaeger.exists():
            raise CheckFailed(f"{jaeger} is missing: `make tracing-build` builds it")
        shutil.copy(jaeger, context / "jaeger")
    return context


MONGOSH_VERSION = "2.3.8"
MONGOSH_IMAGE = f"yoke-compose/mongosh:{MONGOSH_VERSION}"


def ensure_mongosh_image(run: Run) -> None:
    """mongosh from the npm registry on the host's Node.js, as an image the mongo stand-in
    copies from (built once per machine; npm's download cached too)."""
    if image_labels(run, MONGOSH_IMAGE) is not None:
        return
    node = shutil.which("node")
    if node is None or shutil.which("npm") is None:
        raise CheckFailed("mongosh needs Node.js and npm on the host")
    downloaded = CACHE / f"mongosh-{MONGOSH_VERSION}"
    if not (downloaded / "node_modules/mongosh/bin/mongosh.js").exists():
        shutil.rmtree(downloaded, ignore_errors=True)
        downloaded.mkdir(parents=True)
        npm = ["npm", "install", "--no-audit", "--no-fund", "--omit=optional"]
        run_command(
            [*npm, f"mongosh@{MONGOSH_VERSION}"], dict(os.environ), timeout=900, cwd=downloaded
        )
    context = CACHE / "contexts" / "mongosh"
    shutil.rmtree(context, ignore_errors=True)
    context.mkdir(parents=True)
    shutil.copy(HERE / "images/mongosh/Dockerfile", context / "Dockerfile")
    shutil.copy(node, context / "node")
    # The daemon is sent the context as files: node_modules is moved in (no copy), then back.
    os.rename(downloaded / "node_modules", context / "node_modules")
    try:
        run.docker(
            "build",
            "-q",
            "--label",
            f"{STAND_IN_LABEL}=mongosh",
            "-t",
            MONGOSH_IMAGE,
            str(context),
            timeout=1200,
        )
    finally:
        os.rename(context / "node_modules", downloaded / "node_modules")


def build_stand_in(run: Run, name: str) -> str:
    image = STAND_INS[name]
    labels = image_labels(run, image)
    if labels is not None and STAND_IN_LABEL not in labels:
        return f"{image}: the engine has the real image; used as it is"
    if name == "mongo":
        ensure_mongosh_image(run)
    context = build_context(name, run.root)
    started = time.monotonic()
    run.docker("build", "-q", "--label", f"{STAND_IN_LABEL}={name}", "-t", image, str(context))
    return f"{image} (stand-in, {time.monotonic() - started:.0f} s of docker build)"


# --- static checks of the files ----------------------------------------------------------------


def compose_config(run: Run) -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load(run.compose("config"))
    return loaded


def check_restart_policies(run: Run) -> str:
    services = compose_config(run)["services"]
    lacking = [
        name
        for name in (*EXPECTED, "grafana")
        if services[name].get("restart") not in ("always", "unless-stopped")
    ]
    if lacking:
        raise CheckFailed(f"no restart policy: {', '.join(lacking)}")
    return "every long-running container: unless-stopped"


def check_rabbitmq_keeps_its_node(run: Run) -> str:
    rabbitmq = compose_config(run)["services"]["rabbitmq"]
    problems = []
    if not rabbitmq.get("hostname"):
        problems.append("no fixed hostname (the node's name changes with the container)")
    volumes = [str(v.get("target", v) if isinstance(v, dict) else v) for v in rabbitmq["volumes"]]
    # "source:target[:mode]" as docker-compose config prints them
    if "/var/lib/rabbitmq" not in {[*v.split(":"), ""][1] or v for v in volumes}:
        problems.append("no volume for /var/lib/rabbitmq")
    if problems:
        raise CheckFailed("; ".join(problems))
    return f"node rabbit@{rabbitmq['hostname']}, /var/lib/rabbitmq on a volume"


def check_build_context(run: Run) -> str:
    """What the daemon is sent from a checkout with a .env, .local/ and a virtualenv in it."""
    planted = [run.root / ".env", run.root / ".local" / "compose-check-secret"]
    made = [path for path in planted if not path.exists()]
    for path in made:
        path.parent.mkdir(exist_ok=True)
        path.write_text("secret\n")
    try:
        dockerfile = f"FROM {BASE_IMAGE}\nCOPY . /context\nRUN du -sk /context && ls -A /context\n"
        done = subprocess.run(
            [docker_cli(), "build", "--no-cache", "-f", "-", str(run.root)],
            input=dockerfile,
            env=run.docker_env(),
            capture_output=True,
            text=True,
            timeout=600,
            check=True,
        )
    finally:
        for path in made:
            path.unlink()
    listing = done.stdout
    size = re.search(r"^(\d+)\s+/context$", listing, re.MULTILINE)
    kilobytes = int(size.group(1)) if size else -1
    leaked = [
        name
        for name in (".env", ".local", ".venv", ".git")
        if re.search(rf"^{re.escape(name)}$", listing, re.MULTILINE)
    ]
    if leaked or kilobytes > 20_000:
        raise CheckFailed(f"build context {kilobytes} kB, carries {', '.join(leaked) or '-'}")
    return f"build context {kilobytes} kB, without .env, .local, .venv, .git"


def check_healthchecks(run: Run) -> str:
    services = compose_config(run)["services"]
    problems = []
    init_check = services["rabbitmq-init"].get("healthcheck", {})
    if not (init_check.get("disable") or init_check.get("test") in (["NONE"], "NONE")):
        problems.append("rabbitmq-init inherits the image's /healthz check")
    timeout = services["mongodb"].get("healthcheck", {}).get("timeout", "0s")
    if seconds_of(timeout) < 20:
        problems.append(f"mongodb's healthcheck timeout is {timeout}")
    dockerfile = (run.root / "deploy/Dockerfile").read_text()
    if "five services" in dockerfile:
        problems.append('deploy/Dockerfile says "five services"')
    if problems:
        raise CheckFailed("; ".join(problems))
    return f"rabbitmq-init none, mongodb timeout {timeout}, Dockerfile says six"


def seconds_of(duration: str) -> float:
    units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600}
    return sum(
        float(number) * units[unit] for number, unit in re.findall(r"([\d.]+)(ms|s|m|h)", duration)
    )


# --- the running mesh ----------------------------------------------------------------------


def service_of(container: dict[str, Any]) -> str:
    return str(container["Config"]["Labels"].get("com.docker.compose.service", "?"))


def health_problems(run: Run) -> list[str]:
    """What keeps the mesh from being up: each long-running container running (and healthy,
    if it has a health check), in the numbers the file asks for; the one-shot exited 0."""
    seen: dict[str, int] = {}
    problems = []
    for container in run.containers():
        service, state = service_of(container), container["State"]
        if service in ONE_SHOTS:
            if state["Status"] != "exited" or state["ExitCode"] != 0:
                problems.append(f"{service} {state['Status']} (exit {state['ExitCode']})")
            continue
        health = (state.get("Health") or {}).get("Status")
        if state["Status"] == "running" and health in (None, "healthy"):
            seen[service] = seen.get(service, 0) + 1
        else:
            problems.append(f"{container['Name'].lstrip('/')} {state['Status']}/{health}")
    for service, count in EXPECTED.items():
        if seen.get(service, 0) < count:
            problems.append(f"{service}: {seen.get(service, 0)} of {count} up")
    return problems


def wait_all_healthy(run: Run, deadline: float) -> str:
    last: list[str] = []

    def probe() -> bool | None:
        nonlocal last
        last = health_problems(run)
        return True if not last else None

    try:
        poll("every container up", probe, deadline, 3)
    except CheckFailed as error:
        raise CheckFailed(f"{error}: {'; '.join(last)}") from error
    return f"{sum(EXPECTED.values())} containers up and healthy, rabbitmq-init exited 0"


def build_services(run: Run) -> str:
    """Every service's image from deploy/Dockerfile, the cli's too (its profile keeps it out of
    a plain ``build``); all but the first are the same layers, from the build cache."""
    started = time.monotonic()
    run.compose("build", timeout=1800)
    if "cli" in compose_config(run)["services"]:
        run.compose("build", "cli", timeout=1800)
    images = run.docker(
        "images", "--format", "{{.Repository}} {{.ID}}", "--filter", f"reference={PROJECT}_*"
    ).splitlines()
    distinct = {line.split()[1] for line in images}
    took = time.monotonic() - started
    return f"{len(images)} services' images ({len(distinct)} distinct) in {took:.0f} s"


def up(run: Run) -> str:
    run.compose("up", "-d", timeout=1200)
    return wait_all_healthy(run, 300)


def check_rabbitmq_init_unchecked(run: Run) -> str:
    [init] = [c for c in run.containers() if service_of(c) == "rabbitmq-init"]
    health = init["State"].get("Health")
    test = (init["Config"].get("Healthcheck") or {}).get("Test")
    if health is not None or test != ["NONE"]:
        raise CheckFailed(f"rabbitmq-init has a health check ({test}): {health}")
    return "rabbitmq-init runs no health check"


def make_forum(run: Run) -> str:
    """An echo agent joined to a new forum, made as the services' user inside a container."""
    exec_yoke = ("exec", "-T", "processor", "yoke")
    agent = run.compose(*exec_yoke, "agent", "create", "--name", "compose-echo").split()[-1]
    forum = run.compose(*exec_yoke, "forum", "create", "--title", "compose-check").split()[-1]
    run.compose(*exec_yoke, "join", "--agent", agent, "--forum", forum)
    run.values.update(agent=agent, forum=forum)
    return f"echo agent joined to forum {forum[:8]}… (exec processor yoke)"


def agent_answered(run: Run, text: str) -> bool | None:
    out = run.host_yoke("history", run.values["forum"], "--json")
    for line in out.splitlines():
        message = json.loads(line)
        author = message.get("authorActorId") or message.get("author_actor_id")
        if author == run.values["agent"] and text in json.dumps(message):
            return True
    return None


def check_cli_refusal(run: Run) -> str:
    """As the services' user the CLI may not post; it must say so in one line."""
    done = subprocess.run(
        [
            "docker-compose",
            "-p",
            PROJECT,
            "-f",
            str(run.root / "docker-compose.yml"),
            "-f",
            str(HERE / "compose.override.yml"),
            "--env-file",
            str(run.env_file),
            "exec",
            "-T",
            "processor",
            "yoke",
            "post",
            "--forum",
            run.values["forum"],
            "--author",
            "check",
            "--timeout",
            "10",
            "refused?",
        ],
        env=run.docker_env(),
        capture_output=True,
        text=True,
        timeout=120,
        cwd=run.root,
    )
    lines = done.stderr.strip().splitlines()
    if done.returncode == 0 or len(lines) != 1 or "ACCESS_REFUSED" not in lines[0]:
        raise CheckFailed(
            f"exec processor yoke post: exit {done.returncode}, {len(lines)} lines on stderr"
        )
    return f"exec processor yoke post: exit {done.returncode}, one line: {lines[0][:48]}…"


def amqp_turn(run: Run) -> str:
    """A line through the AMQP door, posted the documented way: the cli service (publisher)."""
    text = f"through the door {uuid.uuid4().hex[:8]}"
    out = run.compose(
        "run",
        "--rm",
        "cli",
        "post",
        "--forum",
        run.values["forum"],
        "--author",
        "check",
        text,
        timeout=300,
    )
    poll("the agent's answer", lambda: agent_answered(run, text), 90)
    return f"docker-compose run --rm cli post: line {out.strip()[-12:]} answered by the agent"


def gateway_turn(run: Run, traceparent: str | None = None) -> str:
    token = (
        run.host_yoke(
            "token",
            "create",
            "--name",
            f"check-{uuid.uuid4().hex[:6]}",
            "--forum",
            run.values["forum"],
        )
        .strip()
        .splitlines()[-1]
    )
    text = f"over http {uuid.uuid4().hex[:8]}"
    forum = run.values["forum"]
    headers = {"Authorization": f"Bearer {token}"}
    with httpx.Client(base_url=f"http://{BIND}:8080", headers=headers, timeout=10) as api:
        # A caller's trace, which the gateway's own links to (the services trace, as all do here).
        extra = {"traceparent": traceparent} if traceparent else {}
        posted = api.post(
            f"/v1/forums/{forum}/messages",
            json={"author": {"externalId": "check", "displayName": "Check"}, "text": text},
            headers=extra,
        )
        if posted.status_code != 202:
            raise CheckFailed(f"POST answered {posted.status_code}: {posted.text[:200]}")

        def answered() -> bool | None:
            lines = api.get(f"/v1/forums/{forum}/messages", params={"after": 0})
            lines.raise_for_status()
            body = lines.json()
            items = body if isinstance(body, list) else body.get("messages", body.get("items", []))
            agent_lines = [m for m in items if m.get("role") == "agent"]
            return True if any(text in json.dumps(m) for m in agent_lines) else None

        poll("the agent's answer over HTTP", answered, 90)
    return f"POST {BIND}:8080/v1/forums/…/messages 202, the agent's answer in GET"


# --- traces --------------------------------------------------------------------------------

JAEGER_QUERY = f"http://{BIND}:16686"
# The services a line through the HTTP door crosses before the answer is in the forum.
TURN_SERVICES = {"yoke-gateway", "yoke-ingestion", "yoke-processor", "yoke-egress"}


def jaeger_trace(trace_id: str) -> dict[str, set[str]] | None:
    """service -> span names of a trace, as Jaeger's v3 query API has it (None: not found)."""
    found = httpx.get(f"{JAEGER_QUERY}/api/v3/traces/{trace_id}", timeout=10)
    if found.status_code == 404:
        return None
    found.raise_for_status()
    spans: dict[str, set[str]] = {}
    for resource in found.json()["result"]["resourceSpans"]:
        service = next(
            (
                a["value"].get("stringValue", "")
                for a in resource.get("resource", {}).get("attributes", [])
                if a["key"] == "service.name"
            ),
            "",
        )
        for scope in resource.get("scopeSpans", []):
            spans.setdefault(service, set()).update(s["name"] for s in scope.get("spans", []))
    return spans


def jaeger_takes_a_span(run: Run) -> str:
    """The jaeger service receives OTLP/HTTP on its published port (the official SDK's
    exporter) and answers its query API with the span."""
    provider = TracerProvider(resource=Resource.create({"service.name": "compose-check"}))
    exporter = OTLPSpanExporter(endpoint=f"http://{BIND}:4318/v1/traces", timeout=10)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    with provider.get_tracer("compose-check").start_as_current_span("compose-check probe") as span:
        trace_id = format(span.get_span_context().trace_id, "032x")
    provider.shutdown()
    found = poll("the probe span in Jaeger", lambda: jaeger_trace(trace_id), 60, 1)
    if found != {"compose-check": {"compose-check probe"}}:
        raise CheckFailed(f"Jaeger has, for the probe's trace: {found}")
    services = httpx.get(f"{JAEGER_QUERY}/api/v3/services", timeout=10).json()["services"]
    return (
        f"OTLP/HTTP :4318 span found at :16686/api/v3/traces/{trace_id[:8]}…; services {services}"
    )


def linked_gateway_trace(since: float, caller_span: str) -> str | None:
    """The id of the gateway's trace whose POST span links to the caller's span ``caller_span``
    (Jaeger's search, as its UI's), None while there is none."""
    window = {
        "query.service_name": "yoke-gateway",
        "query.operation_name": "POST /v1/forums/{forumId}/messages",
        "query.start_time_min": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(since - 5)),
        "query.start_time_max": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() + 5)),
        "query.num_traces": "20",
        "query.raw_traces": "true",
    }
    found = httpx.get(f"{JAEGER_QUERY}/api/v3/traces", params=window, timeout=10)
    if found.status_code == 404:
        return None
    found.raise_for_status()
    for resource in found.json()["result"]["resourceSpans"]:
        for scope in resource.get("scopeSpans", []):
            for span in scope.get("spans", []):
                links = span.get("links", [])
                if any(str(link.get("spanId", "")).lower() == caller_span for link in links):
                    return str(span["traceId"]).lower()
    return None


def turn_trace(run: Run) -> str:
    """A line posted over HTTP with a caller's traceparent: the gateway starts a trace of its
    own, whose request span links to the caller's, and the turn's spans, from every service it
    crosses, are found in Jaeger under that trace id."""
    if not (run.root / "shared/yoke/core/tracing.py").exists():
        raise Skipped("the services do not trace yet (no shared/yoke/core/tracing.py)")
    caller_trace, caller_span = uuid.uuid4().hex, uuid.uuid4().hex[:16]
    since = time.time()
    gateway_turn(run, traceparent=f"00-{caller_trace}-{caller_span}-01")
    trace_id = poll(
        "the gateway's trace linked to the caller's span in Jaeger",
        lambda: linked_gateway_trace(since, caller_span),
        60,
        2,
    )
    last: dict[str, set[str]] = {}

    def complete() -> bool | None:
        nonlocal last
        last = jaeger_trace(trace_id) or {}
        return True if set(last) >= TURN_SERVICES else None

    try:
        poll("the turn's spans from every service in Jaeger", complete, 60, 2)
    except CheckFailed as error:
        raise CheckFailed(f"{error}: Jaeger has {last}") from error
    if jaeger_trace(caller_trace) is not None:
        raise CheckFailed(f"spans joined the caller's trace {caller_trace}")
    count = sum(len(names) for names in last.values())
    services = ", ".join(sorted(last))
    return f"trace {trace_id[:8]}… (linked to the caller's): {count} span names from {services}"


def container_ips(run: Run, service: str) -> set[str]:
    return {
        network["IPAddress"]
        for container in run.containers()
        if service_of(container) == service
        for network in container["NetworkSettings"]["Networks"].values()
        if network.get("IPAddress")
    }


def gateway_as_its_own_user(run: Run) -> str:
    """Every AMQP connection the gateway's container holds is its own user's, yoke-gateway."""
    ips = container_ips(run, "gateway")
    auth = ("operator", run.env_value("YOKE_RABBITMQ_OPERATOR_PASSWORD"))

    def its_connections() -> list[str] | None:
        found = httpx.get(f"http://{BIND}:15672/api/connections", auth=auth, timeout=10).json()
        users = [str(c["user"]) for c in found if c.get("peer_host") in ips]
        # The reply queue's client, the stream hub and the webhook worker.
        return users if len(users) >= 3 else None

    users = poll("the gateway's connections", its_connections, 60, 2)
    if set(users) != {"yoke-gateway"}:
        raise CheckFailed(f"the gateway connects as {sorted(set(users))}, not only yoke-gateway")
    return f"{len(users)} connections from the gateway, all as yoke-gateway"


def gateway_user_refused(run: Run) -> str:
    """As the gateway's user, a publish to yoke.events and a bind to it are refused."""
    url = run.amqp_url("yoke-gateway", "YOKE_RABBITMQ_GATEWAY_PASSWORD")

    async def attempts() -> list[str]:
        connection = await aio_pika.connect(url, timeout=10)
        said = []
        try:
            channel = await connection.channel(publisher_confirms=True)
            events = await channel.get_exchange("yoke.events")
            try:
                await events.publish(aio_pika.Message(b"{}"), routing_key="agent.activity.x")
                raise CheckFailed("a publish to yoke.events was confirmed")
            except ChannelAccessRefused as refused:
                said.append(f"publish to yoke.events: {str(refused)[:40]}")
            channel = await connection.channel()
            queue = await channel.declare_queue("yoke.gateway.check", exclusive=True)
            try:
                await queue.bind("yoke.events", routing_key="#")
                raise CheckFailed("a queue of the gateway's user was bound to yoke.events")
            except ChannelAccessRefused:
                said.append("bind to yoke.events refused")
        finally:
            await connection.close()
        return said

    return "; ".join(asyncio.run(attempts()))


def hardened_containers(run: Run) -> str:
    """Our image's containers: no capability, read-only root, no new privileges; the model key
    only where a model is called; the processor's home (MCP servers) writable."""
    problems = []
    ours = {"ingestion", "processor", "egress", "followup", "guardian", "gateway"}
    keyed = set()
    for container in run.containers():
        service, host = service_of(container), container["HostConfig"]
        if service not in ours:
            continue
        if "ALL" not in (host.get("CapDrop") or []):
            problems.append(f"{service}: capabilities kept")
        if not host.get("ReadonlyRootfs"):
            problems.append(f"{service}: writable root")
        if "no-new-privileges:true" not in (host.get("SecurityOpt") or []):
            problems.append(f"{service}: may gain privileges")
        if any(e.startswith("OPENAI_API_KEY=") for e in container["Config"]["Env"]):
            keyed.add(service)
    if keyed != {"processor", "guardian"}:
        problems.append(f"the model key reaches {sorted(keyed)}")
    probe = (
        "import os, pathlib; pathlib.Path(os.environ['HOME'], 'probe').write_text('x'); "
        "caps = [l for l in open('/proc/self/status') if l.startswith('CapEff')][0].split()[1]; "
        "ro = not os.access('/app', os.W_OK); print(int(caps, 16), ro)"
    )
    said = run.compose("exec", "-T", "processor", "python", "-c", probe).split()
    if said != ["0", "True"]:
        problems.append(f"processor: effective capabilities, /app read-only: {said}")
    if problems:
        raise CheckFailed("; ".join(problems))
    return (
        f"{len(ours)} services: cap_drop ALL, read-only root, no-new-privileges; key only in "
        "processor, guardian; processor's HOME writable, no effective capability"
    )


def prometheus_targets(run: Run) -> str:
    expected_yoke = sum(
        n for s, n in EXPECTED.items() if s not in ("rabbitmq", "mongodb", "prometheus", "jaeger")
    )
    last = ""

    def all_up() -> str | None:
        nonlocal last
        body = httpx.get(f"http://{BIND}:9090/api/v1/targets", timeout=10).json()
        targets = body["data"]["activeTargets"]
        by_job: dict[str, int] = {}
        down = []
        for target in targets:
            if target["health"] == "up":
                by_job[target["labels"]["job"]] = by_job.get(target["labels"]["job"], 0) + 1
            else:
                down.append(f"{target['labels'].get('instance')}: {target['health']}")
        last = f"up by job {by_job}; not up: {down}"
        if down or by_job.get("yoke", 0) < expected_yoke or len(by_job) < 3:
            return None
        return ", ".join(f"{job} {count}" for job, count in sorted(by_job.items()))

    try:
        found = poll("every Prometheus target up", all_up, 120, 5)
    except CheckFailed as error:
        raise CheckFailed(f"{error}: {last}") from error
    return f"targets up: {found} (yoke's replicas included)"


def daemon_restart(run: Run) -> str:
    if not run.engine.ours:
        raise Skipped("the engine is not this check's own: not restarting it")
    stop_dockerd()
    start_dockerd()
    # No compose command from here on: only the restart policies bring the mesh back.
    try:
        note = wait_all_healthy(run, 300)
    except CheckFailed:
        # The failure is this step's; `up -d` (the manual repair) lets the later steps check
        # what they are for.
        run.compose("up", "-d", check=False)
        wait_all_healthy(run, 300)
        raise
    gateway_turn(run)
    return f"dockerd stopped and started; by themselves: {note}; a gateway turn after"


def processor_queue_depth(run: Run) -> int:
    auth = ("operator", run.env_value("YOKE_RABBITMQ_OPERATOR_PASSWORD"))
    queues = httpx.get(f"http://{BIND}:15672/api/queues/%2F", auth=auth, timeout=10).json()
    return sum(
        int(q.get("messages", 0) or 0)
        for q in queues
        if str(q["name"]).startswith("yoke.processor")
    )


def rabbitmq_recreated(run: Run) -> str:
    run.compose("stop", "processor")
    text = f"waiting through a recreate {uuid.uuid4().hex[:8]}"
    publisher = run.amqp_url("publisher", "YOKE_RABBITMQ_PUBLISHER_PASSWORD")
    run.host_yoke(
        "post", "--forum", run.values["forum"], "--author", "check", text, amqp_url=publisher
    )
    depth = poll(
        "the line waiting in a processor shard queue",
        lambda: processor_queue_depth(run) or None,
        60,
        2,
    )
    [old] = [c["Id"] for c in run.containers() if service_of(c) == "rabbitmq"]
    since = engine_time(run)
    started = time.monotonic()
    run.compose("up", "-d", "--force-recreate", "--no-deps", "rabbitmq")
    # How the old node went: SIGTERM only is a clean stop; a SIGKILL means the stop timeout
    # ran out (and the new node recovers its queues from an unclean shutdown).
    signals = run.docker(
        "events",
        "--since",
        since,
        "--until",
        engine_time(run),
        "--filter",
        f"container={old}",
        "--filter",
        "event=kill",
        "--format",
        "{{.Actor.Attributes.signal}}",
    ).split()
    stopped = "killed" if "9" in signals else "stopped cleanly"
    wait_all_healthy_of(run, "rabbitmq", 300)
    booted = time.monotonic() - started
    run.compose("start", "processor")
    poll("the waiting line answered after the recreate", lambda: agent_answered(run, text), 180)
    wait_all_healthy(run, 180)
    return (
        f"{depth} waiting in yoke.processor.*; old node {stopped}, new one healthy in "
        f"{booted:.0f} s; the line answered"
    )


def engine_time(run: Run) -> str:
    return run.docker("info", "--format", "{{json .SystemTime}}").strip().strip('"')


def wait_all_healthy_of(run: Run, service: str, deadline: float) -> None:
    def healthy() -> bool | None:
        states = [c["State"] for c in run.containers() if service_of(c) == service]
        good = [s for s in states if (s.get("Health") or {}).get("Status") == "healthy"]
        return True if states and len(good) == len(states) else None

    poll(f"{service} healthy", healthy, deadline, 2)


def testcontainers_module(run: Run) -> str:
    """The suite's fixtures start RabbitMQ and MongoDB themselves from the named images."""
    since = engine_time(run)
    env = {
        key: value
        for key, value in os.environ.items()
        if key not in ("YOKE_AMQP_URL", "YOKE_MONGODB_URL", "YOKE_RABBITMQ_MANAGEMENT_URL")
    }
    env.update(
        DOCKER_HOST=run.engine.host,
        TESTCONTAINERS_RYUK_DISABLED="true",  # its reaper image cannot be pulled here
        YOKE_TEST_RABBITMQ_IMAGE=STAND_INS["rabbitmq"],
        YOKE_TEST_MONGODB_IMAGE=STAND_INS["mongo"],
    )
    module = "tests/cli/test_cli_refused.py"
    # Watched live, not asked for afterwards: the daemon keeps only its last 256 events, and the
    # mesh's health checks (three events each) push a slow test's container starts out of them.
    watcher = subprocess.Popen(
        [docker_cli(), "events", "--since", since, "--filter", "event=start", "--format={{.From}}"],
        env=run.docker_env(),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        done = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", module],
            env=env,
            capture_output=True,
            text=True,
            timeout=900,
            cwd=run.root,
        )
    finally:
        watcher.terminate()
        seen, _ = watcher.communicate(timeout=30)
    summary = (done.stdout.strip().splitlines() or ["(no output)"])[-1]
    if done.returncode != 0:
        raise CheckFailed(f"{module}: {summary} {done.stdout[-600:]} {done.stderr[-300:]}")
    started = seen.split()
    images = sorted(
        {image for image in started if image in (STAND_INS["rabbitmq"], STAND_INS["mongo"])}
    )
    if len(images) != 2:
        raise CheckFailed(f"{module} passed, but started {images}: not the containers")
    return f"{module}: {summary}, on containers of {', '.join(images)}"


def down(run: Run) -> str:
    run.compose("down", "-v", "--remove-orphans", timeout=300)
    left = [c["Name"] for c in run.containers()]
    label = f"label=com.docker.compose.project={PROJECT}"
    volumes = run.docker("volume", "ls", "-q", "--filter", label).split()
    networks = run.docker("network", "ls", "-q", "--filter", label).split()
    if left or volumes or networks:
        raise CheckFailed(f"left: containers {left}, volumes {volumes}, networks {networks}")
    return "no container, volume or network of the project left"


# --- the run ---------------------------------------------------------------------------------


def table(rows: list[Row], total: float) -> str:
    width = max(len(row.step) for row in rows)
    lines = [f"{'step':<{width}}  result  seconds  what it saw", "-" * (width + 40)]
    for row in rows:
        lines.append(f"{row.step:<{width}}  {verdict(row):<6}  {row.seconds:7.0f}  {row.note}")
    lines.append(f"{'total':<{width}}  {'':<6}  {total:7.0f}")
    return "\n".join(lines)


@contextlib.contextmanager
def env_file() -> Iterator[Path]:
    """A .env of the check's own (make env's passwords), ports on the check's address."""
    with tempfile.TemporaryDirectory(prefix="yoke-compose-") as folder:
        path = Path(folder) / ".env"
        path.write_text(f"YOKE_BIND_ADDRESS={BIND}\n")
        path.chmod(0o600)
        run_command(
            [sys.executable, str(HERE.parents[1] / "deploy/make_env.py"), str(path)],
            dict(os.environ),
        )
        yield path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument(
        "--root",
        type=Path,
        default=HERE.parents[1],
        help="the checkout whose compose file, Dockerfile and code run (default: this one)",
    )
    args = parser.parse_args(argv)
    root: Path = args.root.resolve()
    started = time.monotonic()
    rows: list[Row] = []
    engine_row_start = time.monotonic()
    try:
        engine = find_engine()
    except CheckFailed as error:
        print(f"[compose-check] no Docker engine: {error}", file=sys.stderr)
        return 1
    how = "started (its data under the cache)" if engine.started_now else "already answering"
    if engine.installed:
        how = f"{engine.installed} installed, {how}"
    rows.append(Row("engine", True, time.monotonic() - engine_row_start, f"{engine.host}: {how}"))
    failed = False
    with env_file() as path:
        run = Run(root, path, engine, rows)
        try:
            run.compose("down", "-v", "--remove-orphans", check=False)  # a run killed midway
            run.step("debian base image", lambda: ensure_base(run), essential=True)
            for name in STAND_INS:
                run.step(f"stand-in {name}", partial(build_stand_in, run, name), essential=True)
            run.step("1 restart policies", lambda: check_restart_policies(run))
            run.step("2 rabbitmq node kept", lambda: check_rabbitmq_keeps_its_node(run))
            run.step("3 build context", lambda: check_build_context(run))
            run.step("5 health checks", lambda: check_healthchecks(run))
            run.step(
                "build the services' image",
                lambda: build_services(run),
                essential=True,
            )
            run.step("up: all healthy", lambda: up(run), essential=True)
            run.step("5 rabbitmq-init unchecked", lambda: check_rabbitmq_init_unchecked(run))
            run.step("agent and forum", lambda: make_forum(run), essential=True)
            run.step("4 CLI refusal, one line", lambda: check_cli_refusal(run))
            run.step("turn through the AMQP door", lambda: amqp_turn(run))
            run.step("turn through the gateway", lambda: gateway_turn(run))
            run.step("jaeger takes a span", lambda: jaeger_takes_a_span(run))
            run.step("a turn's trace in jaeger", lambda: turn_trace(run))
            run.step("gateway as yoke-gateway", lambda: gateway_as_its_own_user(run))
            run.step("gateway user refused", lambda: gateway_user_refused(run))
            run.step("hardened containers", lambda: hardened_containers(run))
            run.step("prometheus targets", lambda: prometheus_targets(run))
            run.step("1 dockerd restart", lambda: daemon_restart(run))
            run.step("2 rabbitmq recreated", lambda: rabbitmq_recreated(run))
            run.step("testcontainers fixtures", lambda: testcontainers_module(run))
        except Aborted:
            pass
        finally:
            if not run.step("down -v: nothing left", lambda: down(run)):
                failed = True
            if engine.started_now:  # as it found the machine: no engine of its own left running
                run.step("stop its dockerd", stop_own_dockerd)
    failed = failed or any(row.ok is False for row in rows)
    print(table(rows, time.monotonic() - started))
    print("compose-check: " + ("FAILED" if failed else "all checks passed"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""Extra RabbitMQ nodes on this machine, beside the shared broker, for tests that need their own.

The shared broker (``rabbit@<host>`` on 5672/15672/15692/25672, started by ``make services``)
is never touched: every node started here has its own node name, its own AMQP, management,
Prometheus and distribution ports, its own data and log directories under a temporary
directory, its own config file (extra lines are appended: a TLS listener, say), its own
enabled-plugins file, and its own Erlang cookie in a ``HOME`` of its own, so neither the node nor
the ``rabbitmqctl`` calls made for it read or write ``/var/lib/rabbitmq/.erlang.cookie`` or
``~/.erlang.cookie``. Nodes run as the current user from ``/usr/lib/rabbitmq/bin`` (Debian's
``/usr/sbin`` wrappers would switch to the ``rabbitmq`` user and its cookie).

``RabbitNode`` starts one node; ``RabbitCluster`` starts several and joins them with
``rabbitmqctl join_cluster``. Both are context managers whose exit kills whatever is left::

    with RabbitNode.temporary("yoke-tls", extra_config=["listeners.ssl.default = 5999"]) as node:
        node.amqp_url  # amqp://guest:guest@127.0.0.1:<port>/

    with RabbitCluster.temporary(3) as cluster:
        cluster.amqp_urls  # one URL per node
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx

from tests.support.processes import free_port

RABBITMQ_BIN = Path(os.environ.get("YOKE_RABBITMQ_BIN", "/usr/lib/rabbitmq/bin"))
DEFAULT_PLUGINS = (
    "rabbitmq_consistent_hash_exchange",
    "rabbitmq_management",
    "rabbitmq_prometheus",
)
# What deploy/local/services.sh gives the shared broker (handlers may hold a delivery long).
BASE_CONFIG = ("consumer_timeout = 86400000", "loopback_users.guest = true")


def require() -> None:
    """Fail, naming what is missing, unless RabbitMQ's own scripts are installed here."""
    for script in ("rabbitmq-server", "rabbitmqctl"):
        assert (RABBITMQ_BIN / script).is_file(), (
            f"{RABBITMQ_BIN / script} is missing: `make services` installs rabbitmq-server"
        )


def _free_ports(count: int) -> list[int]:
    """Distinct free ports (free_port never hands out one twice while it may still be in use)."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        # The kernel's way: held open together so no two are the same.
        probes = [socket.socket() for _ in range(count)]
        try:
            for probe in probes:
                probe.bind(("127.0.0.1", 0))
            return [int(probe.getsockname()[1]) for probe in probes]
        finally:
            for probe in probes:
                probe.close()
    return [free_port() for _ in range(count)]


def _answers_amqp(port: int) -> bool:
    """Whether an AMQP 0-9-1 server greets on ``port`` (a Connection.Start method frame)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=2) as conn:
            conn.settimeout(2)
            conn.sendall(b"AMQP\x00\x00\x09\x01")
            return conn.recv(1) == b"\x01"
    except OSError:
        return False


def short_hostname() -> str:
    return socket.gethostname().split(".")[0]


class RabbitNodeError(RuntimeError):
    """A node that did not start, stop or join as asked; the message carries its log's tail."""


class RabbitNode:
    """One ``rabbitmq-server`` process with a name, ports and directories of its own."""

    def __init__(
        self,
        name: str,
        base_dir: Path,
        *,
        cookie: str | None = None,
        extra_config: Sequence[str] = (),
        plugins: Sequence[str] = DEFAULT_PLUGINS,
        amqp_port: int | None = None,
        management_port: int | None = None,
        prometheus_port: int | None = None,
        dist_port: int | None = None,
    ) -> None:
        self.name = name
        self.node = f"{name}@{short_hostname()}"
        self.dir = base_dir / name
        self.cookie = cookie or secrets.token_hex(20)
        self.plugins = tuple(plugins)
        ports = _free_ports(4)
        self.amqp_port = amqp_port or ports[0]
        self.management_port = management_port or ports[1]
        self.prometheus_port = prometheus_port or ports[2]
        self.dist_port = dist_port or ports[3]
        self.extra_config = list(extra_config)
        self.popen: subprocess.Popen[bytes] | None = None
        self._log: Any = None

    @classmethod
    @contextlib.contextmanager
    def temporary(cls, name: str | None = None, **options: Any) -> Iterator[RabbitNode]:
        """A started node under a fresh temporary directory, killed and removed on exit."""
        base = Path(tempfile.mkdtemp(prefix="yoke-rabbit-"))
        node = cls(name or f"yoke-{secrets.token_hex(3)}", base, **options)
        try:
            node.start()
            yield node
        finally:
            node.kill()
            shutil.rmtree(base, ignore_errors=True)

    # --- where things are --------------------------------------------------------------------

    @property
    def home(self) -> Path:
        return self.dir / "home"

    @property
    def log_dir(self) -> Path:
        return self.dir / "log"

    @property
    def config_file(self) -> Path:
        return self.dir / "rabbitmq.conf"

    @property
    def amqp_url(self) -> str:
        return f"amqp://guest:guest@127.0.0.1:{self.amqp_port}/"

    @property
    def management_url(self) -> str:
        return f"http://127.0.0.1:{self.management_port}"

    def config_lines(self) -> list[str]:
        lines = [
            *BASE_CONFIG,
            f"listeners.tcp.1 = 127.0.0.1:{self.amqp_port}",
            f"log.dir = {self.log_dir}",
            "log.file.level = info",
        ]
        if "rabbitmq_management" in self.plugins:
            lines += [
                f"management.tcp.port = {self.management_port}",
                "management.tcp.ip = 127.0.0.1",
            ]
        if "rabbitmq_prometheus" in self.plugins:
            lines += [
                f"prometheus.tcp.port = {self.prometheus_port}",
                "prometheus.tcp.ip = 127.0.0.1",
            ]
        return [*lines, *self.extra_config]

    def env(self) -> dict[str, str]:
        """The environment of the node and of the CLI calls made for it: nothing from /etc."""
        return {
            **os.environ,
            "HOME": str(self.home),
            "RABBITMQ_NODENAME": self.node,
            "RABBITMQ_DIST_PORT": str(self.dist_port),
            # Erlang distribution on loopback only, like every listener here.
            "RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS": "-kernel inet_dist_use_interface {127,0,0,1}",
            "RABBITMQ_CONFIG_FILE": str(self.config_file),
            "RABBITMQ_ADVANCED_CONFIG_FILE": str(self.dir / "advanced.config"),
            "RABBITMQ_CONF_ENV_FILE": str(self.dir / "rabbitmq-env.conf"),
            "RABBITMQ_ENABLED_PLUGINS_FILE": str(self.dir / "enabled_plugins"),
            "RABBITMQ_MNESIA_BASE": str(self.dir / "mnesia"),
            "RABBITMQ_LOG_BASE": str(self.log_dir),
            "RABBITMQ_PID_FILE": str(self.dir / "rabbitmq.pid"),
            "RABBITMQ_FEATURE_FLAGS_FILE": str(self.dir / "feature_flags"),
        }

    def _prepare(self) -> None:
        for directory in (self.home, self.log_dir, self.dir / "mnesia"):
            directory.mkdir(parents=True, exist_ok=True)
        cookie_file = self.home / ".erlang.cookie"
        if cookie_file.exists():
            cookie_file.chmod(0o600)
        cookie_file.write_text(self.cookie)
        cookie_file.chmod(0o400)
        self.config_file.write_text("\n".join(self.config_lines()) + "\n")
        (self.dir / "rabbitmq-env.conf").write_text("")
        (self.dir / "enabled_plugins").write_text(f"[{','.join(self.plugins)}].\n")

    # --- running -------------------------------------------------------------------------------

    def start(self, timeout: float = 120) -> None:
        """Start the node and return once it has booted (CLI, AMQP and management answer)."""
        if self.running():
            raise RabbitNodeError(f"{self.node} is running already")
        self._prepare()
        self._log = (self.dir / "server.out").open("ab")
        self.popen = subprocess.Popen(
            [str(RABBITMQ_BIN / "rabbitmq-server")],
            env=self.env(),
            cwd=self.dir,
            stdout=self._log,
            stderr=self._log,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # its own process group: kill() reaches beam and its helpers
        )
        self.wait_ready(timeout)

    def running(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def wait_ready(self, timeout: float = 120) -> None:
        """Poll with a deadline until the node serves AMQP (and management when enabled)."""
        deadline = time.monotonic() + timeout
        while not self._ready():
            if not self.running():
                code = self.popen.returncode if self.popen else None
                raise RabbitNodeError(f"{self.node} exited with {code}\n{self.log_tail()}")
            if time.monotonic() > deadline:
                raise RabbitNodeError(f"{self.node} not ready within {timeout}s\n{self.log_tail()}")
            time.sleep(0.25)

    def _ready(self) -> bool:
        if not _answers_amqp(self.amqp_port):
            return False
        if "rabbitmq_management" not in self.plugins:
            return True
        try:
            response = httpx.get(
                f"{self.management_url}/api/overview", auth=("guest", "guest"), timeout=5
            )
            return response.status_code == 200
        except httpx.HTTPError:
            return False

    def ctl(self, *args: str, timeout: float = 120, check: bool = True) -> str:
        """``rabbitmqctl -n <this node> ...`` with this node's cookie; its output."""
        return self._cli("rabbitmqctl", *args, timeout=timeout, check=check)

    def quorum_status(self, vhost: str, queue: str) -> list[dict[str, Any]]:
        """``rabbitmq-queues quorum_status``: one dict per member (``Raft State``, ``Term``,
        ``Log Index``, ``Commit Index``, ...)."""
        out = self._cli(
            "rabbitmq-queues",
            "quorum_status",
            "-p",
            vhost,
            queue,
            "--formatter",
            "json",
            timeout=30,
            check=True,
        )
        members: list[dict[str, Any]] = json.loads(out)
        return members

    def _cli(self, tool: str, *args: str, timeout: float, check: bool) -> str:
        command = [str(RABBITMQ_BIN / tool), "-n", self.node, *args]
        try:
            done = subprocess.run(
                command,
                env=self.env(),
                cwd=self.dir,
                capture_output=True,
                text=True,
                timeout=timeout,
                stdin=subprocess.DEVNULL,
            )
        except subprocess.TimeoutExpired as error:
            raise RabbitNodeError(f"{' '.join(command)} took over {timeout}s") from error
        if check and done.returncode != 0:
            raise RabbitNodeError(
                f"{' '.join(command)} exited with {done.returncode}:\n{done.stdout}{done.stderr}"
            )
        return done.stdout

    def stop(self, timeout: float = 60) -> None:
        """Stop the node cleanly (``rabbitmqctl stop``), killing it if that overruns."""
        if not self.running():
            return
        try:
            self.ctl("stop", timeout=timeout)
            assert self.popen is not None
            self.popen.wait(timeout=timeout)
        except (RabbitNodeError, subprocess.TimeoutExpired):
            self.kill()
        self._close_log()

    def kill(self) -> None:
        """SIGKILL the node's whole process group (beam, erl_child_setup, inet_gethost)."""
        if self.popen is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.popen.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.popen.wait(timeout=30)
        self._close_log()

    def _close_log(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None

    def log_tail(self, chars: int = 4000) -> str:
        """The end of the node's console output and of its log file, for failure messages."""
        parts = []
        for path in [self.dir / "server.out", *sorted(self.log_dir.glob("*.log"))]:
            if path.is_file():
                parts.append(f"--- {path}\n{path.read_text(errors='replace')[-chars:]}")
        return "\n".join(parts)

    # --- management API --------------------------------------------------------------------

    def api(self, method: str, path: str, **kwargs: Any) -> Any:
        """One management API call on this node (JSON answer, or None for an empty one)."""
        response = httpx.request(
            method, f"{self.management_url}{path}", auth=("guest", "guest"), timeout=30, **kwargs
        )
        response.raise_for_status()
        return response.json() if response.content else None

    def __enter__(self) -> RabbitNode:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.kill()


class RabbitCluster:
    """Several ``RabbitNode``s sharing one cookie, joined to the first with ``join_cluster``."""

    def __init__(self, base_dir: Path, size: int = 3, prefix: str | None = None, **options: Any):
        prefix = prefix or f"yoke-{secrets.token_hex(3)}"
        cookie = options.pop("cookie", None) or secrets.token_hex(20)
        self.nodes = [
            RabbitNode(f"{prefix}-{index}", base_dir, cookie=cookie, **options)
            for index in range(size)
        ]

    @classmethod
    @contextlib.contextmanager
    def temporary(cls, size: int = 3, **options: Any) -> Iterator[RabbitCluster]:
        """A started, joined cluster under a fresh temporary directory, killed on exit."""
        base = Path(tempfile.mkdtemp(prefix="yoke-rabbit-cluster-"))
        cluster = cls(base, size, **options)
        try:
            cluster.start()
            yield cluster
        finally:
            cluster.kill()
            shutil.rmtree(base, ignore_errors=True)

    @property
    def amqp_urls(self) -> list[str]:
        return [node.amqp_url for node in self.nodes]

    def start(self, timeout: float = 180) -> None:
        """Start every node (all at once: boot is the slow part), then join each to the first."""
        deadline = time.monotonic() + timeout
        for node in self.nodes:
            node._prepare()
        for node in self.nodes:  # start all, then wait: boots overlap
            node._log = (node.dir / "server.out").open("ab")
            node.popen = subprocess.Popen(
                [str(RABBITMQ_BIN / "rabbitmq-server")],
                env=node.env(),
                cwd=node.dir,
                stdout=node._log,
                stderr=node._log,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        for node in self.nodes:
            node.wait_ready(max(deadline - time.monotonic(), 1))
        first = self.nodes[0]
        for node in self.nodes[1:]:
            node.ctl("stop_app")
            node.ctl("join_cluster", first.node)
            node.ctl("start_app")
            node.wait_ready(max(deadline - time.monotonic(), 1))
        self.wait_members(len(self.nodes), timeout=max(deadline - time.monotonic(), 1))

    def running_members(self, via: RabbitNode | None = None) -> set[str]:
        """Node names the cluster reports running (asked of ``via``, or the first running node)."""
        asking = via or next(node for node in self.nodes if node.running())
        return {entry["name"] for entry in asking.api("GET", "/api/nodes") if entry.get("running")}

    def wait_members(self, count: int, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                members = self.running_members()
                if len(members) == count:
                    return
            except (httpx.HTTPError, StopIteration):
                members = set()
            if time.monotonic() > deadline:
                raise RabbitNodeError(f"cluster has {sorted(members)} running, not {count} nodes")
            time.sleep(0.5)

    def kill(self) -> None:
        for node in self.nodes:
            node.kill()

    def __enter__(self) -> RabbitCluster:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.kill()

"""The five services as real processes against a test vhost and database."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path

from tests.support import faults
from tests.support.processes import ServiceProcess, eventually
from yoke.cli.supervisor import SERVICES
from yoke.client import Client
from yoke.core.models import Message
from yoke.runtime.joins import Join
from yoke.store.database import Store

# new_join(forum_id=None, name="echo", **join options) -> (forum id, join)
JoinFactory = Callable[..., Awaitable[tuple[str, Join]]]
# Per service started another way: the arguments to python (a test-support wrapper, say) and
# extra environment.
Launch = dict[str, tuple[list[str], dict[str, str]]]
START_SECONDS = 120.0  # the most a service may take to become healthy on a loaded machine


def service_env(amqp_url: str, mongodb_url: str) -> dict[str, str]:
    """What every service a test starts runs with: its servers, two shards, quick retries."""
    return {
        "YOKE_AMQP_URL": amqp_url,
        "YOKE_MONGODB_URL": mongodb_url,
        "YOKE_SHARDS": "2",
        "YOKE_RETRY_BACKOFF_SECONDS": "0.05",
    }


class Mesh:
    def __init__(
        self,
        amqp_url: str,
        mongodb_url: str,
        log_dir: Path,
        env: dict[str, str] | None = None,
        *,
        launch: Launch | None = None,
    ) -> None:
        self.env = {**(env or {}), **service_env(amqp_url, mongodb_url)}
        self.log_dir = log_dir
        self.launch = launch or {}
        self.processes: dict[str, ServiceProcess] = {}
        # The services a test killed for good: their exit code is no clean shutdown's.
        self.killed: set[str] = set()

    def start(self, name: str) -> ServiceProcess:
        args, env = self.launch.get(name, (["-m", f"services.{name}"], {}))
        log_path = self.log_dir / f"{name}.log"
        process = ServiceProcess(args, {**self.env, **env}, log_path)
        self.processes[name] = process
        return process

    async def start_all(self) -> None:
        for name in SERVICES:
            self.start(name)
        try:
            for process in self.processes.values():
                await process.wait_healthy(timeout=START_SECONDS)
        except BaseException:
            # Nothing stops a mesh whose start failed: left running, its processes would
            # outlive the test (and its vhost) and load everything after it.
            for process in self.processes.values():
                process.kill()
            raise

    def start_faulty(self, name: str, point: str) -> ServiceProcess:
        """Stop ``name`` cleanly and start it again under ``tests.support.faults`` with the fault
        ``point`` (``faults.fault("after", function)``, say): it dies there the first time."""
        faults.resolve(point)  # a spec that names nothing fails here, not in the child
        assert self.processes[name].stop() == 0
        process = ServiceProcess(
            ["-m", "tests.support.faults", f"services.{name}"],
            {**self.env, faults.VARIABLE: point},
            self.log_dir / f"{name}-{point.replace(':', '_')}.log",
        )
        self.processes[name] = process
        return process

    async def restart(self, name: str) -> ServiceProcess:
        self.processes[name].kill()
        process = self.start(name)
        await process.wait_healthy()
        return process

    def stop_all(self) -> dict[str, int]:
        return {name: process.stop() for name, process in self.processes.items()}


@asynccontextmanager
async def running_mesh(
    amqp_url: str,
    mongodb_url: str,
    log_dir: Path,
    env: dict[str, str] | None = None,
    *,
    launch: Launch | None = None,
) -> AsyncIterator[Mesh]:
    """The five services, healthy; after, each but those in ``mesh.killed`` must have shut
    down cleanly on SIGTERM."""
    mesh = Mesh(amqp_url, mongodb_url, log_dir, env, launch=launch)
    await mesh.start_all()
    yield mesh
    codes = mesh.stop_all()
    assert all(code == 0 for name, code in codes.items() if name not in mesh.killed), codes


async def say(client: Client, forum_id: str, text: str, who: str = "alice") -> str:
    reply = await client.submit(forum_id, text, external_id=f"test:{who}", display_name=who)
    assert reply.status == "accepted", reply.error
    assert reply.message_id
    return reply.message_id


async def lines_until(
    store: Store, conversation_id: str, done: Callable[[list[Message]], bool], timeout: float = 30
) -> list[Message]:
    found: list[Message] = []

    async def check() -> bool:
        nonlocal found
        found = await store.history(conversation_id)
        return done(found)

    try:
        await eventually(check, timeout=timeout, what=f"lines in {conversation_id}")
    except AssertionError as error:
        shown = "\n".join(
            f"  {m.seq} {m.role}/{m.type} {m.author_actor_id[:8]} {m.text[:60]!r}"
            f" inReplyTo={m.meta.in_reply_to}"
            for m in found[-40:]
        )
        raise AssertionError(f"{error}; the last lines were:\n{shown}") from None
    return found


def agent_lines(lines: list[Message]) -> list[Message]:
    return [line for line in lines if line.role == "agent"]

"""The mesh's processes keep their memory from the programs they start (yoke.core.hardening).

A stdio MCP server is the processor's child. When the mesh runs as a user other than root (as
in compose), the server is that user too, and only the mark ``prctl(PR_SET_DUMPABLE, 0)`` keeps
it out of ``/proc/<processor>/environ``, ``mem`` and the supervisor's: the first test checks
that on this kernel, as ``nobody``; the second that ``yoke up`` and what it starts (a service
and the HTTP gateway) carry the mark. (Running as root, servers run as another user:
tests/deploy/test_secrets.py.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.broker import fresh_vhost
from tests.support.processes import ROOT, eventually, free_port
from tests.support.unprivileged import hides_its_memory, python_for, readable_copies

HARDENING = ROOT / "shared/yoke/core/hardening.py"
SECRET = f"hunter{uuid.uuid4().hex[:8]}"
# Run as nobody: marks itself (or not) and has a child read its parent's environ and memory.
# hardening.py is loaded from the path in argv[2]: a copy nobody can read (readable_copies), as
# the checkout may be somewhere nobody cannot enter.
PARENT = f"""
import importlib.util, json, subprocess, sys
spec = importlib.util.spec_from_file_location("hardening", sys.argv[2])
hardening = importlib.util.module_from_spec(spec)
spec.loader.exec_module(hardening)
if sys.argv[1] == "marked":
    assert hardening.make_undumpable() and not hardening.is_dumpable()
child = '''
import json, os
found = {{}}
for name in ("environ", "maps"):
    try:
        found[name] = {SECRET!r} in open(f"/proc/{{os.getppid()}}/" + name).read()
    except OSError as error:
        found[name] = type(error).__name__
print(json.dumps(found))
'''
print(subprocess.run([sys.executable, "-c", child], capture_output=True, text=True).stdout)
"""


def read_by_own_child(marked: bool) -> dict[str, object]:
    """What a child of a process holding SECRET, of the same user, reads of its parent: run as
    ``nobody`` when the suite is root (root reads any process), else as the suite's user."""
    env = {"SECRET": SECRET, "PATH": "/usr/bin:/bin"}
    with readable_copies(HARDENING) as copies:
        argv = ["-c", PARENT, "marked" if marked else "plain", str(copies[HARDENING])]
        if os.geteuid() == 0:
            python = python_for("nobody")
            assert python is not None, "no Python 3.11+ that nobody can run (docs/security.md)"
            done = subprocess.run(
                [python, *argv],
                user="nobody",
                group=65534,
                extra_groups=[],
                cwd="/",
                env=env,
                capture_output=True,
                text=True,
                timeout=60,
            )
        else:
            done = subprocess.run(
                [sys.executable, *argv], env=env, capture_output=True, text=True, timeout=60
            )
    assert done.returncode == 0, done.stderr
    found: dict[str, object] = json.loads(done.stdout)
    return found


def test_a_marked_process_hides_its_environ_and_memory_from_a_child_of_its_own_user() -> None:
    assert read_by_own_child(marked=False) == {"environ": True, "maps": False}  # readable
    refused = "PermissionError"
    assert read_by_own_child(marked=True) == {"environ": refused, "maps": refused}


def children_of(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(stat.parent.name))
        except (OSError, ValueError, IndexError):
            continue
    return found


@pytest.fixture
def vhost_url(servers: tuple[str, str, str]) -> Iterator[str]:
    with fresh_vhost(servers[0], servers[2], f"yoke-test-{uuid.uuid4().hex[:12]}") as url:
        yield url


async def test_yoke_up_and_the_services_it_starts_are_marked(
    vhost_url: str, module_mongodb_url: str
) -> None:
    """The supervisor, ingestion (as every ``run_service``) and the gateway, started with a
    group other than root's so that root can tell a marked process (its /proc files root's)."""
    env = {
        **os.environ,
        "YOKE_AMQP_URL": vhost_url,
        "YOKE_MONGODB_URL": module_mongodb_url,
        "YOKE_METRICS_PORT": str(free_port()),
        "YOKE_GATEWAY_PORT": str(free_port()),
    }
    script = (
        "import asyncio; from yoke.cli import supervisor; "
        "asyncio.run(supervisor.run(names=('ingestion', 'gateway')))"
    )
    kept = {"group": 65534, "extra_groups": []} if os.geteuid() == 0 else {}
    up = subprocess.Popen(
        [sys.executable, "-c", script], env=env, cwd=ROOT, stdout=subprocess.DEVNULL, **kept
    )
    try:
        processes: list[int] = []

        async def all_marked() -> bool:
            assert up.poll() is None, f"yoke up exited with {up.returncode}"
            processes[:] = [up.pid, *children_of(up.pid)]
            return len(processes) == 3 and all(hides_its_memory(pid) for pid in processes)

        await eventually(all_marked, timeout=60, what="yoke up and its children to be marked")
    finally:
        up.terminate()
        try:
            up.wait(40)
        except subprocess.TimeoutExpired:
            up.kill()
            up.wait(10)

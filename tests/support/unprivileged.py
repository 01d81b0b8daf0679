"""What the unprivileged user that stdio MCP servers run as (when the mesh is root) can run.

Tests run as root, and a test machine's interpreter may live where ``nobody`` cannot reach it
(``/root/.pyenv``, mode 0700): a server started with ``sys.executable`` could not start as
``nobody``. :func:`python_for` finds an interpreter that user can run (the test's own, else a
``python3`` on the usual paths), and conftest keeps stdio servers as root
(``YOKE_MCP_STDIO_USER=root``) only for a suite whose interpreter ``nobody`` cannot run.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from yoke.tools.stdio_user import DEFAULT_USER


def runs_as(user: str, argv: list[str]) -> bool:
    """Whether ``argv`` runs to a clean exit as ``user`` (no groups besides its own)."""
    try:
        account = pwd.getpwnam(user)
    except KeyError:
        return False
    try:
        done = subprocess.run(
            argv,
            user=account.pw_uid,
            group=account.pw_gid,
            extra_groups=[],
            cwd="/",
            env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")},
            capture_output=True,
            timeout=60,
        )
    except (OSError, subprocess.SubprocessError):
        return False
    return done.returncode == 0


def python_for(user: str = DEFAULT_USER) -> str | None:
    """A Python 3.11+ interpreter ``user`` can run, or None."""
    candidates = [sys.executable, shutil.which("python3"), "/usr/bin/python3"]
    for python in dict.fromkeys(c for c in candidates if c):
        if runs_as(user, [python, "-c", "import sys; sys.exit(sys.version_info < (3, 11))"]):
            return python
    return None


def stdio_servers_need_root() -> bool:
    """Running as root, with an interpreter the default stdio user cannot run."""
    return os.geteuid() == 0 and python_for() != sys.executable


def hides_its_memory(pid: int) -> bool:
    """Whether process ``pid`` is marked not dumpable (yoke.core.hardening), so that no process of
    its user without CAP_SYS_PTRACE reads its ``/proc/<pid>/environ``, ``mem``...

    Root's processes are read by root whatever the mark, so it is read from the owner the
    kernel gives those files: a marked process's are root's, group included, while an unmarked
    one's carry its own group (start it with a group other than root's to tell).
    """
    environ = Path(f"/proc/{pid}/environ")
    if os.geteuid() != 0:
        try:
            environ.read_bytes()
        except PermissionError:
            return True
        return False
    return environ.stat().st_gid == 0


@contextlib.contextmanager
def readable_copies(*files: Path) -> Iterator[dict[Path, Path]]:
    """Copies of ``files`` in a temporary directory every user may enter and read (each
    file's copy by its original), removed after: what the unprivileged user must run from a
    checkout it cannot reach (a clone under a mode-0700 directory, as root's home or
    ``mktemp -d`` makes)."""
    folder = Path(tempfile.mkdtemp(prefix="yoke-readable-"))
    try:
        folder.chmod(0o755)
        copies = {}
        for original in files:
            copy = folder / original.name
            shutil.copyfile(original, copy)
            copy.chmod(0o644)
            copies[original] = copy
        yield copies
    finally:
        shutil.rmtree(folder, ignore_errors=True)

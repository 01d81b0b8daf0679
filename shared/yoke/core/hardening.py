"""Keep a process's secrets out of reach of the programs it starts (docs/security.md).

A stdio MCP server is a child of the processor and, unless the processor runs as root (then
:mod:`yoke.tools.stdio_user` starts it as an unprivileged user), runs as the same user: the
kernel would let it read ``/proc/<processor>/environ`` (the broker's and the store's URLs with
their passwords, ``OPENAI_API_KEY``), ``mem``, ``maps`` and the supervisor's as well. A process
marked not dumpable (``prctl(PR_SET_DUMPABLE, 0)``) has those files owned by root and refused
to any other process without ``CAP_SYS_PTRACE``, ptrace included; the mark is per process (an
``execve`` clears it, so the children the mesh starts are not marked, and need not be).
"""

from __future__ import annotations

import ctypes
import logging
import sys

log = logging.getLogger(__name__)

PR_SET_DUMPABLE = 4
PR_GET_DUMPABLE = 3


def _prctl(option: int, value: int = 0) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    result = int(libc.prctl(option, value, 0, 0, 0))
    if result < 0:
        raise OSError(ctypes.get_errno(), f"prctl({option}) failed")
    return result


def make_undumpable() -> bool:
    """Mark this process not dumpable (Linux); False where there is no such thing."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        _prctl(PR_SET_DUMPABLE, 0)
    except (OSError, AttributeError) as error:
        log.warning("could not keep this process's memory private: %s", error)
        return False
    return True


def is_dumpable() -> bool:
    """Whether this process may be read by its user's other processes (True off Linux)."""
    if not sys.platform.startswith("linux"):
        return True
    return _prctl(PR_GET_DUMPABLE) != 0

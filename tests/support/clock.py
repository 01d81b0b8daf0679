"""A wall clock the tests control in real processes: run a child under Debian's libfaketime.

``shifted_env("+3d")`` is the environment that makes a child (a service, a script) see the
wall clock three days ahead (``time.time``, ``datetime.now``, everything that reads
CLOCK_REALTIME), or starting at a given instant (``"@2026-03-29 00:59:50"``, then ticking on);
the monotonic clock is left alone, so timeouts, asyncio and heartbeats behave as usual. What
the child stores and compares is in its shifted time; the servers (RabbitMQ, the database)
and this process keep the real one.

``make services`` installs the library (``deploy/local/services.sh``).
"""

from __future__ import annotations

import glob
import os
import re
from pathlib import Path

# Debian's multiarch directory first, then the upstream Makefile's defaults.
LIBRARY_PATTERNS = (
    "/usr/lib/*-linux-gnu/faketime/libfaketime.so.1",
    "/usr/lib/faketime/libfaketime.so.1",
    "/usr/local/lib/faketime/libfaketime.so.1",
)
# What libfaketime takes for FAKETIME: an offset (+3d, -90m, +30s) or a start instant. An
# unparsable spec is not refused by the library, it is silently misread, so it is refused here.
OFFSET = re.compile(r"[+-]\d+(?:\.\d+)?[smhdy]?")
START = re.compile(r"@\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2}")


class FaketimeMissing(RuntimeError):
    pass


def libfaketime() -> Path:
    """The preload library; FaketimeMissing saying how to get it when it is not installed."""
    for pattern in LIBRARY_PATTERNS:
        for found in sorted(glob.glob(pattern)):
            return Path(found)
    raise FaketimeMissing(
        "libfaketime is not installed (looked for "
        + ", ".join(LIBRARY_PATTERNS)
        + "): run 'make services' (as root on Debian it installs it) or "
        "'apt-get install libfaketime'"
    )


def shifted_env(offset: str, *, zone: str = "UTC") -> dict[str, str]:
    """The environment that runs a child with its wall clock at ``offset``: ``+3d``, ``-2h``,
    ``+90s``, or ``@YYYY-MM-DD HH:MM:SS`` (then ticking on), a local time in ``zone``, the
    child's TZ (libfaketime reads it with mktime). Merge it over the child's environment; an
    LD_PRELOAD this process already has is kept after the library."""
    if not (OFFSET.fullmatch(offset) or START.fullmatch(offset)):
        raise ValueError(
            f"not a libfaketime offset or start: {offset!r} (like '+3d' or '@2026-03-29 00:59:50')"
        )
    preload = [str(libfaketime())]
    if os.environ.get("LD_PRELOAD"):
        preload.append(os.environ["LD_PRELOAD"])
    return {
        "LD_PRELOAD": " ".join(preload),
        "FAKETIME": offset,
        # Monotonic time stays real: asyncio, timeouts and heartbeats do not jump. (0.9.10 reads
        # the first name; later releases the second.)
        "DONT_FAKE_MONOTONIC": "1",
        "FAKETIME_DONT_FAKE_MONOTONIC": "1",
        # A start instant is where the child's clock starts, not each of its own children's.
        "FAKETIME_DONT_RESET": "1",
        # The zone a start instant is read in, whatever the machine's.
        "TZ": zone,
    }

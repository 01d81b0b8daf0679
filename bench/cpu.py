"""CPU time from ``/proc``: on a small machine the servers share cores with the bench, so CPU
per event (ours, the relay's, RabbitMQ's, the store's) says where a hop's time goes.

Linux only; elsewhere every reading is NaN and the figures are simply left out.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100

# Server processes worth attributing, by their ``comm`` name.
SERVERS = {"beam.smp": "rabbitmq", "ferretdb": "ferretdb", "postgres": "postgres"}


def process_cpu(pid: int) -> float:
    """User + system CPU seconds of ``pid`` and of its children it has reaped, so far (NaN when
    unreadable): PostgreSQL's backends exit between two readings, and what they spent stays
    counted in the postmaster's cutime/cstime (a sum of the living alone went negative)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return math.nan
    # The command name is parenthesised and may hold spaces: split after its closing paren.
    fields = stat[stat.rindex(")") + 2 :].split()
    return sum(int(field) for field in fields[11:15]) / TICKS


def servers_cpu() -> dict[str, float]:
    """CPU seconds so far of the local RabbitMQ, FerretDB and PostgreSQL processes, by server."""
    totals: dict[str, float] = {}
    proc = Path("/proc")
    if not proc.is_dir():
        return totals
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            name = (entry / "comm").read_text().strip()
        except OSError:
            continue
        server = SERVERS.get(name)
        if server is not None:
            seconds = process_cpu(int(entry.name))
            if not math.isnan(seconds):
                totals[server] = totals.get(server, 0.0) + seconds
    return totals


def servers_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {name: after[name] - before.get(name, 0.0) for name in after}

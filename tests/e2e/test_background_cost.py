"""What an idle mesh asks of the store (docs/architecture.md, invariant 11): the beats and reads
hand-over and the outbox need, at the rate they need them, not a few operations a second per
process for nothing.

Counted from each service's own ``/metrics`` (pymongo command monitoring by origin: a replica's
rounds are ``ownership``, a writer's heartbeat and dead-writer sweep ``outbox``), over a window
in which nothing is posted.
"""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.mesh import Mesh

pytestmark = pytest.mark.slow

# Idle seconds measured: a few rounds of the slowest background period (the outbox's sweep).
WINDOW_SECONDS = 10.0
# Per service and second. At a beat a second they were 2 (a beat and a live-set read) and 1.5
# (a heartbeat, and the writers read every other second); at a round every 2 s, a heartbeat every
# 2 s and the writers read every 4 s they are 1 and 0.75 (the bounds allow a round more).
MAX_PER_SECOND = {"ownership": 1.25, "outbox": 0.95}


async def _background(mesh: Mesh) -> Counter[tuple[str, str]]:
    """Store operations not made while handling a delivery, per (service, origin)."""
    counts: Counter[tuple[str, str]] = Counter()
    for name, process in mesh.processes.items():
        for family in text_string_to_metric_families(await process.metrics()):
            for sample in family.samples:
                origin = sample.labels.get("origin")
                if sample.name == "yoke_store_operations_total" and origin != "delivery":
                    counts[(name, str(origin))] += int(sample.value)
    return counts


async def test_an_idle_mesh_beats_at_the_rate_hand_over_needs(mesh: Mesh) -> None:
    before = await _background(mesh)
    started = asyncio.get_running_loop().time()
    await asyncio.sleep(WINDOW_SECONDS)  # the measure is of time passing with nothing to do
    after = await _background(mesh)
    seconds = asyncio.get_running_loop().time() - started
    rates = {key: value / seconds for key, value in (after - before).items()}
    shown = ", ".join(
        f"{name}/{origin}={rate:.2f}" for (name, origin), rate in sorted(rates.items())
    )
    print(f"idle background store operations per second: {shown}")
    for name in mesh.processes:
        for origin, most in MAX_PER_SECOND.items():
            rate = rates.get((name, origin), 0.0)
            # Beats there must be (others would take this replica for gone, its writes for a
            # dead writer's), but no more of them than hand-over and the outbox need.
            assert 0 < rate <= most, (name, origin, shown)

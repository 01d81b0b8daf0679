"""Store operations and deliveries per turn, from each service's own ``/metrics``: the counts
tests/e2e/test_turn_cost.py pins for one echo turn, here over a whole phase (one GET per service
before and after it, so counting costs the run nothing it measures).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

# Outcomes of a delivery that count as one handled (a retried one counts once, when it ends).
HANDLED = ("ok", "dead_lettered")


def parse_counts(service: str, text: str) -> Counter[str]:
    """``ops:<service>`` (store operations while handling a delivery), ``background:<service>``
    (the rest) and ``deliveries:<service>`` from one /metrics text."""
    counts: Counter[str] = Counter()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = sample.labels
            if sample.name == "yoke_store_operations_total":
                kind = "ops" if labels.get("origin") == "delivery" else "background"
                counts[f"{kind}:{service}"] += int(sample.value)
            elif sample.name == "yoke_events_handled_total" and labels.get("outcome") in HANDLED:
                counts[f"deliveries:{service}"] += int(sample.value)
    return counts


async def read_counts(ports: Iterable[tuple[str, int]]) -> Counter[str]:
    """The counts of every (service, metrics port) that answers (one that does not adds none)."""
    counts: Counter[str] = Counter()
    async with httpx.AsyncClient(timeout=5) as client:
        for service, port in ports:
            try:
                response = await client.get(f"http://127.0.0.1:{port}/metrics")
            except httpx.HTTPError:
                continue
            counts += parse_counts(service, response.text)
    return counts


def per_turn(before: Counter[str], after: Counter[str], turns: int) -> dict[str, Any]:
    """Store operations and deliveries per turn, in all and by service."""
    delta = after - before
    turns = max(turns, 1)

    def by_service(kind: str) -> dict[str, float]:
        return {
            key.split(":", 1)[1]: round(value / turns, 2)
            for key, value in sorted(delta.items())
            if key.startswith(f"{kind}:")
        }

    operations, deliveries = by_service("ops"), by_service("deliveries")
    return {
        "storeOperations": round(sum(operations.values()), 2),
        "deliveries": round(sum(deliveries.values()), 2),
        "storeOperationsByService": operations,
        "deliveriesByService": deliveries,
        # Beats, live-set reads, sweeps: the phase's clock, not its turns.
        "backgroundStoreOperations": round(sum(by_service("background").values()), 2),
    }

"""Shard assignment (pure logic): bounded, complete, the same everywhere, and moving little."""

from __future__ import annotations

import asyncio
import math
import random

from prometheus_client import REGISTRY

from yoke.coordination.ownership import Ownership, assign


def _owners(assignment: dict[str, list[int]]) -> dict[int, str]:
    return {shard: replica for replica, shards in assignment.items() for shard in shards}


def _moved(before: dict[int, str], after: dict[int, str]) -> int:
    return sum(1 for shard, owner in before.items() if after[shard] != owner)


def test_every_shard_has_one_owner_and_nobody_more_than_a_fair_share() -> None:
    rng = random.Random(7)
    for _ in range(200):
        shards = rng.choice([1, 2, 5, 16, 32, 64])
        replicas = [f"r{rng.random()}" for _ in range(rng.randint(1, 8))]
        assignment = assign("processor", shards, replicas)
        owners = _owners(assignment)
        assert sorted(owners) == list(range(shards))
        assert sum(len(s) for s in assignment.values()) == shards  # none owned twice
        cap = math.ceil(shards / len(replicas))
        assert all(len(s) <= cap for s in assignment.values()), assignment


def test_sixteen_shards_over_three_replicas_are_five_or_six_each() -> None:
    for seed in range(50):
        replicas = [f"replica-{seed}-{n}" for n in range(3)]
        sizes = sorted(len(s) for s in assign("processor", 16, replicas).values())
        assert sizes == [5, 5, 6], sizes


def test_the_assignment_is_a_function_of_the_set_alone() -> None:
    replicas = ["c", "a", "b"]
    assert assign("processor", 16, replicas) == assign("processor", 16, ["b", "c", "a", "a"])
    # and of the service: two services' shards are spread independently
    assert assign("processor", 16, replicas) != assign("ingestion", 16, replicas)


def test_a_change_moves_about_only_the_shards_that_must_move() -> None:
    """A replica leaving: its shards move, and on average under one more per change; one
    joining: the shards it takes, and about one more. (Plain rendezvous hashing moves none
    more, but cannot bound the load.)"""
    rng = random.Random(11)
    extra_on_leave = extra_on_join = 0
    trials = 300
    for trial in range(trials):
        replicas = [f"t{trial}-{n}-{rng.random()}" for n in range(rng.randint(2, 6))]
        before = _owners(assign("processor", 16, replicas))
        gone = rng.choice(replicas)
        after = _owners(assign("processor", 16, [r for r in replicas if r != gone]))
        must = sum(1 for owner in before.values() if owner == gone)
        extra_on_leave += _moved(before, after) - must
        joined = _owners(assign("processor", 16, [*replicas, "newcomer"]))
        must = sum(1 for owner in joined.values() if owner == "newcomer")
        extra_on_join += _moved(before, joined) - must
    assert extra_on_leave / trials < 1.5, extra_on_leave / trials
    assert extra_on_join / trials < 1.5, extra_on_join / trials


async def test_hand_over_counters_start_at_zero_in_both_directions() -> None:
    """A series born at its first value shows no rate in Prometheus: the first hand-overs of a
    replica would be missing from the dashboard's "Shard hand-overs" panel."""
    Ownership(
        "ownership-metrics-test",
        [],
        bus=None,  # type: ignore[arg-type]  # not used before start(); only the metrics matter
        replicas=None,
        consumer=None,  # type: ignore[arg-type]
        prefetch=1,
        lock=asyncio.Lock(),
    )
    for direction in ("gained", "released"):
        labels = {"service": "ownership-metrics-test", "direction": direction}
        assert REGISTRY.get_sample_value("yoke_shard_handovers_total", labels) == 0.0, direction

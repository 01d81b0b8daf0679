"""Two egress replicas share egress's shards, and a join's replies still reach its forum in the
order the agent wrote them across compactions: the old and the new monologue of a join may
hash to shards of different replicas, and the one that owns the new monologue forwards the
old one's unforwarded tail (read from the store) before the new one's first reply.

One replica forwards every line 0.3 s late (``tests.support.slow_egress``), so that a tail
left on it is still in flight when the other receives the new monologue's first reply.
"""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.mesh import JoinFactory, Launch, Mesh, say
from tests.support.processes import ServiceProcess, eventually
from yoke.client import Client
from yoke.store.database import Store

pytestmark = pytest.mark.slow

FORUMS = 8
LINES = 40


@pytest.fixture(scope="module")
def mesh_launch() -> Launch:
    """How the second egress replica starts (the mesh starts only the five services)."""
    return {
        "egress-slow": (
            ["-m", "tests.support.slow_egress"],
            {"YOKE_REPLICA": "1", "YOKE_TEST_EGRESS_DELAY": "0.3"},
        )
    }


@pytest.fixture(scope="module")
async def mesh(mesh: Mesh) -> Mesh:
    """The five services and a second, slow egress replica, each owning one of two shards."""
    await mesh.start("egress-slow").wait_healthy()
    egresses = [mesh.processes["egress"], mesh.processes["egress-slow"]]

    async def one_shard_each() -> bool:
        return [await _shards_owned(p) for p in egresses] == [1, 1]

    await eventually(one_shard_each, timeout=30, what="each egress replica owning a shard")
    return mesh


async def _shards_owned(process: ServiceProcess) -> float:
    for family in text_string_to_metric_families(await process.metrics()):
        for sample in family.samples:
            if sample.name == "yoke_shards_owned":
                return sample.value
    return 0.0


async def _talk(client: Client, store: Store, forum_id: str) -> None:
    """LINES lines said one after another without waiting, then all their answers."""
    for index in range(LINES):
        await say(client, forum_id, f"line {index:03d}")

    async def answered() -> bool:
        found = await store.messages.count_documents({"conversationId": forum_id, "role": "agent"})
        return found >= LINES

    await eventually(answered, timeout=120, what=f"{LINES} answers in {forum_id}")


async def test_replies_keep_their_order_across_compactions_split_over_replicas(
    mesh: Mesh, store: Store, client: Client, new_join: JoinFactory
) -> None:
    joins = [
        await new_join(compaction_threshold_tokens=120, compaction_keep=4) for _ in range(FORUMS)
    ]
    await asyncio.gather(*(_talk(client, store, forum_id) for forum_id, _ in joins))
    await asyncio.sleep(1)  # a quiet period: a line forwarded twice would show up here

    compactions = crossed = 0
    for forum_id, join in joins:
        lines = await store.history(forum_id)
        replies = [line for line in lines if line.role == "agent"]
        humans = [line for line in lines if line.role == "user"]
        assert [r.text for r in replies] == [h.text for h in humans], forum_id
        assert [r.meta.in_reply_to for r in replies] == [h.id for h in humans], forum_id
        participant = await store.get_participant(join.forum_participant_id)
        assert participant is not None
        compactions += len(participant.metadata.get("compactions") or [])  # type: ignore[arg-type]
        writers = await store.messages.distinct(
            "writer", {"conversationId": forum_id, "role": "agent"}
        )
        crossed += len(writers) > 1
    print(f"{compactions} compactions over {FORUMS} forums; {crossed} forums forwarded by both")
    assert compactions >= FORUMS, "too few compactions to say anything"
    # Both replicas forwarded lines of one forum: some compaction moved a join across them.
    assert crossed >= 1

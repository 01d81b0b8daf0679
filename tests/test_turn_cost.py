"""What one turn costs (docs/architecture.md, invariant 11): store operations, deliveries, and rows
read.

A turn is one person's line in a forum with one echo agent, through the five real services, up
to the agent's answer in the forum and the deliveries that follow it. Counted from each
service's own ``/metrics`` (pymongo command monitoring, deliveries handled) and from
PostgreSQL's table statistics behind FerretDB (what FerretDB reads that pymongo cannot see).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import time
from collections import Counter

import pytest
from prometheus_client.parser import text_string_to_metric_families
from pymongo import ASCENDING

from tests.support.mesh import Mesh, say
from tests.support.processes import eventually
from yoke.client import Client
from yoke.ids import derive_id
from yoke.models import Message, TextPart
from yoke.runtime.joins import create_agent, create_forum, join_conversation, join_id
from yoke.runtime.posting import Poster
from yoke.store import Store

pytestmark = pytest.mark.slow

MAX_STORE_OPERATIONS = 15
MAX_DELIVERIES = 8


async def _counts(mesh: Mesh) -> Counter[str]:
    """Store operations while handling deliveries, and deliveries handled, per service."""
    counts: Counter[str] = Counter()
    for name, process in mesh.processes.items():
        text = await process.metrics()
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                labels = sample.labels
                if sample.name == "yoke_store_operations_total":
                    if labels.get("origin") == "delivery":
                        counts[f"ops:{name}:{labels['command']}"] += int(sample.value)
                elif sample.name == "yoke_events_handled_total" and labels.get("outcome") in (
                    "ok",
                    "dead_lettered",
                ):
                    counts[f"deliveries:{name}"] += int(sample.value)
    return counts


async def _settled(mesh: Mesh) -> Counter[str]:
    """The counts once nothing has moved for a second (the turn's tail deliveries are done)."""
    last = await _counts(mesh)
    quiet_since = asyncio.get_running_loop().time()
    while asyncio.get_running_loop().time() - quiet_since < 1.0:
        await asyncio.sleep(0.25)
        now = await _counts(mesh)
        if now != last:
            last, quiet_since = now, asyncio.get_running_loop().time()
    return last


def _total(counts: Counter[str], prefix: str) -> int:
    return sum(value for key, value in counts.items() if key.startswith(prefix))


def _reply_id(agent_id: str, forum_id: str, line_id: str) -> str:
    """The id the echo agent's forum answer to ``line_id`` gets (every effect's id is derived)."""
    key = join_id(agent_id, forum_id)
    copy = derive_id("copy", derive_id("monologue", key), line_id)
    return derive_id("egress", derive_id("output", key, copy))


async def _turn(client: Client, store: Store, forum_id: str, agent_id: str, text: str) -> None:
    """One line and its answer, polled by the answer's id (a look at the whole forum would
    count in the rows read)."""
    line = await say(client, forum_id, text)
    reply = _reply_id(agent_id, forum_id, line)

    async def answered() -> bool:
        return await store.messages.find_one({"_id": reply}, {"_id": 1}) is not None

    await eventually(answered, timeout=60, what=f"the answer to {text!r}", interval=0.05)


async def test_a_turn_costs_a_handful_of_store_operations_and_deliveries(
    mesh: Mesh, store: Store, poster: Poster, client: Client
) -> None:
    forum = await create_forum(store, "cost")
    agent = await create_agent(store, "echo")
    await join_conversation(store, poster, agent.id, forum.id)
    for warm in range(3):  # caches warm, shadow actors and participants made
        await _turn(client, store, forum.id, agent.id, f"warm {warm}")
    before = await _settled(mesh)
    await _turn(client, store, forum.id, agent.id, "what does a turn cost?")
    after = await _settled(mesh)
    delta = after - before
    breakdown = ", ".join(f"{key}={value}" for key, value in sorted(delta.items()))
    operations, deliveries = _total(delta, "ops:"), _total(delta, "deliveries:")
    print(f"one turn: {operations} store operations, {deliveries} deliveries ({breakdown})")
    assert operations <= MAX_STORE_OPERATIONS, breakdown
    assert deliveries <= MAX_DELIVERIES, breakdown


# --- rows PostgreSQL reads for a turn, at two forum lengths --------------------------------


def _psql(sql: str) -> str:
    return subprocess.run(
        ["su", "postgres", "-c", f'psql -d ferretdb -qtAc "{sql}"'],
        check=True,
        capture_output=True,
        text=True,
        timeout=30,
    ).stdout


def _turn_rows(delta: Counter[str]) -> int:
    """Rows read outside the background tables: the outbox's writers and the replicas' beats
    are read every second by every process whatever the traffic (the machine's clock, not the
    turn's)."""
    return sum(v for table, v in delta.items() if not table.startswith(("writers_", "replicas_")))


def _rows_read(schema: str) -> Counter[str]:
    """seq_tup_read + idx_tup_fetch per FerretDB table of one database (one schema)."""
    out = _psql(
        "SELECT relname, coalesce(seq_tup_read,0) + coalesce(idx_tup_fetch,0) "
        f"FROM pg_stat_user_tables WHERE schemaname = '{schema}'"
    )
    rows: Counter[str] = Counter()
    for line in out.splitlines():
        if "|" in line:
            table, count = line.rsplit("|", 1)
            rows[table] = int(count)
    return rows


def _local_ferretdb() -> bool:
    if os.environ.get("YOKE_MONGODB_URL"):
        return False
    try:
        return _psql("SELECT 1").strip() == "1"
    except (OSError, subprocess.SubprocessError):
        return False


def _history_line(conversation_id: str, index: int) -> Message:
    """A person's line of old history (written straight to the store, as if long answered)."""
    return Message(
        id=f"history-{conversation_id}-{index}",
        conversation_id=conversation_id,
        author_actor_id="history",
        role="user",
        parts=[TextPart(text=f"old line {index}")],
    )


async def _fill(store: Store, poster: Poster, forum_id: str, lines: int) -> None:
    """History written straight to the store: people's lines, as if long answered."""
    semaphore = asyncio.Semaphore(8)

    async def write(index: int) -> None:
        async with semaphore:
            await poster.post(_history_line(forum_id, index))

    for start in range(0, lines, 200):
        await asyncio.gather(*(write(i) for i in range(start, min(start + 200, lines))))


async def _rows_per_turn(
    mesh: Mesh, store: Store, client: Client, forum_id: str, agent_id: str, schema: str
) -> float:
    # Table statistics as autovacuum keeps them in a running system: without them PostgreSQL
    # may plan a freshly filled table as a tiny one and scan it.
    for table in _rows_read(schema):
        _psql(f"ANALYZE {schema}.{table}")
    await _turn(client, store, forum_id, agent_id, "settle")
    await _settled(mesh)
    samples = []
    for index in range(3):
        before = _rows_read(schema)
        await _turn(client, store, forum_id, agent_id, f"measured {index}")
        await _settled(mesh)
        delta = await _rows_read_since(schema, before)
        counted = _turn_rows(delta)
        print(f"rows read by table: {dict(delta)}")
        samples.append(counted)
    # The fewest: background work (autovacuum's analyze, another test's cleanup) only adds.
    return min(samples)


# PostgreSQL 15 flushes a busy backend's table statistics at most once a second, an idle
# one's only after 10 s idle: counts are final once they have not moved for longer than that.
STATISTICS_QUIET_SECONDS = 11


async def _rows_read_since(schema: str, before: Counter[str]) -> Counter[str]:
    """Rows read per table since ``before``, once PostgreSQL has published all of them."""
    delta = _rows_read(schema) - before
    quiet_since = time.monotonic()
    deadline = quiet_since + 60
    while time.monotonic() - quiet_since < STATISTICS_QUIET_SECONDS and time.monotonic() < deadline:
        await asyncio.sleep(1)
        now = _rows_read(schema) - before
        if _turn_rows(now) != _turn_rows(delta):
            quiet_since = time.monotonic()
        delta = now
    return delta


async def _write_lines(store: Store, conversation_id: str, count: int) -> None:
    """Lines 1..count, one at a time (seqs 1..count: nobody else writes there)."""
    for index in range(1, count + 1):
        await store.insert_message(_history_line(conversation_id, index))


@pytest.mark.skipif(not _local_ferretdb(), reason="needs the local FerretDB's PostgreSQL")
async def test_a_line_looked_up_by_seq_reads_only_itself(
    store: Store, module_mongodb_url: str
) -> None:
    """A lookup by ``(conversationId, seq)`` (``message_at``, ``last_seq``'s probes) reads the
    line, not its conversation, also while PostgreSQL's statistics predate the conversation
    (the usual case: conversations grow between two autovacuum analyses). With a second index
    led by ``conversationId`` the planner then took the conversation's rows from that one and
    filtered them on seq: 48,000 rows read for one turn in a 2,000-line forum."""
    schema = store.db.name
    tag = derive_id("test", str(time.time()))
    await _write_lines(store, f"small-{tag}", 5)
    table = next(t for t in _rows_read(schema) if t.startswith("messages_"))
    _psql(f"ALTER TABLE {schema}.{table} SET (autovacuum_enabled = false)")
    try:
        _psql(f"ANALYZE {schema}.{table}")
        conversation = f"lookups-{tag}"
        await _write_lines(store, conversation, 1000)
        for statistics in ("older than the conversation", "fresh"):
            if statistics == "fresh":
                _psql(f"ANALYZE {schema}.{table}")
            before = await _rows_read_since(schema, Counter())  # the writes' reads published
            lookups = 0
            for seq in range(100, 1000, 50):
                found = await store.message_at(conversation, seq)
                assert found is not None and found.seq == seq
                lookups += 1
            fresh = Store(module_mongodb_url)  # knows no head: finds it by probes
            try:
                assert await fresh.last_seq(conversation) == 1000
            finally:
                await fresh.close()
            lookups += 2 * 10 + 2  # at most: galloping and bisecting up to 1,000
            rows = (await _rows_read_since(schema, before))[table]
            print(f"statistics {statistics}: {rows} rows read for at most {lookups} lookups")
            assert rows <= lookups, f"{rows} rows for {lookups} lookups (statistics {statistics})"
    finally:
        _psql(f"ALTER TABLE {schema}.{table} RESET (autovacuum_enabled)")


async def test_services_starting_together_drop_the_old_bucket_index(mongodb_url: str) -> None:
    """A store made before ``convBucket`` has the ``(conversationId, bucket)`` index: every
    service drops it at start-up, and those starting together do not trip over each other."""
    stores = [Store(mongodb_url) for _ in range(4)]
    try:
        await stores[0].messages.create_index(
            [("conversationId", ASCENDING), ("bucket", ASCENDING)], name="conv_bucket"
        )
        await asyncio.gather(*(store.ensure_indexes() for store in stores))
        indexes = await stores[0].messages.index_information()
        assert "conv_bucket" not in indexes and "conv_bucket_key" in indexes, indexes
    finally:
        for store in stores:
            await store.close()


@pytest.mark.skipif(not _local_ferretdb(), reason="needs the local FerretDB's PostgreSQL")
async def test_rows_read_for_a_turn_do_not_grow_with_the_forum(
    mesh: Mesh, store: Store, poster: Poster, client: Client
) -> None:
    schema = store.db.name
    results = {}
    # The monologue is long in both (longer than the processor's context window of
    # YOKE_CONTEXT_LINES lines), so the step reads a full window either way.
    for length, monologue_length in ((50, 300), (2000, 2000)):
        forum = await create_forum(store, f"length {length}")
        await _fill(store, poster, forum.id, length)
        agent = await create_agent(store, "echo")
        monologue = derive_id("monologue", join_id(agent.id, forum.id))
        await _fill(store, poster, monologue, monologue_length)
        await join_conversation(store, poster, agent.id, forum.id)
        results[length] = await _rows_per_turn(mesh, store, client, forum.id, agent.id, schema)
    print(f"rows read per turn: {results}")
    # Rows read in buckets of 128 lines: the window may straddle one bucket more or less.
    assert results[2000] <= results[50] * 1.6 + 20, results

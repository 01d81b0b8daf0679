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
from yoke.core.ids import derive_id
from yoke.core.models import Message, TextPart
from yoke.runtime.joins import create_agent, create_forum, join_conversation, join_id
from yoke.runtime.posting import Poster
from yoke.store.database import Store, bucket_key, seq_bucket

pytestmark = pytest.mark.slow

MAX_STORE_OPERATIONS = 9
MAX_DELIVERIES = 5


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
    await _write_lines(store, forum_id, lines)


async def _rows_per_turn(
    mesh: Mesh, store: Store, client: Client, forum_id: str, agent_id: str, schema: str
) -> float:
    # Table statistics as autovacuum keeps them in a running system: without them PostgreSQL
    # may plan a freshly filled table as a tiny one and scan it.
    for table in _rows_read(schema):
        _psql(f"ANALYZE {schema}.{table}")
    await _turn(client, store, forum_id, agent_id, "settle")
    await _settled(mesh)
    # Not waited for (the fewest below leaves out the first sample if it has the settling
    # turn's last reads): each wait takes over 10 s.
    published = _rows_read(schema)
    samples = []
    for index in range(3):
        await _turn(client, store, forum_id, agent_id, f"measured {index}")
        await _settled(mesh)  # nothing has moved for 1 s
        now = await _rows_read_since(store, Counter(), reads_ended_ago=1.0)
        delta, published = now - published, now
        counted = _turn_rows(delta)
        print(f"rows read by table: {dict(delta)}")
        samples.append(counted)
    # The fewest: background work (autovacuum's analyze, another test's cleanup) only adds.
    return min(samples)


# When PostgreSQL 15 publishes a backend's table statistics (pgstat_report_stat, pgstat.c): at
# the end of one of its transactions unless it published less than PGSTAT_MIN_INTERVAL (1 s)
# before, and else from a timer PGSTAT_IDLE_INTERVAL (10 s) after it went idle. So whatever a
# backend read up to a moment T is published once it has ended a transaction 1 s or more after
# T (either that end publishes, or one less than 1 s before it, after T, did), or has been idle
# for longer than 10 s. Waiting for that, backend by backend (10.5-12 s after the reads),
# replaces waiting for counts that had not moved for 11 s, which an idle backend's timer
# publishing a few seconds in started again (12 to 20 s a sample).
STATISTICS_IDLE_SECONDS = 10.5


def _backends_holding_reads(since: str) -> set[int]:
    """FerretDB's backends that may hold statistics of reads made before ``since`` (a time 1 s
    after them) that they have not published yet."""
    out = _psql(
        "SELECT pid FROM pg_stat_activity WHERE datname = 'ferretdb' "
        "AND backend_type = 'client backend' AND pid <> pg_backend_pid() "
        f"AND backend_start < '{since}' AND NOT (state = 'idle' AND (state_change >= '{since}' "
        f"OR state_change < clock_timestamp() - interval '{STATISTICS_IDLE_SECONDS} seconds'))"
    )
    return {int(pid) for pid in out.split()}


async def _rows_read_since(
    store: Store, before: Counter[str], *, reads_ended_ago: float = 0.0
) -> Counter[str]:
    """Rows read per table since ``before``, once PostgreSQL has published every read made
    until now (the caller's reads are over: a turn ``_settled``, or its own lookups done)."""
    schema = store.db.name
    await asyncio.sleep(max(0.0, 1.0 - reads_ended_ago))  # ``since`` is 1 s after the reads
    since = _psql("SELECT clock_timestamp()").strip()
    pending: set[int] | None = None
    deadline = time.monotonic() + 60
    while True:
        # A backend once clear stays clear: what it read before ``since`` is published.
        holding = _backends_holding_reads(since)
        pending = holding if pending is None else pending & holding
        if not pending:
            return _rows_read(schema) - before
        if time.monotonic() > deadline:
            raise AssertionError(f"backends {pending} never published their statistics")
        await asyncio.sleep(0.5)


async def _write_lines(store: Store, conversation_id: str, count: int) -> None:
    """Lines 1..count of a conversation nobody else writes, as if long answered: their events
    long handled, so none is published, and no writer's outbox holds them.

    In batches: the documents ``Store.insert_message`` makes, without a round trip per line
    (a line at a time took minutes on a loaded machine, 8 at once racing for each seq 4.5
    times longer still)."""
    assert await store.last_seq(conversation_id) == 0, f"{conversation_id} is not new"
    for start in range(1, count + 1, 500):
        documents = []
        for seq in range(start, min(start + 500, count + 1)):
            line = _history_line(conversation_id, seq).model_copy(update={"seq": seq})
            document = line.to_document()
            document["convBucket"] = bucket_key(conversation_id, seq_bucket(seq))
            documents.append(document)
        await store.messages.insert_many(documents)


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
            before = await _rows_read_since(store, Counter())  # the writes' reads published
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
            rows = (await _rows_read_since(store, before))[table]
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
        agent = await create_agent(store, "echo")
        monologue = derive_id("monologue", join_id(agent.id, forum.id))
        await asyncio.gather(
            _fill(store, poster, forum.id, length),
            _fill(store, poster, monologue, monologue_length),
        )
        await join_conversation(store, poster, agent.id, forum.id)
        results[length] = await _rows_per_turn(mesh, store, client, forum.id, agent.id, schema)
    print(f"rows read per turn: {results}")
    # Rows read in buckets of 128 lines: the window may straddle one bucket more or less.
    assert results[2000] <= results[50] * 1.6 + 20, results


# --- a step in a long monologue reads past its tail only ------------------------------------


async def _documents_read(mesh: Mesh, service: str) -> Counter[str]:
    """Documents the store returned to ``service`` while it handled deliveries, by command."""
    read: Counter[str] = Counter()
    for family in text_string_to_metric_families(await mesh.processes[service].metrics()):
        for sample in family.samples:
            if (
                sample.name == "yoke_store_documents_read_total"
                and sample.labels.get("origin") == "delivery"
            ):
                read[sample.labels["command"]] += int(sample.value)
    return read


async def test_a_step_in_a_long_monologue_reads_only_the_lines_past_its_tail(
    mesh: Mesh, store: Store, poster: Poster, client: Client
) -> None:
    """The processor keeps the tails of the monologues it steps (yoke.runtime.tails): once a
    monologue's window is in memory, a turn reads the lines written since its last step (the
    copied forum line), never the window again (YOKE_CONTEXT_LINES lines: 200)."""
    forum = await create_forum(store, "tail")
    agent = await create_agent(store, "echo")
    monologue = derive_id("monologue", join_id(agent.id, forum.id))
    await _fill(store, poster, monologue, 250)
    await join_conversation(store, poster, agent.id, forum.id)
    await _turn(client, store, forum.id, agent.id, "the first step reads its window")
    await _settled(mesh)
    before = await _documents_read(mesh, "processor")
    for index in range(2):
        await _turn(client, store, forum.id, agent.id, f"a step at the tail's head {index}")
    await _settled(mesh)
    read = await _documents_read(mesh, "processor") - before
    print(f"documents the processor read for two turns in a 250-line monologue: {dict(read)}")
    # Per turn: the instance's state, the join's configuration when its version is re-read,
    # the line past the tail. A window read again would be 200.
    assert 2 <= sum(read.values()) <= 12, dict(read)

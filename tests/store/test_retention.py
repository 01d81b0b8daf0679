"""Nothing the mesh stores grows for ever: records that are only kept for a while carry the day
or hour they were written in (``ageBucket``), and each service sweeps its expired ones in the
background, keeping whatever is still live (a pending follow-up, an open failure that can be
replayed, an unfinished procedure, a running cooldown, a writer not yet finished).

Records are aged by writing them with old buckets, never by waiting.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from types import SimpleNamespace
from typing import Any

import pytest

from services.followup.scheduler import FollowUpDecision, FollowUps, decision_rule
from services.gateway import owed_answers
from services.gateway.a2a import push, task_store
from services.gateway.webhooks import retention_rules as webhook_rules
from services.guardian.guardian import COLLECTION as GUARDIAN
from services.guardian.guardian import retention_rules as guardian_rules
from tests.support.mesh import JoinFactory, Mesh, lines_until, say
from tests.support.processes import eventually
from yoke.client import Client
from yoke.core.ages import day_bucket, hour_bucket
from yoke.core.models import Message, TextPart
from yoke.core.settings import Settings
from yoke.runtime.calls import reaper
from yoke.runtime.calls.reaper import Reaper
from yoke.runtime.calls.records import (
    TOOL_CALL_DECISIONS_COLLECTION,
    TOOL_CALL_ENDS_COLLECTION,
    TOOL_CALLS_COLLECTION,
    CallDecision,
    CallEnd,
)
from yoke.runtime.calls.repository import OpenCalls
from yoke.runtime.calls.retention import call_rules
from yoke.runtime.compaction import MonologueSwap, swap_rule
from yoke.runtime.escalations import Escalation, Escalations, escalation_rules
from yoke.runtime.join_config import FollowUpConfig, GuardianConfig, JoinConfig, RulePolicy
from yoke.store.database import PROCEDURES, Store
from yoke.store.failures import Failure, close_failure, record_failure
from yoke.store.rate_limit import COLLECTION as LINE_LIMITS
from yoke.store.retention import Sweep, core_rules
from yoke.store.webhooks import DEAD_LETTERS, LEASES, DeadLetter

Doc = dict[str, Any]


# The services sweep every half second, keep records a day (leases an hour) and look back two
# days at their first round: a short first round over the records aged below.
SHORT = {
    "YOKE_RETENTION_SWEEP_SECONDS": "0.5",
    "YOKE_RETENTION_DECISION_DAYS": "1",
    "YOKE_RETENTION_FAILURE_DAYS": "1",
    "YOKE_RETENTION_LEASE_HOURS": "1",
    "YOKE_RETENTION_LOOKBACK_DAYS": "2",
}


@pytest.fixture(scope="module")
def mesh_env() -> dict[str, str]:
    return SHORT


def days_ago(days: float) -> str:
    return day_bucket(datetime.now(UTC) - timedelta(days=days))


def hours_ago(hours: float) -> str:
    return hour_bucket(datetime.now(UTC) - timedelta(hours=hours))


def failure(name: str, *, bucket: str, open_: bool, state: str, seq: int) -> Doc:
    return Failure(
        id=name,
        state_id=state,
        actor="processor",
        service="processor",
        conversation_id="c-1",
        message_id=f"m-{name}",
        seq=seq,
        error="ValueError: bad",
        open=open_,
        age_bucket=bucket,
    ).to_document()


def decision(name: str, *, bucket: str, done: bool) -> Doc:
    return FollowUpDecision(
        id=name, schedule_id=f"s-{name}", outcome="fired", done=done, age_bucket=bucket
    ).to_document()


def swap(name: str, *, bucket: str, done: bool) -> Doc:
    return MonologueSwap(
        id=name,
        forum_participant_id="p-1",
        from_monologue_id="m-1",
        to_monologue_id=f"m-{name}",
        from_seq=1,
        trigger_id="t-1",
        wake_id="w-1",
        done=done,
        age_bucket=bucket,
    ).to_document()


def guardian_doc(name: str, kind: str, bucket: str, **fields: object) -> Doc:
    return {"_id": name, "kind": kind, "ageBucket": bucket, **fields}


async def ids_in(store: Store, collection: str, ids: list[str]) -> set[str]:
    found = await store.db[collection].find({"_id": {"$in": ids}}, {"_id": 1}).to_list()
    return {str(document["_id"]) for document in found}


# --- the sweep over every kind of record, in one process ----------------------------------


async def test_the_sweep_removes_what_expired_and_keeps_what_is_live(mongodb_url: str) -> None:
    # Records are kept a day (leases an hour); the first round looks back three days.
    settings = Settings(
        retention_decision_days=1,
        retention_failure_days=1,
        retention_webhook_dead_letter_days=1,
        retention_lease_hours=1,
        retention_a2a_task_days=1,
        retention_lookback_days=3,
    )
    store = Store(mongodb_url)
    await store.ensure_indexes()
    try:
        future = datetime.now(UTC) + timedelta(days=1)
        old_day, old_hour = days_ago(2), hours_ago(3)  # past a day / an hour: expired
        young_day, young_hour = days_ago(0.9), hours_ago(0.9)  # within: kept
        await store.states.insert_one({"_id": "state-1", "failed": [7]})
        seeded: dict[str, list[Doc]] = {
            "failures": [
                failure("f-handled", bucket=old_day, open_=False, state="state-1", seq=5),
                failure("f-replayable", bucket=old_day, open_=True, state="state-1", seq=7),
                failure("f-forgotten", bucket=old_day, open_=True, state="state-1", seq=6),
                failure("f-orphan", bucket=old_day, open_=True, state="state-gone", seq=7),
                failure("f-young", bucket=young_day, open_=False, state="state-1", seq=4),
            ],
            PROCEDURES: [
                decision("d-done", bucket=old_day, done=True),
                decision("d-firing", bucket=old_day, done=False),
                decision("d-young", bucket=young_day, done=True),
                swap("s-done", bucket=old_day, done=True),
                swap("s-swapping", bucket=old_day, done=False),
            ],
            GUARDIAN: [
                guardian_doc("g-checked", "checked", old_day, messageId="m"),
                guardian_doc("g-checked-young", "checked", young_day, messageId="m"),
                guardian_doc("g-cooled", "cooldown", old_day, until=datetime.now(UTC)),
                guardian_doc("g-cooling", "cooldown", old_day, until=future),
                guardian_doc("g-lease", "lease", old_hour, holder="h"),
                guardian_doc("g-lease-young", "lease", young_hour, holder="h"),
            ],
            "replicas": [
                {
                    "_id": "r-gone",
                    "service": "retired",
                    "beat": datetime(2020, 1, 1, tzinfo=UTC),
                    "ageBucket": old_hour,
                },
                {
                    "_id": "r-live",
                    "service": "processor",
                    "beat": datetime.now(UTC),
                    "ageBucket": hour_bucket(),
                },
            ],
            "writers": [
                {
                    "_id": "sweep:w-1",
                    "claimedAt": datetime(2020, 1, 1, tzinfo=UTC),
                    "ageBucket": old_hour,
                },
                # A dead writer not finished yet: the outbox sweep still has to publish for it.
                {
                    "_id": "w-2",
                    "beat": datetime(2020, 1, 1, tzinfo=UTC),
                    "settledBefore": datetime(2020, 1, 1, tzinfo=UTC),
                    "ageBucket": old_hour,
                },
            ],
            DEAD_LETTERS: [
                DeadLetter(
                    id=name,
                    subscription_id="sub",
                    forum_id="f",
                    message_id="m",
                    seq=1,
                    url="https://example.org",
                    reason="410",
                    attempts=1,
                    age_bucket=bucket,
                ).to_document()
                for name, bucket in (("wd-old", old_day), ("wd-young", young_day))
            ],
            LEASES: [
                {"_id": "wl-old", "subscriptionId": "sub", "bucket": 1, "ageBucket": old_hour},
                {
                    "_id": "wl-young",
                    "subscriptionId": "sub",
                    "bucket": 2,
                    "ageBucket": young_hour,
                },
            ],
            # The gateway's callers' records: A2A tasks and push configs, MCP owed answers.
            **{
                collection: [
                    {"_id": f"{prefix}-old", "ageBucket": old_day},
                    {"_id": f"{prefix}-young", "ageBucket": young_day},
                ]
                for prefix, collection in (
                    ("task", task_store.COLLECTION),
                    ("push", push.CONFIGS),
                    ("owed", owed_answers.COLLECTION),
                )
            },
        }
        # A push config goes with its task, not before: an old one whose task is still kept
        # stays (the old one above has no task).
        seeded[push.CONFIGS].append(
            {"_id": "push-of-young-task", "taskId": "task-young", "ageBucket": old_day}
        )
        for collection, documents in seeded.items():
            await store.create_collections(collection)
            await store.db[collection].insert_many(documents)
        sweep = Sweep(store, core_rules("processor", store, settings), lookback_days=3)
        for rule in (
            decision_rule(settings.retention_decision_days),
            swap_rule(settings.retention_decision_days),
            *guardian_rules(settings),
            *webhook_rules(settings),
            task_store.retention_rule(settings),
            push.retention_rule(store, settings),
            owed_answers.retention_rule(),
        ):
            sweep.add(rule)

        deleted = await sweep.sweep_once()

        kept = {
            "failures": {"f-replayable", "f-young"},
            PROCEDURES: {"d-firing", "d-young", "s-swapping"},
            GUARDIAN: {"g-checked-young", "g-cooling", "g-lease-young"},
            "replicas": {"r-live"},
            "writers": {"w-2"},
            DEAD_LETTERS: {"wd-young"},
            LEASES: {"wl-young"},
            task_store.COLLECTION: {"task-young"},
            push.CONFIGS: {"push-young", "push-of-young-task"},
            owed_answers.COLLECTION: {"owed-young"},
        }
        for collection, documents in seeded.items():
            ids = [str(document["_id"]) for document in documents]
            assert await ids_in(store, collection, ids) == kept[collection], collection
        assert sum(deleted.values()) == sum(len(d) for d in seeded.values()) - sum(
            len(k) for k in kept.values()
        )
        assert deleted["failures"] == 3 and deleted["outbox claims"] == 1

        # A later round looks again at a bucket that held live records: once handled, it goes.
        await close_failure(store, "f-replayable")
        await store.db["failures"].update_one(
            {"_id": "f-replayable"}, {"$set": {"ageBucket": old_day}}
        )
        assert (await sweep.sweep_once())["failures"] == 1
        assert await ids_in(store, "failures", ["f-replayable", "f-young"]) == {"f-young"}
    finally:
        await store.close()


async def test_a_bucket_whose_first_batch_is_live_still_sweeps_what_lies_behind_it(
    mongodb_url: str,
) -> None:
    """Each round reads one batch of a bucket, from where the last round's left off: live
    records at its front never hide the expired ones behind them, and a round's work stays
    bounded by the batch."""
    store = Store(mongodb_url)
    await store.ensure_indexes()
    try:
        await store.create_collections(PROCEDURES)
        old = days_ago(2)
        live = [decision(f"d-firing-{i}", bucket=old, done=False) for i in range(3)]
        done = [decision(f"d-done-{i}", bucket=old, done=True) for i in range(5)]
        for document in (*live, *done):  # one at a time: the live ones come first
            await store.db[PROCEDURES].insert_one(document)
        rule = decision_rule(1)
        sweep = Sweep(store, [rule], lookback_days=3, batch=3)
        swept = [(await sweep.sweep_once())[rule.name] for _ in range(4)]
        ids = [str(d["_id"]) for d in (*live, *done)]
        assert await ids_in(store, PROCEDURES, ids) == {str(d["_id"]) for d in live}, swept
        assert sum(swept) == len(done) and max(swept) <= 3, swept
        # A restarted sweep goes on from the stored progress; the live ones stay for good.
        again = Sweep(store, [rule], lookback_days=3, batch=3)
        assert (await again.sweep_once())[rule.name] == 0
        assert await ids_in(store, PROCEDURES, ids) == {str(d["_id"]) for d in live}
    finally:
        await store.close()


async def test_call_ends_and_decisions_are_swept_by_rule_not_pruned_by_the_reaper(
    mongodb_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every processor's reaper runs every second: it leaves ends and decisions alone (no range
    delete, which FerretDB answers by reading the whole collection); the processor's retention
    rules sweep them by bucket, keeping those whose call is still open."""
    store = Store(mongodb_url)
    await store.ensure_indexes()
    try:
        old, long_ago = days_ago(8), datetime.now(UTC) - timedelta(days=8)
        for name in ("done", "open"):
            end = CallEnd(
                id=f"call-{name}", tool="t", outcome="answered", output="", is_error=False
            )
            made = CallDecision(id=f"call-{name}", tool="t", decision="approve")
            for collection, document, at in (
                (TOOL_CALL_ENDS_COLLECTION, end.to_document(), "endedAt"),
                (TOOL_CALL_DECISIONS_COLLECTION, made.to_document(), "decidedAt"),
            ):
                aged = {**document, at: long_ago, "ageBucket": old}
                await store.db[collection].insert_one(aged)
        # However long the processor has run (its reaper's clock two hours on).
        clock = reaper.time.monotonic
        monkeypatch.setattr(reaper, "time", SimpleNamespace(monotonic=lambda: clock() + 7200))
        await Reaper(OpenCalls(store, None)).reap()  # type: ignore[arg-type]  # no call: nothing to post
        both = ["call-done", "call-open"]
        for collection in (TOOL_CALL_ENDS_COLLECTION, TOOL_CALL_DECISIONS_COLLECTION):
            assert await ids_in(store, collection, both) == set(both), collection
        # Written with the bucket of their day (by the insert that writes them)...
        assert end.to_document()["ageBucket"] == made.to_document()["ageBucket"] == day_bucket()
        # ...and swept by the processor's rules; a call still open keeps its end and decision.
        await store.db[TOOL_CALLS_COLLECTION].insert_one({"_id": "call-open"})
        swept = await Sweep(store, call_rules(store, 7), lookback_days=10).sweep_once()
        assert sorted(swept.values()) == [1, 1], swept
        for collection in (TOOL_CALL_ENDS_COLLECTION, TOOL_CALL_DECISIONS_COLLECTION):
            assert await ids_in(store, collection, both) == {"call-open"}, collection
    finally:
        await store.close()


async def test_a_restart_after_a_long_outage_sweeps_what_expired_meanwhile(
    mongodb_url: str,
) -> None:
    """Progress is stored: a sweep that starts again goes on from where the last one stopped,
    however long ago, rather than looking back only ``lookback_days``."""
    store = Store(mongodb_url)
    await store.ensure_indexes()
    try:
        rule = decision_rule(7)
        await store.create_collections(PROCEDURES)
        await store.db[PROCEDURES].insert_one(decision("d-today", bucket=day_bucket(), done=True))
        now = datetime.now(UTC)
        first = Sweep(store, [rule], owner="followup", lookback_days=1)
        assert await first.sweep_once(now) == {rule.name: 0}  # young: kept
        # The mesh is down for 40 days; the next process looks back one day only.
        later = Sweep(store, [rule], owner="followup", lookback_days=1)
        assert await later.sweep_once(now + timedelta(days=40)) == {rule.name: 1}
        assert await ids_in(store, PROCEDURES, ["d-today"]) == set()
    finally:
        await store.close()


async def test_records_are_kept_from_when_they_were_handled(mongodb_url: str) -> None:
    """A failure handled (or a procedure finished) today is kept its full time from today."""
    store = Store(mongodb_url)
    await store.ensure_indexes()
    try:
        document = failure("f-1", bucket=days_ago(40), open_=True, state="s", seq=1)
        await store.failures.insert_one(document)
        await close_failure(store, "f-1")
        stored = await store.failures.find_one({"_id": "f-1"})
        assert stored is not None and stored["ageBucket"] == day_bucket()
        recorded = Failure(
            id="f-2",
            state_id="s",
            actor="a",
            service="processor",
            conversation_id="c",
            message_id="m",
            seq=2,
            error="e",
        )
        await record_failure(store, recorded)  # the bucket rides on the insert
        stored = await store.failures.find_one({"_id": "f-2"})
        assert stored is not None and stored["ageBucket"] == day_bucket()
    finally:
        await store.close()


async def test_a_line_older_than_its_decisions_keep_is_never_scheduled(mongodb_url: str) -> None:
    """Its decision may be swept: a redelivery of it must not nudge the agent again."""
    store = Store(mongodb_url)
    await store.ensure_indexes()
    try:
        followups = FollowUps(store, None, decision_days=7)  # type: ignore[arg-type]
        line = Message(
            id="old-line",
            conversation_id="forum-1",
            seq=3,
            author_actor_id="agent-1",
            role="agent",
            parts=[TextPart(text="hello")],
            created_at=datetime.now(UTC) - timedelta(days=8),
        )
        assert await followups.schedule(line) is None
    finally:
        await store.close()


# --- the services sweep in the background, and their writers stamp the bucket --------------


class Aged:
    """Records aged while the mesh was down: the expired and the live ones."""

    def __init__(self) -> None:
        old_day, old_hour = days_ago(2), hours_ago(3)  # past a day / an hour: expired
        long_ago = datetime(2020, 1, 1, tzinfo=UTC)
        self.dead: dict[str, list[Doc]] = {
            GUARDIAN: [
                guardian_doc("bg-checked", "checked", old_day, messageId="m"),
                guardian_doc("bg-lease", "lease", old_hour, holder="h"),
            ],
            PROCEDURES: [
                decision("bg-decision", bucket=old_day, done=True),
                swap("bg-swap", bucket=old_day, done=True),
            ],
            "failures": [
                failure("bg-failure", bucket=old_day, open_=False, state="bg-state", seq=5)
            ],
            "replicas": [
                {"_id": "bg-replica", "service": "retired", "ageBucket": old_hour, "beat": long_ago}
            ],
            "writers": [{"_id": "sweep:bg-writer", "claimedAt": long_ago, "ageBucket": old_hour}],
            LINE_LIMITS: [{"_id": "slot/0/1/bridge:bg", "ageBucket": old_hour}],
            TOOL_CALL_ENDS_COLLECTION: [
                CallEnd(
                    id="bg-end",
                    tool="t",
                    outcome="answered",
                    output="",
                    is_error=False,
                    age_bucket=old_day,
                ).to_document()
            ],
            TOOL_CALL_DECISIONS_COLLECTION: [
                CallDecision(
                    id="bg-decision", tool="t", decision="reject", age_bucket=old_day
                ).to_document()
            ],
        }
        self.live: dict[str, list[Doc]] = {
            PROCEDURES: [
                decision("bg-firing", bucket=old_day, done=False),
                swap("bg-swapping", bucket=old_day, done=False),
            ],
            "failures": [failure("bg-open", bucket=old_day, open_=True, state="bg-state", seq=7)],
        }


@pytest.fixture(scope="module")
async def aged(store: Store) -> Aged:
    records = Aged()
    await store.states.insert_one({"_id": "bg-state", "failed": [7]})
    for seeded in (records.dead, records.live):
        for collection, documents in seeded.items():
            await store.create_collections(collection)
            await store.db[collection].insert_many(documents)
    return records


@pytest.fixture(scope="module")
def before_mesh(aged: Aged) -> None:
    """The mesh starts over records that aged while it was down."""


async def test_each_service_sweeps_its_expired_records_while_it_runs(
    mesh: Mesh, store: Store, aged: Aged
) -> None:
    async def swept(expected: dict[str, list[Doc]]) -> bool:
        for collection, documents in expected.items():
            if await ids_in(store, collection, [str(d["_id"]) for d in documents]):
                return False
        return True

    async def all_swept() -> bool:
        return await swept(aged.dead)

    await eventually(all_swept, timeout=30, what="every service to sweep its expired records")
    # Another round over the bucket that held live records (a dead one put there now goes)...
    later = failure("bg-later", bucket=days_ago(2), open_=False, state="bg-state", seq=6)
    await store.failures.insert_one(later)

    async def later_swept() -> bool:
        return await swept({"failures": [later]})

    await eventually(later_swept, timeout=30, what="a later round of the processor's sweep")
    # ...and the live ones stayed through both.
    for collection, documents in aged.live.items():
        ids = [str(d["_id"]) for d in documents]
        assert await ids_in(store, collection, ids) == set(ids), collection
    assert await store.db["replicas"].count_documents({"service": "processor"}) >= 1


async def test_what_the_services_write_carries_its_bucket(
    mesh: Mesh, store: Store, client: Client, new_join: JoinFactory
) -> None:
    guarded = JoinConfig(
        guardian=GuardianConfig(
            cooldown_seconds=60,
            policies=[RulePolicy(kind="rule", pattern=r"(?i)refund", steer="No refunds.")],
        )
    )
    following = JoinConfig(follow_up=FollowUpConfig(after_seconds=0.5, text="Still there?"))
    forum_g, _ = await new_join(config=guarded)
    forum_f, _ = await new_join(config=following)
    await say(client, forum_g, "a refund please")
    await say(client, forum_f, "hello")

    async def checked() -> bool:
        return await store.db[GUARDIAN].find_one({"kind": "checked"}) is not None

    await eventually(checked, timeout=30, what="the guardian's checked record")
    today, hour = day_bucket(), hour_bucket()
    for kind in ("checked", "cooldown"):
        document = await store.db[GUARDIAN].find_one({"kind": kind})
        assert document is not None and document["ageBucket"] == today, kind
    await lines_until(
        store,
        forum_f,
        lambda lines: any(line.meta.in_reply_to and "Still there?" in line.text for line in lines),
    )

    async def decided() -> bool:
        found = await store.db[PROCEDURES].find_one({"kind": "follow-up", "done": True})
        return found is not None

    await eventually(decided, timeout=30, what="the follow-up's finished decision")
    found = await store.db[PROCEDURES].find_one({"kind": "follow-up", "done": True})
    assert found is not None and found["ageBucket"] == today
    replicas = await store.db["replicas"].find({"service": "processor"}).to_list()
    assert replicas and all(r["ageBucket"] in (hour, hour_bucket()) for r in replicas)


async def test_ended_escalations_and_their_decisions_are_swept_and_open_ones_kept(
    mongodb_url: str,
) -> None:
    """Escalations grow with every handoff: an ended one and its decision go after the
    decision days (follow-up's rule); an open or claimed one stays, whatever its age."""
    store = Store(mongodb_url)
    await store.ensure_indexes()
    escalations = Escalations(store)
    try:
        long_ago = datetime.now(UTC) - timedelta(days=8)
        ids = {}
        for state in ("open", "claimed", "ended"):
            escalation = Escalation.model_validate(
                {
                    "_id": f"esc-{state}-{long_ago.timestamp()}",
                    "forumId": "f",
                    "agentActorId": "a",
                    "joinKey": "j",
                    "callId": "c",
                    "reason": "r",
                    "openedAt": long_ago,
                    "deadline": long_ago + timedelta(minutes=15),
                    "state": state,
                }
            )
            assert escalation.to_document()["ageBucket"] == day_bucket(long_ago)
            await escalations.open(escalation)
            await store.db["escalation_decisions"].insert_one(
                {"_id": escalation.id, "action": "cancel", "ageBucket": day_bucket(long_ago)}
            )
            ids[state] = escalation.id
        swept = await Sweep(store, escalation_rules(store, 7), lookback_days=10).sweep_once()
        assert sorted(swept.values()) == [1, 1], swept
        kept = {ids["open"], ids["claimed"]}
        assert await ids_in(store, "escalations", list(ids.values())) == kept
        assert await ids_in(store, "escalation_decisions", list(ids.values())) == kept
    finally:
        await store.close()

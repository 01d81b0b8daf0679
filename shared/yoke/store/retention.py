"""Retention: records the mesh keeps only for a while are swept, by equality, in the background.

docs/architecture.md, invariant 14. Each such record carries its age bucket (:mod:`yoke.core.ages`:
the UTC day or hour it was written in, looked up by equality). A :class:`Sweep` deletes, bucket
by bucket, the buckets whose whole span is older than a :class:`Rule`'s ``keep``; a rule with a
``live`` check reads the bucket and deletes only the records that are no longer needed (a
pending follow-up, an open failure, an unfinished procedure stay, whatever their age).

The bucket is written with the record (no extra operation) and the sweep runs beside the
service's work, never on the path of a turn. Rounds look only at the buckets expired since the
owner's last round (and at those that still held live records): that progress is stored in
:data:`PROGRESS`, so a restart after an outage of any length goes on from it; an owner's very
first round looks back ``lookback_days``. A round reads at most ``batch`` records of a bucket
with a ``live`` check, from where the last round's read left off (past the live records it
kept), so live records at a bucket's front never hide the expired ones behind them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from pymongo import ASCENDING
from pymongo.errors import DuplicateKeyError

from yoke.core.ages import BUCKET_FIELD, SPAN, Unit, bucket_at, bucket_index
from yoke.core.metrics import RETENTION_DELETED
from yoke.core.settings import Settings
from yoke.store.database import Store

log = logging.getLogger(__name__)

Doc = dict[str, Any]

# Each owner's progress per rule: how far it swept, and the expired buckets still holding
# live records.
PROGRESS = "retention"


def _now() -> datetime:
    return datetime.now(UTC)


@dataclass(frozen=True)
class Rule:
    """One kind of record: where it lives, how long it stays at least, and when it is live.

    ``keep`` is in the rule's unit (days or hours); ``where`` narrows the collection by
    equality (``{"kind": "lease"}``); ``live`` says a record is still needed, and keeps it.
    """

    name: str
    collection: str
    unit: Unit
    keep: float
    where: Mapping[str, object] = field(default_factory=dict)
    live: Callable[[Doc], Awaitable[bool]] | None = None

    def first_kept(self, now: datetime) -> int:
        """The oldest bucket with a record younger than ``keep``: every older one expired."""
        return bucket_index(self.unit, now - self.keep * SPAN[self.unit])


class Sweep:
    """The retention rules of one process, applied every ``every`` seconds."""

    def __init__(
        self,
        store: Store,
        rules: list[Rule] | None = None,
        *,
        owner: str = "mesh",
        every: float = 600.0,
        lookback_days: int = 7,
        batch: int = 1000,
    ) -> None:
        self.store = store
        self.rules: list[Rule] = list(rules or [])
        self.owner = owner
        self.every = every
        self.lookback_days = lookback_days
        self.batch = batch
        # Per rule: the first bucket not yet expired at the last round, and the expired
        # buckets that still held live records (looked at again every round), each with how
        # many live records the next round skips (where the last read stopped). Stored in
        # :data:`PROGRESS` too, so a restart (after an outage of any length) goes on from there.
        self._swept_to: dict[str, int] = {}
        self._kept: dict[str, dict[int, int]] = {}
        self._loaded: set[str] = set()
        self._indexed: set[str] = set()

    def add(self, rule: Rule) -> None:
        """Register a rule (a service adds what it owns before it starts)."""
        if any(known.name == rule.name for known in self.rules):
            raise ValueError(f"retention rule {rule.name!r} is registered already")
        self.rules.append(rule)

    async def ensure_indexes(self) -> None:
        """The rules' collections, their bucket indexes and the progress collection: at start,
        before any traffic (see :meth:`Store.create_collections`)."""
        await self._ensure_index(PROGRESS, index=False)
        for rule in self.rules:
            await self._ensure_index(rule.collection)

    async def _ensure_index(self, collection: str, *, index: bool = True) -> None:
        if collection in self._indexed:
            return
        await self.store.create_collections(collection)
        if index:
            await self.store.db[collection].create_index(
                [(BUCKET_FIELD, ASCENDING)], name="age_bucket"
            )
        self._indexed.add(collection)

    def _progress_id(self, rule: Rule) -> str:
        return f"{self.owner}:{rule.name}"

    async def _load(self, rule: Rule) -> None:
        if rule.name in self._loaded:
            return
        await self._ensure_index(PROGRESS, index=False)
        found = await self.store.db[PROGRESS].find_one({"_id": self._progress_id(rule)})
        if found is not None:
            self._swept_to[rule.name] = int(found["sweptTo"])
            offsets = found.get("offsets") or {}
            self._kept[rule.name] = {
                int(index): int(offsets.get(str(index), 0)) for index in found.get("kept") or []
            }
        self._loaded.add(rule.name)

    async def _save(self, rule: Rule) -> None:
        """The owner's progress (its replicas write the same: whichever lands, none is lost
        but a few buckets looked at again)."""
        document = {
            "_id": self._progress_id(rule),
            "sweptTo": self._swept_to[rule.name],
            "kept": sorted(kept := self._kept[rule.name]),
            "offsets": {str(index): skip for index, skip in kept.items() if skip},
        }
        try:
            await self.store.db[PROGRESS].replace_one(
                {"_id": document["_id"]}, document, upsert=True
            )
        except DuplicateKeyError:  # an upsert is no atomic insert on FerretDB: it exists
            await self.store.db[PROGRESS].replace_one({"_id": document["_id"]}, document)

    def _candidates(self, rule: Rule, now: datetime) -> tuple[list[int], int]:
        first_kept = rule.first_kept(now)
        lookback = self.lookback_days * (24 if rule.unit == "hour" else 1)
        start = self._swept_to.get(rule.name, first_kept - lookback)
        wanted = set(range(start, first_kept)) | set(self._kept.get(rule.name, {}))
        return sorted(wanted), first_kept

    async def sweep_rule(self, rule: Rule, now: datetime | None = None) -> int:
        """Delete what ``rule`` lets go of; returns how many records went."""
        await self._ensure_index(rule.collection)
        await self._load(rule)
        collection = self.store.db[rule.collection]
        buckets, first_kept = self._candidates(rule, now or _now())
        skips = self._kept.get(rule.name, {})
        before = (self._swept_to.get(rule.name), dict(skips))
        kept: dict[int, int] = {}
        deleted = 0
        for index in buckets:
            query = {BUCKET_FIELD: bucket_at(rule.unit, index), **rule.where}
            if rule.live is None:
                deleted += (await collection.delete_many(query)).deleted_count
                continue
            # One batch, past the live records the last round kept at the bucket's front (the
            # store's natural order: what is deleted moves the rest up, what stays keeps its
            # place), so they cannot stall the sweep of what lies behind them.
            skip = skips.get(index, 0)
            documents = await collection.find(query).skip(skip).limit(self.batch).to_list()
            alive = 0
            for document in documents:
                if await rule.live(document):
                    alive += 1
                    continue
                deleted += (await collection.delete_one({"_id": document["_id"]})).deleted_count
            if len(documents) >= self.batch:  # more behind: the next round reads on from here
                kept[index] = skip + alive
            elif alive or skip:  # the end: the next round looks at the bucket from its start
                kept[index] = 0
        self._swept_to[rule.name] = first_kept
        self._kept[rule.name] = kept
        if before != (first_kept, kept):
            await self._save(rule)
        if deleted:
            RETENTION_DELETED.labels(rule.name).inc(deleted)
            log.info("retention: %d %s records swept", deleted, rule.name)
        return deleted

    async def sweep_once(self, now: datetime | None = None) -> dict[str, int]:
        """One round over every rule: records deleted, by rule."""
        return {rule.name: await self.sweep_rule(rule, now) for rule in self.rules}

    async def run(self, stopping: asyncio.Event) -> None:
        """A round every ``every`` seconds (the first one too: starting costs nothing), until
        stopping; a failed round is logged and the next one tries again."""
        while not stopping.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stopping.wait(), timeout=self.every)
            if stopping.is_set():
                return
            for rule in self.rules:
                try:
                    await self.sweep_rule(rule)
                except Exception as error:  # the store away: the next round tries again
                    log.warning("retention sweep of %s failed: %r", rule.name, error)


def core_rules(service: str, store: Store, settings: Settings) -> list[Rule]:
    """What every service process owns: its failure records, and (whoever sweeps first)
    silent replicas' documents and outbox claims."""

    async def replayable(document: Doc) -> bool:
        # Open, and still remembered by its instance (so a replay runs it): a handled one, or
        # one its instance forgot (left join, more than MAX_REMEMBERED_FAILURES since), is not.
        if not document.get("open", True):
            return False
        state = await store.states.find_one({"_id": document.get("stateId")}, {"failed": 1})
        return state is not None and document.get("seq") in (state.get("failed") or [])

    hours = settings.retention_lease_hours
    return [
        Rule(
            "failures",
            "failures",
            "day",
            settings.retention_failure_days,
            where={"service": service},
            live=replayable,
        ),
        # A replica beating writes the current hour: one in an old bucket has been silent since
        # (any service's: one never run again has nobody of its own to forget it).
        Rule("replicas", "replicas", "hour", hours),
        # Only claims carry a bucket; a writer's own heartbeat is finished by the outbox sweep.
        Rule("outbox claims", "writers", "hour", hours, live=_unfinished_writer),
    ]


async def _unfinished_writer(document: Doc) -> bool:
    return "beat" in document


def sweep_for(service: str, store: Store, settings: Settings) -> Sweep:
    """A process's sweep, with its settings and the core rules; services add their own."""
    return Sweep(
        store,
        core_rules(service, store, settings),
        owner=service,
        every=settings.retention_sweep_seconds,
        lookback_days=settings.retention_lookback_days,
        batch=settings.retention_batch,
    )

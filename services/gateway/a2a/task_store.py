"""A2A tasks in the mesh's store: a2a-sdk's task store, kept in the collection ``a2a_tasks``.

A record is written when a send is accepted (its line posted): the task's id, its context, its
owner (the token's namespace), the published agent, the kept forum and the line whose turn the
task is, beside the SDK's view of the task (serialized, as the SDK saved it). The record is the
truth for who may see a task; how its turn went is the forum's: a task that is not final in the
record is read again from the store (:func:`~services.gateway.calling.turn_outcome`), so
``tasks/get`` answers the same from any gateway, after any restart, also when the process that
ran the task died before it could write the end.

Writes are few (invariant 11): the record when the send is accepted, then only when the task's
state or status message changes (a delta, an artifact piece, costs none); the process running
the task is its writer (a ``tasks/cancel`` on another gateway writes ``canceled``, which the
runner writes too). Bounded (invariant 14): a token keeps at most ``YOKE_A2A_TASKS_PER_TOKEN``
tasks (its oldest are deleted once a tenth more have piled up) and every record is swept
``YOKE_RETENTION_A2A_TASK_DAYS`` after it was made; what hangs on a task (its push configs) is
told when it is rejected or deleted (:class:`Dependents`).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from datetime import datetime
from typing import Protocol

from a2a.server.cluster.task_store import StoredTask, VersionedTaskStore
from a2a.server.cluster.version import TaskVersion
from a2a.server.context import ServerCallContext
from a2a.server.events.event_queue import Event
from a2a.types.a2a_pb2 import ListTasksRequest, ListTasksResponse, Task, TaskState
from a2a.utils.constants import DEFAULT_LIST_TASKS_PAGE_SIZE
from a2a.utils.errors import InvalidParamsError
from prometheus_client import Counter, Histogram
from pydantic import Field
from pymongo import ASCENDING
from pymongo.asynchronous.collection import AsyncCollection

from services.gateway.a2a.caller import Caller, caller_of
from services.gateway.a2a.turns import apply_end, is_terminal, state_name
from services.gateway.calling import turn_outcome
from yoke.core.ages import day_bucket
from yoke.core.lru import LRUCache
from yoke.core.metrics import LATENCY_BUCKETS
from yoke.core.models import Document, unstorable, utcnow
from yoke.core.settings import Settings
from yoke.store.database import Doc, Store
from yoke.store.retention import Rule

COLLECTION = "a2a_tasks"

TASKS = Counter(
    "yoke_a2a_tasks",
    "A2A tasks by the state they entered: submitted (a send made a task), working, completed, "
    "failed, canceled, rejected (the line was refused: the token's line limit, its size).",
    ["state"],
)
TASK_SECONDS = Histogram(
    "yoke_a2a_task_seconds",
    "From an A2A send accepted to its task's end (completed, failed, canceled), in the process "
    "that ran it.",
    buckets=(*LATENCY_BUCKETS, 300, 900, 3600),
)
for _state in ("submitted", "working", "completed", "failed", "canceled", "rejected"):
    TASKS.labels(_state)


class TaskRecord(Document):
    """One A2A task: whose, which agent's, which turn, and the SDK's last written view."""

    owner: str
    agent: str
    context_id: str
    state: str
    # The a2a Task as protobuf bytes: a caller's metadata keys and strings stay out of BSON.
    task: bytes
    forum_id: str | None = None
    # The newest caller line the task follows (a second message to a working task moves it).
    line_id: str | None = None
    created_at: datetime = Field(default_factory=utcnow)
    # yoke.store.retention: kept YOKE_RETENTION_A2A_TASK_DAYS from this day.
    age_bucket: str = Field(default_factory=day_bucket)

    def proto(self) -> Task:
        task = Task()
        task.ParseFromString(self.task)
        return task


class Attachment:
    """What the executor knows of a task that the SDK's Task does not carry: its forum and
    line, handed over for the save that follows."""

    def __init__(self, forum_id: str, line_id: str) -> None:
        self.forum_id = forum_id
        self.line_id = line_id


def line_claim_id(line_id: str) -> str:
    """The claim of a caller's line by the task its send made (beside the task records; it
    has no owner, so no owner's query finds it)."""
    return f"line:{line_id}"


def retention_rule(settings: Settings) -> Rule:
    return Rule("a2a tasks", COLLECTION, "day", settings.retention_a2a_task_days)


class Dependents(Protocol):
    """What keeps records of tasks (the push config store), told when a task ends up with
    none: its line refused, or its record deleted."""

    def rejected(self, task_id: str) -> None: ...

    async def deleted(self, task_ids: Sequence[str]) -> None: ...


class MeshTaskStore(VersionedTaskStore):
    """a2a-sdk's task store over ``a2a_tasks``, scoped to the caller of each request.

    Versioned only to see which event a save is for; it never reports a version (every save
    comes from the one process running the task), so it answers ``TaskVersion.MISSING``.
    """

    def __init__(self, store: Store, settings: Settings) -> None:
        self.store = store
        self.cap = settings.a2a_tasks_per_token
        # Handed over by the executor for the save right after (bounded all the same).
        self._attached: LRUCache[str, Attachment] = LRUCache(10_000)
        # What this process wrote last of a task (its state and status message), and when the
        # task began: a save that changes neither is skipped. Bounded: forgetting costs a write.
        self._written: LRUCache[str, tuple[int, str, float]] = LRUCache(10_000)
        # Task ids this process made for sends not yet saved: no record can exist, so the SDK's
        # looks for one before the first save cost no read.
        self._fresh: LRUCache[str, bool] = LRUCache(10_000)
        # Inserts per owner since its tasks were last counted (first insert here: counted).
        self._uncounted: LRUCache[str, int] = LRUCache(10_000)
        # The line this process's runner of a task follows: its writes land only while the
        # record follows that line too (a message sent to the task through another gateway
        # moved it: that gateway writes the end).
        self._following: LRUCache[str, str] = LRUCache(10_000)
        # Told of rejected and deleted tasks (the push config store sets itself here).
        self.dependents: Dependents | None = None

    @property
    def collection(self) -> AsyncCollection[Doc]:
        return self.store.db[COLLECTION]

    async def ensure_indexes(self) -> None:
        await self.store.create_collections(COLLECTION)
        await self.collection.create_index([("owner", ASCENDING)], name="owner")

    def new_task_id(self) -> str:
        """An id for a new task (random, like the SDK's own), known here to have no record."""
        task_id = str(uuid.uuid4())
        self._fresh[task_id] = True
        return task_id

    def attach(self, task_id: str, attachment: Attachment) -> None:
        """The forum and line of the task's next save (the executor's, right after it)."""
        self._attached[task_id] = attachment

    async def record(self, task_id: str, caller: Caller | None = None) -> TaskRecord | None:
        """The task's record: the caller's only when one is named (else None, as for a task
        that does not exist: another token learns nothing of it). An id the store cannot hold
        (U+0000) names no task: it is not asked for (every method that takes a task id reads
        it here first, so such an id is TaskNotFoundError, not the store's error)."""
        if task_id in self._fresh or unstorable(task_id) is not None:
            return None
        found = await self.collection.find_one({"_id": task_id})
        if found is None:
            return None
        record = TaskRecord.from_document(found)
        if caller is not None and (record.owner, record.agent) != (caller.owner, caller.agent.id):
            return None
        return record

    async def claim_line(self, line_id: str, task_id: str) -> str:
        """The task a line's send made: ``task_id``, if its claim is the first (a unique
        insert: sends of one message at once, through any gateway, make one task to follow),
        else the one that won. Claims go with the records' retention."""
        claim = {"_id": line_claim_id(line_id), "taskId": task_id, "ageBucket": day_bucket()}
        if await self.store.insert_if_absent(self.collection, claim):
            return task_id
        found = await self.collection.find_one({"_id": line_claim_id(line_id)})
        return str(found["taskId"]) if found is not None else task_id

    async def sent_as(self, caller: Caller, line_id: str) -> TaskRecord | None:
        """The caller's task that a send of ``line_id`` made (a task follows newer lines as
        messages come, its claim stays on the first)."""
        claim = await self.collection.find_one({"_id": line_claim_id(line_id)})
        return None if claim is None else await self.record(str(claim["taskId"]), caller)

    async def current(self, record: TaskRecord) -> Task:
        """The task as it stands: as written when final, else with its turn's end if the forum
        has it (whoever ran the task may not have lived to write it)."""
        task = record.proto()
        if is_terminal(task.status.state) or record.forum_id is None or record.line_id is None:
            return task
        line = await self.store.get_message(record.line_id)
        if line is None:
            return task
        ended = await turn_outcome(self.store, record.forum_id, line)
        return task if ended is None else apply_end(task, ended)

    async def get(self, task_id: str, context: ServerCallContext) -> StoredTask | None:
        record = await self.record(task_id, caller_of(context))
        if record is None:
            return None
        return StoredTask(await self.current(record), TaskVersion.MISSING)

    async def save(
        self,
        task: Task,
        *,
        event: Event | None,
        prev: Task | None,
        prev_version: TaskVersion,
        context: ServerCallContext,
    ) -> TaskVersion:
        caller = caller_of(context)
        self._fresh.pop(task.id, None)
        attached = self._attached.pop(task.id, None)
        state = task.status.state
        if state == TaskState.TASK_STATE_REJECTED and self.dependents is not None:
            self.dependents.rejected(task.id)
        said = task.status.message.message_id if task.status.HasField("message") else ""
        written = self._written.get(task.id)
        if written is not None and attached is None and written[:2] == (state, said):
            return TaskVersion.MISSING  # a delta or an artifact piece: nothing to keep
        fields: Doc = {"state": state_name(state), "task": task.SerializeToString()}
        following = self._following.get(task.id)
        if attached is not None:
            fields |= {"forumId": attached.forum_id, "lineId": attached.line_id}
            self._following[task.id] = attached.line_id
            following = None  # this write moves the task to the line
        if written is None and prev is None:
            record = TaskRecord(
                id=task.id,
                owner=caller.owner,
                agent=caller.agent.id,
                context_id=task.context_id,
                state=fields["state"],
                task=fields["task"],
                forum_id=attached.forum_id if attached else None,
                line_id=attached.line_id if attached else None,
            )
            if await self.store.insert_if_absent(self.collection, record.to_document()):
                TASKS.labels("submitted").inc()
                await self._trim(caller.owner)
            else:
                await self._update(task.id, caller, fields, following)
        else:
            await self._update(task.id, caller, fields, following)
        began = written[2] if written is not None else time.monotonic()
        if written is None or written[0] != state:
            TASKS.labels(state_name(state)).inc()
            if is_terminal(state) and written is not None:
                TASK_SECONDS.observe(time.monotonic() - began)
        self._written[task.id] = (state, said, began)
        return TaskVersion.MISSING

    async def _update(
        self, task_id: str, caller: Caller, fields: Doc, following: str | None = None
    ) -> None:
        query: Doc = {"_id": task_id, "owner": caller.owner}
        if following is not None:
            query["lineId"] = following
        await self.collection.update_one(query, {"$set": fields})

    async def _trim(self, owner: str) -> None:
        """Keep the owner's newest ``cap`` tasks: counted at the owner's first task here and
        then every tenth of the cap, trimmed once a tenth more have piled up (so a busy token
        costs a count now and then, and a read of its records more rarely, not a read on every
        send; with several gateways the slack is a tenth of the cap each)."""
        step = max(1, self.cap // 10)
        since = self._uncounted.get(owner)
        if since is not None and since + 1 < step:
            self._uncounted[owner] = since + 1
            return
        self._uncounted[owner] = 0
        query = {"owner": owner}
        if await self.collection.count_documents(query) <= self.cap + self.cap // 10:
            return
        found = await self.collection.find(query, {"_id": 1, "createdAt": 1}).to_list()
        found.sort(key=lambda record: (record.get("createdAt") or utcnow(), str(record["_id"])))
        trimmed = [str(record["_id"]) for record in found[: len(found) - self.cap]]
        for task_id in trimmed:
            await self.collection.delete_one({"_id": task_id})
        if trimmed and self.dependents is not None:
            await self.dependents.deleted(trimmed)

    async def list(self, params: ListTasksRequest, context: ServerCallContext) -> ListTasksResponse:
        """The caller's tasks with this agent, newest first (at most the token's cap: read
        whole, then filtered and paged here)."""
        caller = caller_of(context)
        found = await self.collection.find(
            {"owner": caller.owner, "agent": caller.agent.id}
        ).to_list()
        records = [TaskRecord.from_document(document) for document in found]
        if params.context_id:
            records = [r for r in records if r.context_id == params.context_id]
        records.sort(key=lambda r: (r.created_at, r.id), reverse=True)
        try:
            start = int(params.page_token or "0")
        except ValueError as error:
            raise InvalidParamsError(message="invalid page token") from error
        if start < 0:
            raise InvalidParamsError(message="invalid page token")
        size = params.page_size or DEFAULT_LIST_TASKS_PAGE_SIZE
        filtered = bool(params.status) or params.HasField("status_timestamp_after")
        if not filtered:
            # Each task's turn is read for the page only: a page costs its own tasks.
            page = [await self.current(record) for record in records[start : start + size]]
            return self._page(page, start, size, len(records))
        tasks = [await self.current(record) for record in records]
        if params.status:
            tasks = [task for task in tasks if task.status.state == params.status]
        if params.HasField("status_timestamp_after"):
            after = params.status_timestamp_after.ToNanoseconds()
            tasks = [t for t in tasks if t.status.timestamp.ToNanoseconds() >= after]
        return self._page(tasks[start : start + size], start, size, len(tasks))

    @staticmethod
    def _page(page: Sequence[Task], start: int, size: int, total: int) -> ListTasksResponse:
        more = start + size < total
        return ListTasksResponse(
            tasks=page,
            next_page_token=str(start + size) if more else "",
            page_size=size,
            total_size=total,
        )

    async def delete(self, task_id: str, context: ServerCallContext) -> None:
        if unstorable(task_id) is not None:
            return  # no such task
        caller = caller_of(context)
        result = await self.collection.delete_one(
            {"_id": task_id, "owner": caller.owner, "agent": caller.agent.id}
        )
        self._written.pop(task_id, None)
        self._following.pop(task_id, None)
        if result.deleted_count and self.dependents is not None:
            await self.dependents.deleted([task_id])

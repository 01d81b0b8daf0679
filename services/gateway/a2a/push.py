"""A2A push notifications, delivered by the gateway's webhook machinery.

A push config (``tasks/pushNotificationConfig/set``, or one given with the send) is kept in
``a2a_push_configs`` (a2a-sdk's config store, scoped to the caller) and, once its task has its
line, is a webhook subscription too (:class:`~yoke.store.webhooks.WebhookSubscription` with
``task_id``) of the task's forum from that line on: the gateway's
:class:`~services.gateway.webhooks.WebhookWorker` delivers it like any subscription (a cursor in
the store, a lease, signed with ``X-Yoke-Signature`` keyed by the config's ``token``, retried
with backoff, dead-lettered past its window), so a task's end is pushed even when the process
that ran it was killed. Its :class:`TaskPushRunner` POSTs only the task's own turn, as A2A
``StreamResponse`` JSON (a ``statusUpdate``: ``working`` while an approver is awaited, then the
end with the reply), and ends the subscription once the end is delivered or dead-lettered (the
config stays, for ``get``/``list``, until retention). The SDK's own sender is not used: it
POSTs from memory, once, and a restart loses what it had not sent.

A config without a ``token`` gets a generated one, returned with the config: it is the secret a
receiver checks the signature with. A config's ``authentication`` (a scheme and credentials) is
sent as the push's ``Authorization`` header beside the signature; the credentials are the
caller's secret for its receiver, so they are kept in the config only (never shown back, never
logged).

The URL is the caller's word (:mod:`yoke.core.outbound`): refused when it is set if its host
resolves inside the operator's network (``YOKE_PUSH_ALLOWED_HOSTS`` lets chosen hosts through), and
checked again when each push connects. Bounded (invariant 14): a config given with a send is
kept only once the send's line is accepted (a refused send keeps none), a task holds at most
``YOKE_A2A_PUSH_CONFIGS_PER_TASK``, a token ``YOKE_A2A_PUSH_CONFIGS_PER_TOKEN``, and a task's
configs go with it (the token's task cap, retention).
"""

from __future__ import annotations

import json
import re
import secrets
import time
from collections.abc import Callable, Sequence
from datetime import datetime

from a2a.server.context import ServerCallContext
from a2a.server.tasks.push_notification_config_store import (
    PushNotificationConfigStore,
    normalize_push_notification_config,
)
from a2a.types.a2a_pb2 import AuthenticationInfo, TaskPushNotificationConfig, TaskState
from a2a.utils.errors import InvalidParamsError, TaskNotFoundError
from a2a.utils.proto_utils import to_stream_response
from google.protobuf.json_format import MessageToDict
from pydantic import Field, SecretStr
from pymongo import ASCENDING
from pymongo.asynchronous.collection import AsyncCollection

from services.gateway.a2a.caller import caller_of
from services.gateway.a2a.task_store import COLLECTION as TASKS
from services.gateway.a2a.task_store import MeshTaskStore, TaskRecord
from services.gateway.a2a.turns import agent_message, final_status, status_event, waiting_text
from services.gateway.calling import Answered, Failed, Waiting, outcome_of, turn_outcome
from services.gateway.webhooks import SubscriptionRunner, WebhookWorker
from yoke.core.ages import day_bucket
from yoke.core.ids import derive_id
from yoke.core.lru import LRUCache
from yoke.core.models import Document, Message, unstorable, utcnow
from yoke.core.outbound import guard_for
from yoke.core.settings import Settings
from yoke.store.database import Doc, Store
from yoke.store.retention import Rule
from yoke.store.webhooks import (
    CURSORS,
    LEASES,
    SECRET_PREFIX,
    Cursor,
    WebhookSubscription,
    collection,
    deliverable,
    url_problem,
)

CONFIGS = "a2a_push_configs"
MIN_TOKEN_CHARS = 16
MAX_TOKEN_CHARS = 256
MAX_CONFIG_ID_CHARS = 128
MAX_CREDENTIALS_CHARS = 4096
# An HTTP authentication scheme's name (RFC 9110 token) and what may follow it in the header.
_SCHEME = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]{1,64}")
_CREDENTIALS = re.compile(r"[\x21-\x7e]+( [\x21-\x7e]+)*")
# A runner whose task ended but whose subscription is still there (the gateway died between
# delivering the end and removing it) finds out at most this often.
CHECK_SECONDS = 60.0


class PushSubscription(WebhookSubscription):
    """A push config's webhook subscription: the receiver's own ``Authorization`` rides along
    (kept out of reprs and logs)."""

    authorization: SecretStr | None = None


class PushConfig(Document):
    """One push config of a task (``id`` derived from the task and the config's id; also the
    webhook subscription's id)."""

    task_id: str
    config_id: str
    owner: str
    url: str
    secret: str
    # The config's authentication: sent as "<scheme> <credentials>" (the caller's secret).
    auth_scheme: str | None = None
    auth_credentials: str | None = Field(default=None, repr=False)
    # Set once the task has its line: the config is then a live subscription of that forum,
    # until the task's end is delivered.
    forum_id: str | None = None
    live: bool = False
    created_at: datetime = Field(default_factory=utcnow)
    # yoke.store.retention: kept as long as its task is (YOKE_RETENTION_A2A_TASK_DAYS, and while the
    # task's record is there).
    age_bucket: str = Field(default_factory=day_bucket)

    def subscription(self) -> PushSubscription:
        assert self.forum_id is not None
        authorization = None
        if self.auth_scheme and self.auth_credentials:
            authorization = SecretStr(f"{self.auth_scheme} {self.auth_credentials}")
        return PushSubscription(
            id=self.id,
            forum_id=self.forum_id,
            url=self.url,
            secret=self.secret,
            created_at=self.created_at,
            task_id=self.task_id,
            authorization=authorization,
        )

    def as_a2a(self) -> TaskPushNotificationConfig:
        """The config as A2A shows it to its owner: the credentials stay out (the caller has
        them; the mesh only sends them)."""
        shown = TaskPushNotificationConfig(
            id=self.config_id, task_id=self.task_id, url=self.url, token=self.secret
        )
        if self.auth_scheme:
            shown.authentication.CopyFrom(AuthenticationInfo(scheme=self.auth_scheme))
        return shown


def subscription_id(task_id: str, config_id: str) -> str:
    return derive_id("a2a-push", task_id, config_id)


def retention_rule(store: Store, settings: Settings) -> Rule:
    """Configs expire with their tasks: past the tasks' days, and only once the task's record
    is gone (its subscription's cursor and leases go with it)."""

    async def live(document: Doc) -> bool:
        task_id = document.get("taskId")
        if await store.db[TASKS].find_one({"_id": task_id}, {"_id": 1}) is not None:
            return True
        await end_subscription(store, str(document["_id"]))
        return False

    return Rule("a2a push configs", CONFIGS, "day", settings.retention_a2a_task_days, live=live)


async def end_subscription(store: Store, push_id: str) -> None:
    """The push config delivers no more (its task ended, or is gone): not live, and its cursor
    and leases deleted (the worker stops its runner at the next refresh)."""
    await store.db[CONFIGS].update_one({"_id": push_id}, {"$set": {"live": False}})
    await collection(store, CURSORS).delete_one({"_id": push_id})
    await collection(store, LEASES).delete_many({"subscriptionId": push_id})


class MeshPushConfigStore(PushNotificationConfigStore):
    """a2a-sdk's push config store over ``a2a_push_configs``; each config of a task with its
    line is a webhook subscription too (:meth:`subscriptions`, the webhook worker's source)."""

    def __init__(self, store: Store, tasks: MeshTaskStore, settings: Settings) -> None:
        self.store = store
        self.tasks = tasks
        self.cap = settings.a2a_push_configs_per_task
        self.token_cap = settings.a2a_push_configs_per_token
        self.guard = guard_for(settings.push_allowed_hosts)
        # A config given with a send, held here until the send's line is accepted (the SDK sets
        # it before the executor posts the line): the executor's start() keeps it then, and a
        # refused line drops it (the task store tells, :meth:`rejected`). Bounded all the same.
        self._pending: LRUCache[str, PushConfig] = LRUCache(10_000)
        tasks.dependents = self

    @property
    def collection(self) -> AsyncCollection[Doc]:
        return self.store.db[CONFIGS]

    async def ensure_indexes(self) -> None:
        await self.store.create_collections(CONFIGS)
        await self.collection.create_index([("taskId", ASCENDING)], name="task")
        await self.collection.create_index([("live", ASCENDING)], name="live")
        await self.collection.create_index([("owner", ASCENDING)], name="owner")

    async def subscriptions(self) -> list[WebhookSubscription]:
        """The live ones (tasks whose end is not delivered yet): few, read every refresh."""
        found = await self.collection.find({"live": True}).to_list()
        configs = [PushConfig.from_document(document) for document in found]
        return [config.subscription() for config in configs if config.forum_id is not None]

    async def set_info(
        self,
        task_id: str,
        notification_config: TaskPushNotificationConfig,
        context: ServerCallContext,
    ) -> TaskPushNotificationConfig:
        if unstorable(task_id) is not None:
            raise TaskNotFoundError(message=f"task {task_id!r} not found")
        caller = caller_of(context)
        config = normalize_push_notification_config(task_id, notification_config)
        if (problem := url_problem(config.url)) is not None:
            raise InvalidParamsError(message=f"invalid push notification url: {problem}")
        scheme, credentials = authentication_of(config)
        secret = config.token or SECRET_PREFIX + secrets.token_urlsafe(32)
        if not MIN_TOKEN_CHARS <= len(secret) <= MAX_TOKEN_CHARS or unstorable(secret):
            raise InvalidParamsError(
                message=f"the push token signs each push: {MIN_TOKEN_CHARS}-{MAX_TOKEN_CHARS} "
                "characters"
            )
        if len(config.id) > MAX_CONFIG_ID_CHARS or unstorable(config.id):
            raise InvalidParamsError(
                message=f"a push config id is 1-{MAX_CONFIG_ID_CHARS} characters"
            )
        if (problem := await self.guard.check(config.url)) is not None:
            raise InvalidParamsError(message=f"invalid push notification url: {problem}")
        pushed = PushConfig(
            id=subscription_id(task_id, config.id),
            task_id=task_id,
            config_id=config.id,
            owner=caller.owner,
            url=config.url,
            secret=secret,
            auth_scheme=scheme,
            auth_credentials=credentials,
        )
        record = await self.tasks.record(task_id)
        await self._check_token_cap(pushed)
        if record is None:
            # Given with the send that makes the task: kept once its line is accepted.
            self._pending[task_id] = pushed
            return pushed.as_a2a()
        if record.line_id is None:
            raise InvalidParamsError(message=f"task {task_id} was rejected: it has nothing to push")
        others = await self.collection.find({"taskId": task_id}, {"_id": 1}).to_list()
        if len({other["_id"] for other in others} - {pushed.id}) >= self.cap:
            raise InvalidParamsError(message=f"a task holds at most {self.cap} push configs")
        # Set again, it starts afresh (its URL or secret may differ): from the task's line.
        await end_subscription(self.store, pushed.id)
        line = await self.store.get_message(record.line_id)
        # It goes with its task (retention): the task's day, not this one.
        pushed = pushed.model_copy(update={"age_bucket": record.age_bucket})
        await self._keep(pushed, line)
        return pushed.as_a2a()

    async def _check_token_cap(self, pushed: PushConfig) -> None:
        """At most ``token_cap`` configs per token (one set again under its id is no more)."""
        query: Doc = {"owner": pushed.owner, "_id": {"$ne": pushed.id}}
        if await self.collection.count_documents(query) >= self.token_cap:
            raise InvalidParamsError(
                message=f"a token holds at most {self.token_cap} push configs: delete some "
                "(tasks/pushNotificationConfig/delete), or wait for their tasks to go"
            )

    async def start(self, task_id: str, line: Message) -> None:
        """Keep the config given with the send whose line (``line``) was just accepted."""
        pushed = self._pending.pop(task_id, None)
        if pushed is not None:
            await self._keep(pushed, line)

    def rejected(self, task_id: str) -> None:
        """The task's line was refused: the config given with its send is not kept."""
        self._pending.pop(task_id, None)

    async def deleted(self, task_ids: Sequence[str]) -> None:
        """The tasks are gone (the token's cap, a delete): their configs go too, with their
        subscriptions' cursors and leases."""
        for task_id in task_ids:
            self._pending.pop(task_id, None)
            found = await self.collection.find({"taskId": task_id}, {"_id": 1}).to_list()
            for document in found:
                await end_subscription(self.store, str(document["_id"]))
                await self.collection.delete_one({"_id": document["_id"]})

    async def _keep(self, pushed: PushConfig, line: Message | None) -> None:
        """The config, live from ``line`` on when there is one (its cursor first: the worker
        never sees a live config without one)."""
        if line is not None:
            cursor = Cursor(id=pushed.id, forum_id=line.conversation_id, seq=line.seq)
            await self.store.insert_if_absent(collection(self.store, CURSORS), cursor.to_document())
            pushed = pushed.model_copy(update={"forum_id": line.conversation_id, "live": True})
        await self.collection.replace_one({"_id": pushed.id}, pushed.to_document(), upsert=True)

    async def _configs(self, task_id: str, owner: str | None = None) -> list[PushConfig]:
        if unstorable(task_id) is not None:
            return []  # no task has such an id (and the store would refuse the query)
        query: Doc = {"taskId": task_id} if owner is None else {"taskId": task_id, "owner": owner}
        found = await self.collection.find(query).to_list()
        return sorted((PushConfig.from_document(d) for d in found), key=lambda c: c.created_at)

    async def get_info(
        self, task_id: str, context: ServerCallContext
    ) -> list[TaskPushNotificationConfig]:
        owner = caller_of(context).owner
        return [pushed.as_a2a() for pushed in await self._configs(task_id, owner)]

    async def get_info_for_dispatch(self, task_id: str) -> list[TaskPushNotificationConfig]:
        return []  # the SDK's sender is not used: the webhook worker delivers

    async def delete_info(
        self, task_id: str, context: ServerCallContext, config_id: str | None = None
    ) -> None:
        for pushed in await self._configs(task_id, caller_of(context).owner):
            if config_id is None or pushed.config_id == config_id:
                await end_subscription(self.store, pushed.id)
                await self.collection.delete_one({"_id": pushed.id})


def authentication_of(config: TaskPushNotificationConfig) -> tuple[str | None, str | None]:
    """The config's authentication as (scheme, credentials), checked to make one header."""
    if not config.HasField("authentication"):
        return None, None
    scheme = config.authentication.scheme.strip()
    credentials = config.authentication.credentials.strip()
    if not _SCHEME.fullmatch(scheme):
        raise InvalidParamsError(
            message="a push config's authentication needs its scheme (an HTTP authentication "
            'scheme such as "Bearer")'
        )
    if not credentials:
        raise InvalidParamsError(
            message="a push config's authentication needs its credentials: they are sent as "
            f"the push's Authorization header ({scheme} <credentials>)"
        )
    if len(credentials) > MAX_CREDENTIALS_CHARS or not _CREDENTIALS.fullmatch(credentials):
        raise InvalidParamsError(
            message="a push config's credentials are 1-"
            f"{MAX_CREDENTIALS_CHARS} visible ASCII characters (one header value)"
        )
    return scheme, credentials


class TaskPushRunner(SubscriptionRunner):
    """A task's push subscription: its turn's lines only, as A2A events; removed at its end."""

    def __init__(
        self, worker: WebhookWorker, subscription: WebhookSubscription, tasks: MeshTaskStore
    ) -> None:
        super().__init__(worker, subscription)
        self.tasks = tasks
        self._task: tuple[TaskRecord, Message] | None = None
        self._checked = time.monotonic()

    async def _follows(self) -> tuple[TaskRecord, Message] | None:
        """The task and the line it follows now (a second message moves it), or None once the
        task is gone (its token's cap, retention)."""
        task_id = self.subscription.task_id
        record = await self.tasks.record(task_id) if task_id is not None else None
        if record is None or record.line_id is None:
            return None
        if self._task is not None and self._task[1].id == record.line_id:
            self._task = (record, self._task[1])
            return self._task
        line = await self.worker.store.get_message(record.line_id)
        self._task = None if line is None else (record, line)
        return self._task

    async def wanted(self, line: Message) -> bool:
        if not deliverable(line):
            return False
        follows = await self._follows()
        if follows is None:
            await end_subscription(self.worker.store, self.subscription.id)
            return False
        return outcome_of(follows[1], line) is not None

    def headers(self) -> dict[str, str]:
        """The config's authentication, as the A2A spec has the agent send it."""
        subscription = self.subscription
        if not isinstance(subscription, PushSubscription) or subscription.authorization is None:
            return {}
        return {"Authorization": subscription.authorization.get_secret_value()}

    def body(self, delivery: str, line: Message) -> bytes:
        assert self._task is not None  # wanted() found it
        record, followed = self._task
        found = outcome_of(followed, line)
        task_id, context_id = record.id, record.context_id
        if isinstance(found, Answered | Failed):
            event = final_status(task_id, context_id, found)
            event.status.timestamp.FromDatetime(line.created_at)  # the same in every retry
        else:
            assert isinstance(found, Waiting)  # an approval notice: the turn goes on
            said = agent_message(task_id, context_id, waiting_text(found), line.id)
            event = status_event(
                task_id, context_id, TaskState.TASK_STATE_WORKING, said, line.created_at
            )
        return json.dumps(MessageToDict(to_stream_response(event)), ensure_ascii=False).encode()

    async def _deliver(self, cursor: Cursor, line: Message) -> bool:
        moved = await super()._deliver(cursor, line)
        ended = self._task is not None and isinstance(
            outcome_of(self._task[1], line), Answered | Failed
        )
        if moved and ended:
            await end_subscription(self.worker.store, self.subscription.id)
        return moved

    async def _step(self) -> None:
        if time.monotonic() - self._checked >= CHECK_SECONDS:
            self._checked = time.monotonic()
            if await self._ended_before_cursor():
                await end_subscription(self.worker.store, self.subscription.id)
        await super()._step()

    async def _ended_before_cursor(self) -> bool:
        """The task is gone, or its end lies at or before the cursor (delivered, and the
        gateway died before it removed the subscription)."""
        follows = await self._follows()
        if follows is None:
            return True
        cursor = await self.worker.store.db[CURSORS].find_one({"_id": self.subscription.id})
        if cursor is None:
            return False
        # However far after its line the end came (turn_outcome reads window after window).
        ended = await turn_outcome(
            self.worker.store,
            self.subscription.forum_id,
            follows[1],
            through=int(cursor.get("seq", 0)),
        )
        return ended is not None


def runner_for(
    tasks: MeshTaskStore,
) -> Callable[[WebhookWorker, WebhookSubscription], SubscriptionRunner]:
    """The webhook worker's runner factory: the A2A door's own for its tasks' subscriptions."""

    def make(worker: WebhookWorker, subscription: WebhookSubscription) -> SubscriptionRunner:
        if subscription.task_id is not None:
            return TaskPushRunner(worker, subscription, tasks)
        return SubscriptionRunner(worker, subscription)

    return make

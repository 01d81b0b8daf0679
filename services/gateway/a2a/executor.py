"""The mesh as a2a-sdk's agent executor: a sent message is a caller's line, its task that turn.

``execute`` posts the message's text as the caller's line in the forum kept for (token,
contextId) (:func:`services.gateway.calling.post_line`: the door makes the forum and joins the
agent with the first line), records the task with the line, and follows the line's turn
(:func:`~services.gateway.calling.follow_turn`) to its end, translating as it goes
(:mod:`services.gateway.a2a.turns`). A refused line (the token's line limit, its size) is a
``rejected`` task that says why; a mesh that does not answer is an error to try again.

A second message to a task this process runs is another line in the same forum, handled by the
join's ``whileBusy`` like any line: the task then follows the newest line (:meth:`move`) and
ends with its answer (under ``queue`` the earlier line's own answer stays in the forum).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Coroutine, Iterator
from typing import Any, Final

from a2a.server.agent_execution import AgentExecutor, RequestContext
from a2a.server.events import EventQueue
from a2a.types.a2a_pb2 import Message as A2AMessage
from a2a.types.a2a_pb2 import Role, Task, TaskState, TaskStatus
from a2a.utils.errors import InternalError
from prometheus_client import Gauge

from services.gateway.a2a.caller import Caller, caller_of
from services.gateway.a2a.push import MeshPushConfigStore
from services.gateway.a2a.task_store import Attachment, MeshTaskStore
from services.gateway.a2a.turns import (
    A2AEvent,
    TurnTranslator,
    agent_message,
    following_turn,
    status_event,
)
from services.gateway.calling import Answered, Failed, TurnEvent, post_line
from services.gateway.deps import ApiError
from yoke.core.ids import derive_id
from yoke.core.lru import LRUCache
from yoke.core.models import Message

log = logging.getLogger(__name__)

DOOR: Final = "a2a"
# Events of a turn waiting for the executor (it is paced by the SDK's queue; the forum's own
# subscription buffers or falls back to the store behind it).
INBOX_EVENTS = 256
# Following a turn again after a failure to: the first pause, and the longest.
FOLLOW_RETRY_SECONDS = 1.0
FOLLOW_RETRY_CAP_SECONDS = 30.0


FOLLOWED = Gauge(
    "yoke_a2a_tasks_followed",
    "A2A tasks whose turn this gateway follows now for their callers (each holds a forum "
    "subscription until its end or YOKE_A2A_FOLLOW_SECONDS).",
)


class _Moved:
    """The task follows a newer line now."""


class _Detached:
    """The task was followed for as long as a gateway follows one: its turn goes on in the
    mesh, and ``tasks/get``, a resubscribe and its pushes bring the end from the store."""


MOVED = _Moved()
DETACHED = _Detached()


def message_text(message: A2AMessage | None) -> str:
    """The message's text parts, in order (the mesh's lines are text)."""
    if message is None:
        return ""
    return "\n".join(part.text for part in message.parts if part.WhichOneof("content") == "text")


def line_key(caller: Caller, message: A2AMessage, task_id: str) -> str:
    """The line's idempotency key: the caller's messageId, so a send retried with the same
    message posts no second line (the door keeps keys in the token's namespace)."""
    return derive_id("a2a-line", caller.agent.id, message.message_id or task_id)


class Turn:
    """A task this process runs: the line it follows, and whether it has ended."""

    def __init__(self, task_id: str, context_id: str, line: Message, queue: EventQueue) -> None:
        self.task_id = task_id
        self.context_id = context_id
        self.forum_id = line.conversation_id
        self.line = line
        self.queue = queue
        self.ended = False
        # Lines being posted to this task: its end waits for them (the task follows them).
        self.posting = 0
        self.settled = asyncio.Event()
        self.settled.set()
        self.inbox: asyncio.Queue[TurnEvent | _Moved | _Detached] = asyncio.Queue(INBOX_EVENTS)

    @contextlib.contextmanager
    def holding(self) -> Iterator[None]:
        """While a line is posted to the task: its end waits (the task may follow it)."""
        self.posting += 1
        self.settled.clear()
        try:
            yield
        finally:
            self.posting -= 1
            if not self.posting:
                self.settled.set()


class MeshExecutor(AgentExecutor):
    """Runs each task's turn in this process; ``turns`` are the ones running here."""

    def __init__(self, tasks: MeshTaskStore, pushes: MeshPushConfigStore) -> None:
        self.tasks = tasks
        self.pushes = pushes
        self.turns: dict[str, Turn] = {}
        # Lines posted by the request handler for tasks that run nowhere now (a restarted
        # gateway): the execute that follows adopts them.
        self._handed: LRUCache[str, Message] = LRUCache(10_000)
        # Told of a task this process stopped following before its end (the request handler
        # lets the SDK's copy of it go), and the tasks telling it.
        self.let_go: Callable[[str], Coroutine[Any, Any, None]] | None = None
        self._letting_go: set[asyncio.Task[None]] = set()

    def hand_over(self, task_id: str, line: Message) -> None:
        self._handed[task_id] = line

    async def execute(self, context: RequestContext, event_queue: EventQueue) -> None:
        caller = caller_of(context.call_context)
        task_id, context_id = context.task_id, context.context_id
        message = context.message
        if task_id is None or context_id is None or message is None:
            raise InternalError(message="a send without its task, context or message")
        if context.current_task is None:
            line = await self._first_line(caller, task_id, context_id, message, event_queue)
            if line is None:
                return
        else:
            line = await self._next_line(task_id, context_id, message, event_queue)
        turn = Turn(task_id, context_id, line, event_queue)
        self.turns[task_id] = turn
        FOLLOWED.inc()
        try:
            await self._follow(caller, turn)
        finally:
            FOLLOWED.dec()
            if self.turns.get(task_id) is turn:
                del self.turns[task_id]

    async def _first_line(
        self,
        caller: Caller,
        task_id: str,
        context_id: str,
        message: A2AMessage,
        queue: EventQueue,
    ) -> Message | None:
        """The task's line, posted and recorded (the task then exists, ``working``); None when
        the door refused it (the task is ``rejected``, saying why)."""
        text = message_text(message)
        try:
            line = await post_line(
                caller.state,
                caller.token,
                DOOR,
                caller.agent,
                context_id,
                text,
                idempotency_key=line_key(caller, message, task_id),
            )
        except ApiError as refused:
            if refused.status >= 500:
                raise InternalError(message=refused.error) from refused
            await self._refuse(task_id, context_id, message, refused.error, queue)
            return None
        winner = await self.tasks.claim_line(line.id, task_id)
        if winner != task_id:  # the same message sent at once again: one task follows it
            said = f"this message was sent already: it is task {winner}"
            await self._refuse(task_id, context_id, message, said, queue)
            return None
        self.tasks.attach(task_id, Attachment(line.conversation_id, line.id))
        await self.pushes.start(task_id, line)  # push configs given with the send
        status = TaskStatus(state=TaskState.TASK_STATE_WORKING)
        await queue.enqueue_event(
            Task(id=task_id, context_id=context_id, status=status, history=[message])
        )
        return line

    @staticmethod
    async def _refuse(
        task_id: str, context_id: str, message: A2AMessage, said: str, queue: EventQueue
    ) -> None:
        """The task ``rejected``, saying why (it follows nothing)."""
        why = agent_message(task_id, context_id, said, f"{task_id}:refused")
        status = TaskStatus(state=TaskState.TASK_STATE_REJECTED, message=why)
        await queue.enqueue_event(
            Task(id=task_id, context_id=context_id, status=status, history=[message])
        )

    async def _next_line(
        self, task_id: str, context_id: str, message: A2AMessage, queue: EventQueue
    ) -> Message:
        """A message to a task that ran elsewhere: its line (posted by the request handler),
        or, without one, the line the task follows already."""
        line = self._handed.pop(task_id, None)
        if line is None:
            record = await self.tasks.record(task_id)
            found = None
            if record is not None and record.line_id is not None:
                found = await self.tasks.store.get_message(record.line_id)
            if found is None:
                raise InternalError(message=f"task {task_id} has no line to follow")
            return found
        self.tasks.attach(task_id, Attachment(line.conversation_id, line.id))
        await queue.enqueue_event(said(task_id, context_id, message))
        return line

    async def move(self, turn: Turn, line: Message, message: A2AMessage) -> None:
        """Make the running task follow ``line``, just posted to its forum (call it while
        :meth:`Turn.holding`: the task's end waits)."""
        turn.line = line
        self.tasks.attach(turn.task_id, Attachment(line.conversation_id, line.id))
        with contextlib.suppress(asyncio.QueueFull):
            turn.inbox.put_nowait(MOVED)  # else it sees the newer line at its next event
        await turn.queue.enqueue_event(said(turn.task_id, turn.context_id, message))

    def running(self, task_id: str) -> Turn | None:
        turn = self.turns.get(task_id)
        return turn if turn is not None and not turn.ended else None

    async def _follow(self, caller: Caller, turn: Turn) -> None:
        translator = TurnTranslator(turn.task_id, turn.context_id)
        deadline = time.monotonic() + caller.state.settings.a2a_follow_seconds
        while True:
            target = turn.line
            ended = await self._follow_line(caller, turn, target, translator, deadline)
            await turn.settled.wait()
            if isinstance(ended, _Detached):
                if self.let_go is not None:  # once this execute has returned
                    letting: asyncio.Task[None] = asyncio.create_task(self.let_go(turn.task_id))
                    self._letting_go.add(letting)
                    letting.add_done_callback(self._letting_go.discard)
                log.info(
                    "task %s: followed for %.0f s, left working (its end is read from the store)",
                    turn.task_id,
                    caller.state.settings.a2a_follow_seconds,
                    extra={"conversationId": turn.forum_id, "messageId": turn.line.id},
                )
                return
            if ended is None or turn.line.id != target.id:
                translator.moved()
                continue  # a newer line: its turn is the task's now
            if turn.ended:
                return  # canceled meanwhile (tasks/cancel wrote the end)
            turn.ended = True
            for event in translator.events(ended):
                await turn.queue.enqueue_event(event)
            return

    async def _follow_line(
        self,
        caller: Caller,
        turn: Turn,
        target: Message,
        translator: TurnTranslator,
        deadline: float,
    ) -> Answered | Failed | _Detached | None:
        """``target``'s turn, translated onto the task's queue, until it ends (its end is
        returned), the task moves to a newer line (None) or ``deadline`` passes."""
        inbox: asyncio.Queue[TurnEvent | _Moved | _Detached] = asyncio.Queue(INBOX_EVENTS)
        turn.inbox = inbox

        async def pump() -> None:
            # A forum subscription that cannot be made, the store away: transient, so followed
            # again after a pause (the turn goes on in the mesh; ending the task for it would
            # call it failed).
            pause = FOLLOW_RETRY_SECONDS
            while True:
                try:
                    events = following_turn(caller.state, turn.forum_id, target, deadline)
                    async with contextlib.aclosing(events) as following:
                        async for event in following:
                            await inbox.put(event)
                    await inbox.put(DETACHED)  # read only if no end came before it
                    return
                except Exception as error:
                    log.warning("task %s: following its turn failed: %r", turn.task_id, error)
                await asyncio.sleep(pause)
                pause = min(pause * 2, FOLLOW_RETRY_CAP_SECONDS)

        pumping = asyncio.create_task(pump(), name=f"a2a-follow:{turn.task_id}")
        try:
            while True:
                item = await inbox.get()
                if isinstance(item, _Moved) or turn.line.id != target.id:
                    return None
                if isinstance(item, Answered | Failed | _Detached):
                    return item
                for event in translator.events(item):
                    await turn.queue.enqueue_event(event)
        finally:
            pumping.cancel()
            await asyncio.gather(pumping, return_exceptions=True)

    async def cancel(self, context: RequestContext, event_queue: EventQueue) -> None:
        """The task's end as ``canceled`` (the request handler has stopped its forum first),
        unless its turn ended already."""
        task_id, context_id = context.task_id, context.context_id
        if task_id is None or context_id is None:
            return
        turn = self.turns.get(task_id)
        if turn is not None:
            if turn.ended:
                return
            turn.ended = True
        stopped = agent_message(task_id, context_id, "canceled by tasks/cancel", f"{task_id}:end")
        await event_queue.enqueue_event(
            status_event(task_id, context_id, TaskState.TASK_STATE_CANCELED, stopped)
        )


def said(task_id: str, context_id: str, message: A2AMessage) -> A2AEvent:
    """``working`` on the caller's newer message: the status carries it, so the task's history
    keeps it once the next status replaces this one."""
    copy = A2AMessage()
    copy.CopyFrom(message)
    copy.role = Role.ROLE_USER
    copy.task_id, copy.context_id = task_id, context_id
    return status_event(task_id, context_id, TaskState.TASK_STATE_WORKING, copy)

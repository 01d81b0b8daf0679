"""A turn of the mesh as A2A events: one mapping for the executor, resubscribers and pushes.

A task is the turn of its newest line (:mod:`services.gateway.calling`): its deltas are chunks of
the artifact ``reply`` (the draft, replaced by the line that follows), a wait for an approver is
``working`` with a status message naming the tool, the agent's answer is the artifact and the
``completed`` status's message, a forum notice that ends the turn is ``failed`` with its words,
and a stop (``tasks/cancel`` is a ``/stop`` of the forum) is ``canceled``. Every event is
derived from the mesh's own facts (the line's id is the message's id, its time the status's),
so whoever translates the same turn, in whichever process, says the same.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator
from datetime import datetime

from a2a.types.a2a_pb2 import (
    Artifact,
    Message,
    Part,
    Role,
    Task,
    TaskArtifactUpdateEvent,
    TaskState,
    TaskStatus,
    TaskStatusUpdateEvent,
)

from services.gateway.calling import Answered, Delta, Failed, TurnEvent, Waiting, follow_turn
from services.gateway.deps import Gateway
from yoke.core.models import Message as Line
from yoke.core.models import utcnow

REPLY_ARTIFACT = "reply"
TERMINAL_STATES = frozenset(
    {
        TaskState.TASK_STATE_COMPLETED,
        TaskState.TASK_STATE_FAILED,
        TaskState.TASK_STATE_CANCELED,
        TaskState.TASK_STATE_REJECTED,
    }
)
# The forum notice's reason for a turn a /stop ended (services/processor/notices.py).
STOPPED = "stopped"

A2AEvent = TaskStatusUpdateEvent | TaskArtifactUpdateEvent


def following_turn(
    state: Gateway, forum_id: str, line: Line, deadline: float | None = None
) -> AsyncGenerator[TurnEvent, None]:
    """:func:`~services.gateway.calling.follow_turn` for a caller of the A2A door, which stops
    ``YOKE_A2A_FOLLOW_SECONDS`` after it began, or at ``deadline`` (a generator: close it,
    and its forum subscription, when a reader stops early)."""
    if deadline is None:
        deadline = time.monotonic() + state.settings.a2a_follow_seconds
    return follow_turn(state, forum_id, line, deadline=deadline)


def state_name(state: TaskState) -> str:
    """``completed``, ``working``...: a state as people (and metric labels) say it."""
    name: str = TaskState.Name(state)
    return name.removeprefix("TASK_STATE_").lower()


def is_terminal(state: TaskState) -> bool:
    return state in TERMINAL_STATES


def agent_message(
    task_id: str,
    context_id: str,
    text: str,
    message_id: str,
    role: Role = Role.ROLE_AGENT,
) -> Message:
    return Message(
        message_id=message_id,
        task_id=task_id,
        context_id=context_id,
        role=role,
        parts=[Part(text=text)],
    )


def status_event(
    task_id: str,
    context_id: str,
    state: TaskState,
    message: Message | None = None,
    at: datetime | None = None,
) -> TaskStatusUpdateEvent:
    status = TaskStatus(state=state, timestamp=at or utcnow())
    if message is not None:
        status.message.CopyFrom(message)
    return TaskStatusUpdateEvent(task_id=task_id, context_id=context_id, status=status)


def reply_artifact(
    task_id: str, context_id: str, text: str, *, append: bool, last: bool
) -> TaskArtifactUpdateEvent:
    artifact = Artifact(artifact_id=REPLY_ARTIFACT, name="reply", parts=[Part(text=text)])
    return TaskArtifactUpdateEvent(
        task_id=task_id, context_id=context_id, artifact=artifact, append=append, last_chunk=last
    )


def final_status(task_id: str, context_id: str, ended: Answered | Failed) -> TaskStatusUpdateEvent:
    """The status a turn's end gives its task (the message's id is the forum line's, so two
    processes that both saw the end say the same)."""
    if isinstance(ended, Answered):
        line = ended.message
        reply = agent_message(task_id, context_id, line.text, line.id)
        return status_event(
            task_id, context_id, TaskState.TASK_STATE_COMPLETED, reply, line.created_at
        )
    state = (
        TaskState.TASK_STATE_CANCELED if ended.reason == STOPPED else TaskState.TASK_STATE_FAILED
    )
    notice = agent_message(task_id, context_id, ended.text, f"{task_id}:end")
    return status_event(task_id, context_id, state, notice)


def waiting_text(wait: Waiting) -> str:
    # From the approval request (a call id): the tool's name; from the forum's notice: its words.
    if wait.call_id is not None:
        return f"waiting for a person to approve: {wait.tool}"
    return wait.tool


class TurnTranslator:
    """One task's turn events as A2A events, in order (it remembers what the draft holds)."""

    def __init__(self, task_id: str, context_id: str) -> None:
        self.task_id = task_id
        self.context_id = context_id
        self._drafting = False
        self._waits: set[str] = set()

    def moved(self) -> None:
        """The task follows a newer line now: what it waits for is that line's."""
        self._waits.clear()

    def events(self, event: TurnEvent) -> list[A2AEvent]:
        task_id, context_id = self.task_id, self.context_id
        if isinstance(event, Delta):
            if not event.text:
                return []  # a draft's end mark: the line (or its abandonment) follows
            # A draft starts (index 0, or the first piece this reader sees) by replacing the
            # artifact: appending to one that does not exist is an agent error in A2A.
            append = self._drafting and event.index > 0
            self._drafting = True
            return [reply_artifact(task_id, context_id, event.text, append=append, last=False)]
        if isinstance(event, Waiting):
            key = event.call_id or "notice"
            # The request and the forum's notice both tell of one wait: say it once.
            if key in self._waits or (event.call_id is None and self._waits):
                return []
            self._waits.add(key)
            message = agent_message(task_id, context_id, waiting_text(event), f"{task_id}:{key}")
            return [status_event(task_id, context_id, TaskState.TASK_STATE_WORKING, message)]
        found: list[A2AEvent] = []
        if isinstance(event, Answered):
            text = event.message.text
            found.append(reply_artifact(task_id, context_id, text, append=False, last=True))
        found.append(final_status(task_id, context_id, event))
        return found


def apply_end(task: Task, ended: Answered | Failed) -> Task:
    """``task`` as its turn's end leaves it (what ``tasks/get`` answers for a task whose
    process did not live to write its end): the reply as artifact and message, or the end."""
    done = Task()
    done.CopyFrom(task)
    final = final_status(task.id, task.context_id, ended)
    if done.status.HasField("message"):
        done.history.append(done.status.message)
    done.status.CopyFrom(final.status)
    if isinstance(ended, Answered):
        del done.artifacts[:]
        done.artifacts.append(
            reply_artifact(
                task.id, task.context_id, ended.message.text, append=False, last=True
            ).artifact
        )
    return done

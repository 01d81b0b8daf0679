"""a2a-sdk's request handler, with what the mesh adds: checks before a line, a message to a
working task as another line in its forum, and ``tasks/cancel`` as a ``/stop``.

Everything else is the SDK's :class:`DefaultRequestHandlerV2`: it runs the executor, saves the
task through the mesh's store, serves ``tasks/get`` from it (which reads a non-final task's
turn from the forum) and resubscriptions from the running process or the mesh
(:mod:`services.gateway.a2a.event_stream`).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator

from a2a.server.agent_execution import RequestContextBuilder
from a2a.server.context import ServerCallContext
from a2a.server.events import Event
from a2a.server.request_handlers import DefaultRequestHandlerV2
from a2a.server.request_handlers.request_handler import validate_request_params
from a2a.types.a2a_pb2 import (
    AgentCard,
    CancelTaskRequest,
    Message,
    Part,
    SendMessageRequest,
    SubscribeToTaskRequest,
    Task,
)
from a2a.utils.errors import (
    A2AError,
    ContentTypeNotSupportedError,
    InternalError,
    InvalidParamsError,
    InvalidRequestError,
    TaskNotCancelableError,
    TaskNotFoundError,
    UnsupportedOperationError,
)
from a2a.utils.task import apply_history_length

from services.gateway.a2a.caller import Caller, caller_of
from services.gateway.a2a.cards import TEXT
from services.gateway.a2a.event_stream import MeshEventStream
from services.gateway.a2a.executor import DOOR, MeshExecutor, Turn, line_key, message_text
from services.gateway.a2a.push import MeshPushConfigStore
from services.gateway.a2a.task_store import MeshTaskStore, TaskRecord
from services.gateway.a2a.turns import is_terminal, state_name
from services.gateway.calling import Answered, caller_author, kept_forum_id, post_line, turn_outcome
from services.gateway.deps import ApiError
from services.gateway.submitting import stop_forum
from yoke.core.ids import derive_id, submitted_line_id
from yoke.core.models import KeptForum, unstorable
from yoke.core.models import Message as Line

# What a kept forum's key may be (yoke.core.models.KeptForum): an A2A contextId is one.
MAX_CONTEXT_ID_CHARS = 128


def refusal(error: ApiError) -> A2AError:
    """The door's refusal of a line in the protocol's terms (a sentence that says what to do)."""
    if error.status >= 500:
        return InternalError(message=error.error)
    retry = error.headers.get("Retry-After")
    if retry is not None:
        return InvalidRequestError(message=f"{error.error} (retry in {retry} s)")
    return InvalidParamsError(message=error.error)


def media_type(part: Part) -> str:
    """A part's media type as the card's modes name them: ``text/plain`` for text that says
    none, a file's own (or ``a file``), ``application/json`` for data that says none."""
    declared = part.media_type.split(";", 1)[0].strip().lower()
    kind = part.WhichOneof("content")
    if declared:
        return declared
    if kind == "text":
        return TEXT
    if kind == "data":
        return "application/json"
    return "a file of no media type" if kind in ("raw", "url") else "an empty part"


def check_message(message: Message) -> None:
    """What the mesh can take as a line, refused before anything is made of it.

    The agent reads text (the card's input modes: ``text/plain``): a part of any other media
    type is refused with ContentTypeNotSupportedError, alone or beside text, as A2A 1.0 requires
    (3.1.1), rather than dropped unseen from what the agent is asked."""
    refused = sorted({media_type(part) for part in message.parts} - {TEXT})
    if refused:
        raise ContentTypeNotSupportedError(
            message=f"the agent takes {TEXT} parts only (and answers in {TEXT}); this message "
            f"has {', '.join(refused)}: send it as text"[:500]
        )
    text = message_text(message)
    if not text.strip():
        raise InvalidParamsError(message="the message has no text: the agent reads text parts")
    for what, value in (
        ("text", text),
        ("messageId", message.message_id),
        ("contextId", message.context_id),
    ):
        if (problem := unstorable(value)) is not None:
            raise InvalidParamsError(message=f"the message's {what} {problem}")
    if len(message.context_id) > MAX_CONTEXT_ID_CHARS:
        raise InvalidParamsError(
            message=f"a contextId is at most {MAX_CONTEXT_ID_CHARS} characters"
        )


class MeshRequestHandler(DefaultRequestHandlerV2):
    def __init__(
        self,
        executor: MeshExecutor,
        tasks: MeshTaskStore,
        pushes: MeshPushConfigStore,
        stream: MeshEventStream,
        card: AgentCard,
        contexts: RequestContextBuilder,
    ) -> None:
        super().__init__(
            agent_executor=executor,
            task_store=tasks,
            agent_card=card,
            push_config_store=pushes,
            request_context_builder=contexts,
            event_stream=stream,
        )
        self.executor = executor
        self.tasks = tasks
        executor.let_go = self.let_go

    async def let_go(self, task_id: str) -> None:
        """The SDK's copy of a task this process stopped following (``YOKE_A2A_FOLLOW_SECONDS``)
        is closed: its subscribers and a blocking send waiting on it end (with the task as the
        store has it), and what comes later for the task is served from the mesh
        (:class:`MeshEventStream`) or runs it anew, never a copy that waits for nothing."""
        active = await self._active_task_registry.get(task_id)
        if active is not None and self.executor.running(task_id) is None:
            await active.aclose()

    async def _sent_before(
        self, params: SendMessageRequest, context: ServerCallContext
    ) -> TaskRecord | None:
        """The task a send of this message (its messageId, in its context) made already: a
        client retrying its send gets that task, not another one following the same line
        (which the token's line limit, answering a repeat "duplicate", would not stop)."""
        message = params.message
        if message.task_id or not message.context_id or not message.message_id:
            return None
        caller = caller_of(context)
        forum_id = kept_forum_id(caller.token, DOOR, caller.agent, message.context_id)
        key = caller.token.namespaced(line_key(caller, message, ""))
        return await self.tasks.sent_as(caller, submitted_line_id(forum_id, key))

    @validate_request_params
    async def on_message_send(
        self, params: SendMessageRequest, context: ServerCallContext
    ) -> Message | Task:
        check_message(params.message)
        earlier = await self._sent_before(params, context)
        if earlier is not None:
            turn = self.executor.running(earlier.id)
            if turn is not None:
                return await self._until_end(turn, params, context)
            task = await self.tasks.current(earlier)
            return apply_history_length(task, params.configuration)
        if params.message.task_id:
            turn = await self._continue(params, context)
            if turn is not None:
                return await self._until_end(turn, params, context)
        sent: Message | Task = await super().on_message_send(params, context)
        return sent

    @validate_request_params
    async def on_message_send_stream(
        self, params: SendMessageRequest, context: ServerCallContext
    ) -> AsyncGenerator[Event, None]:
        check_message(params.message)
        earlier = await self._sent_before(params, context)
        if earlier is not None:
            task = await self.tasks.current(earlier)
            if is_terminal(task.status.state):
                yield task
            else:
                following = SubscribeToTaskRequest(id=earlier.id)
                async for event in self.on_subscribe_to_task(following, context):
                    yield event
            return
        if params.message.task_id:
            turn = await self._continue(params, context)
            if turn is not None:
                active = await self._active_task_registry.get(turn.task_id)
                if active is not None:
                    async for event in active.subscribe(include_initial_task=True):
                        yield event
                    return
        async for event in super().on_message_send_stream(params, context):
            yield event

    async def _continue(
        self, params: SendMessageRequest, context: ServerCallContext
    ) -> Turn | None:
        """A message naming its task: a line in the task's forum. Returns the task's turn when
        it runs here (it follows the line now); None when the SDK is to run the task anew (its
        process is gone), with the line handed to the executor."""
        caller = caller_of(context)
        message = params.message
        record = await self.tasks.record(message.task_id, caller)
        if record is None:
            raise TaskNotFoundError(message=f"task {message.task_id} not found")
        if message.context_id and message.context_id != record.context_id:
            raise InvalidParamsError(
                message=f"context {message.context_id} is not task {record.id}'s "
                f"({record.context_id})"
            )
        message.context_id = record.context_id
        task = await self.tasks.current(record)
        if is_terminal(task.status.state):
            raise UnsupportedOperationError(
                message=f"task {record.id} is {state_name(task.status.state)}: send the message "
                "without its taskId (and with its contextId) for a new task in that conversation"
            )
        turn = self.executor.running(record.id)
        if turn is None:
            self.executor.hand_over(record.id, await self._post(caller, record, message))
            return None
        with turn.holding():
            line = await self._post(caller, record, message)
            await self.executor.move(turn, line, message)
        return turn

    async def _post(self, caller: Caller, record: TaskRecord, message: Message) -> Line:
        try:
            return await post_line(
                caller.state,
                caller.token,
                DOOR,
                caller.agent,
                record.context_id,
                message_text(message),
                idempotency_key=line_key(caller, message, record.id),
            )
        except ApiError as refused:
            raise refusal(refused) from refused

    async def _until_end(
        self, turn: Turn, params: SendMessageRequest, context: ServerCallContext
    ) -> Task:
        """A blocking send to a running task waits for its end, as the first send does."""
        active = await self._active_task_registry.get(turn.task_id)
        if active is not None and not params.configuration.return_immediately:
            try:
                async for event in active.subscribe(replace_status_update_with_task=True):
                    if isinstance(event, Task) and is_terminal(event.status.state):
                        return apply_history_length(event, params.configuration)
            except UnsupportedOperationError:
                pass  # it ended meanwhile: the store has it
        stored = await self.tasks.get(turn.task_id, context)
        if stored is None:
            raise TaskNotFoundError
        return apply_history_length(stored.task, params.configuration)

    @validate_request_params
    async def on_cancel_task(
        self, params: CancelTaskRequest, context: ServerCallContext
    ) -> Task | None:
        """``/stop`` in the task's forum first (its model call is dropped, its open tool calls
        end, its line is not answered), then the SDK's cancel writes ``canceled``. A task whose
        answer came before the stop is not cancelable: it is ``completed``."""
        caller = caller_of(context)
        record = await self.tasks.record(params.id, caller)
        if record is None:
            raise TaskNotFoundError
        task = await self.tasks.current(record)
        if is_terminal(task.status.state):
            raise TaskNotCancelableError(
                message=f"task {record.id} is {state_name(task.status.state)}"
            )
        if record.forum_id is not None and record.line_id is not None:
            try:
                # One stop however many cancels of the task come at once (or are retried).
                once = derive_id("a2a-cancel", record.id)
                key = record.context_id
                await stop_forum(
                    caller.state,
                    caller.token,
                    kept_forum_id(caller.token, DOOR, caller.agent, key),
                    caller_author(caller.token, DOOR),
                    once,
                    KeptForum(door=DOOR, agent=caller.agent.id, key=key),
                )
            except ApiError as refused:
                raise refusal(refused) from refused
            line = await caller.state.store.get_message(record.line_id)
            ended = await turn_outcome(caller.state.store, record.forum_id, line) if line else None
            if isinstance(ended, Answered):
                raise TaskNotCancelableError(
                    message=f"task {record.id} was answered before the cancel: it is completed"
                )
        canceled: Task | None = await super().on_cancel_task(params, context)
        return canceled

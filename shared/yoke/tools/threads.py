"""Tool code the mesh did not write (a plugin's) runs on a thread of its own, never on the loop.

One event loop serves every conversation of a process: a plugin function that computes for a
minute, sync or ``async`` without an ``await``, would stall them all and its timeout could not
even fire. So each call runs on a daemon thread: a sync function is called there, and what an
async one returns is awaited there, in an event loop of that thread's own. The call's timeout
is kept on the caller's side: at the timeout the call ends with an error result, an async
tool's coroutine is cancelled in its loop, and a sync function (Python cannot stop a thread)
runs on until it returns, its answer dropped. At most :data:`MAX_TOOL_THREADS` such threads
run at once in a process; a call finding them all busy waits for one within its own timeout.

Threads are daemons: one that never returns does not keep its process from exiting.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import threading
import weakref
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

# Threads running tool code in one process, those past their timeout included (a bound:
# each is a thread and whatever it holds).
MAX_TOOL_THREADS = 16

_slots: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore] = (
    weakref.WeakKeyDictionary()
)
_running = 0
_running_lock = threading.Lock()


@dataclass
class Waiting:
    """Whether a call still waits for a thread (so a timeout then says why it never ran)."""

    for_thread: bool = True


def running() -> int:
    """Threads running tool code now, those whose call already ended included."""
    return _running


def _slots_of(loop: asyncio.AbstractEventLoop) -> asyncio.Semaphore:
    # One count per event loop (a service has one): a semaphore is bound to its loop.
    slots = _slots.get(loop)
    if slots is None:
        slots = _slots[loop] = asyncio.Semaphore(MAX_TOOL_THREADS)
    return slots


class _Call:
    """One run on its thread: what it answers, and how to cancel an async tool in its loop."""

    def __init__(
        self,
        run: Callable[[], object],
        loop: asyncio.AbstractEventLoop,
        answer: asyncio.Future[Any],
        release: Callable[[], None],
    ) -> None:
        self.run = run
        self.loop = loop
        self.answer = answer
        self.release = release
        self.lock = threading.Lock()
        self.cancelled = False
        self.task: asyncio.Task[Any] | None = None
        self.task_loop: asyncio.AbstractEventLoop | None = None

    def thread_main(self) -> None:
        global _running
        with _running_lock:
            _running += 1
        outcome: tuple[object, BaseException | None] = (None, None)
        try:
            value = self.run()
            if inspect.isawaitable(value):
                value = asyncio.run(self._drive(value))
            outcome = (value, None)
        except BaseException as error:  # the plugin's own code: anything may escape
            outcome = (None, error)
        finally:
            with _running_lock:
                _running -= 1
            with contextlib.suppress(RuntimeError):  # the caller's loop closed meanwhile
                self.loop.call_soon_threadsafe(self._settle, *outcome)

    async def _drive(self, awaitable: Awaitable[object]) -> object:
        with self.lock:
            if self.cancelled:
                raise asyncio.CancelledError
            self.task = asyncio.current_task()
            self.task_loop = asyncio.get_running_loop()
        return await awaitable

    def _settle(self, value: object, error: BaseException | None) -> None:
        self.release()
        if self.answer.done():
            return  # the call ended at its timeout: this answer comes too late
        if error is None:
            self.answer.set_result(value)
        elif isinstance(error, Exception):
            self.answer.set_exception(error)
        else:  # SystemExit, KeyboardInterrupt, a CancelledError of its own: not the caller's
            self.answer.set_exception(RuntimeError(f"raised {type(error).__name__}"))

    def cancel(self) -> None:
        """The call ended: cancel an async tool's coroutine (a sync function runs on)."""
        with self.lock:
            self.cancelled = True
            task, task_loop = self.task, self.task_loop
        if task is not None and task_loop is not None:
            with contextlib.suppress(RuntimeError):  # its loop has just finished
                task_loop.call_soon_threadsafe(task.cancel)


def busy_text() -> str:
    return (
        f"all {MAX_TOOL_THREADS} threads for tools are busy (calls past their timeout may "
        "still be running)"
    )


async def run_in_thread(run: Callable[[], object], name: str, waiting: Waiting) -> object:
    """What ``run()`` returns (awaited, if it is awaitable) once it returns on a thread of its
    own, after waiting for one if all are busy (``waiting`` says when it has one); cancelled
    (its timeout), the call ends at once."""
    loop = asyncio.get_running_loop()
    slots = _slots_of(loop)
    await slots.acquire()
    waiting.for_thread = False
    answer: asyncio.Future[object] = loop.create_future()
    call = _Call(run, loop, answer, slots.release)
    try:
        threading.Thread(target=call.thread_main, name=f"tool {name}", daemon=True).start()
    except BaseException:
        slots.release()
        raise
    try:
        return await answer
    finally:
        if not answer.done() or answer.cancelled():
            call.cancel()

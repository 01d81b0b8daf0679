"""The failure taxonomy every handler's errors are sorted by (docs/architecture.md, invariant 5).

- **transient**: the world is briefly unavailable (the store or broker unreachable, a timeout,
  a model's 429/5xx). Retried with capped backoff for as long as it lasts; the delivery stays
  unacked and nothing is dead-lettered.
- **permanent**: retrying cannot help (invalid data, a bug). Retried a bounded number of times,
  then dead-lettered with its reason, and the conversation goes on.

Code that knows better raises :class:`Transient` or :class:`Permanent` itself; everything else
is classified by :func:`is_transient`.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import TypeVar

from aiormq.exceptions import AMQPConnectionError, ChannelInvalidStateError, ConnectionClosed
from pydantic import ValidationError
from pymongo.errors import (
    AutoReconnect,
    ConnectionFailure,
    ExecutionTimeout,
    NetworkTimeout,
    OperationFailure,
    ServerSelectionTimeoutError,
    WaitQueueTimeoutError,
)

log = logging.getLogger(__name__)

T = TypeVar("T")


class Transient(Exception):
    """Worth retrying for as long as it lasts: something we depend on is briefly unavailable."""


class Permanent(Exception):
    """Retrying cannot help: the input is invalid or the code has a bug."""


class Misconfigured(Exception):
    """The process cannot run as configured (say, a changed shard count): restarting it will
    not help, a person must act. A service exits with :data:`EXIT_MISCONFIGURED`."""


# sysexits' EX_CONFIG: ``yoke up`` does not restart a service that exits with it.
EXIT_MISCONFIGURED = 78


class SetAside(Permanent):
    """Lines already retried, recorded and passed over: dead-letter the delivery now (no more
    retries), with this reason, for an operator's replay."""


class Stopping(Exception):
    """The process is shutting down: leave the delivery unacked for the next consumer."""


def describe_validation_error(error: ValidationError, *, root: str = "body") -> str:
    """Names each failing field, e.g. ``author.externalId: Field required`` (at most five).

    One wording for every rejection a sender reads (a command, an HTTP body, a tool's input
    the model wrote); ``root`` names a failure of the whole value rather than of a field.
    """
    problems = []
    for item in error.errors()[:5]:
        where = ".".join(str(part) for part in item["loc"]) or root
        problems.append(f"{where}: {item['msg']}")
    return "; ".join(problems)


# Server-side MongoDB error codes that mean "not now" rather than "never".
_TRANSIENT_MONGO_CODES = frozenset(
    {
        6,  # HostUnreachable
        7,  # HostNotFound
        89,  # NetworkTimeout
        91,  # ShutdownInProgress
        189,  # PrimarySteppedDown
        262,  # ExceededTimeLimit
        9001,  # SocketException
        10107,  # NotWritablePrimary
        11600,  # InterruptedAtShutdown
        11602,  # InterruptedDueToReplStateChange
        13435,  # NotPrimaryNoSecondaryOk
        13436,  # NotPrimaryOrSecondary
    }
)

_TRANSIENT_TYPES: tuple[type[BaseException], ...] = (
    Transient,
    TimeoutError,
    ConnectionError,
    # pymongo: the server is unreachable or did not answer in time
    AutoReconnect,
    ConnectionFailure,
    NetworkTimeout,
    ServerSelectionTimeoutError,
    WaitQueueTimeoutError,
    ExecutionTimeout,
    # aiormq / aio-pika: the broker connection or channel is gone
    AMQPConnectionError,
    ConnectionClosed,
    ChannelInvalidStateError,
)


def is_transient(error: BaseException) -> bool:
    """True when ``error`` (or what caused it) means "try again later", not "never"."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, Permanent):
            return False
        if isinstance(current, _TRANSIENT_TYPES):
            return True
        if isinstance(current, OperationFailure) and current.code in _TRANSIENT_MONGO_CODES:
            return True
        if isinstance(current, OperationFailure) and current.has_error_label("RetryableWriteError"):
            return True
        current = current.__cause__ or current.__context__
    return False


@dataclass(frozen=True)
class RetryPolicy:
    """How a failing piece of work is retried.

    ``attempts`` bounds permanent failures; transient ones are retried without limit, each wait
    ``backoff * 2**n`` (with jitter) up to ``cap`` seconds, until ``stopping`` is set.
    """

    attempts: int = 3
    backoff: float = 0.2
    cap: float = 5.0

    def delay(self, attempt: int) -> float:
        base: float = min(self.cap, self.backoff * 2.0 ** max(0, attempt - 1))
        return base * random.uniform(0.5, 1.5)

    async def run(
        self,
        work: Callable[[], Awaitable[T]],
        *,
        stopping: asyncio.Event | None = None,
        describe: str = "work",
        extra: Mapping[str, object] | None = None,
        on_retry: Callable[[BaseException, bool], None] | None = None,
        give_up_at_once: tuple[type[BaseException], ...] = (),
    ) -> T:
        """Run ``work`` until it succeeds; raise its permanent error once attempts run out.

        Raises :class:`Stopping` when ``stopping`` is set while waiting out a failure.
        """
        failures = 0
        outage = 0
        while True:
            try:
                return await work()
            except Stopping:
                raise
            except give_up_at_once:
                raise
            except Exception as error:
                transient = is_transient(error)
                if transient:
                    outage += 1
                    delay = self.delay(outage)
                else:
                    failures += 1
                    if failures >= self.attempts:
                        raise
                    delay = self.delay(failures)
                if on_retry is not None:
                    on_retry(error, transient)
                log.warning(
                    "%s failed (%s%s), retrying in %.2fs: %r",
                    describe,
                    "transient, try " if transient else "attempt ",
                    outage if transient else f"{failures} of {self.attempts}",
                    delay,
                    error,
                    extra=extra,
                )
                await sleep_unless(stopping, delay)


async def sleep_unless(stopping: asyncio.Event | None, delay: float) -> None:
    """Sleep ``delay`` seconds; raise :class:`Stopping` at once if ``stopping`` is set."""
    if stopping is None:
        await asyncio.sleep(delay)
        return
    if stopping.is_set():
        raise Stopping
    try:
        await asyncio.wait_for(stopping.wait(), timeout=delay)
    except TimeoutError:
        return
    raise Stopping

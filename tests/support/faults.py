"""Fault injection from test support: run a module with one of its functions made fatal.

    YOKE_FAULT=after:yoke.runtime.compaction:move_participant python -m tests.support.faults \\
        services.processor

wraps the named function (``before:`` or ``after:``, then ``module:qualname``) so that the
process dies with ``os._exit(70)`` the first time it is called (``before``) or returns
(``after``): no cleanup, no acks, no flushing, as with a kill -9 at exactly that point; or
(``raise:``) makes its first call raise a transient store error (the store unreachable for a
moment: the step is retried) and lets every later call through. Then it
runs the given module as ``__main__`` with the remaining arguments. Product modules carry no
hooks of their own: the fault is put in from outside, before the service imports anything.

Tests build a spec from the function itself, ``fault("after", Store.insert_message)``, never
by hand: the name is the code's, so a renamed or moved target fails the test module's import
(pytest's collection) naming it, not a child process minutes later.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import os
import runpy
import sys
from collections.abc import Callable
from typing import Any, Literal

EXIT_CODE = 70
VARIABLE = "YOKE_FAULT"
WHENS = ("before", "after", "raise")

When = Literal["before", "after", "raise"]


class FaultSpecError(ValueError):
    """A spec that names no function the fault can wrap."""


def fault(when: When, target: Callable[..., Any]) -> str:
    """The spec that makes ``target`` fatal (``when``), checked to name that very function."""
    module = getattr(target, "__module__", None)
    qualname = getattr(target, "__qualname__", None)
    if not module or not qualname:
        raise FaultSpecError(f"{target!r} has no module and qualified name to wrap")
    spec = f"{when}:{module}:{qualname}"
    if resolve(spec)[2] is not target:
        raise FaultSpecError(f"{spec} names another object than {target!r} (decorated, aliased?)")
    return spec


def resolve(spec: str) -> tuple[Any, str, Any]:
    """The owner, attribute name and function ``spec`` names; ``FaultSpecError`` if none."""
    when, _, target = spec.partition(":")
    module_name, _, qualname = target.partition(":")
    if when not in WHENS or not module_name or not qualname or "<locals>" in qualname:
        raise FaultSpecError(
            f"{VARIABLE} must look like before|after|raise:module:qualname, not {spec!r}"
        )
    try:
        owner: Any = importlib.import_module(module_name)
        *path, name = qualname.split(".")
        for attribute in path:
            owner = getattr(owner, attribute)
        original = inspect.getattr_static(owner, name)
    except (ImportError, AttributeError) as error:
        raise FaultSpecError(f"{VARIABLE} {spec!r} names nothing ({error!r})") from error
    if isinstance(original, (staticmethod, classmethod)):
        raise FaultSpecError(f"{VARIABLE}: {qualname} is a static or class method; not supported")
    if not callable(original):
        raise FaultSpecError(f"{VARIABLE}: {qualname} is not a function")
    return owner, name, original


def die(spec: str) -> None:
    os.write(2, f"fault injected: {spec}\n".encode())
    os._exit(EXIT_CODE)


class Once:
    """Whether the ``raise:`` fault has fired (it fires on the first call only)."""

    fired = False


def fail_once(spec: str) -> None:
    if not Once.fired:
        Once.fired = True
        os.write(2, f"fault injected: {spec}\n".encode())
        from pymongo.errors import AutoReconnect

        raise AutoReconnect(f"fault injected: {spec}")


def install(spec: str) -> None:
    """Make the function ``spec`` names fatal; exit if it names nothing (a typo must fail)."""
    try:
        owner, name, original = resolve(spec)
    except FaultSpecError as error:
        raise SystemExit(str(error)) from error
    when = spec.partition(":")[0]

    wrapper: Any
    if inspect.iscoroutinefunction(original):

        async def wrapper(*args: Any, **kwargs: Any) -> Any:
            if when == "before":
                die(spec)
            if when == "raise":
                fail_once(spec)
                return await original(*args, **kwargs)
            result = await original(*args, **kwargs)
            die(spec)
            return result

    else:

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if when == "before":
                die(spec)
            if when == "raise":
                fail_once(spec)
                return original(*args, **kwargs)
            result = original(*args, **kwargs)
            die(spec)
            return result

    setattr(owner, name, functools.wraps(original)(wrapper))


def main() -> None:
    if len(sys.argv) < 2:
        raise SystemExit("usage: python -m tests.support.faults MODULE [ARGS...]")
    spec = os.environ.get(VARIABLE)
    if spec:
        install(spec)
    target = sys.argv[1]
    sys.argv = [sys.argv[0], *sys.argv[2:]]
    runpy.run_module(target, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()

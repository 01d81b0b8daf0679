"""What every ``yoke`` verb shares: how it fails (a message on stderr and an exit code), and
the store it works on."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from yoke.settings import Settings
from yoke.store import Store


class CommandError(Exception):
    """Printed to stderr; exit code 1."""


class UsageError(CommandError):
    """A command's input is invalid (say, a join configuration): exit code 2, like argparse."""


async def with_store(action: Callable[[Store], Awaitable[None]]) -> None:
    """Run ``action`` on the mesh's store (YOKE_MONGODB_URL), its collections made."""
    store = Store(Settings().mongodb_url, app_name="yoke-cli")
    try:
        await store.ensure_indexes()
        await action(store)
    finally:
        await store.close()

"""What every ``yoke`` verb shares: how it fails (a message on stderr and an exit code), and
the store it works on."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager

from aiormq.exceptions import ChannelAccessRefused

from yoke.bus import topology
from yoke.client import Client
from yoke.core.models import SubmitReply
from yoke.core.settings import Settings
from yoke.store.database import Store


class CommandError(Exception):
    """Printed to stderr; exit code 1."""


class UsageError(CommandError):
    """A command's input is invalid (say, a join configuration): exit code 2, like argparse."""


@contextmanager
def refusals_as_errors() -> Iterator[None]:
    """A permission RabbitMQ refuses (ACCESS_REFUSED) as one line naming it, not a traceback:
    it is a deployment's choice of user, not a bug (posting needs a bridge's user, whose reply
    queues are ``bridge.*``; the services' user may declare only ``yoke.*``)."""
    try:
        yield
    except ChannelAccessRefused as error:
        raise CommandError(
            f"RabbitMQ refused: {error} (the user in YOKE_AMQP_URL may not do this; "
            "posting needs a bridge's user, compose's publisher: see docs/security.md)"
        ) from error


async def ask_the_door(
    ask: Callable[[Client], Awaitable[SubmitReply]], waited: float
) -> SubmitReply:
    """The door's answer to what ``ask`` submits with the CLI's client (a decision, a hold
    line); no answer within ``waited`` seconds (its own reply wait) is an error naming it."""
    with refusals_as_errors():
        async with Client(
            Settings().amqp_url, queue_prefix=topology.CLI_REPLY_QUEUE_PREFIX
        ) as client:
            try:
                return await ask(client)
            except TimeoutError as error:
                raise CommandError(f"no answer within {waited:g} s") from error


async def with_store(action: Callable[[Store], Awaitable[None]]) -> None:
    """Run ``action`` on the mesh's store (YOKE_MONGODB_URL), its collections made."""
    store = Store(Settings().mongodb_url, app_name="yoke-cli")
    try:
        await store.ensure_indexes()
        await action(store)
    finally:
        await store.close()

"""``yoke webhook add/list/remove``: the gateway's outgoing webhooks (``yoke.store.webhooks``)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Awaitable, Callable
from typing import Any

from yoke.core.settings import Settings
from yoke.store.database import Store
from yoke.store.webhooks import (
    DEAD_LETTERS,
    InvalidWebhookUrl,
    WebhookError,
    add_webhook,
    check_url,
    collection,
    ensure_webhook_indexes,
    list_webhooks,
    load_cursor,
    remove_webhook,
)


async def _with_store(action: Callable[[Store], Awaitable[None]]) -> None:
    store = Store(Settings().mongodb_url, app_name="yoke-cli")
    try:
        await ensure_webhook_indexes(store)
        await action(store)
    except InvalidWebhookUrl as error:
        print(f"yoke: {error}", file=sys.stderr)
        raise SystemExit(2) from error
    except WebhookError as error:
        raise SystemExit(f"yoke: {error}") from error
    finally:
        await store.close()


async def webhook_add(args: argparse.Namespace) -> None:
    try:
        check_url(args.url)  # before the store: a usage error, as argparse's are
    except InvalidWebhookUrl as error:
        print(f"yoke: {error}", file=sys.stderr)
        raise SystemExit(2) from error

    async def action(store: Store) -> None:
        subscription = await add_webhook(store, args.forum, args.url)
        print(subscription.id)
        print(
            "each agent line is POSTed signed: X-Yoke-Signature: sha256=<HMAC-SHA256 of "
            "X-Yoke-Timestamp + '.' + the body, with this secret>; the secret is the last line "
            "(it is not shown again)",
            file=sys.stderr,
        )
        print(subscription.secret)

    await _with_store(action)


async def webhook_list(args: argparse.Namespace) -> None:
    async def action(store: Store) -> None:
        dead = collection(store, DEAD_LETTERS)
        for subscription in await list_webhooks(store):
            cursor = await load_cursor(store, subscription.id)
            line = subscription.to_wire()
            line.pop("secret")
            if cursor is not None:
                line["cursor"] = cursor.seq
                if cursor.failing_since is not None:
                    line["failingSince"] = cursor.failing_since.isoformat()
                    line["lastError"] = cursor.last_error
            line["deadLetters"] = await dead.count_documents({"subscriptionId": subscription.id})
            print(json.dumps(line))

    await _with_store(action)


async def webhook_remove(args: argparse.Namespace) -> None:
    async def action(store: Store) -> None:
        if not await remove_webhook(store, args.id):
            raise WebhookError(f"no webhook {args.id}")

    await _with_store(action)


def register(commands: Any) -> None:
    """``yoke webhook add --forum ID --url URL``, ``yoke webhook list``, ``yoke webhook remove``."""
    webhook = commands.add_parser("webhook", help="outgoing webhooks").add_subparsers(
        dest="sub", required=True
    )

    def command(
        name: str, handler: Callable[[argparse.Namespace], Awaitable[None]], help: str
    ) -> argparse.ArgumentParser:
        sub: argparse.ArgumentParser = webhook.add_parser(name, help=help, description=help)
        sub.set_defaults(handler=handler)
        return sub

    adding = command(
        "add",
        webhook_add,
        "POST each agent line of a forum to URL, signed; prints the subscription id, then the "
        "secret bare on the last line",
    )
    adding.add_argument("--forum", required=True)
    adding.add_argument("--url", required=True)
    command(
        "list",
        webhook_list,
        "one JSON line per subscription (no secret): its cursor, failures and dead letters",
    )
    command("remove", webhook_remove, "delete a subscription").add_argument("id")

"""``yoke token create/list/revoke``: the HTTP gateway's bearer tokens (see
:mod:`yoke.store.tokens`)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from yoke.core.settings import Settings
from yoke.store.database import Store
from yoke.store.tokens import (
    TokenError,
    create_token,
    ensure_token_indexes,
    list_tokens,
    revoke_token,
)


async def _with_store(action: Any, args: argparse.Namespace) -> None:
    store = Store(Settings().mongodb_url, app_name="yoke-cli")
    try:
        await ensure_token_indexes(store)
        await action(store, args)
    except TokenError as error:
        print(f"yoke: {error}", file=sys.stderr)
        sys.exit(1)
    finally:
        await store.close()


async def _create(store: Store, args: argparse.Namespace) -> None:
    forums: list[str] = args.forum or []
    for forum_id in forums:
        forum = await store.get_conversation(forum_id)
        if forum is None or forum.kind != "forum":
            raise TokenError(f"unknown forum {forum_id!r}")
    token, secret = await create_token(
        store,
        args.name,
        forums or None,
        can_approve=args.can_approve,
        can_read_monologues=args.can_read_monologues,
        can_take_over=args.can_take_over,
        can_manage_memory=args.can_manage_memory,
        can_call=args.can_call,
    )
    if token.forums:
        scope = ", ".join(token.forums)
    else:
        scope = "all forums" if token.all_forums else "no forum (it only calls agents)"
    rights = "".join(
        f"; it may {right}"
        for right, has in (
            ("decide approvals", token.can_approve),
            ("read the agents' monologues", token.can_read_monologues),
            ("take its forums over and claim their escalations", token.can_take_over),
            ("list, forget and erase the memories its forums taught", token.can_manage_memory),
            (f"call {', '.join(token.can_call)}", bool(token.can_call)),
        )
        if has
    )
    print(f"token {token.id} for {scope}{rights}; it is shown only now:")
    print(secret)


async def _list(store: Store, args: argparse.Namespace) -> None:
    for token in await list_tokens(store):
        entry = {
            "name": token.id,
            "forums": token.forums,
            "canApprove": token.can_approve,
            "canReadMonologues": token.can_read_monologues,
            "canTakeOver": token.can_take_over,
            "canManageMemory": token.can_manage_memory,
            "canCall": token.can_call,
            "createdAt": token.created_at,
        }
        print(json.dumps(entry, default=str, separators=(",", ":")))


async def _revoke(store: Store, args: argparse.Namespace) -> None:
    if not await revoke_token(store, args.name):
        raise TokenError(f"no token named {args.name!r}")
    print(args.name)


async def token_create(args: argparse.Namespace) -> None:
    await _with_store(_create, args)


async def token_list(args: argparse.Namespace) -> None:
    await _with_store(_list, args)


async def token_revoke(args: argparse.Namespace) -> None:
    await _with_store(_revoke, args)


def _names(value: str) -> list[str]:
    return [name.strip() for name in value.split(",") if name.strip()]


def register(commands: Any) -> None:
    """``yoke token create --name NAME [--forum ID ...] [--can-approve]
    [--can-read-monologues] [--can-take-over] [--can-manage-memory] [--can-call NAME[,NAME]]``,
    ``yoke token list``, ``yoke token revoke NAME``."""
    token = commands.add_parser("token", help="the HTTP gateway's tokens").add_subparsers(
        dest="sub", required=True
    )
    help = (
        "make a bearer token for the HTTP gateway, scoped to the forums named (default: all); "
        "prints it bare on the last line, the only time it is shown (only its hash is stored)"
    )
    create = token.add_parser("create", help=help, description=help)
    create.set_defaults(handler=token_create)
    create.add_argument("--name", required=True, help="1-64 letters, digits, '-' or '_'")
    create.add_argument(
        "--forum", action="append", metavar="ID", help="a forum it may use (repeatable)"
    )
    create.add_argument(
        "--can-approve",
        action="store_true",
        help="its callers may approve or reject tool calls awaiting a decision in its forums",
    )
    create.add_argument(
        "--can-read-monologues",
        action="store_true",
        help="its callers may read the monologues of its forums' agents (the console's "
        "monologue view: their private working, tool inputs and outputs, notices)",
    )
    create.add_argument(
        "--can-take-over",
        action="store_true",
        help="its callers may take its forums over from their agents (/takeover, /handback) "
        "and claim or cancel their escalations (GET /v1/escalations)",
    )
    create.add_argument(
        "--can-manage-memory",
        action="store_true",
        help="its callers may list and forget the agents' memories taught in its forums and "
        "erase its people's (GET /v1/memories, DELETE /v1/memories/ID, POST /v1/memories/erase)",
    )
    create.add_argument(
        "--can-call",
        type=_names,
        default=[],
        metavar="NAME[,NAME]",
        help="published agents (yoke agent publish) its callers may call through the gateway's "
        "MCP and A2A doors",
    )
    help = (
        "one JSON line per token: name, forums (null: all), canApprove, canReadMonologues, "
        "canTakeOver, canManageMemory, canCall, createdAt"
    )
    token.add_parser("list", help=help, description=help).set_defaults(handler=token_list)
    help = "delete a token: it stops working at once"
    revoke = token.add_parser("revoke", help=help, description=help)
    revoke.set_defaults(handler=token_revoke)
    revoke.add_argument("name")

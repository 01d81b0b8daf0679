"""``yoke approve``, ``yoke reject`` and ``yoke approvals``: a person decides on gated calls.

A decision goes through the door every decision goes through (``tool.approval.submit`` on
``yoke.commands``), as the mesh's own RabbitMQ user (YOKE_AMQP_URL's, which the broker verifies)
naming the person ``cli:NAME``: so the first decision stands whichever door it came by, a
bridge's, the HTTP gateway's or this one.
"""

from __future__ import annotations

import argparse
import getpass
import json
import sys
from typing import Any, Literal

from pydantic import ValidationError

from yoke.bus.amqp_nodes import amqp_user
from yoke.cli.base import CommandError, UsageError, ask_the_door, with_store
from yoke.core.errors import describe_validation_error
from yoke.core.settings import Settings
from yoke.core.text import printable
from yoke.runtime.calls.approvals import pending_approvals
from yoke.runtime.join_config import ApprovalConfig
from yoke.store.database import Store


def add_approval_options(verb: argparse.ArgumentParser, what: str) -> None:
    """``--approve TOOL[,TOOL]`` and ``--approval-timeout SECONDS`` (``yoke agent create``,
    ``yoke join``): the ``approval`` of a configuration, as options."""
    verb.add_argument(
        "--approve",
        metavar="TOOL[,TOOL]",
        help=f"{what}: calls of these tools (SERVER__* for an MCP server's) wait for a "
        "person's decision (yoke approve / yoke reject) before they run",
    )
    verb.add_argument(
        "--approval-timeout",
        type=float,
        metavar="SECONDS",
        help="how long a person has to decide (default 86400); then the call ends in error",
    )


def approval_data(args: argparse.Namespace, given: object = None) -> dict[str, Any] | None:
    """The ``approval`` object the options make, over ``given`` (a configuration file's);
    None when neither says anything."""
    data = dict(given) if isinstance(given, dict) else None
    if args.approve is not None:
        tools = [name.strip() for name in args.approve.split(",") if name.strip()]
        data = {**(data or {}), "tools": tools}
    if args.approval_timeout is not None:
        if data is None:
            raise UsageError("--approval-timeout needs --approve (which tools wait)")
        data["timeoutSeconds"] = args.approval_timeout
    return data


def approval_of(args: argparse.Namespace) -> ApprovalConfig | None:
    """The options' approval, checked (exit 2 naming the field when invalid)."""
    data = approval_data(args)
    if data is None:
        return None
    try:
        return ApprovalConfig.model_validate(data)
    except ValidationError as error:
        raise UsageError(f"invalid approval: {describe_validation_error(error)}") from error


def default_name() -> str:
    """Who decides when ``--as`` is not given: the operator's login name."""
    try:
        return getpass.getuser()
    except Exception:  # no login name in a bare container
        return "operator"


async def decide(
    args: argparse.Namespace, decision: Literal["approve", "reject"], reason: str | None
) -> None:
    reply = await ask_the_door(
        lambda client: client.decide(
            args.call_id,
            decision,
            external_id=f"cli:{args.as_}",
            display_name=args.as_,
            reason=reason,
            user_id=amqp_user(Settings().amqp_url),
            reply_timeout=args.timeout,
        ),
        args.timeout,
    )
    if reply.status != "accepted":
        raise CommandError(f"{reply.error or 'rejected'} ({reply.code})")
    if reply.duplicate:
        print("decided so already; nothing changed", file=sys.stderr)


async def approve(args: argparse.Namespace) -> None:
    await decide(args, "approve", args.reason)


async def reject(args: argparse.Namespace) -> None:
    await decide(args, "reject", args.reason)


async def approvals(args: argparse.Namespace) -> None:
    async def action(store: Store) -> None:
        for pending in await pending_approvals(store, args.forum):
            if args.json:
                print(json.dumps(pending.to_wire(), separators=(",", ":")))
                continue
            arguments = json.dumps(pending.input, ensure_ascii=False, separators=(",", ":"))
            deadline = pending.deadline.isoformat(timespec="seconds")
            print(
                printable(
                    f"{pending.call_id}\t{pending.tool}\t{arguments}\t"
                    f"forum {pending.forum_id}\tuntil {deadline}",
                    multiline=True,  # its tabs are the columns; the input is JSON: no newline
                )
            )

    await with_store(action)


def register(commands: Any) -> None:
    """``yoke approve``, ``yoke reject``, ``yoke approvals``."""

    def deciding(name: str, handler: Any, help: str) -> argparse.ArgumentParser:
        verb: argparse.ArgumentParser = commands.add_parser(name, help=help, description=help)
        verb.set_defaults(handler=handler)
        verb.add_argument("call_id", metavar="CALL_ID", help="the call (yoke approvals lists them)")
        verb.add_argument(
            "--as",
            dest="as_",
            default=default_name(),
            metavar="NAME",
            help="who decides (external id cli:NAME; default: your login name)",
        )
        verb.add_argument(
            "--timeout", type=float, default=30.0, help="seconds to wait for the answer"
        )
        return verb

    deciding(
        "approve", approve, "let a call waiting for approval run (the first decision stands)"
    ).add_argument("--reason", help="why, kept with the decision")
    deciding(
        "reject",
        reject,
        "refuse a call waiting for approval: its result is 'rejected by NAME: REASON'",
    ).add_argument("--reason", required=True, help="why (the agent reads it)")
    listing = commands.add_parser(
        "approvals",
        help="the calls waiting for a person's decision, oldest first",
        description="the calls waiting for a person's decision, oldest first: call id, tool, "
        "input, forum and deadline, tab-separated",
    )
    listing.set_defaults(handler=approvals)
    listing.add_argument("--forum", help="only this forum's")
    listing.add_argument("--json", action="store_true", help="one JSON object per line")

"""``yoke takeover``, ``yoke handback`` and ``yoke inbox``: a person takes a forum over from its
agents, hands it back, and answers the escalations agents opened (docs/people-take-over.md).

A takeover is the line ``/takeover [reason]`` and a hand-back ``/handback``, submitted to the
forum as ``cli:NAME`` with ``holdGranted``: the door takes that from the mesh's own RabbitMQ user
(YOKE_AMQP_URL's, which the broker verifies) whoever the person is, and decides, in the forum's
lane, whether the forum is free. A claim or cancel of an escalation is ``escalation.submit``,
decided once at the same door (a claim becomes the claimer's ``/takeover``). The inbox reads the
store.
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import UTC, datetime
from typing import Any

from yoke.bus.amqp_nodes import amqp_user
from yoke.cli.approvals import default_name
from yoke.cli.base import CommandError, ask_the_door, with_store
from yoke.core.models import CommandAuthor, EscalationAction, SubmitReply, as_utc
from yoke.core.settings import Settings
from yoke.core.slash import HANDBACK, takeover_text
from yoke.core.text import printable
from yoke.runtime.escalations import MAX_INBOX_PAGE, Escalation, Escalations, EscalationState
from yoke.store.database import Store


async def hold_line(args: argparse.Namespace, text: str) -> None:
    """Submit ``text`` (a /takeover or /handback) as ``cli:NAME``, granted; print its id."""
    reply = await ask_the_door(
        lambda client: client.submit(
            args.forum,
            text,
            external_id=f"cli:{args.as_}",
            display_name=args.as_,
            reply_timeout=args.timeout,
            hold_granted=True,
        ),
        args.timeout,
    )
    refused(reply)
    print(reply.message_id)


def refused(reply: SubmitReply) -> None:
    """Exit 1 with the door's own words (say, "held by ada since ...")."""
    if reply.status != "accepted":
        raise CommandError(reply.error or f"refused ({reply.code})")


async def takeover(args: argparse.Namespace) -> None:
    await hold_line(args, takeover_text(args.reason))


async def handback(args: argparse.Namespace) -> None:
    await hold_line(args, HANDBACK)


# --- the inbox ---------------------------------------------------------------------------------


def age(seconds: float) -> str:
    """``42s``, ``7m05s``, ``3h12m``, ``2d04h``: short enough for a column."""
    whole = max(0, int(seconds))
    if whole < 60:
        return f"{whole}s"
    if whole < 3600:
        return f"{whole // 60}m{whole % 60:02d}s"
    if whole < 86400:
        return f"{whole // 3600}h{whole % 3600 // 60:02d}m"
    return f"{whole // 86400}d{whole % 86400 // 3600:02d}h"


def state_of(escalation: Escalation) -> str:
    if escalation.state == "claimed" and escalation.claimed_by is not None:
        return f"claimed by {escalation.claimed_by.display_name}"
    if escalation.state == "ended" and escalation.outcome is not None:
        return f"ended ({escalation.outcome})"
    return escalation.state


def wire(escalation: Escalation) -> dict[str, Any]:
    """One JSON line of ``yoke inbox --json``: the stored escalation, ``id`` for ``_id``."""
    document = escalation.model_dump(mode="json", by_alias=True, exclude_none=True)
    return {"id": document.pop("_id"), **document}


async def inbox(args: argparse.Namespace) -> None:
    states: tuple[EscalationState, ...] = (
        ("open", "claimed", "ended") if args.all else ("open", "claimed")
    )

    async def action(store: Store) -> None:
        found = await Escalations(store).listed(
            states=states, forum_ids=[args.forum] if args.forum else None, limit=MAX_INBOX_PAGE
        )
        now = datetime.now(UTC)
        names: dict[str, str] = {}
        for escalation in found:
            if args.json:
                print(json.dumps(wire(escalation), ensure_ascii=False, separators=(",", ":")))
                continue
            agent = escalation.agent_actor_id
            if agent not in names:
                actor = await store.get_actor(agent)
                names[agent] = actor.name if actor is not None else agent
            columns = [
                escalation.id,
                escalation.forum_id,
                names[agent],
                escalation.urgency,
                age((now - as_utc(escalation.opened_at)).total_seconds()),
                "until " + as_utc(escalation.deadline).isoformat(timespec="seconds"),
                state_of(escalation),
                escalation.reason,
            ]
            # Every column through printable: a reason or a name is the outside's text.
            print("\t".join(printable(column) for column in columns))

    await with_store(action)


async def decide(args: argparse.Namespace, action: EscalationAction) -> None:
    """Claim or cancel ``args.escalation_id`` as ``cli:NAME``: the door decides (the first
    decision stands); prints the escalation's forum."""

    found: list[Escalation] = []

    async def look(store: Store) -> None:
        stored = await Escalations(store).get(args.escalation_id)
        found.extend([stored] if stored is not None else [])

    await with_store(look)
    if not found:
        raise CommandError(f"no escalation {printable(args.escalation_id)}")
    escalation = found[0]
    reply = await ask_the_door(
        lambda client: client.submit_escalation(
            escalation.forum_id,
            escalation.id,
            action,
            CommandAuthor(external_id=f"cli:{args.as_}", display_name=args.as_),
            user_id=amqp_user(Settings().amqp_url),
            reply_timeout=args.timeout,
        ),
        args.timeout,
    )
    refused(reply)
    if reply.duplicate:
        print("decided so already; nothing changed", file=sys.stderr)
    print(escalation.forum_id)


async def claim(args: argparse.Namespace) -> None:
    await decide(args, "claim")


async def cancel(args: argparse.Namespace) -> None:
    await decide(args, "cancel")


# --- the verbs ---------------------------------------------------------------------------------


def _as(verb: argparse.ArgumentParser, who: str, *, required: bool = False) -> None:
    if required:
        verb.add_argument(
            "--as", dest="as_", required=True, metavar="NAME", help=f"{who} (external id cli:NAME)"
        )
    else:
        verb.add_argument(
            "--as",
            dest="as_",
            default=default_name(),
            metavar="NAME",
            help=f"{who} (external id cli:NAME; default: your login name)",
        )
    verb.add_argument(
        "--timeout", type=float, default=30.0, help="seconds to wait for the answer (default 30)"
    )


def register(commands: Any) -> None:
    """``yoke takeover``, ``yoke handback``, ``yoke inbox`` (and its ``claim``, ``cancel``)."""

    def verb(parent: Any, name: str, handler: Any, help: str, description: str) -> Any:
        made: argparse.ArgumentParser = parent.add_parser(name, help=help, description=description)
        made.set_defaults(handler=handler)
        return made

    taking = verb(
        commands,
        "takeover",
        takeover,
        "take a forum over from its agents (the line /takeover as NAME); prints the line's id",
        "Submit the line '/takeover [REASON]' to the forum as cli:NAME. From then on its agents "
        "say nothing there (what is said meanwhile they read later, as what happened) until "
        "someone hands it back (yoke handback). Refused, exit 1, when someone holds it already.",
    )
    taking.add_argument("--forum", required=True, help="the forum's id")
    _as(taking, "who takes over", required=True)
    taking.add_argument("--reason", help="why, shown in the forum and to the agents")

    giving = verb(
        commands,
        "handback",
        handback,
        "hand a forum back to its agents (the line /handback as NAME); prints the line's id",
        "Submit the line '/handback' to the forum as cli:NAME: the hold begun by the /takeover "
        "ends and the agents answer again. Refused, exit 1, when nobody holds the forum.",
    )
    giving.add_argument("--forum", required=True, help="the forum's id")
    _as(giving, "who hands back")

    listing = verb(
        commands,
        "inbox",
        inbox,
        "escalations agents opened (their handoff tool), oldest first; claim or cancel them",
        "Escalations waiting for a person or claimed by one, oldest first, tab-separated: id, "
        "forum, agent, urgency, age, deadline, state, reason. 'yoke inbox claim ID' takes the "
        "forum over; 'yoke inbox cancel ID' ends it unanswered (the agent's fallback then).",
    )
    listing.add_argument("--json", action="store_true", help="one JSON object per line")
    listing.add_argument(
        "--all", action="store_true", help=f"ended ones too (at most {MAX_INBOX_PAGE})"
    )
    listing.add_argument("--forum", help="only this forum's")
    deciding = listing.add_subparsers(dest="inbox_action", metavar="ACTION")
    claiming = verb(
        deciding,
        "claim",
        claim,
        "claim an escalation: you take its forum over; prints the forum's id",
        "Claim an escalation as cli:NAME: the door makes it your /takeover of its forum (the "
        "first claim, cancel or timeout stands; a later one exits 1 saying which came first).",
    )
    claiming.add_argument("escalation_id", metavar="ID", help="the escalation (yoke inbox)")
    _as(claiming, "who claims", required=True)
    canceling = verb(
        deciding,
        "cancel",
        cancel,
        "cancel an escalation: nobody takes over; prints the forum's id",
        "Cancel an escalation as cli:NAME: the agent is told, and its join's handoffFallback "
        "applies (resume: it answers on; notice: it waits for the next line).",
    )
    canceling.add_argument("escalation_id", metavar="ID", help="the escalation (yoke inbox)")
    _as(canceling, "who cancels")

"""``yoke memory list|add|forget|erase``: an operator reads, curates and erases what agents
remember (docs/memory.md).

An operator's tool on the store itself, through :class:`yoke.runtime.memories.Memories`: the
same derived keys the processor reads by, so a person named here is found exactly as their
door named them (``cli:ana``, ``amqp:<user>:<id>``, ``http:<ns>:<id>``) and never by a pattern.
"""

from __future__ import annotations

import argparse
import json
from datetime import UTC, datetime
from typing import Any

from yoke.cli.base import CommandError, UsageError, with_store
from yoke.core.ids import new_id
from yoke.core.models import as_utc
from yoke.core.text import printable
from yoke.runtime.join_config import MemoryScope
from yoke.runtime.memories import (
    MAX_LISTED,
    MAX_MEMORY_CHARS,
    Memories,
    Memory,
    MemoryRefused,
    MemorySource,
    person_id_of,
    remaining_lines,
)
from yoke.store.database import Store

# Who a memory added here says added it (``source.addedBy``).
ADDED_BY_CLI = "cli"
DEFAULT_LIMIT = 100


def person_of(external_id: str) -> str:
    """The person's actor id; an id without its door's namespace is a mistake (it names
    nobody: ``ana`` is not ``cli:ana``), not a person with no memories."""
    if ":" not in external_id:
        raise UsageError(
            f"name the person as their door did (cli:NAME, amqp:USER:ID, http:NAMESPACE:ID), "
            f"not {printable(external_id)!r}"
        )
    return person_id_of(external_id)


def scope_of(args: argparse.Namespace) -> tuple[MemoryScope, str] | None:
    """The scope and subject the options name (None: every scope of the agent)."""
    if getattr(args, "person", None) is not None:
        return "person", person_of(args.person)
    if getattr(args, "forum", None) is not None:
        return "forum", args.forum
    if getattr(args, "agent_wide", False):
        return "agent", ""
    return None


def wire(memory: Memory) -> dict[str, Any]:
    """One JSON line of ``yoke memory list --json``: the stored memory, ``id`` for ``_id``,
    without its lexical terms and vector (the index's, not a reader's)."""
    document = memory.model_dump(
        mode="json", by_alias=True, exclude_none=True, exclude={"terms", "vector"}
    )
    return {"id": document.pop("_id"), **document}


def when(moment: datetime) -> str:
    return as_utc(moment).isoformat(timespec="seconds")


def provenance(memory: Memory) -> str:
    """Where a memory came from: the line that taught it, or who added it."""
    source = memory.source
    if source.added_by is not None:
        where = f" for forum {source.forum_id}" if source.forum_id else ""
        return f"added by {source.added_by}{where} at {when(source.at)}"
    author = source.author_name or source.author_actor_id or "?"
    return f"forum {source.forum_id} line {source.message_id} by {author} at {when(source.at)}"


def step_of(memory: Memory) -> str:
    step = memory.step
    if step is None:
        return "-"
    return f"step {step.join_key} line {step.line_id} call {step.call_id}"


async def subject_label(store: Store, memory: Memory, names: dict[str, str]) -> str:
    """A person's subject with the external id their door gave them, when they have written."""
    if memory.scope != "person":
        return memory.subject or "-"
    if memory.subject not in names:
        actor = await store.get_actor(memory.subject)
        external = actor.external_id if actor is not None else None
        names[memory.subject] = f"{memory.subject} ({external})" if external else memory.subject
    return names[memory.subject]


async def memory_list(args: argparse.Namespace) -> None:
    chosen = scope_of(args)

    async def action(store: Store) -> None:
        found = await Memories(store).listed(
            agent_actor_id=args.agent,
            scope=chosen[0] if chosen else None,
            subject=chosen[1] if chosen else None,
            limit=args.limit,
        )
        names: dict[str, str] = {}
        for memory in found:
            if args.json:
                print(json.dumps(wire(memory), ensure_ascii=False, separators=(",", ":")))
                continue
            columns = [
                memory.id,
                memory.scope,
                await subject_label(store, memory, names),
                when(memory.created_at),
                provenance(memory),
                step_of(memory),
                memory.text,
            ]
            # Every column through printable: a memory's text and a name are outside text.
            print("\t".join(printable(column) for column in columns))

    await with_store(action)


async def memory_add(args: argparse.Namespace) -> None:
    chosen = scope_of(args)
    assert chosen is not None  # argparse requires one of the three
    scope, subject = chosen
    text = args.text.strip()
    if not text or len(text) > MAX_MEMORY_CHARS:
        raise UsageError(f"a memory is 1 to {MAX_MEMORY_CHARS} characters")

    async def action(store: Store) -> None:
        agent = await store.get_actor(args.agent)
        if agent is None or agent.kind != "agent":
            raise CommandError(f"no agent {printable(args.agent)}")
        if scope == "forum":
            forum = await store.get_conversation(subject)
            if forum is None or forum.kind != "forum":
                raise CommandError(f"no forum {printable(subject)}")
        source = MemorySource(
            forum_id=subject if scope == "forum" else None,
            at=datetime.now(UTC),
            added_by=ADDED_BY_CLI,
        )
        memory = Memory.new(new_id(), args.agent, scope, subject, text, source)
        try:
            stored, _ = await Memories(store).remember(memory)
        except MemoryRefused as error:
            raise CommandError(f"refused: {error}") from error
        print(stored.id)

    await with_store(action)


async def memory_forget(args: argparse.Namespace) -> None:
    async def action(store: Store) -> None:
        if not await Memories(store).forget(args.memory_id):
            raise CommandError(f"no memory {printable(args.memory_id)}")
        print(args.memory_id)

    await with_store(action)


async def memory_erase(args: argparse.Namespace) -> None:
    person_id = person_of(args.person) if args.person is not None else ""

    async def action(store: Store) -> None:
        memories = Memories(store)
        if args.agent is not None:
            erased = await memories.erase_agent(args.agent)
            if args.json:
                print(json.dumps({"agent": args.agent, "erased": erased}, ensure_ascii=False))
            else:
                print(f"erased {erased} memories of agent {printable(args.agent)}")
            return
        erased = await memories.erase_person(person_id)
        remaining = await remaining_lines(store, person_id)
        if args.json:
            answer = {
                "person": args.person,
                "personId": person_id,
                "erased": erased,
                "remainingLines": [lines.to_wire() for lines in remaining],
            }
            print(json.dumps(answer, ensure_ascii=False, separators=(",", ":")))
            return
        who = printable(args.person)
        print(f"erased {erased} memories about or taught by {who}, in every agent")
        if not remaining:
            print(f"no forum holds a line {who} wrote")
            return
        print(f"{who}'s own lines remain in {len(remaining)} forums (listed, not hidden):")
        for lines in remaining:
            counted = "1 line" if lines.lines == 1 else f"{lines.lines} lines"
            print(f"{printable(lines.forum_id)}\t{counted}")

    await with_store(action)


def limit(value: str) -> int:
    """``--limit``: 1 to :data:`MAX_LISTED`."""
    try:
        number = int(value)
    except ValueError:
        number = 0
    if not 1 <= number <= MAX_LISTED:
        raise argparse.ArgumentTypeError(f"a whole number from 1 to {MAX_LISTED}")
    return number


def register(commands: Any) -> None:
    """``yoke memory list``, ``add``, ``forget`` and ``erase``."""
    memory = commands.add_parser(
        "memory",
        help="what agents remember about people and forums: list, add, forget, erase",
        description="What agents remember (their remember tool, or added here), each with the "
        "forum line that taught it. A person is named by the external id their door gave "
        "them: cli:NAME, amqp:USER:ID (a bridge's), http:NAMESPACE:ID (a gateway token's).",
    ).add_subparsers(dest="sub", required=True, metavar="ACTION")

    def verb(name: str, handler: Any, help: str, description: str) -> argparse.ArgumentParser:
        made: argparse.ArgumentParser = memory.add_parser(name, help=help, description=description)
        made.set_defaults(handler=handler)
        return made

    listing = verb(
        "list",
        memory_list,
        "an agent's memories, newest first, with the line that taught each",
        "An agent's memories, newest first, tab-separated: id, scope, subject, when learned, "
        "where from (forum, line, author and when; or who added it), the step that wrote it, "
        "text. Without --person, --forum or --agent-wide: every scope.",
    )
    listing.add_argument("--agent", required=True, help="the agent's actor id")
    only = listing.add_mutually_exclusive_group()
    only.add_argument("--person", metavar="EXTERNAL_ID", help="only those about this person")
    only.add_argument("--forum", metavar="ID", help="only the forum's")
    only.add_argument("--agent-wide", action="store_true", help="only the agent's own")
    listing.add_argument("--json", action="store_true", help="one JSON object per line")
    listing.add_argument(
        "--limit",
        type=limit,
        default=DEFAULT_LIMIT,
        metavar="N",
        help=f"at most N (1 to {MAX_LISTED}; default {DEFAULT_LIMIT})",
    )

    adding = verb(
        "add",
        memory_add,
        "add a memory to an agent (operator curation); prints its id",
        "Add what the agent should know: about a person (--person), a forum (--forum), or in "
        "every forum (--agent-wide, the scope only an operator writes unless the join's "
        "agentWrites is on). It is recalled and put in prompts like one the agent remembered; "
        f"its source says it was added by {ADDED_BY_CLI}. At most {MAX_MEMORY_CHARS} characters.",
    )
    adding.add_argument("--agent", required=True, help="the agent's actor id")
    about = adding.add_mutually_exclusive_group(required=True)
    about.add_argument("--person", metavar="EXTERNAL_ID", help="about this person")
    about.add_argument("--forum", metavar="ID", help="about this forum")
    about.add_argument("--agent-wide", action="store_true", help="for every forum")
    adding.add_argument("text", metavar="TEXT")

    forgetting = verb(
        "forget",
        memory_forget,
        "forget one memory; prints its id",
        "Delete one memory by id (yoke memory list shows them). Exit 1 when there is none.",
    )
    forgetting.add_argument("memory_id", metavar="ID", help="the memory's id")

    erasing = verb(
        "erase",
        memory_erase,
        "erase every memory about a person (in every agent), or every memory of an agent",
        "--person: erase every memory about the person or taught by their lines, in every "
        "agent, and keep a tombstone so a step still working on their earlier lines cannot "
        "remember them again; prints how many went and the forums where the person's own "
        "lines remain, with counts (listed, not hidden: forums keep their lines). --agent: "
        "erase every memory of an agent (say, one that is gone).",
    )
    who = erasing.add_mutually_exclusive_group(required=True)
    who.add_argument("--person", metavar="EXTERNAL_ID", help="the person, as their door named them")
    who.add_argument("--agent", help="the agent's actor id")
    erasing.add_argument("--json", action="store_true", help="the answer as one JSON object")

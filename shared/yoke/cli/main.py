"""The ``yoke`` command line: ids printed bare (so scripts can capture them), JSON as one line."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any, get_args

from pydantic import ValidationError

from yoke.bus.broker import Bus
from yoke.bus.dead_letters import list_dead_letters, replay_dead_letters
from yoke.cli import supervisor
from yoke.cli.approvals import add_approval_options, approval_data, approval_of
from yoke.cli.approvals import register as register_approvals
from yoke.cli.base import CommandError, UsageError, refusals_as_errors, with_store
from yoke.cli.holds import register as register_holds
from yoke.cli.memory import register as register_memory
from yoke.cli.publishers import register as register_publishers
from yoke.cli.publishing import register as register_publishing
from yoke.cli.status import register as register_status
from yoke.cli.tokens import register as register_tokens
from yoke.cli.tools import check_tool_names
from yoke.cli.tools import register as register_tools
from yoke.cli.webhooks import register as register_webhooks
from yoke.client import STOP_LINE, Client
from yoke.coordination.reshard import ReshardRefused, reshard
from yoke.core.errors import EXIT_MISCONFIGURED, Misconfigured, describe_validation_error
from yoke.core.logs import configure_cli_logging
from yoke.core.models import Message
from yoke.core.redact import redact
from yoke.core.settings import Settings
from yoke.core.text import printable
from yoke.core.tls import refused_as_misconfigured
from yoke.runtime.join_config import JoinConfig, WhileBusy
from yoke.runtime.joins import create_agent, create_forum, join_conversation, leave_conversation
from yoke.runtime.posting import Poster
from yoke.store.database import Store


def split_tools(value: str | None) -> list[str] | None:
    return [name.strip() for name in value.split(",") if name.strip()] if value else None


async def agent_create(args: argparse.Namespace) -> None:
    approval = approval_of(args)

    async def action(store: Store) -> None:
        await check_tool_names(store, split_tools(args.tools))
        await check_tool_names(store, approval.tools if approval is not None else None)
        agent = await create_agent(
            store,
            args.name,
            model=args.model,
            tools=split_tools(args.tools),
            instructions=args.instructions,
            approval=approval,
            while_busy=args.while_busy,
        )
        print(agent.id)

    await with_store(action)


async def forum_create(args: argparse.Namespace) -> None:
    async def action(store: Store) -> None:
        print((await create_forum(store, args.title)).id)

    await with_store(action)


def add_while_busy(verb: argparse.ArgumentParser, what: str) -> None:
    verb.add_argument(
        "--while-busy",
        choices=get_args(WhileBusy),
        help=f"{what}: queue (each line answered in turn), coalesce (a burst answered at "
        "once) or interrupt (a person's line cancels the model call in flight)",
    )


def join_config_of(args: argparse.Namespace) -> JoinConfig:
    """The join's whole configuration: ``--config FILE`` with the shortcut options on top.

    Checked before anything is written; an error names the field (``followUp.afterSeconds``).
    """
    data: dict[str, Any] = {}
    if args.config:
        try:
            with open(args.config, encoding="utf-8") as file:
                loaded = json.load(file)
        except OSError as error:
            raise UsageError(f"cannot read {args.config}: {error.strerror or error}") from error
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise UsageError(f"{args.config} is not JSON: {error}") from error
        if not isinstance(loaded, dict):
            raise UsageError(f"{args.config}: a join configuration is a JSON object")
        data = loaded
    if args.model is not None:
        data["model"] = args.model
    if args.tools is not None:
        data["tools"] = split_tools(args.tools) or []
    if args.while_busy is not None:
        data["whileBusy"] = args.while_busy
    if args.allowed_models is not None:
        # Blanks are kept, so that "a,,b" is refused like the same list in a file.
        data["allowedModels"] = [name.strip() for name in args.allowed_models.split(",")]
    if (approval := approval_data(args, data.get("approval"))) is not None:
        data["approval"] = approval
    if args.follow_up_after is not None:
        follow_up = data.get("followUp")
        data["followUp"] = {
            **(follow_up if isinstance(follow_up, dict) else {}),
            "afterSeconds": args.follow_up_after,
        }
    try:
        return JoinConfig.model_validate(data)
    except ValidationError as error:
        where = f" in {args.config}" if args.config else ""
        raise UsageError(
            f"invalid join configuration{where}: {describe_validation_error(error)}"
        ) from error


async def join(args: argparse.Namespace) -> None:
    config = join_config_of(args)

    async def action(store: Store) -> None:
        await check_tool_names(store, config.tools)
        await check_tool_names(store, config.approval.tools if config.approval else None)
        bus = Bus(Settings().amqp_url, name="yoke-cli")
        await bus.connect()
        try:
            result = await join_conversation(
                store, Poster(store, bus, "cli"), args.agent, args.forum, config
            )
        except LookupError as error:
            raise CommandError(str(error)) from error
        finally:
            await bus.close()
        print(
            json.dumps(
                {
                    "forumParticipantId": result.forum_participant_id,
                    "monologueId": result.monologue_id,
                    "monologueParticipantId": result.monologue_participant_id,
                }
            )
        )

    await with_store(action)


async def leave(args: argparse.Namespace) -> None:
    async def action(store: Store) -> None:
        if not await leave_conversation(store, args.agent, args.forum):
            raise CommandError(f"agent {args.agent} has no join in forum {args.forum}")

    await with_store(action)


async def post(args: argparse.Namespace) -> None:
    await submit_as(args.forum, args.author, args.text, reply_timeout=args.timeout)


async def stop(args: argparse.Namespace) -> None:
    """The line ``/stop`` as ``cli:NAME``: what the person would type in the forum."""
    await submit_as(args.forum, args.as_, STOP_LINE, reply_timeout=args.timeout)


async def submit_as(forum_id: str, name: str, text: str, *, reply_timeout: float) -> None:
    """Submit ``text`` to a forum as the CLI's person ``cli:NAME``; print the line's id."""
    async with Client(Settings().amqp_url) as client:
        try:
            reply = await client.submit(
                forum_id,
                text,
                external_id=f"cli:{name}",
                display_name=name,
                reply_timeout=reply_timeout,
            )
        except TimeoutError as error:
            # Nobody consumes the commands (ingestion down) or it is too busy to answer.
            raise CommandError(f"no answer within {reply_timeout:g} s") from error
    if reply.status != "accepted":
        raise CommandError(reply.error or "rejected")
    print(reply.message_id)


def render(message: Message, names: dict[str, str]) -> str:
    """One line for people: injected instructions and notices say what they are; outside
    text shows its control characters escaped (yoke.core.text)."""
    who = printable(names.get(message.author_actor_id, message.author_actor_id))
    text = printable(message.text, multiline=True)
    if message.meta.instruction:
        instruction = printable(message.meta.instruction)
        return f"[{message.seq}] {who} ({instruction} instruction): {text}"
    if message.type == "notice":
        return f"[{message.seq}] {who} (notice): {text}"
    return f"[{message.seq}] {who}: {text}"


async def history(args: argparse.Namespace) -> None:
    async def action(store: Store) -> None:
        names: dict[str, str] = {}
        for message in await store.history(args.conversation):
            if args.json:
                print(json.dumps(message.to_wire(), separators=(",", ":")))
            else:
                if message.author_actor_id not in names:
                    actor = await store.get_actor(message.author_actor_id)
                    names[message.author_actor_id] = actor.name if actor else "?"
                print(render(message, names))

    await with_store(action)


async def print_lines(client: Client, store: Store, forum_id: str, *, agents_only: bool) -> None:
    """Print the forum's lines as they are published, authors by name."""
    names: dict[str, str] = {}
    async for message in client.watch(forum_id):
        if agents_only and message.role != "agent":
            continue
        if message.author_actor_id not in names:
            actor = await store.get_actor(message.author_actor_id)
            names[message.author_actor_id] = actor.name if actor else "?"
        who = printable(names[message.author_actor_id])
        line = f"{who}: {printable(message.text, multiline=True)}"
        print(line if agents_only else f"[{message.seq}] {line}", flush=True)


@contextlib.asynccontextmanager
async def in_forum(forum_id: str) -> AsyncIterator[tuple[Store, Client]]:
    """The store and an AMQP client, for commands that follow a forum that must exist."""
    settings = Settings()
    store = Store(settings.mongodb_url, app_name="yoke-cli")
    try:
        if await store.get_conversation(forum_id) is None:
            raise CommandError(f"unknown forum {forum_id}")
        async with Client(settings.amqp_url) as client:
            yield store, client
    finally:
        await store.close()


async def chat(args: argparse.Namespace) -> None:
    async with in_forum(args.forum) as (store, client):
        watcher = asyncio.create_task(print_lines(client, store, args.forum, agents_only=True))
        print(
            f"talking in {printable(args.forum)} as {printable(args.as_)}; an empty line or "
            "Ctrl-D ends",
            flush=True,
        )
        loop = asyncio.get_running_loop()
        while True:
            line = await loop.run_in_executor(None, sys.stdin.readline)
            if not line.strip():
                break
            try:
                reply = await client.submit(
                    args.forum, line.strip(), external_id=f"cli:{args.as_}", display_name=args.as_
                )
            except TimeoutError:
                print("no answer within 30 s: is the mesh running?", file=sys.stderr, flush=True)
                continue
            if reply.status != "accepted":
                print(f"rejected: {printable(str(reply.error))}", file=sys.stderr, flush=True)
        await asyncio.sleep(0.5)  # let a reply that is on its way arrive
        watcher.cancel()


async def tail(args: argparse.Namespace) -> None:
    async with in_forum(args.forum) as (store, client):
        await print_lines(client, store, args.forum, agents_only=False)


async def up(args: argparse.Namespace) -> None:
    try:
        replicas = supervisor.parse_replicas(args.replicas or "")
    except supervisor.ReplicasError as error:
        raise UsageError(f"--replicas: {error}") from error
    await supervisor.run(replicas=replicas)


async def asyncapi(args: argparse.Namespace) -> None:
    from yoke.cli.asyncapi import render

    sys.stdout.write(render())


async def dlq_list(args: argparse.Namespace) -> None:
    for letter in await list_dead_letters(Settings().amqp_url):
        print(json.dumps(letter, separators=(",", ":")))


async def dlq_replay(args: argparse.Namespace) -> None:
    count = await replay_dead_letters(Settings().amqp_url)
    print(f"replayed {count} dead letters", file=sys.stderr)


async def reshard_shards(args: argparse.Namespace) -> None:
    async def action(store: Store) -> None:
        services = args.service or list(supervisor.SERVICES)
        try:
            done = await reshard(Settings().amqp_url, store, args.shards, services)
        except ReshardRefused as error:
            raise CommandError(str(error)) from error
        for item in done:
            line = {"service": item.service, "from": item.before, "to": item.after}
            print(json.dumps({**line, "moved": item.moved}))
        if not done:
            print(f"every shard count is already {args.shards}", file=sys.stderr)

    await with_store(action)


def parser() -> argparse.ArgumentParser:
    root = argparse.ArgumentParser(
        prog="yoke",
        description="Yoke mesh: LLM agents in conversations, over RabbitMQ and MongoDB. "
        "Servers come from YOKE_AMQP_URL and YOKE_MONGODB_URL.",
    )
    commands = root.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(
        parent: Any,
        name: str,
        handler: Callable[[argparse.Namespace], Coroutine[Any, Any, None]],
        help: str,
    ) -> argparse.ArgumentParser:
        sub: argparse.ArgumentParser = parent.add_parser(name, help=help, description=help)
        sub.set_defaults(handler=handler)
        return sub

    command(
        commands, "up", up, "run the six services as processes, restarting crashed ones"
    ).add_argument(
        "--replicas",
        metavar="SERVICE=N,...",
        help="replicas per service, sharing its shards (e.g. processor=3,ingestion=2)",
    )

    agent = commands.add_parser("agent", help="manage agents").add_subparsers(
        dest="sub", required=True
    )
    create = command(agent, "create", agent_create, "create an agent; prints its actor id")
    create.add_argument("--name", required=True)
    create.add_argument("--model", help="model id (default fixture-echo)")
    create.add_argument("--tools", help="comma-separated tool names, e.g. clock,calculator")
    create.add_argument("--instructions", help="the agent's system instructions")
    add_approval_options(create, "the agent's default")
    add_while_busy(create, "a person's line while the agent is busy (default queue)")
    register_publishing(agent)

    forum = commands.add_parser("forum", help="manage forums").add_subparsers(
        dest="sub", required=True
    )
    command(forum, "create", forum_create, "create a forum; prints its id").add_argument(
        "--title", required=True
    )

    joining = command(commands, "join", join, "join an agent to a forum; prints one JSON line")
    joining.add_argument("--agent", required=True)
    joining.add_argument("--forum", required=True)
    joining.add_argument("--model", help="overrides the agent's model for this join")
    joining.add_argument("--tools", help="overrides the agent's tools for this join")
    joining.add_argument(
        "--allowed-models",
        metavar="MODEL,...",
        help="models a person's /model may switch to besides the join's own (default: none)",
    )
    add_approval_options(joining, "overrides the agent's approval for this join")
    add_while_busy(joining, "overrides the agent's whileBusy for this join")
    joining.add_argument(
        "--config",
        metavar="FILE.json",
        help="the join's whole configuration (see docs/using.md); joining again replaces it",
    )
    joining.add_argument(
        "--follow-up-after",
        type=float,
        metavar="SECONDS",
        help="nudge the agent when it spoke last and nobody answered for this long",
    )

    leaving = command(commands, "leave", leave, "end a join; the agent stops answering there")
    leaving.add_argument("--agent", required=True)
    leaving.add_argument("--forum", required=True)

    posting = command(commands, "post", post, "submit a line through yoke.commands; prints its id")
    posting.add_argument("--forum", required=True)
    posting.add_argument("--author", required=True, help="your name (external id cli:NAME)")
    posting.add_argument(
        "--timeout", type=float, default=30.0, help="seconds to wait for the answer (default 30)"
    )
    posting.add_argument("text")

    stopping = command(
        commands,
        "stop",
        stop,
        "stop every agent in a forum (submits the line /stop as NAME); prints the line's id",
    )
    stopping.add_argument("--forum", required=True)
    stopping.add_argument(
        "--as", dest="as_", required=True, metavar="NAME", help="who stops (external id cli:NAME)"
    )
    stopping.add_argument(
        "--timeout", type=float, default=30.0, help="seconds to wait for the answer (default 30)"
    )

    showing = command(commands, "history", history, "a conversation's lines in seq order")
    showing.add_argument("conversation")
    showing.add_argument("--json", action="store_true", help="one JSON message per line")

    talking = command(commands, "chat", chat, "type lines into a forum and see agents' replies")
    talking.add_argument("--forum", required=True)
    talking.add_argument("--as", dest="as_", required=True, metavar="NAME")

    tailing = command(commands, "tail", tail, "follow a forum's lines live, as they are posted")
    tailing.add_argument("forum")

    command(commands, "asyncapi", asyncapi, "print the AsyncAPI 3 contract (commands, events)")

    dlq = commands.add_parser("dlq", help="dead letters").add_subparsers(dest="sub", required=True)
    command(dlq, "list", dlq_list, "one JSON line per dead letter: service, error, attempts")
    command(dlq, "replay", dlq_replay, "republish every dead letter where it came from")

    resharding = command(
        commands,
        "reshard",
        reshard_shards,
        "with every service stopped: move each service's shard queues to N shards, "
        "waiting messages included; then start them with YOKE_SHARDS=N",
    )
    resharding.add_argument("shards", type=int, metavar="N")
    resharding.add_argument(
        "--service", action="append", help="only this service (repeatable; default all)"
    )
    register_publishers(commands)
    register_approvals(commands)
    register_holds(commands)
    register_memory(commands)
    register_tokens(commands)
    register_tools(commands)
    register_webhooks(commands)
    register_status(commands)
    return root


def main(argv: list[str] | None = None) -> None:
    configure_cli_logging()  # warnings and tracebacks without connection passwords
    args = parser().parse_args(argv)
    try:
        with refused_as_misconfigured(), refusals_as_errors():
            asyncio.run(args.handler(args))
    except CommandError as error:
        # An error may quote outside text (a door's refusal names a person): never raw.
        print(f"yoke: {printable(redact(str(error)), multiline=True)}", file=sys.stderr)
        sys.exit(2 if isinstance(error, UsageError) else 1)
    except Misconfigured as error:  # say, a server certificate that does not verify
        print(f"yoke: {redact(str(error))}", file=sys.stderr)
        sys.exit(EXIT_MISCONFIGURED)
    except KeyboardInterrupt:
        sys.exit(130)
    except BrokenPipeError:  # `yoke tools list | head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(0)


if __name__ == "__main__":
    main()

"""``yoke agent publish/unpublish/published``: the agents the gateway's MCP and A2A doors show
(see :mod:`yoke.store.publishing`)."""

from __future__ import annotations

import argparse
from typing import Any

from yoke.cli.base import CommandError, with_store
from yoke.store.database import Store
from yoke.store.publishing import (
    PublishingError,
    publish_agent,
    published_agents,
    unpublish_agent,
)


async def agent_publish(args: argparse.Namespace) -> None:
    async def action(store: Store) -> None:
        try:
            published = await publish_agent(store, args.name, args.agent, args.description)
        except PublishingError as error:
            raise CommandError(str(error)) from error
        print(
            f"agent {published.agent_actor_id} published as {published.id}: MCP tool "
            f"{published.id} at /mcp, A2A agent at /a2a/{published.id} (tokens need "
            f"--can-call {published.id})"
        )

    await with_store(action)


async def agent_unpublish(args: argparse.Namespace) -> None:
    async def action(store: Store) -> None:
        if not await unpublish_agent(store, args.name):
            raise CommandError(f"nothing is published as {args.name!r}")
        print(args.name)

    await with_store(action)


async def agent_published(args: argparse.Namespace) -> None:
    async def action(store: Store) -> None:
        for published in await published_agents(store):
            if args.json:
                print(published.model_dump_json(by_alias=True))
            else:
                print(f"{published.id}\t{published.agent_actor_id}\t{published.description}")

    await with_store(action)


def register(agent: Any) -> None:
    """The verbs under ``yoke agent``: ``publish --agent A --name NAME [--description T]``,
    ``unpublish NAME``, ``published [--json]``."""
    help = (
        "publish an agent under NAME: an MCP tool at the gateway's /mcp and an A2A agent at "
        "/a2a/NAME, for tokens made with --can-call NAME (publishing again replaces it)"
    )
    publish = agent.add_parser("publish", help=help, description=help)
    publish.set_defaults(handler=agent_publish)
    publish.add_argument("--agent", required=True, help="the agent's actor id")
    publish.add_argument("--name", required=True, help="1-64 letters, digits, '-' or '_'")
    publish.add_argument(
        "--description", help="what callers are told the agent does (default: 'Ask <name>.')"
    )
    help = "stop publishing NAME: its callers get 'not found' from the next call"
    unpublish = agent.add_parser("unpublish", help=help, description=help)
    unpublish.set_defaults(handler=agent_unpublish)
    unpublish.add_argument("name")
    help = "the published agents: name, agent id and description (one JSON line each with --json)"
    published = agent.add_parser("published", help=help, description=help)
    published.set_defaults(handler=agent_published)
    published.add_argument("--json", action="store_true", help="one JSON object per line")

"""The processor's wiring: ``register`` builds this process's :class:`Processor` and hands its
steps, its background work and its retention rules to the service."""

from __future__ import annotations

import asyncio

from services.processor.processor import Processor
from services.processor.step import TAIL_MARGIN
from yoke.core.models import ToolCallApproved
from yoke.runtime.actor import ActorRuntime
from yoke.runtime.calls.reaper import Reaper, ReapShare
from yoke.runtime.calls.repository import OpenCalls
from yoke.runtime.calls.retention import call_rules
from yoke.runtime.catalog_store import LocalTools, ToolCatalog
from yoke.runtime.compaction import swap_rule
from yoke.runtime.dispatch import ToolDispatch
from yoke.runtime.in_flight import InFlight
from yoke.runtime.mcp_hosting import McpHosting
from yoke.runtime.service import Service
from yoke.runtime.tails import Tails


async def host_tools(hosting: McpHosting, dispatch: ToolDispatch, stopping: asyncio.Event) -> None:
    """The catalog's local and MCP side for this process's life; then the MCP calls still
    running here stop (their deadlines end them in the store)."""
    try:
        await hosting.run(stopping)
    finally:
        await dispatch.close()


def live_processors(service: Service) -> tuple[str, list[str]] | None:
    """This processor and the live ones (its shards' owners), whom the reaper's buckets are
    shared among (None before its first ownership round)."""
    ownership = service.ownership
    if ownership is None or not ownership.live:
        return None
    return ownership.id, ownership.live


def register(service: Service) -> None:
    """Set this process's processor up on ``service``: one :class:`Processor`, its
    collaborators made here once."""
    local = LocalTools.load()
    catalog = ToolCatalog(service.store, local)
    open_calls = OpenCalls(service.store, service.poster)
    reaper = Reaper(open_calls, ReapShare(lambda: live_processors(service)))
    hosting = McpHosting(service.store, catalog)
    dispatch = ToolDispatch(catalog, local, open_calls, service.bus, hosting.host)
    service.background("tool catalog", lambda: host_tools(hosting, dispatch, service.stopping))
    service.background("tool call deadlines", lambda: reaper.run(service.stopping))
    days = service.settings.retention_decision_days
    for rule in (swap_rule(days), *call_rules(service.store, days)):
        service.retention.add(rule)
    # The newest lines of the monologues it steps, so that a step reads only what is new (what
    # this process writes joins them through its poster); a shard gained may bring
    # conversations another process stepped meanwhile: all forgotten.
    tails = service.poster.tails = Tails(
        service.settings.tail_cache_conversations, service.settings.context_lines + TAIL_MARGIN
    )
    service.on_handover(lambda: tails.clear("handover"))
    processor = Processor(
        dispatch=dispatch, open_calls=open_calls, in_flight=InFlight(), tails=tails
    )
    # An approved call runs in its conversation's lane, on the replica owning that shard (its
    # result line wakes the step after it).
    service.on_event(ToolCallApproved, dispatch.run_approved)
    service.on_arrival(processor.notice_arrival)
    # Monologue lines that start a step: user lines, and the agent's tool calls. Its plain text
    # lines go to egress only (the runtime moves the watermark past them as it writes them).
    ActorRuntime(
        service,
        [processor.definition],
        where=[
            {"kind": "monologue", "type": "message", "role": "user"},
            {"kind": "monologue", "type": "message", "calls": "yes"},
        ],
    )

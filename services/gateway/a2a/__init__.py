"""The gateway's A2A door: every published agent an A2A agent, its tasks kept in the mesh's store.

Built on the official a2a-sdk (1.3.0): its route factories and request handler, with the mesh as
the agent executor. Outside code imports :func:`mount` only. The parts, one room each:

- :mod:`.door`: the HTTP side (card and JSON-RPC per published NAME, token, bounds);
- :mod:`.handler`: the SDK's request handler, plus a message to a working task and the cancel;
- :mod:`.executor`: a message is a caller's line, its task that line's turn;
- :mod:`.turns`: a turn's events as A2A events;
- :mod:`.task_store`: tasks in ``a2a_tasks``, and the door's metrics;
- :mod:`.event_stream`: resubscribing to a task no process here runs, from the mesh;
- :mod:`.push`: push notifications through the gateway's webhook machinery;
- :mod:`.cards`, :mod:`.caller`.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

from a2a.server.agent_execution import SimpleRequestContextBuilder
from a2a.server.id_generator import IDGenerator, IDGeneratorContext
from a2a.server.routes import create_jsonrpc_routes
from fastapi import FastAPI
from starlette.routing import Route

from services.gateway.a2a import push, task_store
from services.gateway.a2a.caller import CallerContextBuilder
from services.gateway.a2a.cards import template_card
from services.gateway.a2a.door import Door
from services.gateway.a2a.event_stream import MeshEventStream
from services.gateway.a2a.executor import MeshExecutor
from services.gateway.a2a.handler import MeshRequestHandler
from services.gateway.deps import Gateway

__all__ = ["mount"]


class FreshTaskIds(IDGenerator):
    """The SDK's ids for new tasks, from the task store (which then knows they have no record)."""

    def __init__(self, tasks: task_store.MeshTaskStore) -> None:
        self.tasks = tasks

    def generate(self, context: IDGeneratorContext) -> str:
        return self.tasks.new_task_id()


async def start(door: Door, state: Gateway) -> MeshRequestHandler:
    """The SDK's parts over this gateway's store and forums, wired into the door."""
    settings = state.settings
    tasks = task_store.MeshTaskStore(state.store, settings)
    await tasks.ensure_indexes()
    pushes = push.MeshPushConfigStore(state.store, tasks, settings)
    await pushes.ensure_indexes()
    handler = MeshRequestHandler(
        MeshExecutor(tasks, pushes),
        tasks,
        pushes,
        MeshEventStream(state, tasks),
        template_card(),
        SimpleRequestContextBuilder(task_id_generator=FreshTaskIds(tasks)),
    )
    [route] = create_jsonrpc_routes(
        handler,
        rpc_url="/a2a/{name}",
        context_builder=CallerContextBuilder(),
        enable_v0_3_compat=True,
    )
    assert isinstance(route, Route)
    door.serve(route.endpoint)
    webhooks = state.webhooks
    webhooks.sources.append(pushes.subscriptions)
    webhooks.runner_for = push.runner_for(tasks)
    for rule in (task_store.retention_rule(settings), push.retention_rule(state.store, settings)):
        webhooks.retention.add(rule)
    return handler


def mount(app: FastAPI) -> Door:
    """Serve ``/a2a/NAME`` on ``app``; the door starts inside the gateway's lifespan (after its
    state is up) and drains its running tasks before the gateway goes down."""
    door = Door()
    app.include_router(door.router)
    inner = app.router.lifespan_context

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[Any]:
        async with inner(app) as value:
            handler = await start(door, app.state.gateway)
            try:
                yield value
            finally:
                await handler.aclose()

    app.router.lifespan_context = lifespan
    return door

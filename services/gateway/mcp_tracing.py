"""The MCP door's spans (docs/architecture.md, "Tracing").

The ``mcp`` package's lowlevel ``Server`` ships with an OpenTelemetry middleware that starts
each request's span under the caller's ``params._meta.traceparent`` (the caller's trace, its
sampled flag deciding) and names it after the caller's tool name, unbounded. The door's
requests are spans of the gateway's own instead: each is a child of the HTTP request's span
(tracing.door, sampled by the operator's sampler), ``_meta``'s span only a link, and its name
is the method, from a fixed set; the tool name is an attribute, cut.
"""

from __future__ import annotations

from typing import Any

from mcp.server._otel import OpenTelemetryMiddleware
from mcp.server.context import CallNext, HandlerResult, ServerRequestContext
from mcp.server.lowlevel import Server

from yoke.core import tracing

# The methods a span is named after; any other is "other method" (a caller names the method).
METHODS = frozenset(
    {
        "initialize",
        "ping",
        "tools/list",
        "tools/call",
        "notifications/initialized",
        "notifications/cancelled",
    }
)
# The most of a caller's tool name a span keeps (the catalog's names are at most 64).
MAX_TOOL_NAME_CHARS = 64


class RequestSpans:
    """Each MCP request as a span of the door's trace (a ``ServerMiddleware``)."""

    async def __call__(
        self, ctx: ServerRequestContext[Any, Any], call_next: CallNext
    ) -> HandlerResult:
        method = ctx.method if ctx.method in METHODS else "other method"
        attributes: dict[str, str] = {"mcp.method.name": method}
        name = ctx.params.get("name") if ctx.params else None
        if method == "tools/call":
            attributes["gen_ai.operation.name"] = "execute_tool"
            if isinstance(name, str):
                attributes["gen_ai.tool.name"] = name[:MAX_TOOL_NAME_CHARS]
        meta = ctx.meta if isinstance(ctx.meta, dict) else {}
        with tracing.span(method, kind="server", caller=meta, attributes=attributes):
            return await call_next(ctx)


def install(server: Server[Any]) -> None:
    """The door's spans in place of the SDK's on ``server``."""
    server.middleware = [
        middleware
        for middleware in server.middleware
        if not isinstance(middleware, OpenTelemetryMiddleware)
    ]
    server.middleware.insert(0, RequestSpans())

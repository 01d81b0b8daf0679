"""A request's body, read within the gateway's bounds (invariant 14): refused past a size
before it is all read (413), and when it does not arrive within the header timeout (408: a
slow body holds a connection as a slow head would). A client that goes before its body has all
come is one line, counted (``client_disconnect``), not an error: there is no one to answer. The
REST API, the MCP and the A2A doors all read their bodies here."""

from __future__ import annotations

import asyncio
import logging
import re

from starlette.requests import ClientDisconnect, Request

from services.gateway.deps import ApiError
from services.gateway.limits import REFUSALS

log = logging.getLogger(__name__)

# A Content-Length as ASCII digits, few enough for int() to read at once (int() takes other
# scripts' digits, and refuses more than 4,300 of them).
LENGTH_PATTERN = re.compile(r"[0-9]{1,18}")


async def read_body(request: Request, limit: int, seconds: float) -> bytes:
    """The body of ``request``: at most ``limit`` bytes, all within ``seconds``."""
    declared = request.headers.get("content-length")
    if declared is not None and (not LENGTH_PATTERN.fullmatch(declared) or int(declared) > limit):
        raise ApiError(413, "too_large", f"body is {declared[:20]} bytes; the limit is {limit}")
    body = bytearray()
    try:
        async with asyncio.timeout(seconds):
            async for chunk in request.stream():
                body += chunk
                if len(body) > limit:
                    raise ApiError(413, "too_large", f"body is over the limit of {limit} bytes")
    except TimeoutError as error:
        REFUSALS.labels("body_timeout").inc()
        raise ApiError(
            408, "body_timeout", f"the body did not arrive within {seconds:g} s"
        ) from error
    except ClientDisconnect as error:
        raise client_gone(request, len(body)) from error
    return bytes(body)


def client_gone(request: Request, received: int | None = None) -> ApiError:
    """The client closed its connection before its body had all come: one line, counted, and
    an answer (400) that goes nowhere (the server drops what is sent to a closed connection)."""
    REFUSALS.labels("client_disconnect").inc()
    got = "" if received is None else f" ({received} bytes received)"
    log.info(
        "client went before its body had all come: %s %s%s", request.method, request.url.path, got
    )
    return ApiError(400, "client_disconnect", "the client went before its body had all come")

"""A request's body, read within the gateway's bounds (invariant 14): refused past a size
before it is all read (413), and when it does not arrive within the header timeout (408: a
slow body holds a connection as a slow head would). The REST API, the MCP and the A2A doors
all read their bodies here."""

from __future__ import annotations

import asyncio
import re

from starlette.requests import Request

from services.gateway.deps import ApiError
from services.gateway.limits import REFUSALS

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
    return bytes(body)

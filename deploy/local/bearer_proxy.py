"""A reverse proxy on 127.0.0.1 that adds ``Authorization: Bearer <token>`` to every request it
passes to a gateway: the MCP conformance suite (deploy/local/conformance-mcp.sh) cannot send a
header of its own, and the gateway's /mcp answers 401 without one.

Transparent otherwise: the method, path, body and every other header go as sent, and the answer
(an event stream too) comes back as it is streamed. A ``Host`` or ``Origin`` that names the proxy
itself is rewritten to name the gateway, so a client talks as if to the gateway directly; any
other (``evil.example.com``) passes unchanged, for the gateway to refuse.

    python deploy/local/bearer_proxy.py --upstream http://127.0.0.1:8080 --port 0

The token is read from ``YOKE_TOKEN`` (not an argument: a process list shows arguments). It
prints ``listening on http://127.0.0.1:PORT`` once it accepts connections.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import sys
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

import httpx
import uvicorn
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

# Hop-by-hop headers (RFC 9110 7.6.1) and the length the proxy's own framing sets.
HOP_BY_HOP = {
    "connection",
    "keep-alive",
    "proxy-connection",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "content-length",
}


def app_for(upstream: str, token: str, own_hosts: set[str]) -> object:
    """The ASGI app: each request forwarded to ``upstream`` with the bearer added."""
    target = urlsplit(upstream)
    upstream_host = target.netloc
    client = httpx.AsyncClient(base_url=upstream, timeout=httpx.Timeout(30.0, read=None))

    def rewritten(name: str, value: str) -> str:
        if name == "host" and value in own_hosts:
            return upstream_host
        if name == "origin" and urlsplit(value).netloc in own_hosts:
            return f"{target.scheme}://{upstream_host}"
        return value

    async def app(scope: dict[str, object], receive: object, send: object) -> None:
        if scope["type"] != "http":
            return
        request = Request(scope, receive)  # type: ignore[arg-type]
        headers = [
            (name, rewritten(name, value))
            for name, value in request.headers.items()
            if name not in HOP_BY_HOP and name != "authorization"
        ]
        headers.append(("authorization", f"Bearer {token}"))
        outgoing = client.build_request(
            request.method,
            request.url.path + (f"?{request.url.query}" if request.url.query else ""),
            headers=headers,
            content=await request.body(),
        )
        try:
            answer = await client.send(outgoing, stream=True)
        except httpx.HTTPError as error:
            response: Response = Response(f"upstream: {error}", status_code=502)
            await response(scope, receive, send)  # type: ignore[arg-type]
            return
        passed = [(k, v) for k, v in answer.headers.items() if k.lower() not in HOP_BY_HOP]

        async def body() -> AsyncIterator[bytes]:
            async for chunk in answer.aiter_raw():
                yield chunk

        response = StreamingResponse(
            body(),
            status_code=answer.status_code,
            headers=dict(passed),
            background=BackgroundTask(answer.aclose),
        )
        await response(scope, receive, send)  # type: ignore[arg-type]

    return app


async def serve(upstream: str, token: str, port: int) -> None:
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", port))
    bound = listener.getsockname()[1]
    own = {f"127.0.0.1:{bound}", f"localhost:{bound}"}
    config = uvicorn.Config(
        app_for(upstream, token, own),  # type: ignore[arg-type]
        log_level="warning",
        lifespan="off",
        # The gateway's own Server and Date headers come through: no second of each.
        server_header=False,
        date_header=False,
    )
    server = uvicorn.Server(config)
    serving = asyncio.create_task(server.serve(sockets=[listener]))
    while not server.started:
        if serving.done():
            await serving
            return
        await asyncio.sleep(0.05)
    print(f"listening on http://127.0.0.1:{bound}", flush=True)
    await serving


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--upstream", required=True, help="the gateway's base URL")
    parser.add_argument("--port", type=int, default=0, help="0: any free port")
    args = parser.parse_args()
    token = os.environ.get("YOKE_TOKEN", "")
    if not token:
        print("set YOKE_TOKEN to the token to send", file=sys.stderr)
        return 2
    asyncio.run(serve(args.upstream.rstrip("/"), token, args.port))
    return 0


if __name__ == "__main__":
    sys.exit(main())

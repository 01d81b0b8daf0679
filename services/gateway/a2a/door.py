"""The A2A door's HTTP side: per published NAME, a card and a JSON-RPC endpoint, behind the token.

- ``GET /a2a/NAME/.well-known/agent-card.json``: the card (:mod:`services.gateway.a2a.cards`)
  through a2a-sdk's card route (ETag, 304). It needs the bearer token too, with ``--can-call
  NAME``: publishing is the operator's choice of what the door shows to the tokens allowed, and
  a name is never reachable, or even seen to exist, just because it is published (a client is
  given the URL and its token together; a 401 names the Bearer scheme, which the card repeats).
- ``POST /a2a/NAME``: JSON-RPC, through a2a-sdk's route factory (``create_jsonrpc_routes``) and
  request handler, with the 0.3 method names beside 1.0's. ``Authorization: Bearer`` is needed
  (401 without); a NAME the token may not call is not found (404), as an unpublished one is.

Both look the agent up at request time: publishing, republishing and unpublishing take effect
without a restart (cards are cached by everything they show, so a change is a new card). One
request handler serves every agent: task ids are global, and each request carries its caller
(:mod:`services.gateway.a2a.caller`) to the handler, the store and the executor.

Hostile bodies are refused before the SDK parses them (invariant 14): past the size limit 413,
too slow 408, not UTF-8, not JSON or nested too deeply a JSON-RPC parse error; wrong methods and
types get the SDK's JSON-RPC errors; an internal failure is a JSON-RPC internal error that names
no internals, never a 500. Streams (``SendStreamingMessage``, ``SubscribeToTask`` and their 0.3
names) count against the token's open streams and end when the token is revoked.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Annotated, Any

from a2a.server.routes import create_agent_card_routes
from fastapi import APIRouter, Request
from fastapi import Path as PathParam
from fastapi.responses import JSONResponse, Response
from starlette.types import Message as AsgiMessage
from starlette.types import Receive

from services.gateway.a2a.caller import CALLER_KEY, Caller
from services.gateway.a2a.cards import agent_card
from services.gateway.bodies import read_body
from services.gateway.calling import callable_agent
from services.gateway.deps import (
    ApiError,
    Gateway,
    TokenDep,
    gateway,
    hold_stream,
)
from services.gateway.limits import REFUSALS
from yoke.json_limits import MAX_BODY_DEPTH, nesting_depth
from yoke.lru import LRUCache
from yoke.publishing import PublishedAgent
from yoke.tokens import Token, token_in_force

log = logging.getLogger(__name__)

PARSE_ERROR = -32700
INVALID_REQUEST = -32600
INTERNAL_ERROR = -32603
STREAMING_METHODS = frozenset(
    {"SendStreamingMessage", "SubscribeToTask", "message/stream", "tasks/resubscribe"}
)
# An open stream looks its token up again at most this often (a revoked one ends it).
TOKEN_CHECK_SECONDS = 1.0
# Cards kept built (a few per published agent: one per URL it was reached by).
CARDS_CACHED = 256

Endpoint = Callable[[Request], Awaitable[Response]]
NameParam = Annotated[str, PathParam(description="The name the agent is published under.")]


def rpc_error(code: int, message: str, status: int = 200) -> JSONResponse:
    """A JSON-RPC error for a request that never reached the SDK (its id unknown: null)."""
    body = {"jsonrpc": "2.0", "id": None, "error": {"code": code, "message": message}}
    return JSONResponse(body, status_code=status)


def not_found(name: str) -> ApiError:
    return ApiError(404, "not_found", f"no agent {name[:80]!r} for this token")


def replaying(body: bytes) -> Receive:
    """An ASGI ``receive`` that hands the SDK the body already read."""
    sent = False

    async def receive() -> AsgiMessage:
        nonlocal sent
        if sent:
            return {"type": "http.disconnect"}
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return receive


class Door:
    """The door's endpoints; the SDK's parts are wired in by :meth:`serve` at start-up."""

    def __init__(self) -> None:
        self.router = APIRouter(include_in_schema=False)
        self.router.add_api_route(
            "/a2a/{name}/.well-known/agent-card.json", self.card, methods=["GET"]
        )
        self.router.add_api_route("/a2a/{name}", self.rpc, methods=["POST"])
        self._rpc: Endpoint | None = None
        self._cards: LRUCache[tuple[str, ...], Endpoint] = LRUCache(CARDS_CACHED)

    def serve(self, dispatcher_endpoint: Endpoint) -> None:
        self._rpc = dispatcher_endpoint

    async def _callee(self, state: Gateway, token: Token, name: str) -> PublishedAgent:
        agent = await callable_agent(state, token, name)
        if agent is None:
            raise not_found(name)
        return agent

    async def card(self, request: Request, name: NameParam, token: TokenDep) -> Response:
        state = gateway(request)
        agent = await self._callee(state, token, name)
        url = _rpc_url(request, name)
        key = (agent.id, agent.agent_actor_id, agent.description, str(agent.published_at), url)
        endpoint = self._cards.get(key)
        if endpoint is None:
            [route] = create_agent_card_routes(agent_card(agent, url), card_url=request.url.path)
            endpoint = route.endpoint
            self._cards[key] = endpoint
        return await endpoint(request)

    async def rpc(self, request: Request, name: NameParam, token: TokenDep) -> Response:
        state = gateway(request)
        agent = await self._callee(state, token, name)
        if self._rpc is None:
            raise ApiError(503, "unavailable", "the A2A door is starting; try again")
        settings = state.settings
        limit = settings.max_text_bytes * 2 + 65536
        body = await read_body(request, limit, settings.gateway_header_timeout_seconds)
        parsed = parsed_body(body)
        if isinstance(parsed, Refused):
            REFUSALS.labels("a2a_body").inc()
            return rpc_error(PARSE_ERROR, parsed.why)
        method = method_of(parsed)
        scope = dict(request.scope)
        scope[CALLER_KEY] = Caller(state, token, agent)
        forwarded = Request(scope, replaying(body))
        if method not in STREAMING_METHODS:
            return sanitized(await self._rpc(forwarded))
        release = hold_stream(state, token)
        try:
            response = await self._rpc(forwarded)
        except BaseException:
            release()
            raise
        iterator = getattr(response, "body_iterator", None)
        if iterator is None:
            release()
            return sanitized(response)
        response.body_iterator = watched(iterator, state, token, release)  # type: ignore[attr-defined]
        return response


def _rpc_url(request: Request, name: str) -> str:
    """The JSON-RPC URL as this caller reached the gateway (its scheme, host and any root path)."""
    return str(request.base_url).rstrip("/") + f"/a2a/{name}"


def _no_constant(name: str) -> object:
    raise ValueError(f"{name} is not a JSON number")


@dataclass(frozen=True)
class Refused:
    why: str


def parsed_body(body: bytes) -> object:
    """``body`` as JSON, or :class:`Refused` saying why the SDK should not parse it: not
    UTF-8, not JSON (NaN and Infinity are no JSON numbers), nested too deeply for a parser."""
    if nesting_depth(body) > MAX_BODY_DEPTH:
        return Refused(f"Parse error: the body is nested more than {MAX_BODY_DEPTH} levels deep")
    try:
        parsed: object = json.loads(body.decode(), parse_constant=_no_constant)
    except UnicodeDecodeError as error:
        return Refused(f"Parse error: the body is not UTF-8 ({error.reason} at byte {error.start})")
    except ValueError as error:
        return Refused(f"Parse error: {error}"[:300])
    return parsed


def method_of(request: object) -> str | None:
    """A JSON-RPC request's method, if it names one (the SDK refuses the rest)."""
    method = request.get("method") if isinstance(request, dict) else None
    return method if isinstance(method, str) else None


def sanitized(response: Response) -> Response:
    """A JSON-RPC internal error names no internals (the SDK puts the exception's text there):
    logged here, answered as a sentence."""
    if not isinstance(response, JSONResponse):
        return response
    raw = bytes(response.body)
    if b'"code":-32603' not in raw.replace(b" ", b""):
        return response
    try:
        body = json.loads(raw)
        error = body["error"]
    except (ValueError, KeyError, TypeError):
        return response
    log.warning("A2A request failed: %s", str(error.get("message"))[:500])
    error["message"] = "internal error; try again"
    error.pop("data", None)
    return JSONResponse(body, status_code=response.status_code)


async def watched(
    chunks: AsyncIterator[Any], state: Gateway, token: Token, release: Callable[[], None]
) -> AsyncIterator[Any]:
    """A stream's events until it ends, the client goes, or its token is revoked; released
    whichever way it ends."""
    checked = time.monotonic()
    try:
        async for chunk in chunks:
            if time.monotonic() - checked >= TOKEN_CHECK_SECONDS:
                if not await token_in_force(state.store, token):
                    return
                checked = time.monotonic()
            yield chunk
    finally:
        release()
        aclose = getattr(chunks, "aclose", None)
        if aclose is not None:
            with contextlib.suppress(Exception):
                await aclose()

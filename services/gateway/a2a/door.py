"""The A2A door's HTTP side: per published NAME, a card and a JSON-RPC endpoint, behind the token.

- ``GET /a2a/NAME/.well-known/agent-card.json``: the card (:mod:`services.gateway.a2a.cards`),
  the A2A 1.0 card (it validates against 1.0's schema), or with 0.3's fields beside when the
  caller asks for 0.3 (``A2A-Version: 0.3``, as a header or a query parameter). Cacheable by
  the caller only (``Cache-Control: private, max-age``), with an ``ETag`` and a
  ``Last-Modified`` (when the agent was published, or this gateway started if later: a card
  can change with the gateway), answered 304 to ``If-None-Match`` and ``If-Modified-Since``.
  It needs the bearer token too, with ``--can-call NAME``: publishing is the operator's choice
  of what the door shows to the tokens allowed, and a name is never reachable, or even seen to
  exist, just because it is published (a client is given the URL and its token together; a
  401 names the Bearer scheme, which the card repeats).
- ``POST /a2a/NAME`` (and ``/a2a/NAME/``, where clients that join paths post): JSON-RPC,
  through a2a-sdk's route factory (``create_jsonrpc_routes``) and request handler, with the 0.3
  method names beside 1.0's. ``Authorization: Bearer`` is needed (401 without); a NAME the
  token may not call is not found (404), as an unpublished one is.

Both look the agent up at request time: publishing, republishing and unpublishing take effect
without a restart (cards are cached by everything they show, so a change is a new card). One
request handler serves every agent: task ids are global, and each request carries its caller
(:mod:`services.gateway.a2a.caller`) to the handler, the store and the executor.

Hostile bodies are refused before the SDK parses them (invariant 14): past the size limit 413,
too slow 408, not UTF-8, not JSON or nested too deeply a JSON-RPC parse error; a body that says
it is not JSON (a ``Content-Type`` other than JSON's) ContentTypeNotSupportedError; wrong
methods and types get the SDK's JSON-RPC errors, logged as one line each (not the SDK's
traceback) and counted in ``yoke_a2a_bad_requests_total{reason}``; an internal failure is a
JSON-RPC internal error that names no internals, never a 500. Streams (``SendStreamingMessage``,
``SubscribeToTask`` and their 0.3 names) count against the token's open streams and end within
the token re-check interval once the token is revoked, idle or not.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from email.utils import format_datetime, parsedate_to_datetime
from typing import Annotated, Any

from a2a.server.jsonrpc_models import JSONParseError, JSONRPCError
from a2a.server.request_handlers.response_helpers import (
    agent_card_to_dict,
    build_error_response,
)
from a2a.utils.constants import PROTOCOL_VERSION_0_3, VERSION_HEADER
from a2a.utils.errors import A2AError, ContentTypeNotSupportedError
from fastapi import APIRouter, Request
from fastapi import Path as PathParam
from fastapi.responses import JSONResponse, Response
from google.protobuf.json_format import MessageToDict
from starlette.types import Message as AsgiMessage
from starlette.types import Receive

from services.gateway.a2a.caller import CALLER_KEY, Caller
from services.gateway.a2a.cards import agent_card
from services.gateway.bodies import read_body
from services.gateway.calling import callable_agent
from services.gateway.deps import (
    A2A_BAD_REQUEST_REASONS,
    A2A_BAD_REQUESTS,
    ApiError,
    Gateway,
    TokenDep,
    gateway,
    hold_stream,
    while_token_in_force,
)
from services.gateway.limits import REFUSALS
from yoke.core.json_limits import MAX_BODY_DEPTH, nesting_depth
from yoke.core.lru import LRUCache
from yoke.store.publishing import PublishedAgent
from yoke.store.tokens import Token

log = logging.getLogger(__name__)

INTERNAL_ERROR = -32603
STREAMING_METHODS = frozenset(
    {"SendStreamingMessage", "SubscribeToTask", "message/stream", "tasks/resubscribe"}
)
# Cards kept built (a few per published agent: one per URL it was reached by and version).
CARDS_CACHED = 256
# How long a caller may use a card without asking again (then a 304 revalidates it cheaply).
CARD_MAX_AGE_SECONDS = 300
# What the SDK logs, with a traceback, when a request does not parse: one line here instead.
SDK_REFUSALS = frozenset(
    {
        "Failed to validate base JSON-RPC request",
        "Failed to parse request params",
        "Failed to validate base JSON-RPC request for v0.3",
    }
)
SDK_LOGGERS = ("a2a.server.routes.jsonrpc_dispatcher", "a2a.compat.v0_3.jsonrpc_adapter")

Endpoint = Callable[[Request], Awaitable[Response]]
NameParam = Annotated[str, PathParam(description="The name the agent is published under.")]


def rpc_error(error: A2AError | JSONRPCError) -> JSONResponse:
    """A JSON-RPC error for a request that never reached the SDK (its id unknown: null), in
    the SDK's shape (an A2A error's data holds its ErrorInfo)."""
    body = build_error_response(None, error)
    refused_request(body["error"])
    return JSONResponse(body)


def refused_request(error: dict[str, Any]) -> None:
    """A JSON-RPC error for a request malformed or not to be taken: counted by its reason and
    logged as one line saying why (the SDK's parse error, when it gives one)."""
    code = error.get("code")
    reason = A2A_BAD_REQUEST_REASONS.get(code) if isinstance(code, int) else None
    if reason is None:
        return
    A2A_BAD_REQUESTS.labels(reason).inc()
    why = [str(error.get("message"))]
    data = error.get("data")
    for item in data if isinstance(data, list) else [data]:
        if isinstance(item, str):
            why.append(item)
        elif isinstance(item, dict):  # 1.0's ErrorInfo carries it in its metadata
            metadata = item.get("metadata")
            details = metadata if isinstance(metadata, dict) else item
            if "parseError" in details:
                why.append(str(details["parseError"]))
    log.warning("A2A request refused (%s): %s", reason, " ".join(": ".join(why).split())[:500])


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


class OneLineRefusals(logging.Filter):
    """The SDK's logs of a request refused as malformed (a traceback, then the error) left out:
    the door logs one line of its own for each (:func:`refused_request`), a client's mistake
    being no traceback of ours."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg in SDK_REFUSALS:
            return False
        if str(record.msg).startswith("Request Error (ID: "):
            args = record.args if isinstance(record.args, tuple) else ()
            return len(args) < 2 or args[1] not in A2A_BAD_REQUEST_REASONS
        return True


def quiet_sdk_refusals() -> None:
    for name in SDK_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(found, OneLineRefusals) for found in logger.filters):
            logger.addFilter(OneLineRefusals())


@dataclass(frozen=True)
class Card:
    """A card as served: its body and the headers it is validated by."""

    body: bytes
    etag: str
    modified: datetime  # whole seconds, UTC

    def headers(self) -> dict[str, str]:
        return {
            "ETag": self.etag,
            "Last-Modified": format_datetime(self.modified, usegmt=True),
            "Cache-Control": f"private, max-age={CARD_MAX_AGE_SECONDS}",
            # What else it depends on: the token (who may see it) and the version asked for.
            "Vary": f"Authorization, {VERSION_HEADER}",
        }


def built_card(agent: PublishedAgent, url: str, version_03: bool, since: datetime) -> Card:
    card = agent_card(agent, url)
    # 1.0's card, or a2a-sdk's with 0.3's fields beside (url, preferredTransport, ...), which
    # 0.3 clients need and 1.0's schema forbids.
    shown = agent_card_to_dict(card) if version_03 else MessageToDict(card)
    body = json.dumps(shown, ensure_ascii=False, separators=(",", ":")).encode()
    canonical = json.dumps(shown, sort_keys=True, separators=(",", ":")).encode()
    published = agent.published_at
    if published.tzinfo is None:
        published = published.replace(tzinfo=UTC)
    modified = max(published, since).astimezone(UTC).replace(microsecond=0)
    return Card(body, f'W/"{hashlib.sha256(canonical).hexdigest()}"', modified)


def unchanged(request: Request, card: Card) -> bool:
    """The caller's copy is this card (RFC 9110 13.2.2: If-None-Match decides when sent)."""
    if_none_match = request.headers.get("if-none-match")
    if if_none_match is not None:
        tags = [tag.strip().removeprefix("W/") for tag in if_none_match.split(",")]
        return "*" in tags or card.etag.removeprefix("W/") in tags
    if_modified_since = request.headers.get("if-modified-since")
    if if_modified_since is None:
        return False
    try:
        since = parsedate_to_datetime(if_modified_since)
    except (TypeError, ValueError, IndexError):
        return False  # not an HTTP-date: ignored
    if since.tzinfo is None:
        since = since.replace(tzinfo=UTC)
    return card.modified <= since


def asks_for_0_3(request: Request) -> bool:
    version = request.headers.get(VERSION_HEADER) or request.query_params.get(VERSION_HEADER)
    return version is not None and version.strip().startswith(PROTOCOL_VERSION_0_3)


def json_content_type(request: Request) -> bool:
    """The body is said to be JSON (or not said to be anything)."""
    declared = request.headers.get("content-type")
    if declared is None:
        return True
    media = declared.split(";", 1)[0].strip().lower()
    return media in ("", "application/json") or (
        media.startswith("application/") and media.endswith("+json")
    )


class Door:
    """The door's endpoints; the SDK's parts are wired in by :meth:`serve` at start-up."""

    def __init__(self) -> None:
        self.router = APIRouter(include_in_schema=False)
        self.router.add_api_route(
            "/a2a/{name}/.well-known/agent-card.json", self.card, methods=["GET"]
        )
        self.router.add_api_route("/a2a/{name}", self.rpc, methods=["POST"])
        # Clients that join a path to the base URL post here (else a 307 they do not follow).
        self.router.add_api_route("/a2a/{name}/", self.rpc, methods=["POST"])
        self._rpc: Endpoint | None = None
        self._cards: LRUCache[tuple[str, ...], Card] = LRUCache(CARDS_CACHED)
        # A card's Last-Modified is never before this: the gateway serving it may have changed.
        self._since = datetime.now(UTC)
        quiet_sdk_refusals()

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
        version_03 = asks_for_0_3(request)
        key = (
            agent.id,
            agent.agent_actor_id,
            agent.description,
            str(agent.published_at),
            url,
            str(version_03),
        )
        card = self._cards.get(key)
        if card is None:
            card = built_card(agent, url, version_03, self._since)
            self._cards[key] = card
        if unchanged(request, card):
            return Response(status_code=304, headers=card.headers())
        return Response(card.body, media_type="application/json", headers=card.headers())

    async def rpc(self, request: Request, name: NameParam, token: TokenDep) -> Response:
        state = gateway(request)
        agent = await self._callee(state, token, name)
        if self._rpc is None:
            raise ApiError(503, "unavailable", "the A2A door is starting; try again")
        if not json_content_type(request):
            return rpc_error(
                ContentTypeNotSupportedError(
                    message="the body must be a JSON-RPC request sent as Content-Type: "
                    "application/json"
                )
            )
        settings = state.settings
        limit = settings.max_text_bytes * 2 + 65536
        body = await read_body(request, limit, settings.gateway_header_timeout_seconds)
        parsed = parsed_body(body)
        if isinstance(parsed, Refused):
            REFUSALS.labels("a2a_body").inc()
            return rpc_error(JSONParseError(message=parsed.why))
        method = method_of(parsed)
        scope = dict(request.scope)
        scope[CALLER_KEY] = Caller(state, token, agent)
        forwarded = Request(scope, replaying(body))
        if method not in STREAMING_METHODS:
            return inspected(await self._rpc(forwarded))
        release = hold_stream(state, token)
        try:
            response = await self._rpc(forwarded)
        except BaseException:
            release()
            raise
        iterator = getattr(response, "body_iterator", None)
        if iterator is None:
            release()
            return inspected(response)
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


def inspected(response: Response) -> Response:
    """The SDK's answer, its refusal counted (``yoke_a2a_bad_requests_total{reason}``); an
    internal error names no internals (the SDK puts the exception's text there): logged here,
    answered as a sentence."""
    if not isinstance(response, JSONResponse):
        return response
    raw = bytes(response.body)
    if b'"error"' not in raw:
        return response
    try:
        body = json.loads(raw)
        error = body["error"]
        code = error["code"]
    except (ValueError, KeyError, TypeError):
        return response
    if not isinstance(error, dict):
        return response
    refused_request(error)
    if code != INTERNAL_ERROR:
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
    try:
        async for chunk in while_token_in_force(chunks, state, token):
            yield chunk
    finally:
        release()
        aclose = getattr(chunks, "aclose", None)
        if aclose is not None:
            with contextlib.suppress(Exception):
                await aclose()

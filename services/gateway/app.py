"""The HTTP gateway: a thin door over the mesh's public contract for systems that speak HTTP.

It publishes submit commands to ``yoke.commands`` (the same door, validation and idempotency as
a bridge gets, through :class:`yoke.client.Client`), reads lines from the store by seq, and
streams a forum's events from ``yoke.events``. It never writes a message itself.

Routes: ``/v1/forums/{forumId}/messages`` (POST, GET), ``/v1/forums/{forumId}/stream`` (SSE),
``/v1/forums/{forumId}/stop`` (the line ``/stop``), ``/v1/forums/{forumId}/approvals`` (GET, and
POST ``/{callId}``: ``tool.approval.submit``, for tokens made with ``--can-approve``),
``/v1/forums/{forumId}/takeover`` and ``/handback`` and ``/v1/escalations`` (for tokens made with
``--can-take-over``: :mod:`services.gateway.holds`), ``/v1/memories`` (for tokens made with
``--can-manage-memory``: :mod:`services.gateway.memories`), ``/openapi.json``; ``/healthz`` and
``/metrics`` need no token.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import signal
import socket
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from typing import Annotated, Any, Literal

import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Header, Query, Request
from fastapi import Path as PathParam
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BeforeValidator, Field
from starlette.background import BackgroundTask
from starlette.requests import ClientDisconnect

from services.gateway import a2a, bodies, console, holds, mcp_door, memories, submitting
from services.gateway.bodies import (
    check_idempotency_key,
    json_body,
    json_request,
)
from services.gateway.deps import (
    REQUEST_SECONDS,
    REQUESTS,
    RETRY_AFTER_SECONDS,
    STREAMS,
    ApiError,
    ErrorBody,
    ForumDep,
    Gateway,
    TokenDep,
    gateway,
    hold_stream,
    unavailable,
    while_token_in_force,
)
from services.gateway.limits import MAX_HEADER_BYTES, REFUSALS, gateway_protocol
from services.gateway.stream import BindTimeout, ForumStream, Hub
from services.gateway.submitting import Accepted, accepted
from services.gateway.webhooks import WebhookWorker
from yoke.bus.amqp_nodes import amqp_user
from yoke.client import Client
from yoke.core import tracing
from yoke.core.errors import EXIT_MISCONFIGURED, is_transient
from yoke.core.hardening import make_undumpable
from yoke.core.logs import configure_logging
from yoke.core.metrics import exposition
from yoke.core.models import (
    MAX_NAME_CHARS,
    MAX_REASON_CHARS,
    CommandAuthor,
    Conversation,
    Message,
    WireModel,
    check_storable,
)
from yoke.core.redact import redact
from yoke.core.settings import Settings
from yoke.runtime.calls.approvals import PendingApproval, pending_approvals
from yoke.runtime.calls.records import TOOL_CALL_DECISIONS_COLLECTION, TOOL_CALLS_COLLECTION
from yoke.store.database import Store
from yoke.store.tokens import Token, ensure_token_indexes

log = logging.getLogger(__name__)

# An external id as a caller sends it; namespaced by its token's name before it goes on.
MAX_EXTERNAL_ID_CHARS = 128
MAX_PAGE = 1000
# Above any seq a store can hold (BSON's int64), and short enough to parse in constant time.
MAX_SEQ = 2**62
SEQ_PATTERN = re.compile(r"[0-9]{1,18}")
# Lines a page reads from the store at once, counted against YOKE_GATEWAY_MAX_RESPONSE_BYTES.
PAGE_READ_LINES = 100


class PostAuthor(WireModel):
    """Who speaks: ``externalId`` is yours to choose, within your token's namespace."""

    external_id: Annotated[
        str, Field(min_length=1, max_length=MAX_EXTERNAL_ID_CHARS), BeforeValidator(check_storable)
    ]
    display_name: Annotated[
        str, Field(min_length=1, max_length=MAX_NAME_CHARS), BeforeValidator(check_storable)
    ]


class PostMessage(WireModel):
    author: PostAuthor
    text: Annotated[str, Field(min_length=1), BeforeValidator(check_storable)]


class MessagesPage(WireModel):
    messages: list[Message]


ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorBody, "description": description}
    for status, description in {
        400: "invalid request",
        401: "missing, unknown or revoked token",
        403: "forum outside the token's scope",
        404: "unknown forum",
    }.items()
}

api = APIRouter(prefix="/v1")


@api.post(
    "/forums/{forumId}/messages",
    status_code=202,
    response_model=Accepted,
    responses={
        **ERRORS,
        413: {"model": ErrorBody, "description": "text or body too large"},
        429: {"model": ErrorBody, "description": "too many lines from this token (Retry-After)"},
        503: {"model": ErrorBody, "description": "the mesh did not answer in time"},
    },
    openapi_extra=json_body(PostMessage),
    summary="Post a line to a forum as one of your token's people",
)
async def post_message(
    request: Request,
    forum: ForumDep,
    token: TokenDep,
    idempotency_key: Annotated[
        str | None,
        Header(
            alias="Idempotency-Key",
            description="Each key makes one line (per token and forum); a repeat answers the "
            "first line's id with duplicate true. Without one, each POST is a new line.",
        ),
    ] = None,
) -> JSONResponse:
    state = gateway(request)
    max_text = state.settings.max_text_bytes
    post = await json_request(request, max_text * 2 + 4096, PostMessage)
    size = len(post.text.encode())
    if size > max_text:
        raise ApiError(413, "too_large", f"text is {size} bytes; the limit is {max_text}")
    check_idempotency_key(request, idempotency_key)
    author = person(token, post.author)
    command = submitting.line_command(token, forum.id, author, post.text, idempotency_key)
    return accepted(await submitting.submit_line(state, command))


def person(token: Token, author: PostAuthor) -> CommandAuthor:
    """One of the token's people, as the door knows them (their id in its namespace)."""
    return CommandAuthor(
        external_id=token.namespaced(author.external_id), display_name=author.display_name
    )


class PostStop(WireModel):
    author: PostAuthor


@api.post(
    "/forums/{forumId}/stop",
    status_code=202,
    response_model=Accepted,
    responses={
        **ERRORS,
        503: {"model": ErrorBody, "description": "the mesh did not answer in time"},
    },
    openapi_extra=json_body(PostStop),
    summary="Stop every agent in a forum, as one of your token's people",
    description="Submits the line `/stop` for `author`, exactly as if they had typed it: the "
    "answer is that line's id.",
)
async def stop_agents(
    request: Request,
    forum: ForumDep,
    token: TokenDep,
    idempotency_key: Annotated[
        str | None,
        Header(alias="Idempotency-Key", description="As for posting a line."),
    ] = None,
) -> JSONResponse:
    stop = await json_request(request, 16384, PostStop)
    check_idempotency_key(request, idempotency_key)
    author = person(token, stop.author)
    return accepted(
        await submitting.stop_forum(gateway(request), token, forum.id, author, idempotency_key)
    )


class PostDecision(WireModel):
    """A decision on a call awaiting approval; ``by`` is who decides, within your token's
    namespace like a line's author (default: the token's own name)."""

    decision: Literal["approve", "reject"]
    reason: (
        Annotated[
            str, Field(min_length=1, max_length=MAX_REASON_CHARS), BeforeValidator(check_storable)
        ]
        | None
    ) = None
    by: PostAuthor | None = None


class Decided(WireModel):
    call_id: str
    decision: Literal["approve", "reject"]
    duplicate: bool


class ApprovalsPage(WireModel):
    approvals: list[PendingApproval]


# The decision door's reasons as HTTP statuses: a later decision, or a call that no longer
# waits, is a conflict; the door refusing the gateway itself is the operator's to fix.
STATUS_OF_DECISION_CODE: Mapping[str, int] = {
    "unknown_call": 404,
    "already_decided": 409,
    "not_awaiting_approval": 409,
    "not_allowed": 500,
    "missing_user_id": 500,
}


async def approver_in_scope(forum: ForumDep, token: TokenDep) -> Conversation:
    """The forum of the path, if the token may use it (as :func:`forum_in_scope`) and was made
    to decide approvals (``yoke token create --can-approve``): else 403."""
    if not token.can_approve:
        raise ApiError(
            403,
            "forbidden",
            f"token {token.id!r} may not decide approvals (yoke token create --can-approve)",
        )
    return forum


ApproverForumDep = Annotated[Conversation, Depends(approver_in_scope)]


async def forum_of_call(store: Store, call_id: str) -> str | None:
    """The forum of a gated call, open or decided (None: no such call, or not a gated one).
    The decision command names no forum, so the gateway checks the path's against this: a
    token of one forum never decides another's calls."""
    projection = {"forumId": 1, "state": 1}
    found = await store.db[TOOL_CALLS_COLLECTION].find_one({"_id": call_id}, projection)
    if found is None or found.get("state", "running") == "running":
        # Decided (and perhaps ended since), or never gated: only a decision names its forum.
        found = await store.db[TOOL_CALL_DECISIONS_COLLECTION].find_one({"_id": call_id})
    forum_id = found.get("forumId") if found is not None else None
    return forum_id if isinstance(forum_id, str) else None


@api.post(
    "/forums/{forumId}/approvals/{callId}",
    response_model=Decided,
    responses={
        **ERRORS,
        403: {
            "model": ErrorBody,
            "description": "forum outside the token's scope, or a token "
            "not made with --can-approve",
        },
        404: {"model": ErrorBody, "description": "unknown forum, or no such call in it"},
        409: {
            "model": ErrorBody,
            "description": "decided first (already_decided), or the "
            "call no longer waits (not_awaiting_approval)",
        },
        503: {"model": ErrorBody, "description": "the mesh did not answer in time"},
    },
    openapi_extra=json_body(PostDecision),
    summary="Approve or reject a tool call that waits for a person's decision",
    description="The first decision stands: the same decision again by the same person is "
    "answered with duplicate true, any other with 409.",
)
async def decide_approval(
    request: Request,
    forum: ApproverForumDep,
    token: TokenDep,
    call_id: Annotated[
        str,
        PathParam(
            alias="callId",
            max_length=MAX_EXTERNAL_ID_CHARS,
            description="The call's id (`callId` of its approval event or listing).",
        ),
    ],
) -> JSONResponse:
    state = gateway(request)
    decision = await json_request(request, MAX_REASON_CHARS * 8 + 4096, PostDecision)
    if await forum_of_call(state.store, call_id) != forum.id:
        raise ApiError(404, "unknown_call", f"no call {call_id!r} waits for a decision here")
    by = decision.by or PostAuthor(external_id=token.id, display_name=token.id)
    deciding = state.client.decide(
        call_id,
        decision.decision,
        external_id=token.namespaced(by.external_id),
        display_name=by.display_name,
        reason=decision.reason,
        # The mesh's own user (the door takes decisions from it), which RabbitMQ verifies.
        user_id=amqp_user(state.settings.amqp_url),
        reply_timeout=state.settings.gateway_submit_timeout_seconds,
        publish_timeout=state.settings.gateway_publish_timeout_seconds,
    )
    reply = await submitting.mesh_answer(state, deciding)
    if reply.status == "rejected":
        code = reply.code or "invalid_command"
        status = STATUS_OF_DECISION_CODE.get(code, 400)
        if status == 500:
            log.error("the decision door refused the gateway: %s", reply.error)
        raise ApiError(status, code, reply.error or "rejected")
    answer = Decided(call_id=call_id, decision=decision.decision, duplicate=bool(reply.duplicate))
    return JSONResponse(answer.to_wire())


@api.get(
    "/forums/{forumId}/approvals",
    response_model=ApprovalsPage,
    responses={
        **ERRORS,
        403: {
            "model": ErrorBody,
            "description": "forum outside the token's scope, or a token "
            "not made with --can-approve",
        },
    },
    summary="The forum's tool calls waiting for a person's decision, oldest first",
)
async def list_approvals(request: Request, forum: ApproverForumDep) -> JSONResponse:
    pending = await pending_approvals(gateway(request).store, forum.id)
    return JSONResponse({"approvals": [approval.to_wire() for approval in pending]})


@api.get(
    "/forums/{forumId}/messages",
    response_model=MessagesPage,
    responses=ERRORS,
    summary="A forum's lines in seq order, after a seq",
)
async def list_messages(
    request: Request,
    forum: ForumDep,
    after: Annotated[
        int, Query(ge=0, le=MAX_SEQ, description="lines with a higher seq than this")
    ] = 0,
    limit: Annotated[
        int,
        Query(
            ge=1,
            le=MAX_PAGE,
            description="at most this many (fewer when their bytes reach the response limit: "
            "ask again after the last seq until a page is empty)",
        ),
    ] = 100,
) -> Response:
    for name in ("after", "limit"):
        if len(request.query_params.getlist(name)) > 1:
            raise ApiError(400, "invalid_request", f"{name}: give it once, not several times")
    state = gateway(request)
    store = state.store
    budget = state.settings.gateway_max_response_bytes
    # Bounded by seq (docs/architecture.md, invariant 11): the head by indexed lookups, then at most
    # ``limit`` lines by their buckets; never a read of the whole forum. Bounded in bytes too
    # (invariant 14): read a chunk at a time, and the page ends before the line that would pass
    # YOKE_GATEWAY_MAX_RESPONSE_BYTES (never before its first line).
    head = await store.last_seq(forum.id)
    end = min(after + limit, head)
    encoded: list[bytes] = []
    size = len(b'{"messages":[]}')
    cursor = after
    while cursor < end:
        upper = min(end, cursor + PAGE_READ_LINES)
        for line in await store.history(forum.id, after_seq=cursor, up_to_seq=upper):
            one = json.dumps(
                line.seen_outside().to_wire(), ensure_ascii=False, separators=(",", ":")
            ).encode()
            if encoded and size + len(one) + 1 > budget:
                REFUSALS.labels("page_trimmed").inc()
                return Response(_page(encoded), media_type="application/json")
            encoded.append(one)
            size += len(one) + 1
        cursor = upper
    return Response(_page(encoded), media_type="application/json")


def _page(encoded: list[bytes]) -> bytes:
    return b'{"messages":[' + b",".join(encoded) + b"]}"


@api.get(
    "/forums/{forumId}/stream",
    responses={
        **ERRORS,
        200: {
            "description": "Server-Sent Events: `message` (the line, `id:` its seq) in seq "
            "order, `activity` ({agentActorId, state}) while an agent's step runs, and `delta` "
            "(a piece of the text an agent is writing: {forumId, agentActorId, messageId, "
            "inReplyTo, index, text, end?}; no `id:`, not replayed after a reconnect), and "
            "`approval` (a tool call waiting for a decision, then its decision: `type` "
            "tool.approval.requested or tool.approval.decided; the request's `input` only for a "
            "token made with --can-approve; no `id:`), and `escalation.opened`, "
            "`escalation.claimed`, `escalation.ended` (an agent asked for a person, someone "
            "claimed it, it is over; no `id:`, not replayed: GET /v1/escalations lists them).",
            "content": {"text/event-stream": {}},
        },
    },
    summary="A forum's new lines and agents' activity, live",
)
async def stream(
    request: Request,
    forum: ForumDep,
    token: TokenDep,
    last_event_id: Annotated[
        str | None,
        Header(
            alias="Last-Event-ID",
            description="The last seq received: the stream resumes right after it.",
        ),
    ] = None,
) -> StreamingResponse:
    state = gateway(request)
    settings = state.settings
    cursor: int | None = None
    if last_event_id is not None:
        # ASCII digits only, and few: str.isdigit() passes '²', which int() refuses.
        if not SEQ_PATTERN.fullmatch(last_event_id.strip()):
            raise ApiError(400, "invalid_last_event_id", "Last-Event-ID must be a seq (a number)")
        cursor = int(last_event_id)
    release = hold_stream(state, token)
    stack = contextlib.AsyncExitStack()
    stack.callback(release)
    try:
        # Subscribed before the head is read: every line past it has its event on the way.
        subscription = state.hub.subscribe(
            forum.id,
            buffer_bytes=settings.gateway_stream_buffer_bytes,
            bind_timeout=settings.gateway_bind_timeout_seconds,
        )
        try:
            subscriber = await stack.enter_async_context(subscription)
        except BindTimeout as error:
            REFUSALS.labels("bind_timeout").inc()
            raise unavailable(f"{error}; try again") from error
        head = await state.store.last_seq(forum.id)
        # A Last-Event-ID past the head (another forum's, a store restored from a backup)
        # would hold back every line up to it: resume at the head instead.
        cursor = head if cursor is None else min(cursor, head)
    except BaseException:
        await stack.aclose()
        raise
    forum_stream = ForumStream(state.store, subscriber, cursor, approver=token.can_approve)

    async def events() -> AsyncIterator[bytes]:
        STREAMS.inc()
        try:
            async with (
                contextlib.aclosing(forum_stream.events()) as chunks,
                # A revoked token reads nothing more (``yoke token revoke`` takes effect at
                # once): its stream ends within the token re-check interval, idle or not.
                contextlib.aclosing(while_token_in_force(chunks, state, token)) as watched,
            ):
                async for chunk in watched:
                    yield chunk
        except Exception:
            # Starlette skips the background task when the body raises (the store away), which
            # left the forum's subscriber and bindings for ever. Not on a cancel (the client
            # went): an unbind inside the cancelled scope would be cut short, and the
            # background task, which then runs, does it.
            await stack.aclose()
            raise
        finally:
            STREAMS.dec()

    return StreamingResponse(
        events(),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        background=BackgroundTask(stack.aclose),
    )


async def problems(state: Gateway) -> list[str]:
    """Why this gateway cannot serve (empty when it can): ``/healthz`` lists them."""
    found = [*state.hub.problems(), *state.webhooks.problems()]
    if not state.client.connected:
        found.append("command connection down")
    try:
        async with asyncio.timeout(2):
            await state.store.ping()
    except Exception as error:
        found.append(f"store unreachable: {error!r}"[:300])
    return found


def route_of(request: Request) -> str:
    """The matched route's path template (metric labels never carry ids)."""
    route = request.scope.get("route")
    return str(getattr(route, "path", "other"))


# Scrapes and health checks: a trace each would bury the requests people make.
UNTRACED_PATHS = frozenset({"/metrics", "/healthz"})


# Refusals anyone may earn (no token, a token outside its scope): no trace of them.
REFUSED_STATUSES = frozenset({401, 403})


async def traced(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
    """The request as a server span of a trace of the gateway's own, sampled by the operator's
    sampler; the caller's ``traceparent`` is only its link (tracing.door). Named by its route
    once matched; a refused request's spans are dropped."""
    with tracing.door(
        request.method,  # the route's template, once matched: never a path's ids
        kind="server",
        caller=request.headers,
        attributes={"http.request.method": request.method, "url.path": request.url.path},
        refusable=True,
    ):
        response = await call_next(request)
        if response.status_code in REFUSED_STATUSES:
            tracing.refuse()
        route = route_of(request)
        tracing.rename(f"{request.method} {route}")
        tracing.annotate({"http.route": route, "http.response.status_code": response.status_code})
        return response


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or Settings()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        store = Store(
            settings.mongodb_url, app_name="gateway", pool_size=settings.mongodb_pool_size
        )
        await store.ping()
        await store.ensure_indexes()
        await ensure_token_indexes(store)
        client = Client(settings.amqp_url, queue_prefix="yoke.gateway.replies.")
        await client.__aenter__()
        hub = Hub(settings.amqp_url)
        await hub.start()
        webhooks = WebhookWorker(settings, store)
        app.state.gateway = Gateway(settings, store, client, hub, webhooks)
        await webhooks.start()
        log.info("gateway serving on port %d", settings.gateway_port)
        try:
            yield
        finally:
            await webhooks.stop()
            await hub.close()
            await client.__aexit__()
            await store.close()

    app = FastAPI(
        title="Yoke mesh HTTP gateway",
        version="1.0.0",
        description="Post lines to forums, read them, and follow them live. Every /v1 call "
        "needs `Authorization: Bearer <token>` (`yoke token create`). Errors are "
        '`{"error": "...", "code": "..."}`.',
        lifespan=lifespan,
        # FastAPI's own OpenTelemetry would trace each request a second time (on the provider
        # yoke.core.tracing installs): the gateway's request spans are its own (traced).
        telemetry={"tracing": False, "metrics": False, "logs": False, "operation_spans": False},
        # Swagger UI comes from a CDN, unpinned, into the console's origin: only when asked for
        # (YOKE_GATEWAY_DOCS); /openapi.json is always there for local tools.
        docs_url="/docs" if settings.gateway_docs else None,
        redoc_url=None,
    )

    @app.exception_handler(ApiError)
    async def api_error(request: Request, error: ApiError) -> JSONResponse:
        body = ErrorBody(error=error.error, code=error.code)
        return JSONResponse(body.model_dump(), status_code=error.status, headers=error.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, error: RequestValidationError) -> JSONResponse:
        problems = []
        for item in error.errors()[:5]:
            where = ".".join(str(part) for part in item["loc"] if part != "body") or "body"
            problems.append(f"{where}: {item['msg']}")
        body = ErrorBody(error="; ".join(problems), code="invalid_request")
        return JSONResponse(body.model_dump(), status_code=400)

    @app.exception_handler(ClientDisconnect)
    async def client_gone(request: Request, error: ClientDisconnect) -> JSONResponse:
        # Bodies are read in bodies.read_body, which says so itself; this is for any other
        # read a departed client cuts short: no one to answer, no error of the gateway's.
        return await api_error(request, bodies.client_gone(request))

    @app.exception_handler(Exception)
    async def failed(request: Request, error: Exception) -> JSONResponse:
        if is_transient(error):
            answer = unavailable("the store or the broker is not answering; try again")
            body = ErrorBody(error=answer.error, code=answer.code)
            return JSONResponse(body.model_dump(), status_code=503, headers=answer.headers)
        log.exception("request failed: %s %s", request.method, request.url.path)
        body = ErrorBody(error="internal error", code="internal")
        return JSONResponse(body.model_dump(), status_code=500)

    @app.middleware("http")
    async def count(
        request: Request, call_next: Callable[[Request], Awaitable[Response]]
    ) -> Response:
        started = time.perf_counter()
        head_bytes = sum(len(name) + len(value) for name, value in request.scope["headers"])
        if head_bytes > MAX_HEADER_BYTES:
            # h11 bounds a head only while it is incomplete: one that came whole is measured.
            REFUSALS.labels("header_bytes").inc()
            error = f"the request's headers are {head_bytes} bytes; the limit is {MAX_HEADER_BYTES}"
            body = ErrorBody(error=error, code="headers_too_large")
            response: Response = JSONResponse(body.model_dump(), status_code=431)
        elif not tracing.enabled() or request.url.path in UNTRACED_PATHS:
            response = await call_next(request)
        else:
            response = await traced(request, call_next)
        route = route_of(request)
        REQUESTS.labels(route, str(response.status_code)).inc()
        REQUEST_SECONDS.labels(route).observe(time.perf_counter() - started, tracing.exemplar())
        return response

    @app.get("/healthz", include_in_schema=False)
    async def healthz(request: Request) -> PlainTextResponse:
        found = await problems(gateway(request))
        body = redact("".join(f"{problem}\n" for problem in found) or "ok\n")
        return PlainTextResponse(body, status_code=503 if found else 200)

    @app.get("/metrics", include_in_schema=False)
    async def metrics(request: Request) -> Response:
        # OpenMetrics when the scraper asks (Prometheus does): it carries exemplars.
        body, content_type = exposition(request.headers.get("accept"))
        return Response(body, media_type=content_type)

    app.include_router(api)
    app.include_router(holds.router)
    app.include_router(memories.router)
    app.include_router(console.router)
    mcp_door.mount(app, settings)
    a2a.mount(app)
    return app


class _Server(uvicorn.Server):
    """uvicorn, but a SIGTERM ends it with exit code 0 like every other service (uvicorn raises
    the signal again after its graceful shutdown, so the process would die of it)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, self.handle_exit, signum, None)
        yield


def main() -> None:
    """``python -m services.gateway``: serve on ``YOKE_GATEWAY_PORT`` until SIGTERM."""
    make_undumpable()  # as every service (yoke.core.hardening)
    settings = Settings()
    configure_logging("gateway", settings.log_format, settings.log_level)
    # Off unless OTEL_EXPORTER_OTLP_ENDPOINT is set (yoke.core.tracing); flushed, bounded, at exit.
    if tracing.configure("gateway", content=settings.trace_content):
        log.info("gateway sends traces to %s", tracing.endpoint())
    # Bound here, not by uvicorn: a port that is taken is a configuration problem, and exit 78
    # tells ``yoke up`` not to restart into it again and again.
    family = socket.AF_INET6 if ":" in settings.gateway_host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    # Accepted connections inherit it: a response's head and body are separate writes, and
    # Nagle would hold the body for the client's delayed ACK (40 ms on a kept-alive connection).
    listener.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        listener.bind((settings.gateway_host, settings.gateway_port))
    except OSError as error:
        log.error(
            "gateway cannot start: port %s:%d: %s",
            settings.gateway_host,
            settings.gateway_port,
            error,
        )
        sys.exit(EXIT_MISCONFIGURED)
    config = uvicorn.Config(
        create_app(settings),
        log_config=None,
        access_log=False,
        lifespan="on",
        # uvicorn's h11 with the gateway's bounds (services/gateway/limits.py): connections,
        # the time a request's head may take, and JSON for what h11 refuses.
        http=gateway_protocol(
            settings.gateway_max_connections,
            settings.gateway_header_timeout_seconds,
            RETRY_AFTER_SECONDS,
        ),
        h11_max_incomplete_event_size=MAX_HEADER_BYTES,
        timeout_keep_alive=5,
        # Open streams end at shutdown; clients reconnect with Last-Event-ID elsewhere.
        timeout_graceful_shutdown=3,
    )
    try:
        asyncio.run(_Server(config).serve(sockets=[listener]))
    finally:
        tracing.shutdown()

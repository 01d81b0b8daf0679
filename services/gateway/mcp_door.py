"""The MCP door (``/mcp``): every published agent a tool of an MCP server, for the systems that
call agents as tools (Claude Desktop, Cursor, another agent); how to call one:
docs/agents-as-tools.md.

Served by the ``mcp`` package's lowlevel ``Server``, not ``MCPServer``: ``MCPServer``'s tools
are one list of registered functions for every caller, while here ``tools/list`` is the
published agents *this token* may call, read from the store at each request (publishing shows
without a restart), and ``tools/call`` resolves the name against the token the same way.

Streamable HTTP, stateless, answered as an event stream:
- **Stateless**: a stateful session lives in one process's memory, so every POST of a session
  would have to reach the replica that opened it (sticky sessions), and a restart would lose
  them all. Stateless, any replica answers any POST: what a call needs outlives the process
  in the store (the caller's kept forum, its lines, the answer owed after a deadline).
- **Event stream, not a JSON response**: progress notifications (the agent's deltas) ride the
  POST's own response stream; in JSON-response mode the SDK drops them. No GET stream (405):
  stateless, nothing would ever be sent on one.

A request whose ``Host`` or ``Origin`` names no origin the gateway is reached at
(``YOKE_GATEWAY_PUBLIC_ORIGINS``) is refused first (403): the transport's guard against DNS
rebinding, which the SDK's own check would answer in plain text, and with 421 for a Host. A
request without ``Origin`` (no browser sent it) needs only a known Host. Then the bearer token
is checked before the SDK sees a request (401 as on every route, with the gateway's own check),
the body is bounded in bytes, time and depth as the REST API's is, and the token rides in the
ASGI scope to the handlers.

A handler raises nothing but a refusal (MCPError): the SDK would put any other exception's text
on the wire.

A call waiting for its answer holds one of its token's streams
(``YOKE_GATEWAY_STREAMS_PER_TOKEN``, with the REST API's and the A2A door's), and a call that
collects an owed answer, posting no line, still counts against the token's lines per minute:
one token cannot hold the gateway.
"""

from __future__ import annotations

import contextlib
import logging
import re
import time
from collections.abc import AsyncIterator, Callable
from typing import Annotated, Any, Literal, get_args
from urllib.parse import urlsplit

import anyio
from fastapi import FastAPI
from fastapi.security import HTTPBearer
from mcp.server.context import ServerRequestContext
from mcp.server.lowlevel import Server
from mcp.server.streamable_http_manager import StreamableHTTPSessionManager
from mcp.shared.exceptions import MCPError
from mcp.types import (
    INVALID_PARAMS,
    INVALID_REQUEST,
    PARSE_ERROR,
    CallToolRequestParams,
    CallToolResult,
    ErrorData,
    JSONRPCError,
    ListToolsResult,
    PaginatedRequestParams,
    TextContent,
    Tool,
)
from prometheus_client import Counter, Histogram
from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, ValidationError
from starlette.requests import Request
from starlette.routing import Route
from starlette.types import Message as AsgiMessage
from starlette.types import Receive, Scope, Send

from services.gateway import calling, mcp_tracing, owed_answers
from services.gateway.bodies import read_body
from services.gateway.deps import (
    ApiError,
    Gateway,
    gateway,
    hold_stream,
    require_token,
    while_token_in_force,
)
from yoke.core.errors import describe_validation_error, is_transient
from yoke.core.json_limits import MAX_BODY_DEPTH, nesting_depth
from yoke.core.models import Message, check_storable
from yoke.core.settings import Settings
from yoke.store.database import Store
from yoke.store.publishing import PublishedAgent
from yoke.store.rate_limit import LineLimit
from yoke.store.tokens import Token

log = logging.getLogger(__name__)

Outcome = Literal["answered", "failed", "timeout", "refused", "rate_limited", "invalid"]
CALLS = Counter("yoke_mcp_calls", "MCP tools/call requests answered, by outcome", ["outcome"])
CALL_SECONDS = Histogram(
    "yoke_mcp_call_seconds",
    "Time from an MCP tools/call to its answer, by outcome",
    ["outcome"],
    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
)
# Every outcome's series from the start: a rate needs the 0 before a first call.
for _outcome in get_args(Outcome):
    CALLS.labels(_outcome)
    CALL_SECONDS.labels(_outcome)

PATH = "/mcp"
DOOR: Literal["mcp"] = "mcp"
# The forum a call without ``conversation`` goes to: one per token and agent, so it costs one
# join, not one a call.
DEFAULT_CONVERSATION = "default"
# Visible ASCII, spaces only inside: a key a caller can write back exactly as it was told.
CONVERSATION_PATTERN = re.compile(r"[\x21-\x7e](?:[\x20-\x7e]{0,126}[\x21-\x7e])?")
TOKEN_SCOPE_KEY = "yoke.token"
HANDOVER_SCOPE_KEY = "yoke.handover"
INPUT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "message": {"type": "string", "minLength": 1, "description": "What you say to the agent."},
        "conversation": {
            "type": "string",
            "minLength": 1,
            "maxLength": 128,
            "description": "Continue a conversation of yours by its key (any 1-128 visible "
            f"characters of your choosing); without it, your {DEFAULT_CONVERSATION!r} one.",
        },
    },
    "required": ["message"],
    "additionalProperties": False,
}


def public_origins(settings: Settings) -> frozenset[str]:
    """The origins (``scheme://host[:port]``, lower case) the gateway is reached at: the
    setting's, or where it listens on loopback. A value that is no bare origin is an error at
    start, not a door that refuses every caller."""
    named = [part.strip() for part in settings.gateway_public_origins.split(",") if part.strip()]
    if not named:
        port = settings.gateway_port
        named = [f"http://127.0.0.1:{port}", f"http://localhost:{port}", f"http://[::1]:{port}"]
    origins = set()
    for origin in named:
        parts = urlsplit(origin.lower())
        if parts.scheme not in ("http", "https") or not parts.hostname or parts.path.strip("/"):
            raise ValueError(
                f"YOKE_GATEWAY_PUBLIC_ORIGINS: {origin!r} is not an origin (scheme://host[:port])"
            )
        origins.add(f"{parts.scheme}://{parts.netloc}")
    return frozenset(origins)


def public_hosts(origins: frozenset[str]) -> frozenset[str]:
    """The ``Host`` values of ``origins``: each one's host[:port], and with its scheme's default
    port written out or left out alike."""
    hosts = set()
    for origin in origins:
        parts = urlsplit(origin)
        hosts.add(parts.netloc)
        default = {"http": 80, "https": 443}[parts.scheme]
        bare = parts.netloc.rsplit(":", 1)[0] if parts.port is not None else parts.netloc
        if parts.port in (None, default):
            hosts |= {bare, f"{bare}:{default}"}
    return frozenset(hosts)


def check_conversation(key: str) -> str:
    if not CONVERSATION_PATTERN.fullmatch(key):
        raise ValueError("use 1-128 visible ASCII characters (spaces only inside)")
    return key


class CallArguments(BaseModel):
    """A tool's arguments (INPUT_SCHEMA); the message's bytes are checked against the
    settings, which a schema cannot say."""

    model_config = ConfigDict(extra="forbid", strict=True)

    message: Annotated[str, Field(min_length=1), BeforeValidator(check_storable)]
    conversation: Annotated[str, AfterValidator(check_conversation)] | None = None


class McpDoor:
    """The SDK's server and session manager, behind the gateway's token and body checks."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.body_limit = settings.max_text_bytes * 2 + 4096
        self.origins = public_origins(settings)
        self.hosts = public_hosts(self.origins)
        # The token's lines per minute, for a call that collects and so posts no line: the same
        # count in the store that the door keeps for the lines (set once the store is up).
        self.collect_limit: LineLimit | None = None
        self.server: Server[Any] = Server(
            "yoke-mesh",
            description="The mesh's published agents, each a tool: call one with a message.",
            on_list_tools=self.list_tools,
            on_call_tool=self.call_tool,
        )
        # Spans of the door's trace, not the caller's (_meta's traceparent only a link).
        mcp_tracing.install(self.server)
        self.sessions = StreamableHTTPSessionManager(
            app=self.server,
            stateless=True,
            json_response=False,
            max_request_body_size=self.body_limit,
            # Host and Origin are checked before (__call__), in the door's JSON-RPC words.
            security_settings=None,
        )
        self._bearer = HTTPBearer(auto_error=False)
        # Every method reaches the door, so that each is answered in JSON-RPC words.
        self.route = Route(PATH, self, include_in_schema=False)

    # --- HTTP -------------------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # The route as the gateway's request metrics name it (a plain Route sets no "route").
        scope["route"] = self.route
        request = Request(scope, receive)
        if not self._from_public_origin(request):
            where = "the gateway's origins (YOKE_GATEWAY_PUBLIC_ORIGINS)"
            await _refuse(send, 403, INVALID_REQUEST, f"Host or Origin is not one of {where}")
            return
        try:
            token = await require_token(request, await self._bearer(request))
        except ApiError as error:
            await _refuse(send, error.status, INVALID_REQUEST, error.error, error.headers)
            return
        if request.method != "POST":
            # Stateless: no session to stream to (GET) or to end (DELETE).
            await _refuse(send, 405, INVALID_REQUEST, "POST JSON-RPC to /mcp", {"Allow": "POST"})
            return
        body = await self._read_body(request, send)
        if body is None:
            return
        scope[TOKEN_SCOPE_KEY] = token
        handover = Handover()
        scope[HANDOVER_SCOPE_KEY] = handover
        try:
            await self.sessions.handle_request(
                scope, handover.watch_receive(_replay(body, receive)), handover.watch_send(send)
            )
        finally:
            # The debts its call collected whose answer was not sent: owed still.
            with anyio.CancelScope(shield=True):
                await handover.settle()

    def _from_public_origin(self, request: Request) -> bool:
        """Host names the gateway as its callers reach it, and Origin (sent by browsers) is one
        of its origins: a page elsewhere, or a name rebound to the gateway's address, is not."""
        if request.headers.get("host", "").lower() not in self.hosts:
            return False
        origin = request.headers.get("origin")
        return origin is None or origin.lower().rstrip("/") in self.origins

    async def _read_body(self, request: Request, send: Send) -> bytes | None:
        """The whole body, or None once refused: past the limit (413, before it is all read),
        slower than a request's head may be (408), or nested past MAX_BODY_DEPTH."""
        seconds = self.settings.gateway_header_timeout_seconds
        try:
            body = await read_body(request, self.body_limit, seconds)
        except ApiError as refused:
            await _refuse(send, refused.status, INVALID_REQUEST, refused.error)
            return None
        if nesting_depth(body) > MAX_BODY_DEPTH:
            why = f"the body is nested too deeply (more than {MAX_BODY_DEPTH} levels)"
            await _refuse(send, 400, PARSE_ERROR, why)
            return None
        return body

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        """The SDK's task group for the door's requests: entered inside the gateway's lifespan,
        after its connections are up; left first, so calls in flight end before they close."""
        async with self.sessions.run():
            yield

    # --- MCP --------------------------------------------------------------------------------

    async def list_tools(
        self, ctx: ServerRequestContext[Any], params: PaginatedRequestParams | None
    ) -> ListToolsResult:
        """The published agents the token may call (a handful: one page)."""
        state, token = _caller(ctx)
        agents = await calling.callable_agents(state, token)
        return ListToolsResult(tools=[_tool(agent) for agent in agents])

    async def call_tool(
        self, ctx: ServerRequestContext[Any], params: CallToolRequestParams
    ) -> CallToolResult:
        """A line to the agent, answered with its reply; every call counted by outcome."""
        started = time.perf_counter()
        outcome: Outcome = "failed"
        try:
            outcome, result = await self._answer(ctx, params)
            return result
        except MCPError as error:
            outcome = "refused" if error.error.code == INVALID_PARAMS else "failed"
            raise
        except Exception as error:
            if is_transient(error):
                return _error("the store or the broker is not answering; try again")
            log.exception("MCP call of %r failed", params.name[:80])
            return _error("internal error: the call failed; try again")
        finally:
            CALLS.labels(outcome).inc()
            CALL_SECONDS.labels(outcome).observe(time.perf_counter() - started)

    async def _answer(
        self, ctx: ServerRequestContext[Any], params: CallToolRequestParams
    ) -> tuple[Outcome, CallToolResult]:
        state, token = _caller(ctx)
        agent = await calling.callable_agent(state, token, params.name)
        if agent is None:
            # An unpublished name and one the token may not call look alike (invariant 13).
            raise MCPError(
                code=INVALID_PARAMS,
                message=f"unknown tool {params.name[:80]!r}: no published agent of that name "
                "that this token may call (yoke token create --can-call NAME)",
            )
        try:
            arguments = CallArguments.model_validate(params.arguments or {})
        except ValidationError as error:
            return "invalid", _error(f"invalid arguments: {describe_validation_error(error)}")
        size = len(arguments.message.encode())
        if size > state.settings.max_text_bytes:
            limit = state.settings.max_text_bytes
            return "invalid", _error(f"message is {size} bytes; the limit is {limit}")
        key = arguments.conversation or DEFAULT_CONVERSATION
        try:
            release = hold_stream(state, token)  # while it waits: the token's streams bound it
        except ApiError as error:
            return _refused_line(error)
        try:
            return await self._post_or_collect(state, token, agent, key, arguments.message, ctx)
        finally:
            release()

    async def _post_or_collect(
        self,
        state: Gateway,
        token: Token,
        agent: PublishedAgent,
        key: str,
        message: str,
        ctx: ServerRequestContext[Any],
    ) -> tuple[Outcome, CallToolResult]:
        """The conversation's oldest owed answer whose turn has ended, if there is one and this
        call is the one to hand it back (``message`` is not sent), else ``message`` posted and
        its answer: while an owed turn still runs, a new message (a ``/stop``) gets through."""
        owner = _owner(token)
        forum_id = calling.kept_forum_id(token, DOOR, agent, key)
        collected = await self._collect(state, forum_id, owner, _handover(ctx))
        if collected is not None:
            return collected
        # Once the mesh has the line, its answer is owed if the caller goes: the post is not cut
        # short by the caller going (the cancellation lands in _follow, which owes it).
        try:
            with anyio.CancelScope(shield=True):
                line = await calling.post_line(state, token, DOOR, agent, key, message)
        except ApiError as error:
            return _refused_line(error)
        return await self._follow(state, token, agent, key, line, Progress(ctx))

    async def _collect(
        self, state: Gateway, forum_id: str, owner: str, handover: Handover
    ) -> tuple[Outcome, CallToolResult] | None:
        """The oldest owed answer of the forum handed back, if its turn has ended (in the store)
        and this call's claim on it wins; None when there is none to hand back. The debt is
        paid only once its answer went out to the caller (``handover``): a caller that went
        before leaves it owed, at its first age."""
        store = state.store
        # Closed when left early (a debt handed back, or one that still runs).
        async with contextlib.aclosing(owed_answers.owed(store, forum_id)) as debts:
            async for debt in debts:
                ended = await calling.turn_outcome(store, forum_id, debt.line)
                if ended is None:
                    return None  # it still runs (its answers come in order): the message goes
                # Claimed, it is left to the handover or given back whatever the caller does.
                with anyio.CancelScope(shield=True):
                    if not await owed_answers.claim(store, debt):
                        continue  # another call hands it back
                    try:
                        refused = await self._count_collecting(owner)
                    except BaseException:
                        await owed_answers.give_back(store, debt)
                        raise
                    if refused is not None:
                        await owed_answers.give_back(store, debt)
                        return "rate_limited", refused
                    if not handover.hold(store, debt):
                        # The request is over (its caller went): nobody to hand it to.
                        await owed_answers.give_back(store, debt)
                return _handed_back(ended)
        return None

    async def _count_collecting(self, owner: str) -> CallToolResult | None:
        """A collecting call counted as one of the token's lines (the door counts those under
        ``token:<namespace>``): its refusal past the token's lines per minute, else None."""
        assert self.collect_limit is not None, "mount() sets it as the gateway starts"
        wait = await self.collect_limit.take(f"token:{owner}")
        if wait is None:
            return None
        limit = self.collect_limit.per_minute
        return _error(
            f"too many calls from this token ({limit} a minute, YOKE_TOKEN_LINES_PER_MINUTE; "
            f"collecting an answer counts as one): retry after {wait} s"
        )

    async def _follow(
        self,
        state: Gateway,
        token: Token,
        agent: PublishedAgent,
        key: str,
        line: Message,
        progress: Progress,
    ) -> tuple[Outcome, CallToolResult]:
        """Follow ``line``'s turn to its end or the deadline; on the deadline (or a caller that
        went) the answer is owed to the conversation, and a later call collects it. A token
        revoked meanwhile ends the call at once (as it ends the token's streams), owed nothing:
        no call of that token will come to collect it."""
        forum_id = line.conversation_id
        owner = _owner(token)
        limit = self.settings.mcp_owed_answers_per_token

        async def owe() -> None:
            await owed_answers.owe(state.store, forum_id, line, owner, limit)

        ended: calling.Answered | calling.Failed | None = None
        try:
            # anyio's deadline, as the SDK's task groups are anyio's.
            with anyio.move_on_after(self.settings.mcp_call_timeout_seconds) as deadline:
                # Read to its end (it stops after the outcome), or cut short by an exception
                # that passes through it or by the token's revocation: its subscription is
                # closed either way.
                turn = calling.follow_turn(state, forum_id, line)
                async for event in while_token_in_force(turn, state, token):
                    if isinstance(event, calling.Delta):
                        if event.text:  # a draft's last delta says only that it ended
                            await progress.send(event.text)
                    elif isinstance(event, calling.Waiting):
                        await progress.send(f"waiting for a person to approve: {event.tool}")
                    else:
                        ended = event
        except ApiError as error:  # the forum's events could not be bound: the mesh is busy
            await owe()
            return "failed", _error(error.error)
        except BaseException:
            # The caller went (or the gateway stops): its next call collects the answer.
            with anyio.CancelScope(shield=True):
                await owe()
            raise
        if ended is None and not deadline.cancelled_caught:
            # follow_turn, given no deadline, ends only with the outcome: the watch ended it.
            return "refused", _error("this token was revoked while the call waited")
        if ended is None:
            await owe()
            seconds = self.settings.mcp_call_timeout_seconds
            text = (
                f"{agent.id} is still working on your message (past {seconds:g} s). Its answer "
                f"stays in your conversation {key!r}: once it is ready, the next call of "
                f"{agent.id} with conversation={key!r} returns it instead of sending that "
                "call's message; until then, calls there send their messages as usual."
            )
            return "timeout", CallToolResult(content=[TextContent(type="text", text=text)])
        if isinstance(ended, calling.Failed):
            return "failed", _error(ended.text)
        return "answered", CallToolResult(
            content=[TextContent(type="text", text=ended.message.text)]
        )


class Handover:
    """What one ``/mcp`` request hands its caller: the debts its call collected are paid (their
    documents deleted) only as a JSON-RPC result goes out on the response while the caller is
    there (just before it is sent, so a caller that has it finds the debt paid); a caller that
    went before (its request cancelled, the connection closed) leaves them owed, at their first
    age, and their claims given back, for a later call to collect.

    Held from the claim to the result's sending or the request's end: a gateway that dies
    meanwhile leaves the claim, which keeps the debt from being handed back until retention
    takes both (owed_answers)."""

    def __init__(self) -> None:
        self.held: list[tuple[Store, owed_answers.Debt]] = []
        self.gone = False  # the caller disconnected
        self.over = False

    def hold(self, store: Store, debt: owed_answers.Debt) -> bool:
        """Keep ``debt`` (claimed) until its answer is sent or the request ends; False once it
        has ended (nobody to hand it to: the call gives it back)."""
        if self.over:
            return False
        self.held.append((store, debt))
        return True

    def watch_receive(self, receive: Receive) -> Receive:
        async def watched() -> AsgiMessage:
            message = await receive()
            if message["type"] == "http.disconnect":
                self.gone = True
            return message

        return watched

    def watch_send(self, send: Send) -> Send:
        async def watched(message: AsgiMessage) -> None:
            body = message.get("body", b"") if message["type"] == "http.response.body" else b""
            if RESULT_MARK in body and not self.gone and self.held:
                with anyio.CancelScope(shield=True):
                    await self._pay()
            await send(message)

        return watched

    async def _pay(self) -> None:
        """What it holds paid; one the store could not pay stays held, given back at the end
        (owed again rather than lost: a later call may hand it back a second time)."""
        while self.held:
            store, debt = self.held[0]
            try:
                await owed_answers.paid(store, debt)
            except Exception:
                log.warning("an owed answer handed back could not be paid", exc_info=True)
                return
            self.held.pop(0)

    async def settle(self) -> None:
        """At the request's end: what it still holds (its answer never sent) given back."""
        self.over = True
        held, self.held = self.held, []
        for store, debt in held:
            with contextlib.suppress(Exception):  # else its claim stays until retention
                await owed_answers.give_back(store, debt)


# A JSON-RPC result on the response's event stream (progress notifications and errors carry
# none; a text inside one is escaped, so its quotes are not these).
RESULT_MARK = b'"result":'


class Progress:
    """Progress notifications for one call, when its caller asked for them (a progressToken):
    each piece's text as the message, the count so far as the progress (it must grow)."""

    def __init__(self, ctx: ServerRequestContext[Any]) -> None:
        self.session = ctx.session
        self.sent = 0

    async def send(self, message: str) -> None:
        self.sent += 1
        # A no-op without a progressToken; the request's own stream carries it.
        await self.session.report_progress(self.sent, None, message)


# --- pieces -----------------------------------------------------------------------------------


def _caller(ctx: ServerRequestContext[Any]) -> tuple[Gateway, Token]:
    """The gateway and the token :meth:`McpDoor.__call__` checked for this request."""
    request = ctx.request
    assert isinstance(request, Request), "the MCP door is served over HTTP only"
    token = request.scope[TOKEN_SCOPE_KEY]
    assert isinstance(token, Token)
    return gateway(request), token


def _handover(ctx: ServerRequestContext[Any]) -> Handover:
    """The request's :class:`Handover`, which :meth:`McpDoor.__call__` put in its scope."""
    request = ctx.request
    assert isinstance(request, Request), "the MCP door is served over HTTP only"
    handover = request.scope[HANDOVER_SCOPE_KEY]
    assert isinstance(handover, Handover)
    return handover


def _owner(token: Token) -> str:
    """Whom a debt is owed to, and under what name the token's lines are counted."""
    return token.namespace or token.id


def _tool(agent: PublishedAgent) -> Tool:
    return Tool(name=agent.id, description=agent.description, input_schema=INPUT_SCHEMA)


def _error(text: str) -> CallToolResult:
    return CallToolResult(content=[TextContent(type="text", text=text)], is_error=True)


def _handed_back(ended: calling.Outcome) -> tuple[Outcome, CallToolResult]:
    """An owed turn's end handed back instead of sending the call's message, which it says."""
    note = (
        "That was {} your earlier message in this conversation, whose call ended before it; "
        "this call's message was not sent: call again to send it."
    )
    if isinstance(ended, calling.Failed):
        words = [ended.text, note.format("how it ended for")]
        return "failed", CallToolResult(
            content=[TextContent(type="text", text=text) for text in words], is_error=True
        )
    words = [ended.message.text, note.format("the answer to")]
    return "answered", CallToolResult(content=[TextContent(type="text", text=t) for t in words])


def _refused_line(error: ApiError) -> tuple[Outcome, CallToolResult]:
    """The door's refusal of the line, in its words (the REST API's statuses, as outcomes)."""
    if error.status == 429:  # its lines per minute, or its streams
        retry = error.headers.get("Retry-After", "60")
        return "rate_limited", _error(f"{error.error}: retry after {retry} s")
    if error.status in (400, 404, 413):
        return "invalid", _error(error.error)
    return "failed", _error(error.error)


async def _refuse(
    send: Send, status: int, code: int, message: str, headers: dict[str, str] | None = None
) -> None:
    """A refusal before the SDK: a JSON-RPC error body, which the mcp client shows as is."""
    body = JSONRPCError(jsonrpc="2.0", id=None, error=ErrorData(code=code, message=message))
    encoded = body.model_dump_json(by_alias=True, exclude_unset=True).encode()
    head = [(b"content-type", b"application/json"), (b"content-length", str(len(encoded)).encode())]
    head += [(name.lower().encode(), value.encode()) for name, value in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": head})
    await send({"type": "http.response.body", "body": encoded})


def _replay(body: bytes, receive: Receive) -> Receive:
    """``receive`` with the body already read handed over first; after it, the client's
    disconnect (which ends an event stream early) comes through as it would."""
    given = False

    async def replay() -> AsgiMessage:
        nonlocal given
        if not given:
            given = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


def mount(app: FastAPI, settings: Settings) -> McpDoor:
    """Serve ``/mcp`` on ``app``: the route, and the SDK's task group run inside the app's
    lifespan (after the gateway's state is up, before it goes down)."""
    door = McpDoor(settings)
    app.router.routes.append(door.route)
    inner: Callable[[FastAPI], contextlib.AbstractAsyncContextManager[Any]]
    inner = app.router.lifespan_context

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[Any]:
        async with inner(app) as state:
            gateway = app.state.gateway
            # Made before any traffic (FerretDB can hang making one lazily under load).
            await owed_answers.ensure_indexes(gateway.store)
            gateway.webhooks.retention.add(owed_answers.retention_rule())
            door.collect_limit = LineLimit(gateway.store, settings.token_lines_per_minute)
            async with door.running():
                yield state

    app.router.lifespan_context = lifespan
    return door

"""What every gateway route stands on: the process's state, errors as JSON, and the token check.

Routers (the REST API here, the console and webhooks beside it) import from this module, not
from ``app``, so that ``app`` can import them all without a cycle.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Annotated, TypeVar

from fastapi import Depends, Path, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import Counter, Gauge, Histogram

from services.gateway.limits import REFUSALS, TOKEN_PATTERN, UnknownSecrets
from services.gateway.stream import Hub
from services.gateway.tool_calls import ToolCallStates
from services.gateway.webhooks import WebhookWorker
from yoke.client import Client
from yoke.core.metrics import STORE_ORIGIN
from yoke.core.models import Conversation, WireModel
from yoke.core.settings import Settings
from yoke.runtime.catalog_store import ToolCatalog
from yoke.store.database import Store
from yoke.store.tokens import Token, find_token, hash_secret
from yoke.store.tokens import collection as token_collection

log = logging.getLogger(__name__)

REQUESTS = Counter(
    "yoke_gateway_requests", "HTTP requests answered by the gateway", ["route", "status"]
)
REQUEST_SECONDS = Histogram(
    "yoke_gateway_request_seconds", "Time to answer an HTTP request (streams: to open)", ["route"]
)
STREAMS = Gauge("yoke_gateway_streams", "Event streams open on this gateway process")
A2A_BAD_REQUESTS = Counter(
    "yoke_a2a_bad_requests",
    "A2A JSON-RPC requests refused as malformed before any task, by the JSON-RPC error's reason",
    ["reason"],
)
# The JSON-RPC errors of a request the A2A door cannot act on, and their reasons (bounded).
A2A_BAD_REQUEST_REASONS = {
    -32700: "parse_error",
    -32600: "invalid_request",
    -32601: "method_not_found",
    -32602: "invalid_params",
    -32005: "content_type_not_supported",
    -32009: "version_not_supported",
}
for _reason in A2A_BAD_REQUEST_REASONS.values():
    A2A_BAD_REQUESTS.labels(_reason)
# Seconds a client is told to wait (Retry-After) when the mesh or the store does not answer.
RETRY_AFTER_SECONDS = 5
# An open stream looks its token up again this often, idle or not (a revoked one ends it).
TOKEN_CHECK_SECONDS = 1.0
# The origin of the token watch's store reads in yoke_store_operations.
TOKEN_WATCH_ORIGIN = "token-watch"

Chunk = TypeVar("Chunk")


@dataclass
class Gateway:
    """One gateway process's connections, shared by every request."""

    settings: Settings
    store: Store
    client: Client
    hub: Hub
    # Delivers webhooks; the A2A door adds its task pushes to it, the MCP door a retention rule.
    webhooks: WebhookWorker
    # Secrets found to be no token's lately: a flood of one bad token is one store read.
    unknown_secrets: UnknownSecrets = field(default_factory=UnknownSecrets)
    # Streams open on this process, by token name (YOKE_GATEWAY_STREAMS_PER_TOKEN).
    streams_by_token: dict[str, int] = field(default_factory=dict)
    # Their tokens, looked up again now and then (a revoked one ends them).
    token_watch: TokenWatch = field(default_factory=lambda: TokenWatch())
    # Where each tool call stands, for the console: one per process, so every console shares
    # its catalog copy (a few seconds stale).
    tool_call_states: ToolCallStates = field(init=False)

    def __post_init__(self) -> None:
        self.tool_call_states = ToolCallStates(self.store, ToolCatalog(self.store))


class ErrorBody(WireModel):
    """Every error the gateway answers: a sentence for people and a code for programs."""

    error: str
    code: str


class ApiError(Exception):
    """Answered as ``{"error", "code"}`` with ``status`` (see ``app``'s exception handler)."""

    def __init__(
        self, status: int, code: str, error: str, headers: dict[str, str] | None = None
    ) -> None:
        super().__init__(error)
        self.status = status
        self.code = code
        self.error = error
        self.headers = headers or {}


def unavailable(error: str) -> ApiError:
    return ApiError(503, "unavailable", error, {"Retry-After": str(RETRY_AFTER_SECONDS)})


def gateway(request: Request) -> Gateway:
    state: Gateway = request.app.state.gateway
    return state


_bearer = HTTPBearer(
    auto_error=False,
    description="A token made by `yoke token create`, sent as `Authorization: Bearer <token>`.",
)


async def require_token(
    request: Request,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> Token:
    """The caller's token: 401 without one or with one that is unknown or revoked.

    The reusable check for every route that needs a token (the API, the console's data, the
    monologue view); a route then checks the token's scope (:func:`forum_in_scope`).
    """
    challenge = {"WWW-Authenticate": "Bearer"}
    if credentials is None:
        raise ApiError(
            401, "unauthorized", "missing token: send Authorization: Bearer <token>", challenge
        )
    unknown = ApiError(401, "unauthorized", "unknown or revoked token", challenge)
    secret = credentials.credentials
    # Cheap refusals first: a secret of the wrong shape, or one found unknown a moment ago, costs
    # no store read (a flood of bad tokens must not become a flood of reads).
    if not TOKEN_PATTERN.fullmatch(secret):
        REFUSALS.labels("invalid_token").inc()
        raise unknown
    state = gateway(request)
    digest = hash_secret(secret)
    if digest in state.unknown_secrets:
        REFUSALS.labels("invalid_token").inc()
        raise unknown
    token = await find_token(state.store, secret)
    if token is None:
        state.unknown_secrets.add(digest)
        raise unknown
    return token


TokenDep = Annotated[Token, Depends(require_token)]


async def forum_in_scope(
    forum_id: Annotated[
        str, Path(alias="forumId", description="The forum's id (`yoke forum create`).")
    ],
    request: Request,
    token: TokenDep,
) -> Conversation:
    """The forum of the path, if the token may use it: scope first (403, also for an unknown
    id, so a scoped token learns nothing of other forums), then existence (404)."""
    if not token.allows(forum_id):
        raise ApiError(403, "forbidden", f"this token may not use forum {forum_id!r}")
    forum = await gateway(request).store.get_conversation(forum_id)
    if forum is None or forum.kind != "forum":
        # A monologue is not a forum: the API never shows one.
        raise ApiError(404, "unknown_forum", f"unknown forum {forum_id!r}")
    return forum


ForumDep = Annotated[Conversation, Depends(forum_in_scope)]


def require_monologue_reader(token: Token, what: str) -> None:
    """403 unless the token was made with ``--can-read-monologues``: an agent's private
    working (its monologue, tool inputs and outputs, notices) is a right of its own, which a
    token that only posts lines has not."""
    if not token.can_read_monologues:
        raise ApiError(
            403,
            "forbidden",
            f"token {token.id!r} may not read {what} (yoke token create --can-read-monologues)",
        )


def hold_stream(state: Gateway, token: Token) -> Callable[[], None]:
    """Count a stream against the token's open streams on this process
    (YOKE_GATEWAY_STREAMS_PER_TOKEN: the REST API's and the A2A door's together): 429 past it.
    Returns the release, which only its first call does."""
    limit = state.settings.gateway_streams_per_token
    open_streams = state.streams_by_token
    if open_streams.get(token.id, 0) >= limit:
        REFUSALS.labels("streams_per_token").inc()
        raise ApiError(
            429,
            "too_many_streams",
            f"token {token.id!r} has {limit} streams open on this gateway, its limit: close one "
            "first",
            {"Retry-After": str(RETRY_AFTER_SECONDS)},
        )
    open_streams[token.id] = open_streams.get(token.id, 0) + 1
    released = False

    def release() -> None:
        nonlocal released
        if released:
            return
        released = True
        left = open_streams.get(token.id, 1) - 1
        if left > 0:
            open_streams[token.id] = left
        else:
            open_streams.pop(token.id, None)

    return release


class TokenWatch:
    """The tokens of the streams open on this process, looked up again together every
    ``every`` seconds (one store read for them all, however many streams are open or idle);
    a token found revoked, or revoked and made again, ends each of its streams."""

    def __init__(self, every: float = TOKEN_CHECK_SECONDS) -> None:
        self.every = every
        # (token name, secret's hash) -> what to call when it is found revoked, by stream.
        self._watched: dict[tuple[str, str], dict[object, Callable[[], None]]] = {}
        self._looking: asyncio.Task[None] | None = None

    def watch(self, store: Store, token: Token, revoked: Callable[[], None]) -> Callable[[], None]:
        """Call ``revoked`` once ``token`` is found revoked; returns the end of the watch."""
        key, stream = (token.id, token.hash), object()
        self._watched.setdefault(key, {})[stream] = revoked
        if self._looking is None or self._looking.done():
            self._looking = asyncio.create_task(self._look(store))

        def unwatch() -> None:
            streams = self._watched.get(key, {})
            streams.pop(stream, None)
            if not streams:
                self._watched.pop(key, None)

        return unwatch

    async def _look(self, store: Store) -> None:
        # Its reads are told apart from what requests cost (yoke_store_operations' origin).
        STORE_ORIGIN.set(TOKEN_WATCH_ORIGIN)
        while self._watched:
            await asyncio.sleep(self.every)
            keys = list(self._watched)
            if not keys:  # every stream and call ended meanwhile: nothing to look up
                break
            try:
                found = {
                    document["_id"]: document.get("hash")
                    async for document in token_collection(store).find(
                        {"_id": {"$in": sorted({name for name, _ in keys})}}, {"hash": 1}
                    )
                }
            except Exception as error:  # the store away: looked up again at the next interval
                log.warning("could not look up the open streams' tokens: %r", error)
                continue
            for key in keys:
                name, secret_hash = key
                if found.get(name) != secret_hash:
                    for revoked in list(self._watched.pop(key, {}).values()):
                        revoked()


async def while_token_in_force(
    chunks: AsyncIterator[Chunk], state: Gateway, token: Token
) -> AsyncGenerator[Chunk]:
    """``chunks`` until they end or ``token`` is found revoked: every stream (the REST API's,
    the A2A door's) and every MCP call waiting for its answer reads through this, so ``yoke
    token revoke`` ends it within the token re-check interval (:class:`TokenWatch`), also while
    it has nothing to send.

    When the token is found gone while the stream waits for its next chunk, that wait is
    cancelled (in the stream's own task, so whatever the chunks hold is closed where it was
    opened) and the stream ends as if its chunks had; found gone while a chunk is being sent,
    the stream ends before the next."""
    stream = asyncio.current_task()
    assert stream is not None
    waiting = revoked = False

    def on_revoked() -> None:
        nonlocal revoked
        revoked = True
        if waiting:
            stream.cancel()

    unwatch = state.token_watch.watch(state.store, token, on_revoked)
    iterator = aiter(chunks)
    try:
        while not revoked:
            waiting = True
            try:
                chunk = await anext(iterator)
            except StopAsyncIteration:
                return
            except asyncio.CancelledError:
                if not revoked:
                    raise
                stream.uncancel()
                return
            finally:
                waiting = False
            yield chunk
    finally:
        unwatch()

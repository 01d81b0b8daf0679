"""What every gateway route stands on: the process's state, errors as JSON, and the token check.

Routers (the REST API here, the console and webhooks beside it) import from this module, not
from ``app``, so that ``app`` can import them all without a cycle.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Annotated, Any

from fastapi import Depends, Path, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import Counter, Gauge, Histogram

from services.gateway.limits import REFUSALS, TOKEN_PATTERN, UnknownSecrets
from services.gateway.stream import Hub
from yoke.client import Client
from yoke.models import Conversation, WireModel
from yoke.settings import Settings
from yoke.store import Store
from yoke.tokens import Token, find_token, hash_secret

REQUESTS = Counter(
    "yoke_gateway_requests", "HTTP requests answered by the gateway", ["route", "status"]
)
REQUEST_SECONDS = Histogram(
    "yoke_gateway_request_seconds", "Time to answer an HTTP request (streams: to open)", ["route"]
)
STREAMS = Gauge("yoke_gateway_streams", "Event streams open on this gateway process")
# Seconds a client is told to wait (Retry-After) when the mesh or the store does not answer.
RETRY_AFTER_SECONDS = 5


@dataclass
class Gateway:
    """One gateway process's connections, shared by every request."""

    settings: Settings
    store: Store
    client: Client
    hub: Hub
    # Anything a router wires in at start-up (say, the webhook worker) keeps its objects here.
    extras: dict[str, Any] = field(default_factory=dict)
    # Secrets found to be no token's lately: a flood of one bad token is one store read.
    unknown_secrets: UnknownSecrets = field(default_factory=UnknownSecrets)
    # Streams open on this process, by token name (YOKE_GATEWAY_STREAMS_PER_TOKEN).
    streams_by_token: dict[str, int] = field(default_factory=dict)


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

"""Who calls: the token and the published agent of one A2A request, carried to the SDK's parts.

The door authenticates a request and finds the agent its path names before the SDK sees it;
a2a-sdk then hands every part (the request handler, the task store, the executor) its own
:class:`ServerCallContext`, which :class:`CallerContextBuilder` fills with the :class:`Caller`.
A context without one is a bug, never a caller: :func:`caller_of` refuses it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from a2a.auth.user import User
from a2a.server.context import ServerCallContext
from a2a.server.routes import DefaultServerCallContextBuilder

from services.gateway.deps import Gateway
from yoke.store.publishing import PublishedAgent
from yoke.store.tokens import Token

if TYPE_CHECKING:
    from starlette.requests import Request

# Where the door leaves the caller in the request's scope, and the SDK's context carries it.
CALLER_KEY = "yoke.a2a.caller"


@dataclass(frozen=True)
class Caller:
    """A token calling one published agent through the A2A door, on this gateway."""

    state: Gateway
    token: Token
    agent: PublishedAgent

    @property
    def owner(self) -> str:
        """Whose tasks these are: the token's namespace (a token made again under an old name
        is another owner, as its kept forums are other forums)."""
        return self.token.namespace or self.token.id


class TokenUser(User):
    """The SDK's view of the caller (its owner-scoping helpers read ``user_name``)."""

    def __init__(self, token: Token) -> None:
        self._name = token.namespace or token.id

    @property
    def is_authenticated(self) -> bool:
        return True

    @property
    def user_name(self) -> str:
        return self._name


class CallerContextBuilder(DefaultServerCallContextBuilder):
    """The SDK's call context, with the caller the door found for this request."""

    def build(self, request: Request) -> ServerCallContext:
        context = super().build(request)
        caller = request.scope.get(CALLER_KEY)
        if isinstance(caller, Caller):
            context.state[CALLER_KEY] = caller
            context.user = TokenUser(caller.token)
        return context


def caller_of(context: ServerCallContext | None) -> Caller:
    caller = context.state.get(CALLER_KEY) if context is not None else None
    if not isinstance(caller, Caller):
        raise RuntimeError("an A2A call context without its caller (the door sets it)")
    return caller

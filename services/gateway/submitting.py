"""How the gateway hands a command to the mesh: published on ``yoke.commands`` through its
:class:`~yoke.client.Client`, bounded in time, and the door's answer or refusal in HTTP terms.
Every line the gateway submits (the REST API's, the MCP and A2A doors', a stop) is made by
:func:`line_command` and submitted by :func:`submit_line`."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Mapping

from fastapi.responses import JSONResponse

from services.gateway.deps import ApiError, Gateway, unavailable
from services.gateway.limits import REFUSALS
from yoke.client import STOP_LINE
from yoke.core.ids import new_id
from yoke.core.models import CommandAuthor, KeptForum, SubmitMessage, SubmitReply, WireModel
from yoke.store.tokens import Token

log = logging.getLogger(__name__)

# The door's reasons (SubmitReply.code) as HTTP statuses; anything else is a 400.
STATUS_OF_CODE: Mapping[str, int] = {
    "too_large": 413,
    "unknown_conversation": 404,
    "not_a_forum": 404,
    "too_many_conversations": 403,
}


class Accepted(WireModel):
    message_id: str
    duplicate: bool


def accepted(reply: SubmitReply) -> JSONResponse:
    assert reply.message_id is not None
    body = Accepted(message_id=reply.message_id, duplicate=bool(reply.duplicate))
    return JSONResponse(body.to_wire(), status_code=202)


async def mesh_answer(state: Gateway, submitted: Awaitable[SubmitReply]) -> SubmitReply:
    """The door's answer to a command being submitted (through ``state.client``, bounded by
    ``gateway_submit_timeout_seconds``), or a 503 without one."""
    timeout = state.settings.gateway_submit_timeout_seconds
    try:
        return await submitted
    except TimeoutError as error:
        if str(error):  # the publish's own bound (Client's publish_timeout) says what it was
            REFUSALS.labels("publish_timeout").inc()
            raise unavailable(f"{error}; try again") from error
        raise unavailable(f"the mesh did not answer within {timeout:g} s; try again") from error
    except Exception as error:
        log.warning("could not submit to the mesh: %r", error)
        raise unavailable("the mesh cannot be reached; try again") from error


async def submit_line(
    state: Gateway, command: SubmitMessage, statuses: Mapping[str, int] = STATUS_OF_CODE
) -> SubmitReply:
    """The door's acceptance of the line ``command`` (``message_id`` set), or its refusal as an
    :class:`ApiError`: 429 with Retry-After past the token's lines per minute, 413, 404, 400
    (``statuses``: a route's own codes beside these); 503 when the mesh does not answer in
    time."""
    settings = state.settings
    submitting = state.client.submit_raw(
        # An ordinary line's body as before: holdGranted only on the hold lines it grants.
        command.model_dump_json(
            exclude_none=True, exclude=None if command.hold_granted else {"hold_granted"}
        ).encode(),
        reply_timeout=settings.gateway_submit_timeout_seconds,
        # A broker in a memory or disk alarm reads no publish: a 503, not a request that hangs.
        publish_timeout=settings.gateway_publish_timeout_seconds,
    )
    reply = await mesh_answer(state, submitting)
    if reply.status == "rejected":
        code = reply.code or "invalid_command"
        if code == "rate_limited":
            # The door counts each token's lines (YOKE_TOKEN_LINES_PER_MINUTE, in the store).
            retry = {"Retry-After": str(reply.retry_after or 60)}
            raise ApiError(429, code, reply.error or "too many lines; retry later", retry)
        raise ApiError(statuses.get(code, 400), code, reply.error or "rejected")
    assert reply.message_id is not None
    return reply


def line_command(
    token: Token,
    forum_id: str,
    author: CommandAuthor,
    text: str,
    idempotency_key: str | None = None,
    kept: KeptForum | None = None,
    *,
    hold_granted: bool = False,
) -> SubmitMessage:
    """The command of a line the gateway writes for ``token``: its idempotency key in the
    token's namespace, so one token's key never finds another token's line (invariant 13).
    ``hold_granted``: a ``/takeover`` or ``/handback`` of a token made with
    ``--can-take-over`` (the door lets the gateway's user hold any forum)."""
    return SubmitMessage(
        conversation_id=forum_id,
        author=author,
        text=text,
        idempotency_key=token.namespaced(idempotency_key or new_id()),
        kept=kept,
        hold_granted=hold_granted,
    )


async def stop_forum(
    state: Gateway,
    token: Token,
    forum_id: str,
    author: CommandAuthor,
    idempotency_key: str | None = None,
    kept: KeptForum | None = None,
) -> SubmitReply:
    """``/stop`` in the forum as ``author``, exactly as if they had typed it: every agent there
    stops (the REST door's stop and an A2A ``tasks/cancel`` in its caller's kept forum)."""
    return await submit_line(
        state, line_command(token, forum_id, author, STOP_LINE, idempotency_key, kept)
    )

"""People take a forum over, over HTTP (docs/people-take-over.md): ``POST .../takeover`` and
``.../handback`` submit the lines ``/takeover [reason]`` and ``/handback`` for a person of the
token's, and the inbox (``GET /v1/escalations``, ``POST /v1/escalations/{id}/claim`` and
``/cancel``) lists and decides the escalations of the token's forums.

Taking over and deciding escalations is a right of its own (``yoke token create
--can-take-over``): only for such a token does the gateway mark a hold line ``holdGranted``,
which the door takes from the gateway's user (and from nobody's else), and submit
``escalation.submit``. The door decides the rest (a forum held already, one nobody holds, a
claim that came second) and the gateway answers its refusal as a status. An escalation of a
forum out of the token's scope is unknown to it (404), exactly as one that does not exist.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from typing import Annotated, Literal

from fastapi import APIRouter, Depends, Header, Query, Request
from fastapi import Path as PathParam
from fastapi.responses import JSONResponse
from pydantic import BeforeValidator, Field

from services.gateway import submitting
from services.gateway.bodies import check_idempotency_key, json_body, json_request
from services.gateway.deps import ApiError, ErrorBody, ForumDep, TokenDep, gateway
from services.gateway.submitting import STATUS_OF_CODE, Accepted, accepted
from yoke.core.models import (
    MAX_NAME_CHARS,
    CommandAuthor,
    Conversation,
    EscalationAction,
    EscalationOutcome,
    EscalationUrgency,
    ShownPerson,
    SubmitReply,
    WireModel,
    check_storable,
)
from yoke.core.slash import HANDBACK, takeover_text
from yoke.runtime.escalations import MAX_INBOX_PAGE, Escalation, Escalations, EscalationState
from yoke.runtime.holds import MAX_HOLD_REASON_CHARS
from yoke.store.tokens import Token

router = APIRouter(prefix="/v1")

# A person's name as the caller gives it: their external id in the token's namespace, and the
# name shown (within both bounds: a line's author's externalId and displayName).
MAX_PERSON_CHARS = min(128, MAX_NAME_CHARS)
PersonName = Annotated[
    str, Field(min_length=1, max_length=MAX_PERSON_CHARS), BeforeValidator(check_storable)
]
HoldReason = Annotated[
    str, Field(min_length=1, max_length=MAX_HOLD_REASON_CHARS), BeforeValidator(check_storable)
]
BODY_BYTES = MAX_HOLD_REASON_CHARS * 8 + 4096

# The door's refusals of a hold line: the forum is held already (by whom, since when, in the
# error), nobody holds it, or the door refused the gateway itself.
STATUS_OF_HOLD_CODE: Mapping[str, int] = {
    **STATUS_OF_CODE,
    "held": 409,
    "not_held": 409,
    "not_allowed": 403,
}
# The door's refusals of an escalation's decision: decided first, or over; not_allowed and
# missing_user_id are the door refusing the gateway itself (the operator's to fix).
STATUS_OF_ESCALATION_CODE: Mapping[str, int] = {
    "unknown_escalation": 404,
    "unknown_conversation": 404,
    "already_claimed": 409,
    "escalation_ended": 409,
    "held": 409,
    "not_claimable": 409,
    "not_allowed": 500,
    "missing_user_id": 500,
}


class PostTakeover(WireModel):
    """Who takes the forum over (``as``: a person of your token's; default: the token's own
    name) and why (shown in the forum's line and notices)."""

    as_: PersonName | None = Field(default=None, alias="as")
    reason: HoldReason | None = None


class PostHandback(WireModel):
    """Who hands the forum back (default: the token's own name)."""

    as_: PersonName | None = Field(default=None, alias="as")


class PostClaim(WireModel):
    """Who claims the escalation: they hold its forum from then on."""

    as_: PersonName = Field(alias="as")


class PostCancel(WireModel):
    """Who cancels the escalation (default: the token's own name)."""

    as_: PersonName | None = Field(default=None, alias="as")


class EscalationView(WireModel):
    """An escalation as the inbox shows it: what the agent asked for and where it stands,
    nothing of the monologue it was asked from (its call's id, its join)."""

    id: str
    forum_id: str
    agent_actor_id: str
    reason: str
    urgency: EscalationUrgency
    opened_at: datetime
    deadline: datetime
    state: EscalationState
    claimed_by: ShownPerson | None = None  # by name: another token's namespace is not shown
    claimed_at: datetime | None = None
    outcome: EscalationOutcome | None = None
    ended_at: datetime | None = None

    @classmethod
    def of(cls, escalation: Escalation) -> EscalationView:
        return cls.model_validate(
            escalation.model_dump(include=set(cls.model_fields), by_alias=False)
        )


class EscalationsPage(WireModel):
    escalations: list[EscalationView]


class Decided(WireModel):
    escalation_id: str
    action: EscalationAction
    duplicate: bool
    # A claim's: the ``/takeover`` line it wrote in the forum.
    message_id: str | None = None


def person(token: Token, name: str | None) -> CommandAuthor:
    """``name`` (default: the token's own) as one of the token's people, as the gateway names
    every author (``POST .../stop``'s): their external id in the token's namespace."""
    shown = name or token.id
    return CommandAuthor(external_id=token.namespaced(shown), display_name=shown)


def require_taker(token: Token) -> None:
    if not token.can_take_over:
        raise ApiError(
            403,
            "forbidden",
            f"token {token.id!r} may not take forums over (yoke token create --can-take-over)",
        )


async def taker_in_scope(forum: ForumDep, token: TokenDep) -> Conversation:
    """The forum of the path, if the token may use it (scope first, as every forum route) and
    was made with ``--can-take-over``: else 403."""
    require_taker(token)
    return forum


TakerForumDep = Annotated[Conversation, Depends(taker_in_scope)]
IdempotencyKey = Annotated[
    str | None,
    Header(
        alias="Idempotency-Key",
        description="As for posting a line: a repeat answers the first line's id with "
        "duplicate true.",
    ),
]
HOLD_RESPONSES: dict[int | str, dict[str, object]] = {
    400: {"model": ErrorBody, "description": "invalid request (a reason too long)"},
    401: {"model": ErrorBody, "description": "missing, unknown or revoked token"},
    403: {
        "model": ErrorBody,
        "description": "forum outside the token's scope, or a token not made with --can-take-over",
    },
    404: {"model": ErrorBody, "description": "unknown forum"},
    409: {
        "model": ErrorBody,
        "description": "held by someone already (held), or held by nobody (not_held)",
    },
    503: {"model": ErrorBody, "description": "the mesh did not answer in time"},
}


async def submit_hold(
    request: Request,
    token: Token,
    forum_id: str,
    author: CommandAuthor,
    text: str,
    idempotency_key: str | None,
) -> JSONResponse:
    check_idempotency_key(request, idempotency_key)
    command = submitting.line_command(
        token, forum_id, author, text, idempotency_key, hold_granted=True
    )
    reply = await submitting.submit_line(gateway(request), command, STATUS_OF_HOLD_CODE)
    return accepted(reply)


@router.post(
    "/forums/{forumId}/takeover",
    status_code=202,
    response_model=Accepted,
    responses=HOLD_RESPONSES,
    openapi_extra=json_body(PostTakeover, required=False),
    summary="Take a forum over from its agents, as one of your token's people",
    description="Submits the line `/takeover [reason]` for `as`: the forum's agents post "
    "nothing there until it is handed back. The answer is that line's id.",
)
async def take_over(
    request: Request,
    forum: TakerForumDep,
    token: TokenDep,
    idempotency_key: IdempotencyKey = None,
) -> JSONResponse:
    body = await json_request(request, BODY_BYTES, PostTakeover, optional=True)
    author = person(token, body.as_)
    text = takeover_text(body.reason)
    return await submit_hold(request, token, forum.id, author, text, idempotency_key)


@router.post(
    "/forums/{forumId}/handback",
    status_code=202,
    response_model=Accepted,
    responses=HOLD_RESPONSES,
    openapi_extra=json_body(PostHandback, required=False),
    summary="Hand a forum you took over back to its agents",
    description="Submits the line `/handback` for `as`: the forum's agents answer again.",
)
async def hand_back(
    request: Request,
    forum: TakerForumDep,
    token: TokenDep,
    idempotency_key: IdempotencyKey = None,
) -> JSONResponse:
    body = await json_request(request, BODY_BYTES, PostHandback, optional=True)
    author = person(token, body.as_)
    return await submit_hold(request, token, forum.id, author, HANDBACK, idempotency_key)


# --- the inbox -----------------------------------------------------------------------------


@router.get(
    "/escalations",
    response_model=EscalationsPage,
    responses={401: {"model": ErrorBody, "description": "missing, unknown or revoked token"}},
    summary="Escalations of the token's forums, oldest first",
    description="What agents asked a person for (their `handoff` tool): open ones wait for a "
    "claim, claimed ones are held by their claimer, ended ones were handed back, canceled or "
    "timed out.",
)
async def list_escalations(
    request: Request,
    token: TokenDep,
    state: Annotated[
        Literal["open", "claimed", "ended"], Query(description="which escalations")
    ] = "open",
    limit: Annotated[int, Query(ge=1, le=MAX_INBOX_PAGE, description="at most this many")] = 50,
) -> JSONResponse:
    for name in ("state", "limit"):
        if len(request.query_params.getlist(name)) > 1:
            raise ApiError(400, "invalid_request", f"{name}: give it once, not several times")
    if not token.all_forums and not token.forums:
        return JSONResponse(EscalationsPage(escalations=[]).to_wire())
    found = await Escalations(gateway(request).store).listed(
        states=(state,), forum_ids=None if token.all_forums else token.forums, limit=limit
    )
    page = EscalationsPage(escalations=[EscalationView.of(e) for e in found])
    return JSONResponse(page.to_wire())


EscalationId = Annotated[
    str,
    PathParam(
        alias="escalationId",
        max_length=128,
        description="The escalation's id (`escalationId` of its event, `id` in the inbox).",
    ),
]
DECISION_RESPONSES: dict[int | str, dict[str, object]] = {
    400: {"model": ErrorBody, "description": "invalid request"},
    401: {"model": ErrorBody, "description": "missing, unknown or revoked token"},
    403: {"model": ErrorBody, "description": "a token not made with --can-take-over"},
    404: {
        "model": ErrorBody,
        "description": "no such escalation in the token's forums (unknown_escalation)",
    },
    409: {
        "model": ErrorBody,
        "description": "claimed by someone first (already_claimed), over (escalation_ended), "
        "its forum held by someone else (held) or kept for an outside caller (not_claimable)",
    },
    503: {"model": ErrorBody, "description": "the mesh did not answer in time"},
}


async def decide(
    request: Request,
    token: Token,
    escalation_id: str,
    action: EscalationAction,
    name: str | None,
) -> JSONResponse:
    """Submit the decision for the token's person, once the escalation is found in scope."""
    state = gateway(request)
    escalation = await Escalations(state.store).get(escalation_id)
    if escalation is None or not token.allows(escalation.forum_id):
        raise ApiError(404, "unknown_escalation", f"unknown escalation {escalation_id!r}")
    deciding = state.client.submit_escalation(
        escalation.forum_id,
        escalation_id,
        action,
        by=person(token, name),
        reply_timeout=state.settings.gateway_submit_timeout_seconds,
        publish_timeout=state.settings.gateway_publish_timeout_seconds,
    )
    reply: SubmitReply = await submitting.mesh_answer(state, deciding)
    if reply.status == "rejected":
        code = reply.code or "invalid_command"
        status = STATUS_OF_ESCALATION_CODE.get(code, 400)
        raise ApiError(status, code, reply.error or "rejected")
    answer = Decided(
        escalation_id=escalation_id,
        action=action,
        duplicate=bool(reply.duplicate),
        message_id=reply.message_id,
    )
    return JSONResponse(answer.to_wire(), status_code=202)


@router.post(
    "/escalations/{escalationId}/claim",
    status_code=202,
    response_model=Decided,
    responses=DECISION_RESPONSES,
    openapi_extra=json_body(PostClaim),
    summary="Claim an escalation: take its forum over, as one of your token's people",
    description="The first decision stands: of two claims one is taken, the other answered "
    "409. The claim writes `/takeover` in the forum for `as`.",
)
async def claim(request: Request, token: TokenDep, escalation_id: EscalationId) -> JSONResponse:
    require_taker(token)
    body = await json_request(request, BODY_BYTES, PostClaim)
    return await decide(request, token, escalation_id, "claim", body.as_)


@router.post(
    "/escalations/{escalationId}/cancel",
    status_code=202,
    response_model=Decided,
    responses=DECISION_RESPONSES,
    openapi_extra=json_body(PostCancel, required=False),
    summary="Cancel an open escalation: its agent goes on without a person",
)
async def cancel(request: Request, token: TokenDep, escalation_id: EscalationId) -> JSONResponse:
    require_taker(token)
    body = await json_request(request, BODY_BYTES, PostCancel, optional=True)
    return await decide(request, token, escalation_id, "cancel", body.as_)

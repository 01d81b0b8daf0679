"""What agents remember, over HTTP (docs/memory.md): ``GET /v1/memories`` lists an agent's
memories, ``DELETE /v1/memories/{memoryId}`` forgets one, ``POST /v1/memories/erase`` erases a
person of the token's in every agent.

It is a right of its own (``yoke token create --can-manage-memory``): what agents learned of
people is no business of a token that only posts lines. A token sees a memory only if the
forum whose line taught it is in its scope (an operator's memory, taught in no forum, only an
all-forums token sees); any other is unknown to it (404), exactly as one that does not exist.
A person is named as the gateway names every author, in the token's namespace
(``http:<ns>:<id>``), and found by the actor id derived from that: no caller's string is ever a
pattern, a prefix or an operator in a query.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from fastapi import Path as PathParam
from fastapi.responses import JSONResponse, Response
from pydantic import BeforeValidator, Field

from services.gateway.bodies import json_body, json_request
from services.gateway.deps import ApiError, ErrorBody, TokenDep, gateway
from services.gateway.limits import REFUSALS
from yoke.core.metrics import MEMORIES_FORGOTTEN, MEMORY_ERASURES
from yoke.core.models import WireModel, check_storable, unstorable
from yoke.runtime.join_config import MemoryScope
from yoke.runtime.memories import (
    MAX_LISTED,
    Memories,
    Memory,
    MemoryStep,
    RemainingLines,
    person_id_of,
    remaining_lines,
)
from yoke.store.tokens import Token

router = APIRouter(prefix="/v1")

# An id (an agent's, a forum's, a memory's) or a person's external id as a caller gives it.
MAX_ID_CHARS = 128
PersonName = Annotated[
    str, Field(min_length=1, max_length=MAX_ID_CHARS), BeforeValidator(check_storable)
]
BODY_BYTES = MAX_ID_CHARS * 8 + 1024


class MemorySourceView(WireModel):
    """The forum line that taught a memory: where, which line, who said it, when."""

    forum_id: str | None = None
    message_id: str | None = None
    author_name: str | None = None
    at: datetime


class MemoryView(WireModel):
    """A memory as a token is shown it: what the agent keeps and where it learned it. The step
    that wrote it names the agent's monologue: only for a token that may read monologues."""

    id: str
    agent_actor_id: str
    scope: MemoryScope
    text: str
    created_at: datetime
    source: MemorySourceView
    step: MemoryStep | None = None

    @classmethod
    def of(cls, memory: Memory, token: Token) -> MemoryView:
        source = memory.source
        return cls(
            id=memory.id,
            agent_actor_id=memory.agent_actor_id,
            scope=memory.scope,
            text=memory.text,
            created_at=memory.created_at,
            source=MemorySourceView(
                forum_id=source.forum_id,
                message_id=source.message_id,
                author_name=source.author_name,
                at=source.at,
            ),
            step=memory.step if token.can_read_monologues else None,
        )


class MemoriesPage(WireModel):
    memories: list[MemoryView]
    # The page ended early at YOKE_GATEWAY_MAX_RESPONSE_BYTES: ask for fewer.
    cut: bool = False


class PostErase(WireModel):
    """Whose memories go: a person of the token's (their external id, as they post lines)."""

    person: PersonName


class Erased(WireModel):
    """How many memories went (of those the token may see), and the forums of the token's
    where the person's own lines remain, with how many: listed, never hidden."""

    erased: int
    remaining_lines: list[RemainingLines]


def require_memory_manager(token: Token) -> None:
    if not token.can_manage_memory:
        raise ApiError(
            403,
            "forbidden",
            f"token {token.id!r} may not manage memories (yoke token create --can-manage-memory)",
        )


def forum_scope(token: Token) -> list[str] | None:
    """The forums whose memories the token sees (None: all, and those taught in no forum)."""
    return None if token.all_forums else list(token.forums or [])


def sees(token: Token, memory: Memory) -> bool:
    forum_id = memory.source.forum_id
    return token.all_forums or (forum_id is not None and token.allows(forum_id))


def checked(name: str, value: str | None) -> str | None:
    """A query parameter the store can hold (no NUL, no lone surrogate): else 400."""
    if value is not None and (problem := unstorable(value)) is not None:
        raise ApiError(400, "invalid_request", f"{name}: {problem}")
    return value


def once(request: Request, *names: str) -> None:
    for name in names:
        if len(request.query_params.getlist(name)) > 1:
            raise ApiError(400, "invalid_request", f"{name}: give it once, not several times")


ERRORS: dict[int | str, dict[str, object]] = {
    400: {"model": ErrorBody, "description": "invalid request"},
    401: {"model": ErrorBody, "description": "missing, unknown or revoked token"},
    403: {
        "model": ErrorBody,
        "description": "a token not made with --can-manage-memory, or a forum outside its scope",
    },
}


@router.get(
    "/memories",
    response_model=MemoriesPage,
    responses=ERRORS,
    summary="An agent's memories taught in the token's forums, newest first",
    description="All of them, or those about one person of the token's (`person`), or about "
    "one forum (`forum`). An unknown agent has none.",
)
async def list_memories(
    request: Request,
    token: TokenDep,
    agent: Annotated[
        str, Query(min_length=1, max_length=MAX_ID_CHARS, description="the agent's actor id")
    ],
    person: Annotated[
        str | None,
        Query(
            min_length=1,
            max_length=MAX_ID_CHARS,
            description="a person of the token's: their external id, as they post lines",
        ),
    ] = None,
    forum: Annotated[
        str | None,
        Query(min_length=1, max_length=MAX_ID_CHARS, description="a forum of the token's"),
    ] = None,
    limit: Annotated[int, Query(ge=1, le=MAX_LISTED, description="at most this many")] = 100,
) -> Response:
    require_memory_manager(token)
    once(request, "agent", "person", "forum", "limit")
    checked("agent", agent)
    checked("person", person)
    checked("forum", forum)
    if person is not None and forum is not None:
        raise ApiError(400, "invalid_request", "give person or forum, not both")
    if forum is not None and not token.allows(forum):
        raise ApiError(403, "forbidden", f"this token may not use forum {forum!r}")
    scope: MemoryScope | None = None
    subject: str | None = None
    if person is not None:
        scope, subject = "person", person_id_of(token.namespaced(person))
    elif forum is not None:
        scope, subject = "forum", forum
    forums = forum_scope(token)
    found: list[Memory] = []
    if forums is None or forums:
        found = await Memories(gateway(request).store).listed(
            agent_actor_id=agent, scope=scope, subject=subject, forum_ids=forums, limit=limit
        )
    # Memories whose subject is another agent's cannot match (the scope key names the agent);
    # the source forum is checked again here, so a listing never shows what ``sees`` hides.
    views = [MemoryView.of(memory, token) for memory in found if sees(token, memory)]
    return page(views, gateway(request).settings.gateway_max_response_bytes)


def page(views: list[MemoryView], budget: int) -> Response:
    """The page as JSON, ending before the memory that would pass ``budget`` bytes."""
    encoded: list[bytes] = []
    size = len(b'{"memories":[],"cut":false}')
    cut = False
    for view in views:
        one = json.dumps(view.to_wire(), ensure_ascii=False, separators=(",", ":")).encode()
        if encoded and size + len(one) + 1 > budget:
            REFUSALS.labels("page_trimmed").inc()
            cut = True
            break
        encoded.append(one)
        size += len(one) + 1
    body = b'{"memories":[' + b",".join(encoded) + b'],"cut":' + (b"true" if cut else b"false")
    return Response(body + b"}", media_type="application/json")


MemoryId = Annotated[
    str,
    PathParam(
        alias="memoryId",
        min_length=1,
        max_length=MAX_ID_CHARS,
        description="The memory's id (`id` in the list, the `remember` tool's answer).",
    ),
]


@router.delete(
    "/memories/{memoryId}",
    status_code=204,
    responses={
        **ERRORS,
        404: {"model": ErrorBody, "description": "no such memory in the token's forums"},
    },
    summary="Forget one memory",
)
async def forget_memory(request: Request, token: TokenDep, memory_id: MemoryId) -> Response:
    require_memory_manager(token)
    checked("memoryId", memory_id)
    memories = Memories(gateway(request).store)
    memory = await memories.get(memory_id)
    unknown = ApiError(404, "unknown_memory", f"unknown memory {memory_id!r}")
    if memory is None or not sees(token, memory):
        raise unknown
    if not await memories.forget(memory_id):
        raise unknown  # forgotten meanwhile
    MEMORIES_FORGOTTEN.inc()
    return Response(status_code=204)


@router.post(
    "/memories/erase",
    response_model=Erased,
    responses=ERRORS,
    openapi_extra=json_body(PostErase),
    summary="Erase what every agent remembers of one of your token's people",
    description="Every memory about the person or taught by them goes, in every agent, and "
    "none they taught before now can come back. `erased` counts those taught in the token's "
    "forums; `remainingLines` lists the token's forums where the person's own lines remain.",
)
async def erase_person(request: Request, token: TokenDep) -> JSONResponse:
    require_memory_manager(token)
    body = await json_request(request, BODY_BYTES, PostErase)
    state = gateway(request)
    person_id = person_id_of(token.namespaced(body.person))
    forums = forum_scope(token)
    memories = Memories(state.store)
    # Counted before they go: a scoped token learns nothing of what other forums taught.
    shown = None if forums is None else await visible_count(memories, person_id, forums)
    erased = await memories.erase_person(person_id)
    MEMORY_ERASURES.inc(erased)
    remaining = await remaining_lines(state.store, person_id, forums)
    answer = Erased(
        erased=erased if shown is None else min(shown, erased), remaining_lines=remaining
    )
    return JSONResponse(answer.to_wire())


async def visible_count(memories: Memories, person_id: str, forums: list[str]) -> int:
    """How many of the person's memories (about them, or taught by them) were taught in
    ``forums``: each counted once, by equality on the derived person id."""
    if not forums:
        return 0
    taught_in: dict[str, Any] = {"$in": forums}
    about = {"personId": person_id, "source.forumId": taught_in}
    taught = {"taughtBy": person_id, "source.forumId": taught_in}
    both = {"personId": person_id, "taughtBy": person_id, "source.forumId": taught_in}
    collection = memories.collection
    counted = [await collection.count_documents(where) for where in (about, taught, both)]
    return counted[0] + counted[1] - counted[2]

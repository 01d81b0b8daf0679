"""The web console: forums, a live forum view, agents' monologues, the inbox of escalations,
and dead letters.

Pages are plain HTML (Jinja templates extending ``templates/base.html``, autoescaped) with
nothing but the ids of their path in them; the data comes from the token-guarded JSON below and
from the public API (``/v1``), fetched by a little JavaScript (``static/console.js``, no build
step) with the token in an ``Authorization`` header. The token is asked once and kept in the
tab's session storage; it is never put in a URL (a stream is read with ``fetch``, since
``EventSource`` cannot send a header).

A token made with ``--can-read-monologues`` reads the monologues of the agents joined to the
forums in its scope: a monologue is shown if some forum in scope has an agent whose active
monologue, or one of its compaction chain, it is; any other token gets 403 there (an app that
posts lines never reads an agent's private working). Mesh-wide dead letters (the broker's
queue, which holds monologue lines too) are shown to all-forums tokens with that right only;
webhook dead letters to the tokens whose scope holds their forum.

The forum view draws an agent's line as it is written, from the stream's ``delta`` events
(keyed by the line's id, text appended in index order), and replaces that draft with the line
when it comes (or drops it when it ends ``abandoned``). For a token made with
``--can-approve`` it lists the calls awaiting approval (``GET /v1/.../approvals``, then the
stream's ``approval`` events) with the tool, its input and Approve / Reject (a reason for a
reject), and each decided one with its decision and who took it. The monologue view draws each
tool call with its source, state and duration (``services/gateway/tool_calls.py``), and a gated
call's decision, who and why, redrawn as the call ends.

The forum view says who holds the forum (a person who took it over, docs/people-take-over.md)
and, for a token made with ``--can-take-over``, offers Take over and Hand back (``POST
/v1/.../takeover``, ``/handback``). The inbox lists the open escalations of the token's forums
(``GET /v1/escalations``), each with Claim for such a token (``POST .../claim``).

For a token made with ``--can-manage-memory``, an agent's memories page lists what the agent
remembers that the token's forums taught (:mod:`services.gateway.memories` decides which), each
with the forum line that taught it, read by that line's id, and Forget (``DELETE
/v1/memories/{id}``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, get_args

from fastapi import APIRouter, Query, Request
from fastapi import Path as PathParam
from fastapi.responses import HTMLResponse, JSONResponse, Response
from jinja2 import Environment, FileSystemLoader, StrictUndefined, Template

from services.gateway.deps import (
    ApiError,
    ForumDep,
    TokenDep,
    gateway,
    require_monologue_reader,
)
from services.gateway.memories import (
    MAX_ID_CHARS,
    MemoryView,
    checked,
    forum_scope,
    require_memory_manager,
    sees,
)
from yoke.bus.dead_letters import list_dead_letters
from yoke.core.models import CallerDoor, Participant
from yoke.runtime.chain import chain_of
from yoke.runtime.holds import Holds
from yoke.runtime.instances import INGESTION, PROCESSOR
from yoke.runtime.joins import participant_id
from yoke.runtime.memories import MAX_LISTED, Memories, Memory
from yoke.store.database import Store
from yoke.store.forum_list import ForumList
from yoke.store.tokens import Token
from yoke.store.webhooks import dead_letters

log = logging.getLogger(__name__)

HERE = Path(__file__).resolve().parent
# Loaded once; a page missing a value it names fails instead of rendering a blank.
TEMPLATE_ENVIRONMENT = Environment(
    loader=FileSystemLoader(HERE / "templates"),
    autoescape=True,
    undefined=StrictUndefined,
    trim_blocks=True,
    keep_trailing_newline=True,
    auto_reload=False,
)
PAGES = ("index", "forum", "inbox", "dead_letters", "memories")
TEMPLATES: Mapping[str, Template] = {
    name: TEMPLATE_ENVIRONMENT.get_template(f"{name}.html") for name in PAGES
}
STATIC_TYPES: Mapping[str, str] = {
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
}
STATIC: Mapping[str, tuple[bytes, str]] = {
    path.name: (path.read_bytes(), STATIC_TYPES[path.suffix])
    for path in (HERE / "static").iterdir()
    if path.suffix in STATIC_TYPES
}
# Pages load only their own script and style and talk only to this origin.
PAGE_HEADERS: Mapping[str, str] = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; "
    "connect-src 'self'; img-src 'self'; base-uri 'none'; form-action 'self'; "
    "frame-ancestors 'none'",
    "Referrer-Policy": "no-referrer",
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-store",
}
MAX_FORUMS = 100  # one page of the forum list
MAX_NAMES = 200
MAX_LINES = 500
DEAD_LETTERS_SHOWN = 200
# A memory's source line is shown up to this many characters.
MAX_SOURCE_CHARS = 2000
# A compacted-away monologue is looked for among this many of its forum's joins at most.
MAX_JOINS_SEARCHED = 1000
DEAD_LETTER_READ_SECONDS = 10.0
# Actors named to any token that may read a conversation they wrote in: the mesh's own
# (tool results, nudges, steering), who are nobody's secret.
OPEN_KINDS = ("system",)

router = APIRouter(include_in_schema=False)


def page(name: str, **values: str) -> HTMLResponse:
    body = TEMPLATES[name].render(values)
    return HTMLResponse(body, headers=PAGE_HEADERS)


# --- pages ---------------------------------------------------------------------------------


@router.get("/")
async def index_page() -> HTMLResponse:
    return page("index")


@router.get("/forums/{forum_id}")
async def forum_page(forum_id: str) -> HTMLResponse:
    return page("forum", forum_id=forum_id)


@router.get("/inbox")
async def inbox_page() -> HTMLResponse:
    return page("inbox")


@router.get("/dead-letters")
async def dead_letters_page() -> HTMLResponse:
    return page("dead_letters")


@router.get("/agents/{agent_id}/memories")
async def memories_page(agent_id: str) -> HTMLResponse:
    return page("memories", agent_id=agent_id)


@router.get("/console/static/{name}")
async def static_file(name: str) -> Response:
    found = STATIC.get(name)
    if found is None:
        raise ApiError(404, "not_found", f"no file {name!r}")
    content, media_type = found
    return Response(content, media_type=media_type, headers={"Cache-Control": "no-cache"})


# --- data ----------------------------------------------------------------------------------


@router.get("/console/api/forums")
async def forums(
    request: Request,
    token: TokenDep,
    before: Annotated[int | None, Query(ge=1, description="the previous page's next")] = None,
    limit: Annotated[int, Query(ge=1, le=MAX_FORUMS)] = MAX_FORUMS,
) -> JSONResponse:
    """The forums the token may use, newest first: a token's own list, or (an all-forums
    token) every forum a page at a time; ``next`` is the ``before`` of the next page."""
    state = gateway(request)
    store = state.store
    cursor: int | None = None
    if not token.all_forums:
        forum_ids = token.forums or []
    else:
        forum_ids, cursor = await ForumList.of(store).page(before, limit)
    found = [await store.get_conversation(forum_id) for forum_id in forum_ids]
    shown = [f for f in found if f is not None and f.kind == "forum"]
    return JSONResponse({"forums": [forum.to_wire() for forum in shown], "next": cursor})


async def joined_participants(
    store: Store, forum_id: str, cap: int
) -> tuple[list[Participant], bool]:
    """The agents' forum participants, newest join first, at most ``cap`` (and whether more
    were cut), found through the forum's joins (one ingestion instance each, by equality on
    indexed fields): never the forum's other participants, whose number a token can grow."""
    query = {"actor": INGESTION, "watch": forum_id}
    documents = await store.states.find(query, {"config.agentActorId": 1}).to_list(cap + 1)
    agents = [str(d.get("config", {}).get("agentActorId") or "") for d in documents]
    found = [await store.get_participant(participant_id(forum_id, agent)) for agent in agents]
    participants = [p for p in found if p is not None]
    participants.sort(key=lambda p: (p.joined_at, p.id), reverse=True)
    return participants[:cap], len(documents) > cap


# What a token without --can-read-monologues is not shown of a forum's agents.
MONOLOGUE_KEYS = frozenset({"monologueId", "monologues"})


async def agents_of(store: Store, forum_id: str, cap: int) -> tuple[list[dict[str, Any]], bool]:
    """The forum's agents with their active monologue and the monologues before it (at most
    ``cap``, newest join first), and whether some were cut."""
    agents = []
    participants, cut = await joined_participants(store, forum_id, cap)
    for participant in participants:
        monologue_id = participant.metadata.get("monologueId")
        if not isinstance(monologue_id, str):
            continue
        actor = await store.get_actor(participant.actor_id)
        chain = [link.from_monologue_id for link in chain_of(participant)]
        agents.append(
            {
                "agentActorId": participant.actor_id,
                "name": actor.name if actor is not None else participant.actor_id,
                "monologueId": monologue_id,
                "monologues": [*chain, monologue_id] if monologue_id not in chain else chain,
                "left": participant.left_at is not None,
            }
        )
    return agents, cut


@router.get("/console/api/forums/{forumId}")
async def forum_info(request: Request, forum: ForumDep, token: TokenDep) -> JSONResponse:
    """A forum, its head seq and its agents (for the forum view and its monologue panel;
    ``agentsCut`` when there were more than ``YOKE_CONSOLE_MAX_AGENTS``), and whether the
    token may decide approvals (the view then lists them, with their buttons) and read the
    agents' monologues (else the view offers none); who holds the forum (``hold``: its holder's
    name, since when and why), and whether the token may take it over and hand it back."""
    state = gateway(request)
    agents, cut = await agents_of(state.store, forum.id, state.settings.console_max_agents)
    if not token.can_read_monologues:
        # Their monologues are the agents' private working: not even their ids.
        agents = [
            {key: value for key, value in agent.items() if key not in MONOLOGUE_KEYS}
            for agent in agents
        ]
    return JSONResponse(
        {
            "forum": forum.to_wire(),
            "head": await state.store.last_seq(forum.id),
            "agents": agents,
            "agentsCut": cut,
            "canApprove": token.can_approve,
            "canReadMonologues": token.can_read_monologues,
            "canTakeOver": token.can_take_over,
            "canManageMemory": token.can_manage_memory,
            "hold": await hold_of(state.store, forum.id),
        }
    )


async def hold_of(store: Store, forum_id: str) -> dict[str, Any] | None:
    """Who holds the forum, as its readers see it in its lines already: the holder's name,
    since when, why, and the escalation the hold claimed."""
    hold = await Holds(store).get(forum_id)
    if hold is None:
        return None
    shown = {
        "holder": hold.holder.display_name,
        "since": hold.since.isoformat(),
        "reason": hold.reason,
        "escalationId": hold.escalation_id,
    }
    return {key: value for key, value in shown.items() if value is not None}


@router.get("/console/api/token")
async def token_info(token: TokenDep) -> JSONResponse:
    """The token's name and what it may do (the inbox offers Claim to a token that may)."""
    return JSONResponse(
        {
            "name": token.id,
            "allForums": token.all_forums,
            "canApprove": token.can_approve,
            "canReadMonologues": token.can_read_monologues,
            "canTakeOver": token.can_take_over,
            "canManageMemory": token.can_manage_memory,
        }
    )


async def readable_forum(store: Store, token: Token, conversation_id: str) -> str | None:
    """The forum through which the token may read the conversation (a forum in its scope, or
    the monologue of a join there, for a token that may read monologues), or None."""
    conversation = await store.get_conversation(conversation_id)
    if conversation is None:
        return None
    if conversation.kind == "forum":
        return conversation.id if token.allows(conversation.id) else None
    if not token.can_read_monologues:
        return None
    join = await join_of_monologue(store, conversation_id)
    return join[0] if join is not None and token.allows(join[0]) else None


@router.get("/console/api/names")
async def names(
    request: Request,
    token: TokenDep,
    ids: Annotated[str, Query(max_length=MAX_NAMES * 40, description="comma-separated")],
    conversation: Annotated[str, Query(max_length=64, description="where they wrote")],
) -> JSONResponse:
    """Display names of the authors of a conversation's lines the token may read.

    Human ids are derived from ``externalId``, so anyone can compute them: an actor is named
    only if it took part in that conversation (its participant there, a derived id), or is
    one of the mesh's own; a conversation out of scope is 403."""
    store = gateway(request).store
    if await readable_forum(store, token, conversation) is None:
        raise ApiError(403, "forbidden", f"this token may not read {conversation!r}")
    found: dict[str, str] = {}
    # The callers of a published agent (the MCP and A2A doors), by the door they came through.
    doors: dict[str, str] = {}
    for actor_id in [i for i in ids.split(",") if i][:MAX_NAMES]:
        actor = await store.get_actor(actor_id)
        if actor is None:
            continue
        took_part = await store.get_participant(participant_id(conversation, actor_id))
        if took_part is not None or actor.kind in OPEN_KINDS:
            found[actor_id] = actor.name
            door = (actor.external_id or "").partition(":")[0]
            if door in get_args(CallerDoor):
                doors[actor_id] = door
    return JSONResponse({"names": found, "doors": doors})


async def join_of_monologue(store: Store, monologue_id: str) -> tuple[str, str] | None:
    """The forum and the agent whose join owns the monologue (active or compacted away).

    Read through joins, never through the monologue's participants (one per forum author:
    a token grows them): the processor instance that watches it, or, for a monologue a
    compaction left, the joins of the forum its first line names (a join's chain lists it)."""
    monologue = await store.get_conversation(monologue_id)
    if monologue is None or monologue.kind != "monologue":
        return None
    active = await store.states.find_one({"actor": PROCESSOR, "watch": monologue_id})
    if active is not None:
        config = active.get("config", {})
        return str(config.get("sourceConversationId")), str(config.get("agentActorId"))
    first = await store.history(monologue_id, after_seq=0, up_to_seq=1)
    forum_id = first[0].meta.source_conversation_id if first else None
    if not forum_id:
        return None
    joined, _ = await joined_participants(store, forum_id, MAX_JOINS_SEARCHED)
    for participant in joined:
        monologues = {link.from_monologue_id for link in chain_of(participant)}
        monologues.add(str(participant.metadata.get("monologueId") or ""))
        if monologue_id in monologues:
            return participant.conversation_id, participant.actor_id
    return None


@router.get("/console/api/monologues/{monologueId}/messages")
async def monologue_messages(
    request: Request,
    token: TokenDep,
    monologue_id: Annotated[str, PathParam(alias="monologueId")],
    after: Annotated[int | None, Query(ge=0)] = None,
    limit: Annotated[int, Query(ge=1, le=MAX_LINES)] = 200,
) -> JSONResponse:
    """A monologue's lines after ``after`` (default: its last ``limit`` lines), in seq order,
    and ``toolCalls``: where each call stands that the page shows or must redraw (see
    :meth:`ToolCallStates.views`), keyed by ``callLineId`` and ``callId``.

    Scope: only a token made with ``--can-read-monologues`` reads any (else 403); a monologue
    belongs to its join's forum; a token that may not use that forum gets 403, as does one
    asking for an id that is not a monologue (nothing is told about it).
    """
    require_monologue_reader(token, "monologues")
    state = gateway(request)
    store = state.store
    join = await join_of_monologue(store, monologue_id)
    if join is None or not token.allows(join[0]):
        raise ApiError(403, "forbidden", f"this token may not read monologue {monologue_id!r}")
    forum_id, agent_actor_id = join
    head = await store.last_seq(monologue_id)
    start = max(0, head - limit) if after is None else after
    lines = await store.history(monologue_id, after_seq=start, up_to_seq=min(start + limit, head))
    calls = await state.tool_call_states.views(monologue_id, forum_id, agent_actor_id, lines)
    return JSONResponse(
        {
            "forumId": forum_id,
            "head": head,
            "messages": [line.to_wire() for line in lines],
            "toolCalls": [call.to_wire() for call in calls],
        }
    )


@router.get("/console/api/dead-letters")
async def dead_letter_list(request: Request, token: TokenDep) -> JSONResponse:
    """Webhook dead letters of the forums in scope; the mesh's (monologue lines among them)
    for all-forums tokens that may read monologues."""
    state = gateway(request)
    scope = None if token.all_forums else (token.forums or [])
    letters = await dead_letters(state.store, scope, limit=DEAD_LETTERS_SHOWN)
    body: dict[str, Any] = {"webhooks": [letter.to_wire() for letter in letters]}
    body["mesh"] = await mesh_dead_letters(state.settings.amqp_url) if everything(token) else None
    return JSONResponse(body)


def everything(token: Token) -> bool:
    return token.all_forums and token.can_read_monologues


async def mesh_dead_letters(amqp_url: str) -> list[dict[str, object]] | str:
    """The broker's dead-letter queue, read and put back (or why it could not be read)."""
    try:
        async with asyncio.timeout(DEAD_LETTER_READ_SECONDS):
            return await list_dead_letters(amqp_url, limit=DEAD_LETTERS_SHOWN)
    except Exception as error:
        log.warning("dead letters not read: %r", error)
        return f"the dead-letter queue could not be read: {type(error).__name__}"


@router.get("/console/api/agents/{agentId}/memories")
async def agent_memories(
    request: Request,
    token: TokenDep,
    agent_id: Annotated[str, PathParam(alias="agentId", min_length=1, max_length=MAX_ID_CHARS)],
    limit: Annotated[int, Query(ge=1, le=MAX_LISTED)] = 100,
) -> JSONResponse:
    """The agent's memories the token may see, newest first (``GET /v1/memories``'s), each
    with ``line``: the forum line that taught it (its seq, author and text), read by its id,
    when it is still there and in the token's scope. The agent's name only to a token that
    sees some of its memories (or every forum): an agent's id tells nothing else."""
    require_memory_manager(token)
    checked("agentId", agent_id)
    store = gateway(request).store
    forums = forum_scope(token)
    found: list[Memory] = []
    if forums is None or forums:
        found = await Memories(store).listed(agent_actor_id=agent_id, forum_ids=forums, limit=limit)
    entries = []
    for memory in found:
        if not sees(token, memory):
            continue
        entry = MemoryView.of(memory, token).to_wire()
        entry["line"] = await source_line(store, token, memory)
        entries.append(entry)
    name = None
    if entries or token.all_forums:
        actor = await store.get_actor(agent_id)
        name = actor.name if actor is not None and actor.kind == "agent" else None
    return JSONResponse({"agentActorId": agent_id, "name": name, "memories": entries})


async def source_line(store: Store, token: Token, memory: Memory) -> dict[str, Any] | None:
    """The line that taught ``memory``, if it is still stored, in the forum the memory names
    and that forum is the token's (one read by the line's id)."""
    source = memory.source
    if source.message_id is None or source.forum_id is None or not token.allows(source.forum_id):
        return None
    line = await store.get_message(source.message_id)
    if line is None or line.conversation_id != source.forum_id:
        return None
    text = line.text
    if len(text) > MAX_SOURCE_CHARS:
        text = text[:MAX_SOURCE_CHARS] + "…"
    return {
        "seq": line.seq,
        "authorActorId": line.author_actor_id,
        "createdAt": line.created_at.isoformat(),
        "text": text,
    }

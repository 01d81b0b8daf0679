"""One trace per turn (docs/architecture.md, "Tracing"), read back from a real Jaeger.

The five services, the gateway and a worker tool (the SDK's ``serve``, a process of its own)
run with ``OTEL_EXPORTER_OTLP_ENDPOINT`` pointing at the module's Jaeger (tests/support/jaeger.py);
the model is the fake OpenAI server, so the model call is a GenAI client span with real usage.
Lines come through the AMQP door as a bridge sends them (with or without a ``traceparent`` of
its own) and through the HTTP gateway; each test reads its trace back by id, or by the search
Jaeger's UI makes, and checks who is whose parent. The last test stops the collector.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from urllib.parse import quote

import aio_pika
import httpx
import pytest
from aio_pika.abc import AbstractIncomingMessage
from prometheus_client.parser import text_string_to_metric_families

from tests.support.approvals import sums
from tests.support.fake_openai import FakeOpenAI, completion, openai_env
from tests.support.gateway_process import CLEAN_EXITS, running_gateway
from tests.support.jaeger import Jaeger, Span, Trace
from tests.support.mesh import Mesh, agent_lines, lines_until, say
from tests.support.processes import ROOT, eventually, local_http
from tests.support.worker_process import as_user
from tests.support.worker_tools import WorkerTool, ask_direct, registered_worker_tool
from yoke.bus import topology
from yoke.bus.amqp_nodes import amqp_user
from yoke.cli.publishers import create_publisher, management_of
from yoke.client import Client
from yoke.core.ids import new_id
from yoke.core.models import CommandAuthor, Message, MessagePosted, ToolResultPart
from yoke.runtime.calls.approvals import pending_approvals
from yoke.runtime.escalations import Escalation, Escalations
from yoke.runtime.join_config import ApprovalConfig, JoinConfig
from yoke.runtime.joins import create_agent, create_forum, join_conversation, join_id
from yoke.runtime.posting import Poster
from yoke.store.database import Store
from yoke.store.tokens import create_token, ensure_token_indexes

pytestmark = pytest.mark.slow

WAIT = 60.0  # the most a test waits for anything the mesh or Jaeger does, on a loaded machine
MODEL = "gpt-test"  # what the fake OpenAI server answers as
PRICE = (1.0, 2.0)  # USD per million input and output tokens: the span's yoke.cost_usd
SCHEMA = {"type": "object", "properties": {"tag": {"type": "string"}}}


@pytest.fixture(scope="module")
def mesh_env(jaeger: Jaeger, fake_openai: FakeOpenAI) -> dict[str, str]:
    return {
        **jaeger.env(),
        # A collector that is away is given up on within 2 s a batch (the last test).
        "OTEL_EXPORTER_OTLP_TIMEOUT": "2",
        "YOKE_PRICES": json.dumps({MODEL: PRICE}),
        **openai_env(fake_openai.base_url, give_up_seconds=10),
    }


@pytest.fixture(scope="module")
def gateway_env(jaeger: Jaeger) -> dict[str, str]:
    return jaeger.env()


@pytest.fixture(scope="module")
async def tool(
    amqp_url: str, module_mongodb_url: str, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[WorkerTool]:
    """A worker tool, registered before the services start (their first catalog read has it)."""
    async with registered_worker_tool(
        amqp_url,
        module_mongodb_url,
        f"traced-{uuid.uuid4().hex[:8]}",
        SCHEMA,
        Path(tmp_path_factory.mktemp("tools")),
        timeout=120,
    ) as made:
        yield made


@pytest.fixture(scope="module")
def before_mesh(tool: WorkerTool) -> None:
    """The worker tool is in the catalog when the services start."""


@pytest.fixture(scope="module")
def worker(
    tool: WorkerTool, jaeger: Jaeger, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[subprocess.Popen[bytes]]:
    """The SDK's ``serve`` for the tool (tests/chaos/tool_worker.py), in a process of its own
    that traces to the module's Jaeger as ``yoke-tool-NAME``."""
    folder = Path(tmp_path_factory.mktemp("worker"))
    log = (folder / "worker.log").open("ab")
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.chaos.tool_worker",
            "--url",
            tool.url,
            "--tool",
            tool.name,
            "--runs",
            str(folder / "runs.jsonl"),
            "--seconds",
            "0",
        ],
        env={**os.environ, **jaeger.env(), "YOKE_LOG_FORMAT": "json"},
        cwd=ROOT,
        stdout=log,
        stderr=log,
    )
    try:
        yield process
    finally:
        process.terminate()
        try:
            process.wait(20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)
        log.close()


async def echo_forum(store: Store, poster: Poster, **options: Any) -> tuple[str, str]:
    """A forum with one agent of the fake OpenAI model: (forum, agent)."""
    forum = await create_forum(store, "traced")
    agent = await create_agent(store, "echo")
    await join_conversation(store, poster, agent.id, forum.id, model=MODEL, **options)
    return forum.id, agent.id


async def answered(store: Store, forum_id: str, count: int = 1) -> list[Message]:
    """The forum's lines once the agent has answered ``count`` times."""
    return await lines_until(
        store, forum_id, lambda lines: len(agent_lines(lines)) >= count, timeout=WAIT
    )


def submit_body(forum_id: str, text: str) -> dict[str, Any]:
    return {
        "conversationId": forum_id,
        "author": {"externalId": f"test:{new_id()[:8]}", "displayName": "ada"},
        "text": text,
        "idempotencyKey": new_id(),
    }


def spans_of(trace: Trace, service: str, name: str) -> list[Span]:
    return [span for span in trace if span.service == service and span.name == name]


def one_of(trace: Trace, service: str, name: str, **attributes: object) -> Span:
    """The one span of ``service`` named ``name`` with these attributes (the tree otherwise)."""
    found = [
        span
        for span in spans_of(trace, service, name)
        if all(span.attributes.get(key) == value for key, value in attributes.items())
    ]
    assert len(found) == 1, (
        f"{len(found)} {name!r} spans of {service} {attributes}:\n{trace.tree()}"
    )
    return found[0]


def has(service: str, name: str, **attributes: object) -> Any:
    """A ``Jaeger.trace(until=...)`` condition: a span like that has arrived."""
    return lambda trace: any(
        span.service == service
        and span.name == name
        and all(span.attributes.get(key) == value for key, value in attributes.items())
        for span in trace
    )


def whole(trace: Trace) -> bool:
    """A ``Jaeger.trace(until=...)`` condition: every span's parent has arrived but the root's.
    Spans are exported as they end, and the door's delivery ends after what it set going (the
    copy, the step, egress's forward) may have ended and been exported."""
    return len(trace.roots()) == 1


def answer_forwarded(trace: Trace) -> bool:
    """The answer to a tool round has reached egress, with every span on its way there."""
    return any(
        span.name == "forward"
        and any(
            above.name == "step" and above.attributes.get("yoke.trigger") == "tool_result"
            for above in trace.ancestors(span)
        )
        for span in trace
    )


def chats(trace: Trace, step: Span) -> bool:
    """Whether ``step`` called the model."""
    return any(child.name == f"chat {MODEL}" for child in trace.children(step))


async def answering_step(
    jaeger: Jaeger, trace: Trace, calling: Span, line_id: str, since: datetime
) -> tuple[Trace, Trace, Span]:
    """The step that answered a round's last results line ``line_id`` once its answer has
    reached egress, with the turn's trace as it stands then and the trace that holds the step:
    the turn's own, or one whose span that wrote the line links to ``calling``, the step that
    waited (a line written by a sweep, outside any turn, or the door's of a worker's answer)."""
    found: tuple[Trace, Trace, Span] | None = None

    def answering(candidate: Trace) -> Span | None:
        forwarded = {
            ancestor.span_id
            for forward in spans_of(candidate, "yoke-egress", "forward")
            for ancestor in candidate.ancestors(forward)
        }
        return next(
            (
                span
                for span in spans_of(candidate, "yoke-processor", "step")
                if span.attributes.get("yoke.message_id") == line_id
                and chats(candidate, span)
                and span.span_id in forwarded
            ),
            None,
        )

    async def arrived() -> bool:
        nonlocal found
        turn = await jaeger.find_trace(trace.trace_id)
        assert turn is not None
        step = answering(turn)
        if step is not None:
            found = (turn, turn, step)
            return True
        searched = [
            found
            for service in ("yoke-processor", "yoke-ingestion")
            for found in await jaeger.find_traces(service, since=since, operation="tool_result")
        ]
        for other in searched:
            if not any(
                (link.trace_id, link.span_id) == (trace.trace_id, calling.span_id)
                for span in other
                for link in span.links
            ):
                continue
            linked = await jaeger.find_trace(other.trace_id)
            step = answering(linked) if linked is not None else None
            if linked is not None and step is not None:
                found = (turn, linked, step)
                return True
        return False

    try:
        await eventually(arrived, timeout=WAIT, what=f"the step answering {line_id}", interval=0.5)
    except AssertionError as error:
        turn = await jaeger.find_trace(trace.trace_id)
        raise AssertionError(f"{error}; the turn's trace:\n{(turn or trace).tree()}") from None
    assert found is not None
    return found


async def linked_trace(
    jaeger: Jaeger, service: str, operation: str, since: datetime, trace_id: str, to: Span
) -> Trace:
    """The trace with a span ``operation`` of ``service`` whose root links to span ``to`` of
    trace ``trace_id`` (an answer that came through the door from an outsider)."""
    found: Trace | None = None

    async def arrived() -> bool:
        nonlocal found
        for candidate in await jaeger.find_traces(service, since=since, operation=operation):
            whole_trace = await jaeger.find_trace(candidate.trace_id)
            if whole_trace is None:
                continue
            if any(
                (link.trace_id, link.span_id) == (trace_id, to.span_id)
                for root in whole_trace.roots()
                for link in root.links
            ):
                found = whole_trace
                return True
        return False

    await eventually(arrived, timeout=WAIT, what=f"the trace linked to {to.name}", interval=0.5)
    assert found is not None
    return found


def every(*conditions: Any) -> Any:
    return lambda trace: all(condition(trace) for condition in conditions)


def above(trace: Trace, child: Span, ancestor: Span) -> None:
    """``ancestor`` is on ``child``'s path to the root, and started no later."""
    assert ancestor in trace.ancestors(child), (
        f"{ancestor.name} [{ancestor.service}] is not above {child.name} [{child.service}]:\n"
        f"{trace.tree()}"
    )
    assert ancestor.start_ns <= child.start_ns


def print_tree(title: str, trace: Trace) -> None:
    """Shown with -s: the span tree, which the issue's closing note quotes."""
    print(f"\n{title} (trace {trace.trace_id}, {len(trace)} spans):\n{trace.tree()}")


# --- a turn is one trace -----------------------------------------------------------------------


async def test_a_line_through_the_amqp_door_is_one_trace_in_turn_order(
    mesh: Mesh, jaeger: Jaeger, store: Store, poster: Poster, client: Client
) -> None:
    """A bridge's line without a traceparent of its own: the door starts the trace, and every
    hop of the turn joins it, each below the hop before."""
    forum_id, _ = await echo_forum(store, poster)
    since = datetime.now(UTC)
    line_id = await say(client, forum_id, "hello, traced")
    await answered(store, forum_id)

    async def the_trace() -> Trace | None:
        found = await jaeger.find_traces("yoke-ingestion", since=since, operation="accept")
        return next(
            (
                trace
                for trace in found
                if any(span.attributes.get("yoke.message_id") == line_id for span in trace)
            ),
            None,
        )

    found: Trace | None = None

    async def searched() -> bool:
        nonlocal found
        found = await the_trace()
        return found is not None

    await eventually(searched, timeout=WAIT, what="the line's trace in Jaeger's search")
    assert found is not None
    trace = await jaeger.trace(
        found.trace_id,
        timeout=WAIT,
        until=every(
            has("yoke-egress", "forward", **{"yoke.forum_id": forum_id}),
            has("yoke-processor", f"chat {MODEL}"),
            whole,
        ),
    )
    print_tree("one turn through the AMQP door", trace)
    assert {"yoke-ingestion", "yoke-processor", "yoke-egress"} <= trace.services
    [root] = trace.roots()  # one trace, one root: the intake's delivery of the command
    assert root.name == f"process {topology.SUBMIT_COMMAND}" and root.kind == "consumer"
    accept = one_of(trace, "yoke-ingestion", "accept", **{"yoke.message_id": line_id})
    copy = one_of(trace, "yoke-ingestion", "copy", **{"yoke.forum_id": forum_id})
    step = one_of(trace, "yoke-processor", "step", **{"yoke.forum_id": forum_id})
    chat = one_of(trace, "yoke-processor", f"chat {MODEL}")
    forward = one_of(trace, "yoke-egress", "forward", **{"yoke.forum_id": forum_id})
    above(trace, accept, root)
    above(trace, copy, accept)
    above(trace, step, copy)
    above(trace, chat, step)
    above(trace, forward, step)
    # Each hop crosses the broker: a producer span in one service, the consumer in the next.
    hop = trace.parent(trace.parent(step) or step)
    assert hop is not None and hop.kind == "producer" and hop.service == "yoke-ingestion"
    assert step.attributes["yoke.trigger"] == "line"
    assert step.attributes["yoke.conversation_id"] == copy.attributes["yoke.conversation_id"]
    # The model call after the GenAI conventions, priced by the table.
    assert chat.kind == "client"
    assert chat.attributes["gen_ai.operation.name"] == "chat"
    assert chat.attributes["gen_ai.request.model"] == MODEL
    assert chat.attributes["gen_ai.response.model"] == MODEL
    assert chat.attributes["gen_ai.usage.input_tokens"] == 11
    assert chat.attributes["gen_ai.usage.output_tokens"] == 7
    assert chat.attributes["yoke.cost_usd"] == pytest.approx((11 * PRICE[0] + 7 * PRICE[1]) / 1e6)
    # No prompt or completion unless the operator turns it on (YOKE_TRACE_CONTENT).
    assert not any(key.startswith("gen_ai.input") for key in chat.attributes)
    assert not any(key.startswith("gen_ai.output") for key in chat.attributes)
    # Store operations are child spans of the work that made them.
    finds = [span for span in trace if span.attributes.get("db.system.name") == "mongodb"]
    assert any(span.name == "insert messages" for span in finds), trace.tree()
    assert all(trace.parent(span) is not None for span in finds)
    # Resource: the service names and the standard attributes.
    assert chat.resource["service.name"] == "yoke-processor"


async def test_the_mesh_own_traceparent_is_continued_and_mesh_headers_are_dropped(
    mesh: Mesh, jaeger: Jaeger, store: Store, poster: Poster, amqp_url: str
) -> None:
    """The AMQP door continues the trace of a publisher of the mesh's own (the services' user,
    as the CLI publishes), and the command router still drops what only the mesh may say
    (``x-yoke-*``): a forged conversation header routes nothing. A bridge's is only a link
    (test_a_bridges_traceparent_is_only_a_link)."""
    forum_id, _ = await echo_forum(store, poster)
    other_id, _ = await echo_forum(store, poster)
    header, trace_id, caller_span = traceparent()
    reply = await ask_direct(
        amqp_url,
        topology.SUBMIT_COMMAND,
        submit_body(forum_id, "from a bridge that traces"),
        user_id=amqp_user(amqp_url),
        headers={
            "traceparent": header,
            "tracestate": "bridge=1",
            topology.CONVERSATION_HEADER: other_id,
            topology.USER_HEADER: "someone-else",
        },
    )
    assert reply["status"] == "accepted", reply
    await answered(store, forum_id)

    def rooted_at_the_caller(trace: Trace) -> bool:
        """The door's delivery has arrived: ``whole`` alone also holds while it has not and
        one subtree, its parent still on its way, is all there is (seen on a loaded run)."""
        return [root.parent_span_id for root in trace.roots()] == [caller_span]

    trace = await jaeger.trace(
        trace_id,
        timeout=WAIT,
        until=every(
            has("yoke-egress", "forward", **{"yoke.forum_id": forum_id}), rooted_at_the_caller
        ),
    )
    [root] = trace.roots()
    assert root.parent_span_id == caller_span  # the publisher's span, kept outside the trace
    accept = one_of(trace, "yoke-ingestion", "accept", **{"yoke.message_id": reply["messageId"]})
    # Keyed by the body's conversation, not by the forged header.
    assert accept.attributes["yoke.forum_id"] == forum_id
    assert not [line for line in await store.history(other_id) if line.role == "user"]
    assert {"yoke.forum_id": forum_id}.items() <= one_of(
        trace, "yoke-processor", "step"
    ).attributes.items()


async def test_an_http_callers_trace_context_is_a_link_and_its_tracestate_goes_no_further(
    mesh: Mesh, jaeger: Jaeger, store: Store, poster: Poster, gateway_url: str, amqp_url: str
) -> None:
    """The HTTP door starts a trace of its own under the operator's sampler: the caller's span
    is a link of its server span, never its parent, and the caller's ``tracestate`` (8 KB of
    well-formed entries) rides no publish of the turn."""
    forum_id, _ = await echo_forum(store, poster)
    secret = await token_for(store, forum_id)
    header, trace_id, caller_span = traceparent()
    since = datetime.now(UTC)
    async with published(amqp_url) as seen, httpx.AsyncClient(base_url=gateway_url) as http:
        response = await http.post(
            f"/v1/forums/{forum_id}/messages",
            json={"author": {"externalId": "ada", "displayName": "Ada"}, "text": "over HTTP"},
            headers={
                "Authorization": f"Bearer {secret}",
                "traceparent": header,
                "tracestate": BIG_TRACESTATE,
            },
            timeout=30,
        )
        assert response.status_code == 202, response.text
        line_id = response.json()["messageId"]
        [reply] = agent_lines(await answered(store, forum_id))
        await eventually(saw(seen, reply.id), timeout=WAIT, what="the answer's publish")
    post = await door_span(jaeger, "POST /v1/forums/{forumId}/messages", since, forum_id)
    trace = await jaeger.trace(
        post.trace_id,
        timeout=WAIT,
        until=every(has("yoke-egress", "forward", **{"yoke.forum_id": forum_id}), whole),
    )
    print_tree("one turn through the HTTP gateway", trace)
    assert post.trace_id != trace_id, "the caller's trace id was continued"
    assert post.kind == "server" and post.parent_span_id is None, trace.tree()
    assert [(link.trace_id, link.span_id) for link in post.links] == [(trace_id, caller_span)]
    assert post.attributes["http.response.status_code"] == 202
    accept = one_of(trace, "yoke-ingestion", "accept", **{"yoke.message_id": line_id})
    above(trace, accept, post)
    above(trace, one_of(trace, "yoke-egress", "forward"), accept)
    carried_no_further(seen, trace_id)


async def test_the_operators_sampler_decides_whatever_the_callers_flags_say(
    mesh: Mesh,
    store: Store,
    poster: Poster,
    gateway_url: str,
    amqp_url: str,
    module_mongodb_url: str,
    jaeger: Jaeger,
    tmp_path: Path,
) -> None:
    """A caller's unsampled flag does not keep the door's always-on sampler from sampling, nor
    its sampled flag make a ratio-0 sampler sample: what the gateway publishes says so."""
    forum_id, _ = await echo_forum(store, poster)
    secret = await token_for(store, forum_id)
    header, _, _ = traceparent(sampled=False)
    flags = await published_flags(amqp_url, gateway_url, forum_id, secret, header)
    assert flags == (True, False), "an unsampled caller suppressed the operator's sampling"
    header, _, _ = traceparent()
    ratio = {
        **jaeger.env(),
        "OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
        "OTEL_TRACES_SAMPLER_ARG": "0",
    }
    async with running_gateway(
        amqp_url, module_mongodb_url, tmp_path, exits=CLEAN_EXITS, **ratio
    ) as ratio_url:
        flags = await published_flags(amqp_url, ratio_url, forum_id, secret, header)
    assert flags == (False, False), "a sampled caller overrode the operator's ratio sampler"


async def test_refused_requests_are_not_traced(
    mesh: Mesh, jaeger: Jaeger, store: Store, poster: Poster, gateway_url: str
) -> None:
    """A 401 (no token, an unknown one, at /v1 and at /mcp) and a 403 leave no span: what
    anyone may send costs the operator's trace store nothing."""
    forum_id, _ = await echo_forum(store, poster)
    other_id, _ = await echo_forum(store, poster)
    secret = await token_for(store, forum_id)
    header, _, _ = traceparent()
    since = datetime.now(UTC)
    async with httpx.AsyncClient(base_url=gateway_url, timeout=30) as http:
        refused = [
            await http.get(f"/v1/forums/{forum_id}/messages", headers={"traceparent": header}),
            await http.get(
                f"/v1/forums/{forum_id}/messages",
                headers={"traceparent": header, "Authorization": "Bearer yoke_" + "x" * 43},
            ),
            await http.post("/mcp", content=b"{}", headers={"traceparent": header, **MCP_HEADERS}),
            await http.get(
                f"/v1/forums/{other_id}/messages",
                headers={"traceparent": header, "Authorization": f"Bearer {secret}"},
            ),
        ]
        assert [response.status_code for response in refused] == [401, 401, 401, 403]
        # A request the door serves, after them: once its span is in, theirs would be too.
        served = await http.get(
            f"/v1/forums/{forum_id}/messages", headers={"Authorization": f"Bearer {secret}"}
        )
        assert served.status_code == 200
    served = await door_span(jaeger, "GET /v1/forums/{forumId}/messages", since, forum_id)
    spans = [
        span
        for found in await jaeger.find_traces("yoke-gateway", since=since, limit=100)
        for span in found
        if span.service == "yoke-gateway"
    ]
    shown = "\n".join(f"{span.name} {span.attributes}" for span in spans)
    # One trace, the served request's: no request span of a refusal, nor its token lookup.
    assert {span.trace_id for span in spans} == {served.trace_id}, shown
    assert [
        span.attributes["http.response.status_code"] for span in spans if span.kind == "server"
    ] == [200], shown


async def test_an_mcp_calls_meta_is_only_a_link_and_its_span_name_is_bounded(
    mesh: Mesh, jaeger: Jaeger, store: Store, poster: Poster, gateway_url: str
) -> None:
    """``params._meta.traceparent`` does not re-parent the MCP call: its span is the door's
    request span's child, linked to the caller's; a tool name of the caller's is an attribute
    (cut), never the span's name."""
    forum_id, _ = await echo_forum(store, poster)
    secret = await token_for(store, forum_id)
    header, trace_id, caller_span = traceparent()
    name = "n" * 300
    since = datetime.now(UTC)
    call = {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "tools/call",
        "params": {
            "name": name,
            "arguments": {"message": "hi"},
            "_meta": {"traceparent": header, "tracestate": BIG_TRACESTATE},
        },
    }
    async with httpx.AsyncClient(base_url=gateway_url, timeout=30) as http:
        response = await http.post(
            "/mcp", json=call, headers={"Authorization": f"Bearer {secret}", **MCP_HEADERS}
        )
    assert response.status_code == 200 and "unknown tool" in response.text, response.text
    post = await door_span(jaeger, "POST /mcp", since)
    trace = await jaeger.trace(
        post.trace_id,
        timeout=WAIT,
        until=lambda trace: any(span.name.startswith("tools/call") for span in trace),
    )
    [called] = [span for span in trace if span.name.startswith("tools/call")]
    assert len(called.name) <= 64, called.name
    assert called.parent_span_id == post.span_id, trace.tree()
    assert [(link.trace_id, link.span_id) for link in called.links] == [(trace_id, caller_span)]
    assert called.attributes["gen_ai.tool.name"] == name[:64]
    assert await jaeger.find_trace(trace_id) is None, "a span joined the caller's trace"


async def test_a_bridges_traceparent_is_only_a_link(
    mesh: Mesh,
    jaeger: Jaeger,
    store: Store,
    poster: Poster,
    amqp_url: str,
    servers: tuple[str, str, str],
) -> None:
    """A bridge (a RabbitMQ user not the mesh's own) is an outside caller at the AMQP door: its
    span is a link of the door's delivery, which starts a trace of the mesh's own, and its
    tracestate goes no further."""
    forum_id, _ = await echo_forum(store, poster)
    management = management_of(amqp_url, servers[2])
    bridge = f"traced-bridge-{uuid.uuid4().hex[:8]}"
    password = await create_publisher(management, bridge)
    header, trace_id, caller_span = traceparent()
    since = datetime.now(UTC)
    try:
        async with published(amqp_url) as seen:
            reply = await ask_direct(
                as_user(amqp_url, bridge, password),
                topology.SUBMIT_COMMAND,
                submit_body(forum_id, "from a bridge of its own"),
                user_id=bridge,
                headers={"traceparent": header, "tracestate": BIG_TRACESTATE},
            )
            assert reply["status"] == "accepted", reply
            [answer] = agent_lines(await answered(store, forum_id))
            await eventually(saw(seen, answer.id), timeout=WAIT, what="the answer's publish")
    finally:
        async with httpx.AsyncClient(base_url=management.url, auth=management.auth) as api:
            await api.delete(f"/api/users/{quote(bridge, safe='')}")
    accept = await ingestion_accept(jaeger, since, reply["messageId"])
    trace = await jaeger.trace(
        accept.trace_id,
        timeout=WAIT,
        until=every(has("yoke-egress", "forward", **{"yoke.forum_id": forum_id}), whole),
    )
    [root] = trace.roots()
    assert accept.trace_id != trace_id and root.parent_span_id is None, trace.tree()
    assert root.name == f"process {topology.SUBMIT_COMMAND}" and root.kind == "consumer"
    assert [(link.trace_id, link.span_id) for link in root.links] == [(trace_id, caller_span)]
    carried_no_further(seen, trace_id, caller=bridge)


# The most a header of the mesh's may say of a caller's tracestate (none at all, today).
MAX_TRACESTATE_BYTES = 512
# 32 list members of 255 bytes: as large as a well-formed W3C tracestate gets (8 KB).
BIG_TRACESTATE = ",".join(f"v{index:02d}=" + "x" * 250 for index in range(32))
MCP_HEADERS = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json"}


def traceparent(*, sampled: bool = True) -> tuple[str, str, str]:
    """A caller's own span, as a bridge or an HTTP client would send it: (header, trace id,
    span id)."""
    trace_id, span_id = uuid.uuid4().hex, uuid.uuid4().hex[:16]
    return f"00-{trace_id}-{span_id}-{'01' if sampled else '00'}", trace_id, span_id


async def token_for(store: Store, forum_id: str) -> str:
    await ensure_token_indexes(store)
    _, secret = await create_token(store, f"traced{new_id()[:8]}", [forum_id])
    return secret


@contextlib.asynccontextmanager
async def published(amqp_url: str) -> AsyncIterator[list[AbstractIncomingMessage]]:
    """Every message published on the commands, events and forum exchanges while inside, as a
    queue of the test's own bound to each with ``#`` receives it."""
    connection = await aio_pika.connect(amqp_url)
    try:
        channel = await connection.channel()
        queue = await channel.declare_queue(exclusive=True, auto_delete=True)
        for exchange in (
            topology.COMMANDS_EXCHANGE,
            topology.EVENTS_EXCHANGE,
            topology.FORUM_EXCHANGE,
        ):
            await queue.bind(exchange, routing_key="#")
        seen: list[AbstractIncomingMessage] = []

        async def keep(message: AbstractIncomingMessage) -> None:
            seen.append(message)

        await queue.consume(keep, no_ack=True)
        yield seen
    finally:
        await connection.close()


def saw(seen: list[AbstractIncomingMessage], text: str) -> Callable[[], Awaitable[bool]]:
    """An ``eventually`` condition: a message seen mentions ``text`` (a line's id)."""

    async def mentioned() -> bool:
        return any(text.encode() in message.body for message in seen)

    return mentioned


def carried_no_further(
    seen: list[AbstractIncomingMessage], caller_trace: str, caller: str | None = None
) -> None:
    """No publish seen but the caller's own (RabbitMQ user ``caller``) carries the caller's
    trace id or more than a bounded tracestate."""
    ours = [message for message in seen if caller is None or message.user_id != caller]
    assert ours
    for message in ours:
        headers = message.headers or {}
        state = headers.get("tracestate")
        assert state is None or len(str(state)) <= MAX_TRACESTATE_BYTES, (
            f"{message.routing_key} carries a tracestate of {len(str(state))} bytes"
        )
        assert caller_trace not in str(headers.get("traceparent", "")), message.routing_key


async def published_flags(
    amqp_url: str, gateway_url: str, forum_id: str, secret: str, header: str
) -> tuple[bool, bool]:
    """(sampled, of the caller's trace) of the traceparent on the command a gateway publishes
    for a line posted with ``header``."""
    async with published(amqp_url) as seen, httpx.AsyncClient(base_url=gateway_url) as http:
        response = await http.post(
            f"/v1/forums/{forum_id}/messages",
            json={"author": {"externalId": "ada", "displayName": "Ada"}, "text": "sampled?"},
            headers={"Authorization": f"Bearer {secret}", "traceparent": header},
            timeout=30,
        )
        assert response.status_code == 202, response.text
        line_id = response.json()["messageId"]

        def command() -> AbstractIncomingMessage | None:
            return next(
                (
                    message
                    for message in seen
                    if message.routing_key == topology.SUBMIT_COMMAND
                    and message.exchange == topology.COMMANDS_EXCHANGE
                ),
                None,
            )

        async def arrived() -> bool:
            return command() is not None

        await eventually(arrived, timeout=WAIT, what="the command")
    found = command()
    assert found is not None and line_id
    value = str((found.headers or {}).get("traceparent", ""))
    assert re.fullmatch(r"00-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}", value), value
    _, trace_id, _, flags = value.split("-")
    return bool(int(flags, 16) & 1), trace_id == header.split("-")[1]


async def door_span(
    jaeger: Jaeger, name: str, since: datetime, forum_id: str | None = None
) -> Span:
    """The gateway's server span ``name`` started since ``since`` (of ``forum_id``'s path)."""
    found: Span | None = None

    async def arrived() -> bool:
        nonlocal found
        for trace in await jaeger.find_traces("yoke-gateway", since=since, operation=name):
            for span in trace:
                if span.name == name and (
                    forum_id is None or forum_id in str(span.attributes.get("url.path"))
                ):
                    found = span
                    return True
        return False

    await eventually(arrived, timeout=WAIT, what=f"the gateway's {name} span", interval=0.5)
    assert found is not None
    return found


async def ingestion_accept(jaeger: Jaeger, since: datetime, line_id: str) -> Span:
    """The door's ``accept`` span of the line ``line_id``."""
    found: Span | None = None

    async def arrived() -> bool:
        nonlocal found
        for trace in await jaeger.find_traces("yoke-ingestion", since=since, operation="accept"):
            for span in trace:
                if span.name == "accept" and span.attributes.get("yoke.message_id") == line_id:
                    found = span
                    return True
        return False

    await eventually(arrived, timeout=WAIT, what="the line's accept span", interval=0.5)
    assert found is not None
    return found


# --- tools, workers, approvals ------------------------------------------------------------------


async def test_a_tool_round_traces_every_call_and_the_workers_own_span(
    mesh: Mesh,
    jaeger: Jaeger,
    store: Store,
    poster: Poster,
    amqp_url: str,
    fake_openai: FakeOpenAI,
    tool: WorkerTool,
    worker: subprocess.Popen[bytes],
) -> None:
    forum_id, _ = await echo_forum(store, poster, tools=["calculator", tool.name])
    fake_openai.script(
        completion(
            tool_calls=[
                ("c1", "calculator", json.dumps({"expression": "6*7"})),
                ("c2", tool.name, json.dumps({"tag": "traced"})),
            ]
        ),
        completion("the tools have answered"),
    )
    since = datetime.now(UTC)
    header, trace_id, _ = traceparent()
    reply = await ask_direct(
        amqp_url,
        topology.SUBMIT_COMMAND,
        submit_body(forum_id, "use your tools"),
        user_id=amqp_user(amqp_url),
        headers={"traceparent": header},
    )
    assert reply["status"] == "accepted", reply
    lines = await answered(store, forum_id)
    assert agent_lines(lines)[-1].text == "the tools have answered"
    worker_service = f"yoke-tool-{tool.name}"
    trace = await jaeger.trace(
        trace_id,
        timeout=WAIT,
        until=every(
            has(worker_service, f"execute_tool {tool.name}"),
            has("yoke-processor", "step", **{"yoke.trigger": "tool_call"}),
        ),
    )
    calling = one_of(trace, "yoke-processor", "step", **{"yoke.trigger": "tool_call"})
    calculator = one_of(trace, "yoke-processor", "execute_tool calculator")
    asked = one_of(trace, "yoke-processor", f"execute_tool {tool.name}")
    assert calculator.attributes["gen_ai.tool.name"] == "calculator"
    assert calculator.attributes["yoke.tool.source"] == "builtin"
    assert asked.attributes["yoke.tool.source"] == "worker"
    assert asked.attributes["yoke.tool.waits"] is True
    above(trace, calculator, calling)
    above(trace, asked, calling)
    # The worker's own span, from its own process, below the publish of its call.
    ran = one_of(trace, worker_service, f"execute_tool {tool.name}")
    assert ran.kind == "consumer" and ran.attributes["gen_ai.tool.name"] == tool.name
    above(trace, ran, asked)
    # Its answer comes through the AMQP door from an outsider (the worker's RabbitMQ user): a
    # trace of the mesh's own, whose delivery links to the worker's span and whose result
    # links to the step that waited.
    answer = await linked_trace(jaeger, "yoke-ingestion", "tool_result", since, trace_id, ran)
    answer = await jaeger.trace(answer.trace_id, timeout=WAIT, until=whole)
    [door] = answer.roots()
    assert door.kind == "consumer" and door.parent_span_id is None, answer.tree()
    assert door.links[0].attributes["yoke.link"] == "caller"
    result = one_of(answer, "yoke-ingestion", "tool_result")
    above(answer, result, door)
    assert [(link.trace_id, link.span_id) for link in result.links] == [(trace_id, calling.span_id)]
    # Two results lines (the calculator's in the round, the worker's of its own): the step of
    # the later one calls the model (invariant 10), the other waits for it.
    monologue = str(calling.attributes["yoke.conversation_id"])
    results = {
        part.name: line
        for line in await store.history(monologue)
        for part in line.parts
        if isinstance(part, ToolResultPart)
    }
    assert sorted(results) == sorted(["calculator", tool.name])
    last = max(results.values(), key=lambda line: line.seq)
    trace, home, answering = await answering_step(jaeger, trace, calling, last.id, since)
    print_tree("a turn with a tool round", trace)
    answer = await jaeger.trace(answer.trace_id, timeout=WAIT)
    print_tree("the worker's answer, through the door", answer)
    both = list({found.trace_id: found for found in (trace, answer, home)}.values())
    if home.trace_id not in (trace.trace_id, answer.trace_id):
        print_tree("the answering step, in a trace of its own", home)
    waits = [
        (found, span)
        for found in both
        for span in spans_of(found, "yoke-processor", "step")
        if span.attributes["yoke.trigger"] == "tool_result" and span != answering
    ]
    assert len(waits) == 1 and not chats(*waits[0]), "\n".join(t.tree() for t in both)
    # Whatever delivery ran it, the answering step is that delivery's child ...
    delivery = home.parent(answering)
    assert delivery is not None and delivery.kind == "consumer", home.tree()
    assert delivery.name == f"process {MessagePosted.TYPE}"
    if home.trace_id == trace.trace_id:
        # ... below the round's step when the round's own line came last (the worker answered
        # before the step wrote it) ...
        assert last is not results[tool.name], home.tree()
        above(trace, answering, calling)
    elif home.trace_id == answer.trace_id:
        # ... below the door's delivery of the worker's answer when its line came last ...
        assert last is results[tool.name], home.tree()
        above(home, answering, door)
    else:
        # ... or, when the deadline reaper's sweep finished the call between the door's end
        # and its line (it writes the line, the door's copy is a repeat), in a trace of its
        # own, whose span that wrote the worker's line links to the step that waited.
        assert last is results[tool.name], home.tree()
        [written] = home.roots()
        assert (written.name, written.service) == ("tool_result", "yoke-processor"), home.tree()
        assert [(link.trace_id, link.span_id) for link in written.links] == [
            (trace_id, calling.span_id)
        ]
        assert written.links[0].attributes["yoke.link"] == "waited_for"
        above(home, answering, written)
    # Egress saw the call line too (nothing of it to forward), then the answer.
    forwards = [span for found in both for span in spans_of(found, "yoke-egress", "forward")]
    assert len(forwards) == 2, "\n".join(t.tree() for t in both)
    assert any(answering in home.ancestors(span) for span in forwards), home.tree()
    # A step's log line names the trace and the span Jaeger has.
    ended = [
        entry
        for entry in json_lines(mesh.processes["processor"].output())
        if entry.get("message", "").startswith("tool call calculator (builtin) ended")
        and entry.get("trace_id") == trace_id
    ]
    assert ended, "no log line of the calculator's end carries the trace id"
    assert trace.span(ended[-1]["span_id"]) is not None


async def test_the_step_after_an_approval_links_to_the_step_that_asked(
    mesh: Mesh, jaeger: Jaeger, store: Store, poster: Poster, amqp_url: str
) -> None:
    forum = await create_forum(store, "approvals")
    agent = await create_agent(store, "accountant")
    await join_conversation(
        store,
        poster,
        agent.id,
        forum.id,
        JoinConfig(
            model="fixture-script",
            tools=["calculator"],
            script=[*sums("2+3")],
            approval=ApprovalConfig(tools=["calculator"], timeout_seconds=3600),
        ),
    )
    asking_header, asking_trace, _ = traceparent()
    reply = await ask_direct(
        amqp_url,
        topology.SUBMIT_COMMAND,
        submit_body(forum.id, "add them up"),
        user_id=amqp_user(amqp_url),
        headers={"traceparent": asking_header},
    )
    assert reply["status"] == "accepted", reply
    call_id = ""

    async def waiting() -> bool:
        nonlocal call_id
        pending = await pending_approvals(store, forum.id)
        call_id = pending[0].call_id if pending else ""
        return bool(call_id)

    await eventually(waiting, timeout=WAIT, what="the call to wait for approval")
    deciding_header, deciding_trace, _ = traceparent()
    decided = await ask_direct(
        amqp_url,
        topology.APPROVAL_COMMAND,
        {
            "callId": call_id,
            "decision": "approve",
            "by": {"externalId": "cli:ada", "displayName": "ada"},
        },
        user_id=amqp_user(amqp_url),
        headers={"traceparent": deciding_header},
    )
    assert decided["status"] == "accepted", decided
    await answered(store, forum.id)
    asked = await jaeger.trace(
        asking_trace, timeout=WAIT, until=has("yoke-processor", "execute_tool calculator")
    )
    asking_step = one_of(asked, "yoke-processor", "step", **{"yoke.trigger": "tool_call"})
    later = await jaeger.trace(
        deciding_trace,
        timeout=WAIT,
        until=every(
            has("yoke-processor", "execute_tool calculator", **{"yoke.approved": True}),
            answer_forwarded,
            whole,
        ),
    )
    print_tree("an approval's later steps", later)
    ran = one_of(later, "yoke-processor", "execute_tool calculator", **{"yoke.approved": True})
    assert [(link.trace_id, link.span_id) for link in ran.links] == [
        (asking_trace, asking_step.span_id)
    ]
    result = one_of(later, "yoke-processor", "tool_result", **{"yoke.call_id": call_id})
    assert [link.span_id for link in result.links] == [asking_step.span_id]
    above(later, one_of(later, "yoke-processor", "step", **{"yoke.trigger": "tool_result"}), ran)
    results = [
        part
        for line in await store.history(agent_monologue(later))
        for part in line.parts
        if isinstance(part, ToolResultPart)
    ]
    assert [part.output for part in results] == ["5"]


def agent_monologue(trace: Trace) -> str:
    step = next(span for span in trace if span.name == "step")
    return str(step.attributes["yoke.conversation_id"])


# --- logs and metrics join the trace ---------------------------------------------------------


def json_lines(output: str) -> list[dict[str, Any]]:
    found = []
    for line in output.splitlines():
        if line.startswith("{"):
            try:
                found.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return found


EXEMPLAR = re.compile(r"^yoke_event_handling_seconds_bucket\{.*\} \S+ # \{(?P<labels>[^}]*)\}")


async def test_a_claim_its_takeover_and_the_hand_back_are_spans_of_their_traces(
    mesh: Mesh, jaeger: Jaeger, store: Store, poster: Poster, client: Client
) -> None:
    """docs/people-take-over.md: a claim is a ``claim`` span of the door, and the takeover it
    writes is the agent's ``takeover`` span below it, in one trace; a ``/handback`` line's
    trace holds the agent's ``handback`` span below the door's ``accept``."""
    forum = await create_forum(store, "held")
    agent = await create_agent(store, "echo")
    config = JoinConfig(model=MODEL, takeover_by=["test:bob"])
    await join_conversation(store, poster, agent.id, forum.id, config)
    now = datetime.now(UTC)
    escalation = Escalation.model_validate(
        {
            "_id": new_id(),
            "forumId": forum.id,
            "agentActorId": agent.id,
            "joinKey": join_id(agent.id, forum.id),
            "callId": new_id(),
            "reason": "wants a person",
            "openedAt": now,
            "deadline": now + timedelta(minutes=15),
        }
    )
    await Escalations(store).open(escalation)
    since = datetime.now(UTC)
    bob = CommandAuthor(external_id="test:bob", display_name="bob")
    claimed = await client.submit_escalation(forum.id, escalation.id, "claim", bob)
    assert claimed.status == "accepted", claimed.error
    await answered(store, forum.id)  # the hold's notice
    found: Trace | None = None

    async def claim_traced() -> bool:
        nonlocal found
        traces = await jaeger.find_traces("yoke-ingestion", since=since, operation="claim")
        found = next(
            (
                t
                for t in traces
                if any(s.attributes.get("yoke.escalation_id") == escalation.id for s in t)
            ),
            None,
        )
        return found is not None

    await eventually(claim_traced, timeout=WAIT, what="the claim's trace", interval=0.5)
    assert found is not None
    trace = await jaeger.trace(
        found.trace_id, timeout=WAIT, until=has("yoke-processor", "takeover")
    )
    print_tree("a claim and its takeover", trace)
    above(
        trace, one_of(trace, "yoke-processor", "takeover"), one_of(trace, "yoke-ingestion", "claim")
    )

    line_id = await say(client, forum.id, "/handback", who="bob")
    await answered(store, forum.id, 2)  # the hand-back's notice
    back: Trace | None = None

    async def handback_traced() -> bool:
        nonlocal back
        for candidate in await jaeger.find_traces(
            "yoke-processor", since=since, operation="handback"
        ):
            whole_trace = await jaeger.find_trace(candidate.trace_id)
            if whole_trace is not None and any(
                s.attributes.get("yoke.message_id") == line_id for s in whole_trace
            ):
                back = whole_trace
                return True
        return False

    await eventually(handback_traced, timeout=WAIT, what="the hand-back's trace", interval=0.5)
    assert back is not None
    above(
        back,
        one_of(back, "yoke-processor", "handback"),
        one_of(back, "yoke-ingestion", "accept", **{"yoke.message_id": line_id}),
    )


async def test_latency_histograms_carry_exemplars_that_open_their_trace(
    mesh: Mesh, jaeger: Jaeger, store: Store, poster: Poster, client: Client
) -> None:
    forum_id, _ = await echo_forum(store, poster)
    await say(client, forum_id, "for the exemplars")
    await answered(store, forum_id)
    processor = mesh.processes["processor"]
    async with local_http(5) as http:
        scrape = await http.get(
            f"http://127.0.0.1:{processor.port}/metrics",
            headers={"Accept": "application/openmetrics-text; version=1.0.0"},
        )
        plain = await http.get(f"http://127.0.0.1:{processor.port}/metrics")
    assert scrape.headers["content-type"].startswith("application/openmetrics-text")
    assert scrape.text.rstrip().endswith("# EOF")
    assert plain.headers["content-type"].startswith("text/plain")
    assert " # {" not in plain.text  # the older format has no exemplars
    exemplars = [
        dict(pair.split("=", 1) for pair in found["labels"].split(","))
        for line in scrape.text.splitlines()
        if (found := EXEMPLAR.match(line))
    ]
    assert exemplars, scrape.text[:2000]
    trace_id = exemplars[-1]["trace_id"].strip('"')
    trace = await jaeger.trace(trace_id, timeout=WAIT)
    assert trace.span(exemplars[-1]["span_id"].strip('"')) is not None


# --- a collector that is away ----------------------------------------------------------------


# The services a turn with one agent and no follow-up or guardian passes through.
TURN_SERVICES = ("ingestion", "processor", "egress")


def dropped(text: str) -> float:
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "yoke_trace_spans_dropped_total"
    )


async def test_with_the_collector_stopped_turns_are_answered_and_drops_counted(
    mesh: Mesh, jaeger: Jaeger, store: Store, poster: Poster, client: Client
) -> None:
    forum_id, _ = await echo_forum(store, poster)
    await say(client, forum_id, "while the collector is up")
    await answered(store, forum_id)
    before = {name: dropped(await process.metrics()) for name, process in mesh.processes.items()}
    await jaeger.stop()
    started = time.monotonic()
    for index in range(3):
        await say(client, forum_id, f"while the collector is away {index}")
        await answered(store, forum_id, count=2 + index)
    seconds = time.monotonic() - started
    # As fast as ever: nothing waits for the collector (a lost export takes it 2 s a batch).
    assert seconds < 15, f"three turns took {seconds:.1f} s with the collector away"

    async def counted() -> bool:
        for name in TURN_SERVICES:
            if dropped(await mesh.processes[name].metrics()) <= before[name]:
                return False
        return True

    await eventually(counted, timeout=WAIT, what="each service of the turn to count lost spans")
    metrics = await mesh.processes["processor"].metrics()
    assert 'yoke_trace_spans_dropped_total{reason="export_failed"}' in metrics
    for process in mesh.processes.values():
        assert await process.healthy()
    await asyncio.sleep(0)  # the mesh stops cleanly after (running_mesh checks exit codes)

"""The tracing backend itself: the Jaeger ``make tracing`` builds and runs, and the test support
that starts one per module (tests/support/jaeger.py), against spans from the official
OpenTelemetry SDK and its OTLP/HTTP exporter, configured by the standard environment as the
services are.
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import pytest
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExportResult
from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode, TraceFlags

from tests.support.jaeger import Jaeger
from tests.support.processes import ROOT, free_port

SCRIPT = ROOT / "deploy/local/tracing.sh"


@pytest.fixture
def provider(jaeger: Jaeger, monkeypatch: pytest.MonkeyPatch) -> Iterator[TracerProvider]:
    """The SDK exporting to the module's Jaeger, set up only by jaeger.env() (the exporter reads
    OTEL_EXPORTER_OTLP_ENDPOINT and adds /v1/traces), one span at a time."""
    for name, value in jaeger.env().items():
        monkeypatch.setenv(name, value)
    provider = TracerProvider(
        resource=Resource.create({"service.name": f"yoke-test-{uuid.uuid4().hex[:6]}"})
    )
    provider.add_span_processor(SimpleSpanProcessor(OTLPSpanExporter()))
    yield provider
    provider.shutdown()


def hex_trace_id(span: trace.Span) -> str:
    return format(span.get_span_context().trace_id, "032x")


def hex_span_id(span: trace.Span) -> str:
    return format(span.get_span_context().span_id, "016x")


async def test_a_span_sent_over_otlp_http_is_found_by_its_trace_id_as_sent(
    jaeger: Jaeger, provider: TracerProvider
) -> None:
    tracer = provider.get_tracer("tests.deploy")
    service = provider.resource.attributes["service.name"]
    waited_on = SpanContext(
        trace_id=uuid.uuid4().int >> 1, span_id=0x1234ABCD, is_remote=True,
        trace_flags=TraceFlags(TraceFlags.SAMPLED),
    )  # fmt: skip
    before = datetime.now(UTC)

    def send() -> tuple[str, str, str]:
        with (
            tracer.start_as_current_span(
                "turn", kind=SpanKind.SERVER, attributes={"yoke.forum_id": "f-1"}
            ) as parent,
            tracer.start_as_current_span(
                "chat fixture-echo",
                kind=SpanKind.CLIENT,
                links=[Link(waited_on, {"yoke.link": "approval"})],
                attributes={
                    "gen_ai.operation.name": "chat",
                    "gen_ai.usage.input_tokens": 12,
                    "yoke.cost_usd": 0.0012,
                    "yoke.streamed": True,
                    "yoke.tools": ["clock", "calculator"],
                },
            ) as child,
        ):
            time.sleep(0.05)
            child.add_event("first delta")
            child.set_status(Status(StatusCode.ERROR, "model gave up"))
        return hex_trace_id(parent), hex_span_id(parent), hex_span_id(child)

    trace_id, parent_id, child_id = await asyncio.to_thread(send)
    found = await jaeger.trace(trace_id, until=lambda t: len(t) == 2)

    turn, chat = found.one("turn"), found.one("chat fixture-echo")
    assert (turn.span_id, chat.span_id) == (parent_id, child_id)
    assert turn.parent_span_id is None and chat.parent_span_id == turn.span_id
    assert found.parent(chat) == turn and found.roots() == [turn]
    assert {turn.service, chat.service} == {service}
    assert (turn.kind, chat.kind) == ("server", "client")
    assert turn.attributes == {"yoke.forum_id": "f-1"}
    # Types survive the trip: int, float, bool and a list stay what they were.
    assert chat.attributes == {
        "gen_ai.operation.name": "chat",
        "gen_ai.usage.input_tokens": 12,
        "yoke.cost_usd": 0.0012,
        "yoke.streamed": True,
        "yoke.tools": ["clock", "calculator"],
    }
    [link] = chat.links
    assert link.trace_id == format(waited_on.trace_id, "032x")
    assert link.span_id == format(waited_on.span_id, "016x")
    assert link.attributes == {"yoke.link": "approval"}
    assert (chat.status, chat.status_message) == ("error", "model gave up")
    assert chat.events == ("first delta",)
    assert before <= turn.start <= chat.start <= datetime.now(UTC)
    assert timedelta(milliseconds=50) <= chat.duration <= turn.duration < timedelta(seconds=10)
    assert "chat fixture-echo" in found.tree().splitlines()[1]
    assert service in await jaeger.services()


async def test_search_by_service_and_duration_finds_the_slow_trace_only(
    jaeger: Jaeger, provider: TracerProvider
) -> None:
    """What an operator does in Jaeger's search to find a slow turn."""
    tracer = provider.get_tracer("tests.deploy")
    service = str(provider.resource.attributes["service.name"])
    since = datetime.now(UTC) - timedelta(seconds=1)

    def send(seconds: float) -> str:
        with tracer.start_as_current_span("turn") as span:
            time.sleep(seconds)
        return hex_trace_id(span)

    slow = await asyncio.to_thread(send, 0.3)
    fast = await asyncio.to_thread(send, 0.0)
    for trace_id in (slow, fast):
        await jaeger.trace(trace_id)

    everything = await jaeger.find_traces(service, since=since)
    assert {t.trace_id for t in everything} == {slow, fast}
    found = await jaeger.find_traces(service, since=since, min_duration=timedelta(seconds=0.2))
    assert [t.trace_id for t in found] == [slow]


async def test_a_trace_nobody_sent_is_not_found(jaeger: Jaeger) -> None:
    unknown = uuid.uuid4().hex
    assert await jaeger.find_trace(unknown) is None
    with pytest.raises(AssertionError, match="no span of it"):
        await jaeger.trace(unknown, timeout=0.5)


def listening_ports(pid: int) -> set[tuple[str, int]]:
    """(address, port) of every TCP socket the process listens on, from /proc."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = set()
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state == "0A" and inode in inodes:  # LISTEN
                address, port = local.split(":")
                found.add((address, int(port, 16)))
    return found


async def test_it_listens_only_on_loopback_and_only_for_otlp_and_queries(jaeger: Jaeger) -> None:
    assert jaeger.popen is not None
    loopback = format(socket.htonl(0x7F000001), "08X")  # /proc's 127.0.0.1
    assert listening_ports(jaeger.popen.pid) == {
        (loopback, port)
        for port in (
            jaeger.ui_port,
            jaeger.query_grpc_port,
            jaeger.otlp_grpc_port,
            jaeger.otlp_http_port,
        )
    }


def alive(pid: int) -> bool:
    """The process runs (a zombie, ended but not yet reaped, does not)."""
    try:
        return "State:\tZ" not in Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False


def script(directory: Path, *args: str, **ports: int) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "YOKE_TRACING_DIR": str(directory),
        **{f"YOKE_JAEGER_{name.upper()}_PORT": str(port) for name, port in ports.items()},
    }
    return subprocess.run(
        [str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=120, check=False
    )


async def test_make_tracing_runs_one_jaeger_says_where_and_stops_it(
    jaeger: Jaeger, tmp_path: Path
) -> None:
    ports = {
        "ui": free_port(),
        "otlp_grpc": free_port(),
        "otlp_http": free_port(),
        "query_grpc": free_port(),
    }
    started = await asyncio.to_thread(script, tmp_path, "start", **ports)
    try:
        assert started.returncode == 0, started.stderr
        assert f"Jaeger: http://127.0.0.1:{ports['ui']}" in started.stdout
        endpoint = f"OTEL_EXPORTER_OTLP_ENDPOINT=http://127.0.0.1:{ports['otlp_http']}"
        assert endpoint in started.stdout
        pid = int((tmp_path / "jaeger.pid").read_text())
        async with httpx.AsyncClient(timeout=5) as http:
            answer = await http.get(f"http://127.0.0.1:{ports['ui']}/api/v3/services")
        assert answer.status_code == 200
        # A second start finds it running and starts nothing.
        again = await asyncio.to_thread(script, tmp_path, "start", **ports)
        assert again.returncode == 0 and f"already running (pid {pid})" in again.stdout
        assert int((tmp_path / "jaeger.pid").read_text()) == pid
    finally:
        stopped = await asyncio.to_thread(script, tmp_path, "stop", **ports)
    assert stopped.returncode == 0 and f"stopping Jaeger (pid {pid}" in stopped.stdout
    assert not alive(pid)
    # A port someone else holds (the module's Jaeger) is refused with what to set.
    taken = await asyncio.to_thread(script, tmp_path, "start", **{**ports, "ui": jaeger.ui_port})
    assert taken.returncode != 0
    assert f"something else answers on 127.0.0.1:{jaeger.ui_port}" in taken.stderr


def port_refuses(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    except ConnectionRefusedError:
        return True
    return False


async def test_a_stopped_jaeger_refuses_and_comes_back_empty_on_the_same_endpoint(
    jaeger: Jaeger, provider: TracerProvider
) -> None:
    """What a test of turns with the collector away relies on (run last: it empties the
    store)."""
    tracer = provider.get_tracer("tests.deploy")

    def send(name: str) -> str:
        with tracer.start_as_current_span(name) as span:
            pass
        return hex_trace_id(span)

    before = await asyncio.to_thread(send, "before")
    await jaeger.trace(before)
    endpoint = jaeger.otlp_endpoint
    stopping = time.monotonic()
    await jaeger.stop()
    # Promptly: no export of its own to wait out (Jaeger traces its queries unless told not to).
    assert time.monotonic() - stopping < 5
    assert not jaeger.running and port_refuses(jaeger.otlp_http_port)
    # An export meanwhile fails within its timeout (retries included) and raises nothing.
    with TracerProvider().get_tracer("tests.deploy").start_as_current_span("lost") as lost:
        pass
    assert isinstance(lost, ReadableSpan)
    exporter = OTLPSpanExporter(timeout=1)
    began = time.monotonic()
    result = await asyncio.to_thread(exporter.export, [lost])
    assert result is SpanExportResult.FAILURE and time.monotonic() - began < 5
    exporter.shutdown()  # type: ignore[no-untyped-call]

    await jaeger.start()
    assert jaeger.otlp_endpoint == endpoint
    after = await asyncio.to_thread(send, "after")
    assert (await jaeger.trace(after)).one("after").name == "after"
    assert await jaeger.find_trace(before) is None  # kept in memory only

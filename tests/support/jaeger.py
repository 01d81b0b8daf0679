"""A real Jaeger v2 (the binary ``make tracing`` builds) for tests, read through its query API.

Each ``Jaeger`` runs a process of its own with the shipped configuration
(deploy/local/jaeger.yaml: OTLP in, traces in memory) on free ports of its own, kept across a
``stop()`` and ``start()``: the services a test points at ``otlp_endpoint`` keep exporting to the
same address while the collector is away. Traces are read back with the v3 query API
(``/api/v3/traces/{id}``, OTLP JSON) as they were sent (``raw_traces``: no Jaeger adjustment),
so a test sees each span's name, service, parent, timing, attributes and links as exported.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import pytest

from tests.support.processes import ROOT, eventually, free_port, local_http

BINARY = ROOT / ".local/bin/jaeger"
CONFIG = ROOT / "deploy/local/jaeger.yaml"
# OTLP's span kinds and status codes, as the JSON gives them (enum numbers).
KINDS = {0: "unspecified", 1: "internal", 2: "server", 3: "client", 4: "producer", 5: "consumer"}
STATUSES = {0: "unset", 1: "ok", 2: "error"}


def binary() -> Path:
    """``YOKE_JAEGER_BIN`` or the one ``make tracing`` builds; the test fails (it does not skip)
    when it is missing."""
    found = Path(os.environ.get("YOKE_JAEGER_BIN", BINARY))
    if not os.access(found, os.X_OK):
        pytest.fail(f"no Jaeger binary at {found}: run 'deploy/local/tracing.sh build' (make test)")
    return found


@dataclass(frozen=True)
class Link:
    trace_id: str
    span_id: str
    attributes: dict[str, object]


@dataclass(frozen=True)
class Span:
    """One span as exported: ids in lowercase hex, times in nanoseconds since the epoch."""

    trace_id: str
    span_id: str
    parent_span_id: str | None
    name: str
    service: str
    kind: str
    start_ns: int
    end_ns: int
    attributes: dict[str, object]
    links: tuple[Link, ...]
    status: str
    status_message: str
    events: tuple[str, ...]
    resource: dict[str, object]

    @property
    def start(self) -> datetime:
        return datetime.fromtimestamp(self.start_ns / 1e9, UTC)

    @property
    def duration(self) -> timedelta:
        return timedelta(microseconds=(self.end_ns - self.start_ns) / 1000)


@dataclass(frozen=True)
class Trace:
    """A trace's spans in start order, and the questions tests ask of them."""

    trace_id: str
    spans: tuple[Span, ...]

    def __iter__(self) -> Iterator[Span]:
        return iter(self.spans)

    def __len__(self) -> int:
        return len(self.spans)

    @property
    def names(self) -> set[str]:
        return {span.name for span in self.spans}

    @property
    def services(self) -> set[str]:
        return {span.service for span in self.spans}

    def named(self, name: str) -> list[Span]:
        return [span for span in self.spans if span.name == name]

    def one(self, name: str) -> Span:
        """The only span called ``name`` (an AssertionError shows the tree otherwise)."""
        found = self.named(name)
        assert len(found) == 1, f"{len(found)} spans named {name!r} in:\n{self.tree()}"
        return found[0]

    def span(self, span_id: str) -> Span | None:
        return next((span for span in self.spans if span.span_id == span_id), None)

    def parent(self, span: Span) -> Span | None:
        return self.span(span.parent_span_id) if span.parent_span_id else None

    def children(self, span: Span) -> list[Span]:
        return [child for child in self.spans if child.parent_span_id == span.span_id]

    def ancestors(self, span: Span) -> list[Span]:
        """Parent first, up to the root (or the first parent this trace lacks)."""
        found: list[Span] = []
        current = self.parent(span)
        while current is not None and current not in found:
            found.append(current)
            current = self.parent(current)
        return found

    def roots(self) -> list[Span]:
        """Spans whose parent is not in the trace (the root, or a caller's span kept outside)."""
        return [span for span in self.spans if self.parent(span) is None]

    def tree(self) -> str:
        """One line a span, children indented under their parent: name, service, duration."""
        lines: list[str] = []

        def draw(span: Span, depth: int) -> None:
            millis = span.duration.total_seconds() * 1000
            linked = f"  (links {len(span.links)})" if span.links else ""
            lines.append(f"{'  ' * depth}{span.name}  [{span.service}]  {millis:.1f} ms{linked}")
            for child in self.children(span):
                draw(child, depth + 1)

        for root in self.roots():
            draw(root, 0)
        return "\n".join(lines)


def _value(value: dict[str, object]) -> object:
    """An OTLP JSON AnyValue as Python: int64s arrive as strings, arrays and maps nested."""
    if "stringValue" in value:
        return value["stringValue"]
    if "intValue" in value:
        return int(str(value["intValue"]))
    if "doubleValue" in value:
        return float(str(value["doubleValue"]))
    if "boolValue" in value:
        return bool(value["boolValue"])
    if "arrayValue" in value:
        items = value["arrayValue"]
        assert isinstance(items, dict)
        return [_value(item) for item in items.get("values", [])]
    if "kvlistValue" in value:
        pairs = value["kvlistValue"]
        assert isinstance(pairs, dict)
        return _attributes(pairs.get("values", []))
    if "bytesValue" in value:
        return value["bytesValue"]
    return None


def _attributes(pairs: object) -> dict[str, object]:
    assert isinstance(pairs, list)
    return {str(pair["key"]): _value(pair.get("value", {})) for pair in pairs}


def _parse(trace_id: str, body: dict[str, object]) -> Trace:
    spans: list[Span] = []
    result = body.get("result")
    assert isinstance(result, dict), body
    for resource_spans in result.get("resourceSpans", []):
        resource = _attributes(resource_spans.get("resource", {}).get("attributes", []))
        service = str(resource.get("service.name", ""))
        for scope_spans in resource_spans.get("scopeSpans", []):
            for raw in scope_spans.get("spans", []):
                status = raw.get("status", {})
                spans.append(
                    Span(
                        trace_id=str(raw["traceId"]).lower(),
                        span_id=str(raw["spanId"]).lower(),
                        parent_span_id=str(raw["parentSpanId"]).lower()
                        if raw.get("parentSpanId")
                        else None,
                        name=str(raw.get("name", "")),
                        service=service,
                        kind=KINDS.get(int(raw.get("kind", 0)), "unspecified"),
                        start_ns=int(raw.get("startTimeUnixNano", 0)),
                        end_ns=int(raw.get("endTimeUnixNano", 0)),
                        attributes=_attributes(raw.get("attributes", [])),
                        links=tuple(
                            Link(
                                trace_id=str(link["traceId"]).lower(),
                                span_id=str(link["spanId"]).lower(),
                                attributes=_attributes(link.get("attributes", [])),
                            )
                            for link in raw.get("links", [])
                        ),
                        status=STATUSES.get(int(status.get("code", 0)), "unset"),
                        status_message=str(status.get("message", "")),
                        events=tuple(str(event.get("name", "")) for event in raw.get("events", [])),
                        resource=resource,
                    )
                )
    spans.sort(key=lambda span: (span.start_ns, span.end_ns))
    return Trace(trace_id.lower(), tuple(spans))


def _rfc3339(moment: datetime) -> str:
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class Jaeger:
    """A Jaeger process of the caller's own; ``start()`` it (``running_jaeger`` does)."""

    def __init__(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.directory = directory
        self.log_path = directory / "jaeger.log"
        self.ui_port = free_port()
        self.query_grpc_port = free_port()
        self.otlp_grpc_port = free_port()
        self.otlp_http_port = free_port()
        self.popen: subprocess.Popen[bytes] | None = None

    @property
    def otlp_endpoint(self) -> str:
        """OTLP/HTTP's base address, as OTEL_EXPORTER_OTLP_ENDPOINT takes it (the SDK's
        exporter adds /v1/traces)."""
        return f"http://127.0.0.1:{self.otlp_http_port}"

    @property
    def otlp_grpc_endpoint(self) -> str:
        return f"http://127.0.0.1:{self.otlp_grpc_port}"

    @property
    def query_url(self) -> str:
        """The UI's and the query API's address."""
        return f"http://127.0.0.1:{self.ui_port}"

    def env(self) -> dict[str, str]:
        """What a service needs to export here: the endpoint, and the SDK's batch sent every
        200 ms rather than every 5 s (tests wait for the spans)."""
        return {"OTEL_EXPORTER_OTLP_ENDPOINT": self.otlp_endpoint, "OTEL_BSP_SCHEDULE_DELAY": "200"}

    @property
    def running(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    async def start(self, timeout: float = 60) -> None:
        """Run it (a fresh, empty store) and wait until the query API and OTLP/HTTP answer."""
        if self.running:
            return
        env = {
            **os.environ,
            "YOKE_JAEGER_UI_PORT": str(self.ui_port),
            "YOKE_JAEGER_QUERY_GRPC_PORT": str(self.query_grpc_port),
            "YOKE_JAEGER_OTLP_GRPC_PORT": str(self.otlp_grpc_port),
            "YOKE_JAEGER_OTLP_HTTP_PORT": str(self.otlp_http_port),
        }
        with self.log_path.open("ab") as log:
            self.popen = subprocess.Popen(
                [str(binary()), "--config", str(CONFIG)], env=env, stdout=log, stderr=log
            )
        async with local_http(2) as http:

            async def answers() -> bool:
                if not self.running:
                    raise AssertionError(f"jaeger exited:\n{self.output()[-3000:]}")
                try:
                    services = await http.get(f"{self.query_url}/api/v3/services")
                    # Any answer at all from the receiver: it listens (GET is not its method).
                    await http.get(f"{self.otlp_endpoint}/v1/traces")
                except httpx.HTTPError:
                    return False
                return services.status_code == 200

            await eventually(answers, timeout=timeout, what="jaeger to answer")

    async def stop(self, timeout: float = 20) -> None:
        """SIGTERM, then wait (killed past ``timeout``); what it stored is gone with it."""
        popen = self.popen
        if popen is None or popen.poll() is not None:
            return
        popen.send_signal(signal.SIGTERM)
        try:
            await asyncio.to_thread(popen.wait, timeout)
        except subprocess.TimeoutExpired:
            popen.kill()
            await asyncio.to_thread(popen.wait, 10)

    async def _get(self, path: str, **params: str) -> httpx.Response:
        async with local_http(10) as http:
            return await http.get(f"{self.query_url}{path}", params=params)

    async def find_trace(self, trace_id: str) -> Trace | None:
        """The trace as stored now, or None when Jaeger has no span of it."""
        response = await self._get(f"/api/v3/traces/{trace_id}", raw_traces="true")
        if response.status_code == 404:
            return None
        response.raise_for_status()
        return _parse(trace_id, response.json())

    async def trace(
        self,
        trace_id: str,
        timeout: float = 30,
        *,
        until: Callable[[Trace], bool] | None = None,
    ) -> Trace:
        """The trace once it holds a span (or once ``until`` holds: spans of several services
        arrive at their own pace); an AssertionError at the deadline shows what had come."""
        wanted = until or (lambda trace: len(trace) > 0)
        last: Trace | None = None

        async def arrived() -> bool:
            nonlocal last
            last = await self.find_trace(trace_id)
            return last is not None and wanted(last)

        try:
            await eventually(arrived, timeout=timeout, what=f"trace {trace_id}", interval=0.2)
        except AssertionError as error:
            seen = last.tree() if last is not None else "(no span of it)"
            raise AssertionError(f"{error}; Jaeger has:\n{seen}") from None
        assert last is not None
        return last

    async def find_traces(
        self,
        service: str,
        *,
        since: datetime,
        until: datetime | None = None,
        min_duration: timedelta | None = None,
        operation: str | None = None,
        limit: int = 20,
    ) -> list[Trace]:
        """Jaeger's search, as its UI's: traces with a span of ``service`` started in the
        window (and at least ``min_duration`` long)."""
        params = {
            "query.service_name": service,
            "query.start_time_min": _rfc3339(since),
            "query.start_time_max": _rfc3339(until or datetime.now(UTC) + timedelta(seconds=5)),
            "query.num_traces": str(limit),
            "query.raw_traces": "true",
        }
        if min_duration is not None:
            params["query.duration_min"] = f"{int(min_duration.total_seconds() * 1e6)}us"
        if operation is not None:
            params["query.operation_name"] = operation
        response = await self._get("/api/v3/traces", **params)
        if response.status_code == 404:
            return []
        response.raise_for_status()
        whole = _parse("", response.json())
        by_trace: dict[str, list[Span]] = {}
        for span in whole:
            by_trace.setdefault(span.trace_id, []).append(span)
        return [Trace(trace_id, tuple(spans)) for trace_id, spans in by_trace.items()]

    async def services(self) -> list[str]:
        response = await self._get("/api/v3/services")
        response.raise_for_status()
        return sorted(response.json().get("services", []))

    def output(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


@asynccontextmanager
async def running_jaeger(directory: Path) -> AsyncIterator[Jaeger]:
    """A started Jaeger, stopped after (also when the test stopped it itself)."""
    jaeger = Jaeger(directory)
    try:
        await jaeger.start()
        yield jaeger
    finally:
        await jaeger.stop()

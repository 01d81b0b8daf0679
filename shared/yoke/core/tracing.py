"""OpenTelemetry for the mesh: the one module that knows it (docs/architecture.md, "Tracing").

Off unless ``OTEL_EXPORTER_OTLP_ENDPOINT`` is set. Then :func:`configure` installs an SDK
``TracerProvider`` (sampler and resource from the standard ``OTEL_*`` variables; service name
``yoke-<service>`` unless ``OTEL_SERVICE_NAME`` or ``OTEL_RESOURCE_ATTRIBUTES`` says one) that
sends spans over OTLP/HTTP from a batch processor with a bounded queue, on a thread of its own:
a slow, broken or absent collector never holds a turn up, and the spans it costs are counted
(``yoke_trace_spans_dropped``). Off, every function here returns at once: no span, no header,
no exemplar, nothing allocated past a shared null context.

Spans cross the bus as W3C ``traceparent`` AMQP headers (:func:`inject`, :func:`span` with
``parent=``) between the mesh's own processes. What an outside caller sends (an HTTP request's
``traceparent``, a bridge's or a tool worker's AMQP headers, an MCP request's ``_meta``) decides
nothing: a door's span (:func:`door`) is the root of a trace of the mesh's own, sampled by the
operator's sampler alone, and the caller's span is only its link, flags and ``tracestate``
dropped. A door's request refused (401, 403) leaves no span at all (:func:`refuse`).

The tracer is OpenTelemetry's process-wide one, as every instrumentation expects: set once by
:func:`configure`; what else lives here is the exporter's bookkeeping.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import threading
import time
from collections.abc import Iterator, Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.propagators.textmap import Getter
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from yoke.core.metrics import TRACE_SPANS_DROPPED, TRACE_SPANS_EXPORTED

log = logging.getLogger(__name__)

ENDPOINT_VARIABLE = "OTEL_EXPORTER_OTLP_ENDPOINT"
# Prompts and completions go on model-call spans only when the operator asks (YOKE_TRACE_CONTENT).
CONTENT_VARIABLE = "YOKE_TRACE_CONTENT"
# How long a stopping process waits for its last spans to leave.
SHUTDOWN_SECONDS = 3.0
# At most one warning this often while spans cannot be exported (the counter has them all).
WARN_EVERY_SECONDS = 60.0
DEFAULT_QUEUE_SIZE = 2048
# The longest text recorded on a span when content is on (a prompt can be the whole window).
MAX_CONTENT_CHARS = 16_384

# Attribute names the mesh's spans share (never metric labels: one value per conversation).
FORUM_ID = "yoke.forum_id"
CONVERSATION_ID = "yoke.conversation_id"
MESSAGE_ID = "yoke.message_id"
# The W3C headers (AMQP header names are case-sensitive: any spelling of them is theirs).
TRACE_HEADERS = frozenset({"traceparent", "tracestate"})
# The most spans of one held trace (a door's request not yet answered) kept until it answers:
# past it, the rest are dropped (counted: held_full).
MAX_HELD_SPANS = 256

Kind = Literal["internal", "server", "client", "producer", "consumer"]
_KINDS = {
    "internal": trace.SpanKind.INTERNAL,
    "server": trace.SpanKind.SERVER,
    "client": trace.SpanKind.CLIENT,
    "producer": trace.SpanKind.PRODUCER,
    "consumer": trace.SpanKind.CONSUMER,
}
Attributes = Mapping[str, str | int | float | bool]
Headers = TypeVar("Headers", bound=MutableMapping[str, Any])
_NO_SPAN: contextlib.nullcontext[None] = contextlib.nullcontext()
_PROPAGATOR = TraceContextTextMapPropagator()


class _HeaderGetter(Getter[Mapping[str, Any]]):
    """Header values as AMQP and HTTP give them: text, or bytes from a client that sent them
    so; anything else is no header at all."""

    def get(self, carrier: Mapping[str, Any], key: str) -> list[str] | None:
        value = carrier.get(key)
        if isinstance(value, bytes):
            value = value.decode("latin-1")
        return [value] if isinstance(value, str) else None

    def keys(self, carrier: Mapping[str, Any]) -> list[str]:
        return [str(key) for key in carrier]


_GETTER = _HeaderGetter()


class _Held:
    """The spans of door requests not yet answered, by trace: let through once the request
    is served, dropped with it when it is refused (:func:`refuse`). Spans end on any thread."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.traces: dict[int, list[Any]] = {}
        self.refused: set[int] = set()
        # Where released spans go: the export queue of the provider configure() made (None: a
        # provider of a program's own, whose spans are never held).
        self.sink: Any = None

    def hold(self, trace_id: int) -> bool:
        with self.lock:
            if self.sink is None or trace_id in self.traces:
                return False
            self.traces[trace_id] = []
            return True

    def take(self, span: Any) -> bool:
        """Keep ``span`` if its trace is held (``True``: taken, kept or dropped)."""
        with self.lock:
            kept = self.traces.get(span.context.trace_id)
            if kept is None:
                return False
            if len(kept) < MAX_HELD_SPANS:
                kept.append(span)
                return True
        TRACE_SPANS_DROPPED.labels("held_full").inc()
        return True

    def refuse(self, trace_id: int) -> None:
        with self.lock:
            if trace_id in self.traces:
                self.refused.add(trace_id)

    def release(self, trace_id: int) -> None:
        with self.lock:
            spans = self.traces.pop(trace_id, [])
            refused = trace_id in self.refused
            self.refused.discard(trace_id)
            sink = self.sink
        if not refused and sink is not None:
            for span in spans:
                sink(span)


_HELD = _Held()


@dataclass
class _Tracing:
    tracer: trace.Tracer
    content: bool
    # Only what configure() made is shut down here (a worker inside a program of its own
    # may run on that program's provider).
    owned: Any = None


_active: _Tracing | None = None


def enabled() -> bool:
    return _active is not None


def endpoint() -> str:
    """Where spans go (for a log line; the URL's password, if any, is the logs' to mask)."""
    return os.environ.get(ENDPOINT_VARIABLE, "").strip()


def content_enabled() -> bool:
    """Whether model-call spans may carry the prompt and the completion."""
    return _active is not None and _active.content


def configure(service: str, *, content: bool | None = None) -> bool:
    """Trace this process as ``yoke-<service>`` when ``OTEL_EXPORTER_OTLP_ENDPOINT`` is set
    (``True``: tracing is on). Idempotent; a process whose program installed an SDK provider of
    its own traces through that one."""
    global _active
    if _active is not None:
        return True
    if content is None:
        content = os.environ.get(CONTENT_VARIABLE, "").strip().lower() in ("1", "true", "yes")
    current = trace.get_tracer_provider()
    if not isinstance(current, trace.ProxyTracerProvider | trace.NoOpTracerProvider):
        _active = _Tracing(current.get_tracer("yoke"), content)
        return True
    if not os.environ.get(ENDPOINT_VARIABLE, "").strip():
        return False
    try:
        provider = _sdk_provider(service)
    except Exception as error:  # OTEL_* variables the SDK refuses: the mesh runs untraced
        log.error("tracing is off: the OpenTelemetry SDK refused its settings: %s", error)
        return False
    trace.set_tracer_provider(provider)
    _active = _Tracing(provider.get_tracer("yoke"), content, owned=provider)
    atexit.register(shutdown)
    # The exporter's own complaints would be one log line per batch while the collector is
    # away: the counter has them, and _CountingExporter warns now and then.
    logging.getLogger("opentelemetry").setLevel(logging.CRITICAL)
    return True


def _sdk_provider(service: str) -> Any:
    """The SDK's provider with the OTLP/HTTP exporter behind a bounded, counted queue
    (imported here: a process that traces nothing never loads the SDK)."""
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider

    resource = Resource.create()
    named = str(resource.attributes.get(SERVICE_NAME, ""))
    if not named or named.startswith("unknown_service"):
        resource = resource.merge(Resource({SERVICE_NAME: f"yoke-{service}"}))
    # Shut down by shutdown() (at exit too), within a bound: the SDK's own exit hook waits for
    # an unanswering collector up to 30 s.
    provider = TracerProvider(resource=resource, shutdown_on_exit=False)
    provider.add_span_processor(_counted_batches(OTLPSpanExporter()))
    return provider


def _counted_batches(exporter: Any) -> Any:
    from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor
    from opentelemetry.sdk.trace.export import (
        BatchSpanProcessor,
        SpanExporter,
        SpanExportResult,
    )

    try:
        size = int(os.environ.get("OTEL_BSP_MAX_QUEUE_SIZE", DEFAULT_QUEUE_SIZE))
    except ValueError:
        size = DEFAULT_QUEUE_SIZE

    class Counted(SpanExporter):
        """Counts what leaves (or fails to) and how full the queue is."""

        def __init__(self) -> None:
            self.queued = 0
            self.lock = threading.Lock()
            self.warned = 0.0

        def taken(self) -> bool:
            """A span enters the queue; ``False`` when it is full (the oldest is dropped)."""
            with self.lock:
                if self.queued >= size:
                    return False
                self.queued += 1
                return True

        def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
            with self.lock:
                self.queued = max(0, self.queued - len(spans))
            try:
                result: SpanExportResult = exporter.export(spans)
            except Exception as error:
                result = SpanExportResult.FAILURE
                self.warn(repr(error))
            if result is SpanExportResult.SUCCESS:
                TRACE_SPANS_EXPORTED.inc(len(spans))
            else:
                TRACE_SPANS_DROPPED.labels("export_failed").inc(len(spans))
                self.warn("the collector did not take them")
            return result

        def warn(self, why: str) -> None:
            now = time.monotonic()
            if now - self.warned >= WARN_EVERY_SECONDS:
                self.warned = now
                log.warning("spans not exported (%s); counted in yoke_trace_spans_dropped", why)

        def shutdown(self) -> None:
            exporter.shutdown()

        def force_flush(self, timeout_millis: int = 30000) -> bool:
            return bool(exporter.force_flush(timeout_millis))

    counted = Counted()
    batches = BatchSpanProcessor(counted, max_queue_size=size)

    class Bounded(SpanProcessor):
        def on_start(self, span: Any, parent_context: Any = None) -> None:
            pass

        def on_end(self, span: ReadableSpan) -> None:
            context = span.context
            if context is None or not context.trace_flags.sampled:
                return
            if not _HELD.take(span):
                self.queue(span)

        def queue(self, span: ReadableSpan) -> None:
            if not counted.taken():
                TRACE_SPANS_DROPPED.labels("queue_full").inc()
            batches.on_end(span)

        def shutdown(self) -> None:
            batches.shutdown()  # type: ignore[no-untyped-call]

        def force_flush(self, timeout_millis: int = 30000) -> bool:
            return bool(batches.force_flush(timeout_millis))

    bounded = Bounded()
    _HELD.sink = bounded.queue
    return bounded


def shutdown(timeout: float = SHUTDOWN_SECONDS) -> None:
    """Send what is queued and stop, waiting at most ``timeout`` (a collector that does not
    answer never holds a stopping process up)."""
    global _active
    tracing, _active = _active, None
    if tracing is None or tracing.owned is None:
        return
    closing = threading.Thread(target=tracing.owned.shutdown, name="yoke-trace-flush", daemon=True)
    closing.start()
    closing.join(timeout)


# --- spans -------------------------------------------------------------------------------------


def span(
    name: str,
    *,
    kind: Kind = "internal",
    attributes: Attributes | None = None,
    parent: Mapping[str, Any] | None = None,
    caller: Mapping[str, Any] | None = None,
    links: Sequence[str | None] = (),
    child_only: bool = False,
) -> contextlib.AbstractContextManager[object]:
    """A span around the work inside, made current (``with tracing.span("step"): ...``).

    ``parent``: headers of the mesh's own (AMQP) whose ``traceparent`` this span continues, a
    new trace when they carry none; ``caller``: what an outside caller sent as its trace context
    (headers, an MCP request's ``_meta``): only ever a link of this span (``yoke.link``:
    ``caller``), never its parent, its flags and ``tracestate`` dropped; ``links``:
    ``traceparent`` values of the spans this work follows from (the step that started a wait);
    ``child_only``: no span at all outside a trace (publishes and store operations of
    background work would each be a trace of their own).
    """
    tracing = _active
    if tracing is None:
        return _NO_SPAN
    if child_only and not trace.get_current_span().get_span_context().is_valid:
        return _NO_SPAN
    context = _PROPAGATOR.extract(parent, getter=_GETTER) if parent is not None else None
    return tracing.tracer.start_as_current_span(
        name,
        context=context,
        kind=_KINDS[kind],
        attributes=attributes,
        links=_links(links, caller),
    )


def door(
    name: str,
    *,
    kind: Kind,
    caller: Mapping[str, Any],
    attributes: Attributes | None = None,
    refusable: bool = False,
) -> contextlib.AbstractContextManager[object]:
    """A door's span (an HTTP request, a delivery an outsider published): the root of a trace
    of the mesh's own, which the operator's sampler alone samples (``OTEL_TRACES_SAMPLER``;
    a caller's sampled flag neither forces nor suppresses it), linked to the span ``caller``'s
    ``traceparent`` names, if any; the caller's ``tracestate`` is dropped.

    ``refusable``: the span, and every span of its trace that ends before it, are held until
    it ends, and dropped if :func:`refuse` was called inside (a refused request: no trace).
    """
    tracing = _active
    if tracing is None:
        return _NO_SPAN
    made = tracing.tracer.start_as_current_span(
        name,
        context=Context(),  # a root, whatever is current
        kind=_KINDS[kind],
        attributes=attributes,
        links=_links((), caller),
    )
    return _held(made) if refusable else made


@contextlib.contextmanager
def _held(made: contextlib.AbstractContextManager[trace.Span]) -> Iterator[object]:
    held: int | None = None
    try:
        with made as current:
            context = current.get_span_context()
            if context.trace_flags.sampled and _HELD.hold(context.trace_id):
                held = context.trace_id
            yield current
    finally:
        if held is not None:
            _HELD.release(held)


def refuse() -> None:
    """The current door request is refused (401, 403): its trace is dropped when its door's
    span ends (:func:`door` with ``refusable``)."""
    if _active is None:
        return
    _HELD.refuse(trace.get_current_span().get_span_context().trace_id)


def recording() -> bool:
    """Whether the current span is recorded (in a trace, and sampled): what a listener asks
    before it prepares a child span."""
    return _active is not None and trace.get_current_span().is_recording()


def finished_span(
    name: str, seconds: float, attributes: Attributes, *, error: str | None = None
) -> None:
    """A child span of the current one that has just ended, ``seconds`` long (what an event
    listener hears of: a store command); nothing outside a recorded trace."""
    tracing = _active
    if tracing is None or not trace.get_current_span().is_recording():
        return
    end = time.time_ns()
    made = tracing.tracer.start_span(
        name,
        kind=trace.SpanKind.CLIENT,
        attributes=attributes,
        start_time=end - int(seconds * 1e9),
    )
    if error is not None:
        made.set_status(trace.Status(trace.StatusCode.ERROR, error[:200]))
    made.end(end_time=end)


def annotate(attributes: Attributes) -> None:
    """Set attributes on the current span (what is known only once the work is done)."""
    if _active is None:
        return
    current = trace.get_current_span()
    if current.is_recording():
        current.set_attributes(attributes)


def rename(name: str) -> None:
    """Rename the current span (an HTTP route is known only once it is matched)."""
    if _active is None:
        return
    current = trace.get_current_span()
    if current.is_recording():
        current.update_name(name)


def link(value: str | None) -> None:
    """Link the current span to the span ``value`` (a ``traceparent``) names, unless it is of
    this trace already (then its parents say as much)."""
    if _active is None or not value:
        return
    current = trace.get_current_span()
    made = _link(value)
    if made is None or not current.is_recording():
        return
    if made.context.trace_id != current.get_span_context().trace_id:
        current.add_link(made.context, made.attributes)


def _link(value: str | None) -> trace.Link | None:
    if not value:
        return None
    context = _PROPAGATOR.extract({"traceparent": value}, getter=_GETTER)
    span_context = trace.get_current_span(context).get_span_context()
    if not span_context.is_valid:
        return None
    return trace.Link(span_context, {"yoke.link": "waited_for"})


def _caller_link(caller: Mapping[str, Any]) -> trace.Link | None:
    """A link to the span an outside caller's ``traceparent`` names: its ids only (no flags,
    no ``tracestate``), so nothing of what the caller says of its trace travels on."""
    value = _GETTER.get(caller, "traceparent")
    if not value:
        return None
    context = _PROPAGATOR.extract({"traceparent": value[0]}, getter=_GETTER)
    found = trace.get_current_span(context).get_span_context()
    if not found.is_valid:
        return None
    ids = trace.SpanContext(found.trace_id, found.span_id, is_remote=True)
    return trace.Link(ids, {"yoke.link": "caller"})


def _links(values: Sequence[str | None], caller: Mapping[str, Any] | None) -> list[trace.Link]:
    made = [link for value in values if (link := _link(value)) is not None]
    if caller is not None and (link := _caller_link(caller)) is not None:
        made.append(link)
    return made


# --- propagation -------------------------------------------------------------------------------


def inject(headers: Headers) -> Headers:
    """``headers`` with the current span's ``traceparent`` (and ``tracestate``, which the
    mesh's spans never have from a caller), replacing any the caller copied from elsewhere, in
    any spelling; as they were outside a trace."""
    if _active is None:
        return headers
    if trace.get_current_span().get_span_context().is_valid:
        for name in [name for name in headers if str(name).lower() in TRACE_HEADERS]:
            del headers[name]
        _PROPAGATOR.inject(headers)
    return headers


def traceparent() -> str | None:
    """The current span as a ``traceparent`` value, to keep where a wait is recorded (and
    :func:`link` to later); None outside a trace."""
    if _active is None:
        return None
    carrier: dict[str, str] = {}
    inject(carrier)
    return carrier.get("traceparent")


# --- logs and metrics ---------------------------------------------------------------------------


def ids() -> tuple[str, str] | None:
    """The current trace and span ids in hex (a log line's ``trace_id``, ``span_id``)."""
    if _active is None:
        return None
    context = trace.get_current_span().get_span_context()
    if not context.is_valid:
        return None
    return format(context.trace_id, "032x"), format(context.span_id, "016x")


def exemplar() -> dict[str, str] | None:
    """An exemplar for a histogram observation made inside a span (OpenMetrics: a slow
    bucket's sample opens its trace), None outside one or in one sampled out (no trace to
    open). A log line names even those: the ids still join the lines of one turn."""
    if _active is None:
        return None
    context = trace.get_current_span().get_span_context()
    if not context.is_valid or not context.trace_flags.sampled:
        return None
    return {
        "trace_id": format(context.trace_id, "032x"),
        "span_id": format(context.span_id, "016x"),
    }


def content(value: object) -> str:
    """``value`` as a span attribute's text (JSON), cut at :data:`MAX_CONTENT_CHARS`."""
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    return text[:MAX_CONTENT_CHARS]

"""yoke.core.tracing's own pieces: off by default at no cost, and on, a collector that is slow,
full or away never holds the process up and its losses are counted.

Tracing on is process-wide (OpenTelemetry's provider is set once), so those cases run in a
child process each, against a collector of the test's own that takes connections and never
answers. The whole path through the mesh and a real Jaeger: tests/e2e/test_tracing.py.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator

import pytest

from tests.support.processes import ROOT
from yoke.core import tracing
from yoke.core.logs import JsonFormatter, TextFormatter
from yoke.core.metrics import exposition


def test_off_without_an_endpoint_nothing_is_made(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(tracing.ENDPOINT_VARIABLE, raising=False)
    assert tracing.configure("test") is False
    assert not tracing.enabled()
    first, second = tracing.span("a"), tracing.span("b", parent={"traceparent": "00-x"})
    assert first is second  # one shared null context: nothing allocated per span
    with first as made:
        assert made is None
        headers = {"x-yoke-conversation": "f"}
        assert tracing.inject(headers) == {"x-yoke-conversation": "f"}
        assert tracing.traceparent() is None
        assert tracing.exemplar() is None and tracing.ids() is None
    record = logging.LogRecord("yoke.test", logging.INFO, __file__, 1, "a line", None, None)
    assert "trace_id" not in JsonFormatter("test").format(record)
    assert "trace_id" not in TextFormatter("test").format(record)


def test_metrics_are_openmetrics_when_the_scraper_asks() -> None:
    body, content_type = exposition("application/openmetrics-text; version=1.0.0; q=0.5, */*")
    assert content_type.startswith("application/openmetrics-text")
    assert body.rstrip().endswith(b"# EOF")
    body, content_type = exposition(None)
    assert content_type.startswith("text/plain") and b"# EOF" not in body


@pytest.fixture
def silent_collector() -> Iterator[str]:
    """An OTLP/HTTP address that takes connections and never answers (a wedged collector)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(server.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.getsockname()[1]}"
    finally:
        stop.set()
        thread.join(5)
        for connection in held:
            connection.close()
        server.close()


def run_traced(code: str, **env: str) -> dict[str, object]:
    """``code`` in a child process with tracing on; it prints one JSON object last."""
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env={**os.environ, **env},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    found: dict[str, object] = json.loads(result.stdout.strip().splitlines()[-1])
    return found


PROBE = """
    import json, time
    from yoke.core import tracing
    from yoke.core.metrics import TRACE_SPANS_DROPPED
    from opentelemetry import trace

    assert tracing.configure("probe")
    resource = trace.get_tracer_provider().resource.attributes
    caller = "00-" + "ab" * 16 + "-" + "cd" * 8 + "-01"
    started = time.monotonic()
    with tracing.span("outer", parent={"traceparent": caller.encode()}):
        headers = tracing.inject({"traceparent": "00-" + "ef" * 16 + "-" + "12" * 8 + "-01"})
        ids = tracing.ids()
        kept = tracing.traceparent()
        exemplar = tracing.exemplar()
    for index in range(20):
        with tracing.span(f"span {index}"):
            pass
    spent = time.monotonic() - started
    before_stop = time.monotonic()
    tracing.shutdown(1.0)
    stopping = time.monotonic() - before_stop
    print(json.dumps({
        "service": resource["service.name"],
        "headers": headers,
        "ids": ids,
        "kept": kept,
        "exemplar": exemplar,
        "spent": spent,
        "stopping": stopping,
        "queue_full": TRACE_SPANS_DROPPED.labels("queue_full")._value.get(),
    }))
"""


def test_on_spans_go_through_a_bounded_queue_that_never_holds_the_process_up(
    silent_collector: str,
) -> None:
    found = run_traced(
        PROBE,
        OTEL_EXPORTER_OTLP_ENDPOINT=silent_collector,
        OTEL_BSP_MAX_QUEUE_SIZE="5",
        OTEL_BSP_MAX_EXPORT_BATCH_SIZE="5",
        OTEL_BSP_SCHEDULE_DELAY="60000",
        OTEL_EXPORTER_OTLP_TIMEOUT="30",
    )
    assert found["service"] == "yoke-probe"
    # A caller's traceparent is the span's parent: same trace, and the header sent on is ours
    # (what the caller had copied in is replaced).
    trace_id, span_id = found["ids"]  # type: ignore[misc]
    assert trace_id == "ab" * 16 and span_id != "cd" * 8
    assert found["headers"] == {"traceparent": f"00-{trace_id}-{span_id}-01"}
    assert found["kept"] == f"00-{trace_id}-{span_id}-01"
    assert found["exemplar"] == {"trace_id": trace_id, "span_id": span_id}
    # 21 spans into a queue of 5 that the collector never empties: the overflow is counted, and
    # neither the spans nor the stop waited for the collector. The SDK's worker wakes as the queue
    # reaches a batch (5) and may take one batch out before the loop ends (when the machine lets
    # it run); it then waits on the silent collector, so at most 5 queued + 5 taken are not lost.
    assert 21 - 5 - 5 <= found["queue_full"] <= 21 - 5
    assert float(found["spent"]) < 1.0  # type: ignore[arg-type]
    assert float(found["stopping"]) < 3.0  # type: ignore[arg-type]


def test_settings_the_sdk_refuses_leave_tracing_off_not_the_service_down(
    silent_collector: str,
) -> None:
    found = run_traced(
        """
        import json
        from yoke.core import tracing
        print(json.dumps({"on": tracing.configure("probe"), "span": tracing.traceparent()}))
        """,
        OTEL_EXPORTER_OTLP_ENDPOINT=silent_collector,
        OTEL_BSP_MAX_QUEUE_SIZE="5",  # smaller than its export batch (512): refused
    )
    assert found == {"on": False, "span": None}


def test_the_standard_service_name_variable_wins(silent_collector: str) -> None:
    found = run_traced(
        PROBE,
        OTEL_EXPORTER_OTLP_ENDPOINT=silent_collector,
        OTEL_SERVICE_NAME="named-by-the-operator",
        OTEL_TRACES_SAMPLER="always_off",
    )
    assert found["service"] == "named-by-the-operator"
    # Sampled out (OTEL_TRACES_SAMPLER): nothing queued and no exemplar pointing at a trace
    # nobody has; log lines still name the ids (they join a turn's lines across services).
    assert found["exemplar"] is None
    assert found["ids"] is not None
    assert found["queue_full"] == 0


MODEL_CALL = """
    import asyncio, json
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from yoke.core import tracing
    from yoke.llm.base import InferenceRequest
    from yoke.llm.providers import provider_for
    from yoke.core.models import Message, TextPart
    from yoke.core.settings import Settings

    # A program's own provider (a worker inside an application, say): tracing uses it.
    memory = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    trace.set_tracer_provider(provider)
    assert tracing.configure("probe")
    line = Message(
        id="l1", conversation_id="c1", author_actor_id="a1", role="user",
        parts=[TextPart(text="a secret of the forum")],
    )
    request = InferenceRequest(transcript=[line], tools={}, call_id_prefix="p")
    asyncio.run(provider_for("fixture-echo", [], Settings()).infer(request))
    [span] = memory.get_finished_spans()
    print(json.dumps({"name": span.name, "kind": str(span.kind), **dict(span.attributes)}))
"""


@pytest.mark.parametrize("content", ["false", "true"])
def test_a_model_call_is_a_genai_span_with_content_only_when_asked(content: str) -> None:
    found = run_traced(MODEL_CALL, YOKE_TRACE_CONTENT=content)
    assert found["name"] == "chat fixture-echo" and found["kind"] == "SpanKind.CLIENT"
    assert found["gen_ai.operation.name"] == "chat"
    assert found["gen_ai.request.model"] == found["gen_ai.response.model"] == "fixture-echo"
    assert found["gen_ai.usage.input_tokens"] == 9  # the echo's estimate: 21 // 4 + 4
    assert found["gen_ai.usage.output_tokens"] == 5
    assert found["yoke.cost_usd"] == 0.0  # a fixture's known price
    recorded = json.dumps(found)
    if content == "true":
        assert "a secret of the forum" in str(found["gen_ai.input.messages"])
        assert "a secret of the forum" in str(found["gen_ai.output.messages"])
    else:
        assert "a secret of the forum" not in recorded
        assert not any(key.startswith(("gen_ai.input", "gen_ai.output")) for key in found)

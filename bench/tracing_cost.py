"""What tracing costs: CPU per turn with every span sampled, against tracing off, same run.

The five services are restarted twice, as the operator would run them: without
``OTEL_EXPORTER_OTLP_ENDPOINT`` (tracing off, the default), then with it and
``OTEL_TRACES_SAMPLER=always_on``. The endpoint is a collector stand-in in the bench's own
process (:class:`OtlpSink`: takes each OTLP/HTTP batch and answers 200), so the figure is the
services' cost (spans made, batched, encoded and sent) and no backend's; the sink's own CPU is
the driver's. Each side: a fresh forum, warm-up turns, then ``--tracing-turns`` turns one at a
time, the CPU of each service (and of the local servers) per turn, counted until the SDK's
last batch has gone, and the spans exported per turn (the services'
``yoke_trace_spans_exported``).
"""

from __future__ import annotations

import asyncio
import math
import threading
from collections.abc import Iterable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from bench.mesh_bench import DRIVER, Figures, MeshBench
from bench.services import Services

WARMUP_TURNS = 5
# Past the SDK's batch delay (OTEL_BSP_SCHEDULE_DELAY, 5 s): the last spans of the run are sent,
# and their sending counted, before the CPU is read (off, the same wait: the same idle CPU).
EXPORT_SETTLE_SECONDS = 6.0
START_WITHIN = 120.0


class OtlpSink:
    """An OTLP/HTTP endpoint that takes every batch (what a healthy collector does) and keeps
    only how many came and their bytes."""

    def __init__(self) -> None:
        self.batches = 0
        self.bytes = 0
        self._lock = threading.Lock()
        sink = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:
                length = int(self.headers.get("content-length", "0"))
                self.rfile.read(length)
                with sink._lock:
                    sink.batches += 1
                    sink.bytes += length
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> OtlpSink:
        self.thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.server.shutdown()
        self.server.server_close()


async def spans_exported(ports: Iterable[int]) -> float:
    """``yoke_trace_spans_exported`` summed over the services (0 while tracing is off)."""
    total = 0.0
    async with httpx.AsyncClient(timeout=5) as client:
        for port in ports:
            try:
                text = (await client.get(f"http://127.0.0.1:{port}/metrics")).text
            except httpx.HTTPError:
                continue
            for family in text_string_to_metric_families(text):
                for sample in family.samples:
                    if sample.name == "yoke_trace_spans_exported_total":
                        total += sample.value
    return total


class TracingBench:
    """The two sides on one mesh; the services are left running traced (the last phase)."""

    def __init__(self, mesh: MeshBench) -> None:
        self.mesh = mesh

    async def run(self) -> Figures:
        mesh = self.mesh
        with OtlpSink() as sink:
            await self.restart({})
            off = await self.side("tracing off")
            # The SDK's batching as an operator gets it (a batch every 5 s, or of 512 spans).
            await self.restart(
                {"OTEL_EXPORTER_OTLP_ENDPOINT": sink.endpoint, "OTEL_TRACES_SAMPLER": "always_on"}
            )
            on = await self.side("tracing on")
            on["collectorBatches"], on["collectorBytes"] = sink.batches, sink.bytes
        total_off, total_on = off["servicesCpuMsPerTurn"], on["servicesCpuMsPerTurn"]
        ratio = total_on / total_off if total_off and not math.isnan(total_off) else None
        mesh.progress(
            f"tracing: services' CPU per turn {total_off:.2f} ms off, {total_on:.2f} ms on"
            f" (every span sampled, {on['spansPerTurn']:.0f} spans a turn)"
        )
        return {
            "turns": mesh.args.tracing_turns,
            "off": off,
            "on": on,
            "servicesCpuRatio": round(ratio, 3) if ratio is not None else None,
        }

    async def restart(self, tracing: dict[str, str]) -> None:
        """The five services again, with ``tracing``'s variables (none: tracing off)."""
        mesh = self.mesh
        codes = await mesh.services.stop()
        if any(code != 0 for code in codes.values()):
            raise RuntimeError(f"tracing: the services did not stop cleanly: {codes}")
        mode = "on" if tracing else "off"
        mesh.progress(f"tracing: restarting the five services with tracing {mode}")
        env = {
            name: value for name, value in mesh.services.env.items() if not name.startswith("OTEL_")
        }
        mesh.services = Services({**env, **tracing}, mesh.log_dir)
        await mesh.services.start(within=START_WITHIN)

    async def side(self, label: str) -> Figures:
        mesh = self.mesh
        turns = mesh.args.tracing_turns
        (forum,), _ = await mesh.join_forums(1, label)
        await mesh.turns.closed_loop(f"{label} warmup", [forum], WARMUP_TURNS, mesh.progress)
        await mesh.quiet(f"{label} warmup")
        ports = [process.port for process in mesh.services.processes.values()]
        spans = await spans_exported(ports)
        before = mesh.cpu()
        run = await mesh.turns.closed_loop(label, [forum], turns, mesh.progress)
        await mesh.quiet(label)
        mesh.tracker.forget()
        await asyncio.sleep(EXPORT_SETTLE_SECONDS)
        cpu = mesh.cpu_per_turn(before, run.turns)
        exported = await spans_exported(ports)
        services = [name for name in mesh.services.processes if name in cpu]
        return {
            **run.summary(),
            "cpuMsPerTurn": cpu,
            "servicesCpuMsPerTurn": round(sum(cpu[name] for name in services), 3),
            "driverCpuMsPerTurn": cpu.get(DRIVER),
            "spansPerTurn": round((exported - spans) / max(run.turns, 1), 1),
        }

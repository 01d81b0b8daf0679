"""Streaming: how soon people see an agent start writing, and how soon its line is there.

The gateway runs as a real process beside the mesh (for this phase only), and one forum is
joined by an agent whose model streams its echo in :data:`PIECES` pieces over :data:`SECONDS`
seconds (``fixture-stream-50-2``), a model that writes at a steady rate. Each turn POSTs a line
over HTTP (httpx, kept alive) and times, on an open ``/stream``, POST -> the draft's first
``delta`` event and POST -> the finished line's ``message`` event, one turn at a time; it also
counts each draft's deltas (the processor merges pieces to about 20 a second).
"""

from __future__ import annotations

import asyncio
import time

import httpx

from bench.gateway import START_WITHIN, latency_figures
from bench.http_answers import StreamReader
from bench.mesh_bench import Figures, MeshBench
from bench.services import ServiceProcess
from bench.stats import percentile
from yoke.cli.supervisor import GATEWAY
from yoke.runtime.joins import create_agent
from yoke.store.tokens import create_token, ensure_token_indexes

PIECES = 50
SECONDS = 2
MODEL = f"fixture-stream-{PIECES}-{SECONDS}"
TOKEN_NAME = "bench-streaming"
# Series, as written to the results.
FIRST_DELTA = "postToFirstDelta"
LINE = "postToLine"
# Unmeasured turns first: the fresh gateway's first stream, connections and caches.
WARMUP_TURNS = 1


class StreamingBench:
    """The gateway process, its token, a forum with the streaming agent and an open stream."""

    def __init__(self, mesh: MeshBench) -> None:
        self.mesh = mesh
        self.args = mesh.args
        self.progress = mesh.progress
        # A turn takes the model's SECONDS at least.
        self.patience = float(mesh.args.turn_timeout) + SECONDS
        self.forum = ""
        self._posted = 0

    async def run(self) -> Figures:
        mesh = self.mesh
        agent = await create_agent(mesh.store, "streaming", model=MODEL)
        (self.forum,), _ = await mesh.join_forums(1, "streaming", agent_id=agent.id, track=False)
        await ensure_token_indexes(mesh.store)
        _, secret = await create_token(mesh.store, TOKEN_NAME, [self.forum])
        self.progress(f"streaming: starting the gateway process (logs in {mesh.log_dir})")
        gateway = ServiceProcess(GATEWAY, mesh.services.env, mesh.log_dir)
        stream = StreamReader(gateway.url, self.forum, secret)
        api = httpx.AsyncClient(
            base_url=gateway.url,
            headers={"Authorization": f"Bearer {secret}"},
            timeout=self.patience,
        )
        first: list[float] = []
        whole: list[float] = []
        deltas: list[int] = []
        try:
            await gateway.wait_healthy(START_WITHIN)
            await stream.open(within=30)
            for _ in range(WARMUP_TURNS):
                await self.turn(api, stream)
            begin = time.perf_counter()
            for _ in range(self.args.stream_turns):
                to_delta, to_line, count = await self.turn(api, stream)
                first.append(to_delta)
                whole.append(to_line)
                deltas.append(count)
            self.progress(
                f"streaming: {len(whole)} turns in {time.perf_counter() - begin:.1f}s, POST ->"
                f" first delta p50 {percentile(first, 0.5) * 1000:.1f} ms, POST -> line p50"
                f" {percentile(whole, 0.5) * 1000:.1f} ms"
            )
        finally:
            await api.aclose()
            await stream.close()  # before the stop: an open stream holds the shutdown up
            code = await asyncio.to_thread(gateway.stop)
        if code != 0:
            self.progress(f"streaming: the gateway exited with {code}; its log: {gateway.log_path}")
        return {
            "turns": len(whole),
            "model": MODEL,
            "modelSeconds": SECONDS,
            FIRST_DELTA: latency_figures(first),
            LINE: latency_figures(whole),
            "deltasPerAnswer": {
                "min": min(deltas, default=0),
                "p50": percentile([float(n) for n in deltas], 0.5) if deltas else 0,
                "max": max(deltas, default=0),
            },
            "exitCode": code,
        }

    async def turn(self, api: httpx.AsyncClient, stream: StreamReader) -> tuple[float, float, int]:
        """(POST -> first delta, POST -> line, deltas of the draft) of one turn, in seconds."""
        self._posted += 1
        # Long enough for every piece to hold two characters.
        text = f"streamed line {self._posted} ".ljust(PIECES * 2, ".")
        body = {"author": {"externalId": "person", "displayName": "person"}, "text": text}
        started = time.perf_counter()
        response = await api.post(f"/v1/forums/{self.forum}/messages", json=body)
        if response.status_code != 202:
            raise RuntimeError(
                f"the gateway refused a line: {response.status_code} {response.text}"
            )
        line_id = str(response.json()["messageId"])
        drafted = await stream.drafts.wait(line_id, self.patience)
        answered = await stream.answers.wait(line_id, self.patience)
        return drafted - started, answered - started, stream.deltas.get(line_id, 0)

"""The HTTP gateway beside the AMQP door, in one forum, one turn at a time, door after door.

The gateway runs as a real process beside the mesh (started for this phase only, so the other
phases measure the mesh as before), with a token made as ``yoke token create`` makes one and a
webhook subscription as ``yoke webhook add`` adds one. Each round posts a line over HTTP
(httpx, kept alive) and times POST -> 202, POST -> the agent's answer on an open ``/stream``
and POST -> its webhook delivery; calls the same agent, published, through the gateway's MCP
server and as its A2A agent (:mod:`bench.callers`: call -> answer, send -> completed, each in
its caller's own kept forum); then submits a
line through :class:`yoke.client.Client` and times the door's answer and the agent's answer on
``yoke.events``: the baseline, in the same forum and the same run, interleaved so every door
sees the same machine.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import httpx

from bench.callers import A2aCaller, McpCaller
from bench.http_answers import StreamReader, WebhookReceiver
from bench.mesh_bench import Figures, MeshBench
from bench.services import ServiceProcess
from bench.stats import percentile
from bench.turns import ACCEPTED, START
from yoke.cli.supervisor import GATEWAY
from yoke.store.publishing import publish_agent
from yoke.store.tokens import create_token, ensure_token_indexes
from yoke.store.webhooks import add_webhook, ensure_webhook_indexes

START_WITHIN = 120.0
TOKEN_NAME = "bench-gateway"
PUBLISHED_NAME = "bench-echo"
# Series, as written to the results (what each times is in report.gateway_lines).
POST = "post"
AMQP_SUBMIT = "amqpSubmit"
STREAM = "postToStream"
AMQP_TURN = "amqpTurn"
WEBHOOK = "postToWebhook"
MCP_CALL = "mcpCall"
A2A_TASK = "a2aTask"
SERIES = (POST, AMQP_SUBMIT, STREAM, AMQP_TURN, WEBHOOK, MCP_CALL, A2A_TASK)
# (ratio's name, gateway series, its AMQP baseline): p50 over p50.
RATIOS = (
    ("accept", POST, AMQP_SUBMIT),
    ("answer", STREAM, AMQP_TURN),
    ("mcp", MCP_CALL, AMQP_TURN),
    ("a2a", A2A_TASK, AMQP_TURN),
)


def latency_figures(seconds: list[float]) -> Figures:
    return {
        "count": len(seconds),
        **{
            f"p{round(q * 100)}Ms": round(percentile(seconds, q) * 1000, 2)
            for q in (0.5, 0.9, 0.99)
        },
        "maxMs": round(percentile(seconds, 1.0) * 1000, 2),
    }


@dataclass
class Rounds:
    """Each series' samples in seconds."""

    samples: dict[str, list[float]] = field(default_factory=lambda: {k: [] for k in SERIES})

    def add(self, name: str, seconds: float) -> None:
        self.samples[name].append(seconds)


@dataclass
class Callers:
    """The published agent's callers through the gateway's MCP and A2A doors."""

    mcp: McpCaller
    a2a: A2aCaller


class GatewayBench:
    """The gateway process, its token, a forum with the echo agent, a stream and a webhook."""

    def __init__(self, mesh: MeshBench) -> None:
        self.mesh = mesh
        self.args = mesh.args
        self.progress = mesh.progress
        self.patience = float(mesh.args.turn_timeout)
        self.receiver = WebhookReceiver()
        self.forum = ""
        self._posted = 0

    async def run(self) -> Figures:
        await self.receiver.start()
        try:
            return await self._run()
        finally:
            await self.receiver.close()
            self.mesh.tracker.forget()

    async def _run(self) -> Figures:
        mesh, args = self.mesh, self.args
        (self.forum,), _ = await mesh.join_forums(1, "gateway")
        await ensure_token_indexes(mesh.store)
        await publish_agent(mesh.store, PUBLISHED_NAME, mesh.agent_id, "Echoes the line.")
        _, secret = await create_token(
            mesh.store, TOKEN_NAME, [self.forum], can_call=[PUBLISHED_NAME]
        )
        await ensure_webhook_indexes(mesh.store)
        # Before the gateway starts: its worker takes the subscription's lease as it starts.
        await add_webhook(mesh.store, self.forum, self.receiver.url)
        self.progress(f"gateway: starting the gateway process (logs in {mesh.log_dir})")
        gateway = ServiceProcess(GATEWAY, mesh.services.env, mesh.log_dir)
        stream = StreamReader(gateway.url, self.forum, secret)
        callers = Callers(
            McpCaller(gateway.url, secret, PUBLISHED_NAME, self.patience),
            A2aCaller(gateway.url, secret, PUBLISHED_NAME, self.patience),
        )
        api = httpx.AsyncClient(
            base_url=gateway.url,
            headers={"Authorization": f"Bearer {secret}"},
            timeout=self.patience,
        )
        try:
            begin = time.perf_counter()
            await gateway.wait_healthy(START_WITHIN)
            healthy = time.perf_counter()
            await stream.open(within=30)
            await callers.mcp.open()
            await callers.a2a.open()
            self.progress(
                f"gateway: healthy in {healthy - begin:.1f}s, stream open"
                f" {time.perf_counter() - healthy:.1f}s later"
            )
            if args.turn_warmup:
                await self.rounds(api, stream, callers, "gateway warmup", args.turn_warmup)
            rounds = await self.rounds(api, stream, callers, "gateway", args.gateway_turns)
        finally:
            await callers.a2a.close()
            await callers.mcp.close()
            await api.aclose()
            await stream.close()  # before the stop: an open stream holds the shutdown up
            code = await asyncio.to_thread(gateway.stop)
        if code != 0:
            self.progress(f"gateway: exited with {code}; its log: {gateway.log_path}")
        figures: Figures = {
            "turns": len(rounds.samples[POST]),
            **{name: latency_figures(samples) for name, samples in rounds.samples.items()},
            "exitCode": code,
        }
        figures["ratios"] = {
            name: round(figures[ours]["p50Ms"] / figures[base]["p50Ms"], 3)
            for name, ours, base in RATIOS
            if figures[base]["p50Ms"] > 0
        }
        return figures

    async def rounds(
        self,
        api: httpx.AsyncClient,
        stream: StreamReader,
        callers: Callers,
        label: str,
        count: int,
    ) -> Rounds:
        """``count`` rounds, each a turn through the gateway, a call through its MCP server and
        a task of its A2A agent, then a turn through the AMQP door; every answer awaited
        wherever it goes before the next line (one turn at a time)."""
        rounds = Rounds()
        begin = time.perf_counter()
        last_report = begin
        for index in range(count):
            await self.http_turn(api, stream, rounds)
            rounds.add(MCP_CALL, await callers.mcp.call(f"mcp line {index}"))
            rounds.add(A2A_TASK, await callers.a2a.call(f"a2a line {index}"))
            await self.amqp_turn(stream, rounds)
            if time.perf_counter() - last_report > 5:
                last_report = time.perf_counter()
                self.progress(f"{label}: {index + 1}/{count} rounds")
        post, submit = rounds.samples[POST], rounds.samples[AMQP_SUBMIT]
        self.progress(
            f"{label}: {count} rounds in {time.perf_counter() - begin:.1f}s, POST -> 202 p50"
            f" {percentile(post, 0.5) * 1000:.1f} ms, Client.submit p50"
            f" {percentile(submit, 0.5) * 1000:.1f} ms"
        )
        return rounds

    async def http_turn(self, api: httpx.AsyncClient, stream: StreamReader, rounds: Rounds) -> None:
        self._posted += 1
        body = {
            "author": {"externalId": "person", "displayName": "person"},
            "text": f"gateway line {self._posted}",
        }
        started = time.perf_counter()
        response = await api.post(f"/v1/forums/{self.forum}/messages", json=body)
        accepted = time.perf_counter()
        if response.status_code != 202:
            raise RuntimeError(
                f"the gateway refused a line: {response.status_code} {response.text}"
            )
        line_id = str(response.json()["messageId"])
        on_stream = await stream.answers.wait(line_id, self.patience)
        delivered = await self.receiver.answers.wait(line_id, self.patience)
        rounds.add(POST, accepted - started)
        rounds.add(STREAM, on_stream - started)
        rounds.add(WEBHOOK, delivered - started)

    async def amqp_turn(self, stream: StreamReader, rounds: Rounds) -> None:
        line_id, seconds = await self.mesh.turns.turn(self.forum)
        stamps = self.mesh.tracker.stamps[line_id]
        rounds.add(AMQP_SUBMIT, stamps[ACCEPTED] - stamps[START])
        rounds.add(AMQP_TURN, seconds)
        # Its answer reaches the stream and the webhook too: let it, so the next POST's
        # delivery does not queue behind it.
        await stream.answers.wait(line_id, self.patience)
        await self.receiver.answers.wait(line_id, self.patience)

"""``python -m bench`` (``make bench``): whole turns through the real mesh, beside the bus hop
and the raw aio-pika relay, in one run, in a throwaway vhost and database.

First the floor: a raw relay hop and one hop of the yoke bus, each with a warm-up, ``--events``
events over ``--conversations`` closed loops, then ``--serial`` events one at a time (the raw
side first, so the store's after-work cannot slow it). Then the five services start as real
processes and the turn phases run (:mod:`bench.mesh_bench`): latency, the HTTP gateway against
the AMQP door (:mod:`bench.gateway`), streaming (:mod:`bench.streaming`), tool rounds inline,
by a worker and over MCP (:mod:`bench.tool_rounds`), throughput (also with one and with two
processor replicas), growth, isolation and scale. The table is printed and written to
``bench/results.json``, and so is the before/after table against ``bench/baseline.json``
(:mod:`bench.compare`); both go into docs/bench.md too (:mod:`bench.readme`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench import bus_hop, compare, raw_relay, readme, report
from bench.child import PROFILE_ENV
from bench.cpu import servers_cpu, servers_delta
from bench.gateway import GatewayBench
from bench.loop import Side, closed_loop
from bench.mesh_bench import Figures, MeshBench
from bench.sandbox import Sandbox, management_url_for, sandbox
from bench.stats import Run, Samples, percentile, summary, table
from bench.streaming import StreamingBench
from bench.tool_rounds import ToolRoundsBench
from bench.tracing_cost import TracingBench
from yoke.core.logs import configure_logging
from yoke.core.redact import redact_url
from yoke.core.settings import Settings

EVENTS_ENV = "YOKE_BENCH_EVENTS"
# Connecting, declaring quorum queues and starting a relay process: generous, but not forever
# (a store that accepts connections and never answers would otherwise hang the run).
START_WITHIN = 120.0
RESULTS = readme.RESULTS

# Options with a full and a ``--quick`` default: (name, full, quick, type, help).
SIZES: tuple[tuple[str, float, float, type, str], ...] = (
    ("events", 2000, 200, int, "events per side in the hop's loaded phase"),
    ("conversations", 50, 10, int, "hop conversations, one event in flight each"),
    ("warmup", 200, 20, int, "unmeasured hop events per side first"),
    ("serial", 200, 50, int, "hop events sent one at a time after the loaded phase; 0 skips"),
    ("turns", 200, 20, int, "turns one at a time in one forum (turn latency)"),
    ("turn-warmup", 10, 3, int, "unmeasured turns before the latency phase"),
    ("gateway-turns", 200, 20, int, "turns one at a time through the HTTP gateway and AMQP"),
    ("stream-turns", 30, 5, int, "turns one at a time of a model streaming 50 pieces over 2 s"),
    ("tool-turns", 200, 20, int, "rounds of tool turns, one turn of each kind a round"),
    ("forums", 200, 10, int, "forums posting at once (throughput)"),
    ("forum-turns", 5, 2, int, "turns each forum posts, one after another (throughput)"),
    ("growth-lines", 5000, 200, int, "lines of history in the long forum (growth)"),
    ("growth-turns", 30, 8, int, "turns measured in the fresh and in the long forum (growth)"),
    ("isolation-forums", 20, 4, int, "ordinary forums (isolation)"),
    ("isolation-turns", 20, 6, int, "turns each ordinary forum posts (isolation)"),
    ("slow-seconds", 5.0, 2.0, float, "seconds the slow forum's model takes per step"),
    ("joins", 10000, 200, int, "idle forums joined (scale)"),
    ("scale-turns", 20, 3, int, "turns in one of them after the joins (scale)"),
    ("tracing-turns", 100, 10, int, "turns one at a time with tracing off, then on (tracing)"),
)


def progress(text: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {text}", flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench",
        description=(
            "Whole turns through the real mesh (the five services as processes, an echo "
            "agent): (1) turn latency, a line submitted on yoke.commands until the agent's "
            "answering forum line is seen on yoke.events, p50/p99, one turn at a time; "
            "(2) throughput with --forums forums posting at once, and the same with one and "
            "with two processor replicas sharing the shards; (3) growth, turn p50 in a "
            "fresh forum against one with --growth-lines lines of history; (4) isolation, "
            "p99 of ordinary forums while one forum's model takes --slow-seconds per step, "
            "against the same without it; (5) scale, RSS of each service with --joins joined "
            "idle forums, and how long the joins took; (6) where a turn's time and CPU go "
            "(per hop, per service, RabbitMQ/FerretDB/PostgreSQL) and the ratios to a raw "
            "aio-pika relay hop and one bus hop, measured first in the same run; (7) the "
            "HTTP gateway as a process beside the mesh, --gateway-turns turns one at a time: "
            "POST -> 202, POST -> the answer on an open /stream and POST -> its webhook "
            "delivery, against the AMQP door's Client.submit and its turn, interleaved; (8) "
            "tool rounds, --tool-turns rounds, each one turn of three fixture-script agents "
            "making one call: the built-in clock inline in the processor, a worker tool served "
            "by a yoke.tools.worker process, an MCP server's echo over stdio; the whole turn "
            "and the call line -> result line, against the inline one's; (9) streaming, "
            "--stream-turns turns one at a time through the gateway of an agent whose model "
            "streams 50 pieces over 2 s (fixture-stream-50-2): POST -> the first delta and "
            "POST -> the finished line on an open /stream; (10) tracing, --tracing-turns "
            "turns one at a time with the services restarted untraced, then tracing every "
            "span to an OTLP sink in the bench: CPU per turn off and on. Uses "
            "YOKE_AMQP_URL / YOKE_MONGODB_URL (and YOKE_RABBITMQ_MANAGEMENT_URL) when set; "
            "works in a fresh vhost and database that it removes afterwards. Prints a table "
            "with targets and pass/miss, writes it as JSON, asserts nothing."
        ),
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="every phase small (a smoke run of a minute or two); explicit sizes still win",
    )
    for name, full, quick, kind, text in SIZES:
        default = full
        if name == "events":
            default = int(os.environ.get(EVENTS_ENV, str(full)))
        parser.add_argument(
            f"--{name}",
            type=kind,
            default=None,
            help=f"{text} (default {default:g}, --quick {quick:g})",
        )
    phases = (
        "hop",
        "gateway",
        "streaming",
        "tools",
        "replicas",
        "growth",
        "isolation",
        "scale",
        "tracing",
    )
    for phase in phases:
        parser.add_argument(
            f"--skip-{phase}", action="store_true", help=f"leave the {phase} phase out"
        )
    parser.add_argument(
        "--mesh-shards",
        type=int,
        default=4,
        help="YOKE_SHARDS of the five services (default 4)",
    )
    parser.add_argument(
        "--join-concurrency",
        type=int,
        default=16,
        help="joins in flight at once (default 16)",
    )
    parser.add_argument(
        "--turn-timeout",
        type=float,
        default=60.0,
        help="seconds to wait for one turn's answer before giving up (default 60)",
    )
    parser.add_argument(
        "--results",
        type=Path,
        default=RESULTS,
        help=f"where to write the figures as JSON (default {RESULTS}, which also rewrites"
        " docs/bench.md's figures section)",
    )
    parser.add_argument(
        "--baseline",
        type=Path,
        default=compare.BASELINE,
        help=f"the figures to compare today's with (default {compare.BASELINE})",
    )
    parser.add_argument(
        "--shards",
        type=int,
        default=2,
        help="shard queues of the relay (YOKE_SHARDS of the bus service; default 2)",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=30.0,
        help="seconds to wait for one event's relayed copy before giving up (default 30)",
    )
    parser.add_argument(
        "--profile",
        metavar="DIR",
        help="run both relays under cProfile and write their stats into DIR (skews figures)",
    )
    args = parser.parse_args(argv)
    for name, full, quick, kind, _ in SIZES:
        attribute = name.replace("-", "_")
        if getattr(args, attribute) is None:
            default = int(os.environ.get(EVENTS_ENV, str(full))) if name == "events" else full
            setattr(args, attribute, kind(quick if args.quick else default))
    if args.profile:
        Path(args.profile).mkdir(parents=True, exist_ok=True)
    for name in (
        "events",
        "conversations",
        "shards",
        "turns",
        "gateway_turns",
        "stream_turns",
        "tool_turns",
        "forums",
        "forum_turns",
        "growth_turns",
        "isolation_forums",
        "isolation_turns",
        "joins",
        "scale_turns",
        "tracing_turns",
        "mesh_shards",
        "join_concurrency",
    ):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.warmup < 0 or args.serial < 0 or args.turn_warmup < 0 or args.growth_lines < 0:
        parser.error("--warmup, --serial, --turn-warmup and --growth-lines cannot be negative")
    return args


@dataclass
class Outcome:
    """What one side measured: its runs and the stage samples of driver and relay."""

    load: Run
    serial: Run | None
    samples: Samples
    servers: dict[str, float] = field(default_factory=dict)


async def measure_phase(
    side: Side, phase: str, label: str, conversations: list[str], total: int, patience: float
) -> tuple[Run, dict[str, float]]:
    driver, relay, servers = time.process_time(), side.relay_cpu(), servers_cpu()
    progress(f"{side.label} {phase}: {total} events, {len(conversations)} in flight")
    latencies, wall = await closed_loop(
        side, phase, conversations, total, patience=patience, progress=progress
    )
    run = Run(
        label=label,
        in_flight=len(conversations),
        latencies=latencies,
        wall=wall,
        driver_cpu=time.process_time() - driver,
        relay_cpu=side.relay_cpu() - relay,
    )
    progress(f"{label}: {run.rate:.0f} ev/s, p50 {run.ms(0.5):.2f} ms, p99 {run.ms(0.99):.2f} ms")
    return run, servers_delta(servers, servers_cpu())


async def measure(side: Side, args: argparse.Namespace) -> Outcome:
    conversations = [f"conv-{index:03d}" for index in range(args.conversations)]
    progress(f"{side.label}: starting the relay process")
    try:
        async with asyncio.timeout(START_WITHIN):
            await side.start()
    except BaseException as error:
        with contextlib.suppress(Exception):
            await side.stop()
        if isinstance(error, TimeoutError):
            raise RuntimeError(
                f"{side.label}: not ready within {START_WITHIN:.0f}s (do the broker and the"
                " store answer?)"
            ) from None
        raise
    try:
        if args.warmup:
            progress(f"{side.label} warmup: {args.warmup} events (not measured)")
            await closed_loop(
                side, "warmup", conversations, args.warmup, patience=args.timeout, progress=progress
            )
        load, servers = await measure_phase(
            side, "load", side.label, conversations, args.events, args.timeout
        )
        serial = None
        if args.serial:
            label = f"{side.label} (serial)"
            serial, _ = await measure_phase(
                side, "serial", label, conversations[:1], args.serial, args.timeout
            )
    finally:
        progress(f"{side.label}: stopping the relay process")
        samples = await side.stop()
    return Outcome(load=load, serial=serial, samples=samples, servers=servers)


def stage_lines(samples: Samples, names: list[str]) -> list[str]:
    lines = [f"  {'':<44}{'load p50':>10}{'load p99':>10}{'serial p50':>12}"]
    for name in names:
        load, serial = samples.get("load", name), samples.get("serial", name)
        lines.append(
            f"  {name:<44}{percentile(load, 0.5) * 1000:>10.2f}"
            f"{percentile(load, 0.99) * 1000:>10.2f}{percentile(serial, 0.5) * 1000:>12.2f}"
        )
    return lines


def raw_hop_cpu_ms(outcome: Outcome) -> float | None:
    """CPU per raw hop in the loaded phase, the relay's and the servers' (what a turn's "every
    process" figure counts, the driver left out on both sides); None when unmeasured."""
    seconds = outcome.load.relay_cpu + sum(outcome.servers.values())
    value = outcome.load.cpu_per_event_ms(seconds)
    return None if math.isnan(value) else round(value, 3)


def servers_line(outcome: Outcome) -> str:
    events = outcome.load.events
    parts = [
        f"{name} {seconds / events * 1000:.3f} ms" for name, seconds in outcome.servers.items()
    ]
    return ", ".join(sorted(parts)) or "n/a (servers not local)"


def breakdown(bus: Outcome, raw: Outcome) -> str:
    skipped = len(bus.samples.get("load", bus_hop.SKIPPED))
    lines = [
        "Where a bus hop's time goes (ms; relay stages use wall clocks across processes):",
        *stage_lines(
            bus.samples,
            [
                bus_hop.DRIVER_POST,
                bus_hop.TO_HANDLER,
                bus_hop.NOOP_INSERT,
                bus_hop.REPLY_POST,
                bus_hop.TO_RECEIVER,
            ],
        ),
        f"  {bus_hop.SKIPPED} (handled and skipped): {skipped} for {bus.load.events} hops",
        "The raw relay's publishes, for comparison (ms):",
        *stage_lines(raw.samples, [raw_relay.DRIVER_PUBLISH, raw_relay.RELAY_PUBLISH]),
        "Server CPU per event in the loaded phase (local processes, anyone's load included):",
        f"  bus hop:   {servers_line(bus)}",
        f"  raw relay: {servers_line(raw)}",
    ]
    return "\n".join(lines)


def machine_busy() -> str:
    """Say so when others already load the machine: the figures then move run to run."""
    cpus = os.cpu_count() or 1
    try:
        load = os.getloadavg()[0]
    except OSError:
        return ""
    progress(f"machine: {cpus} cpus, load average {load:.2f}")
    return f"load average was {load:.2f} on {cpus} cpus at the start" if load > cpus / 2 else ""


async def run(args: argparse.Namespace) -> None:
    # SIGTERM (a CI timeout, kill) cancels like Ctrl-C, so the vhost and database still go.
    task = asyncio.current_task()
    assert task is not None
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
    busy = machine_busy()
    settings = Settings()
    management = management_url_for(
        settings.amqp_url, os.environ.get("YOKE_RABBITMQ_MANAGEMENT_URL")
    )
    progress(
        f"servers: {redact_url(settings.amqp_url)} (management {management}), "
        f"{redact_url(settings.mongodb_url)}"
    )
    raw = bus = None
    results: Figures = {
        "machine": {"cpus": os.cpu_count(), "note": busy or None},
        "options": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
    }
    async with sandbox(settings.amqp_url, settings.mongodb_url, management) as box:
        progress(f"sandbox: vhost {box.vhost}, database {box.database}")
        raw = await measure(
            raw_relay.RawRelay(
                box, child_env(box, args), args.shards, bus_hop.typical_event_bytes()
            ),
            args,
        )
        if not args.skip_hop:
            bus = await measure(bus_hop.BusHop(box, child_env(box, args)), args)
        await measure_turns(box, management, args, results)
        progress("removing the vhost and the database")
    hop = raw.serial or raw.load
    results["rawRelay"] = {
        "load": {**report.run_figures(raw.load), "cpuMsPerEvent": raw_hop_cpu_ms(raw)},
        "serial": report.run_figures(raw.serial),
    }
    if bus is not None:
        results["busHop"] = {
            "load": report.run_figures(bus.load),
            "serial": report.run_figures(bus.serial),
        }
    report.finish(results, hop.ms(0.5), hop.ms(0.99), raw.load.rate)
    runs = [
        *(o.load for o in (bus, raw) if o is not None),
        *(o.serial for o in (bus, raw) if o is not None and o.serial is not None),
    ]
    print()
    print(table(runs))
    if bus is not None:
        print()
        print(breakdown(bus, raw))
        print()
        print(summary(bus.load, raw.load))
    print()
    print(report.render(results))
    results["comparison"], before_after = compare.comparison(results, args.baseline)
    print()
    print(before_after)
    report.write(results, args.results)
    print(f"\nfigures written to {args.results}")
    if args.results.resolve() == RESULTS and readme.write(results):
        print(f"and to the figures section of {readme.README}")
    if busy:
        print(f"note: {busy}; figures from a quiet machine compare better")
    if args.profile:
        print(f"relay profiles: {args.profile}/*.pstats (python -m pstats FILE)")


async def measure_turns(
    box: Sandbox, management: str, args: argparse.Namespace, results: Figures
) -> None:
    """The five services as processes, and each turn phase the options leave in."""
    mesh = MeshBench(box, management, args, progress)
    failed = True
    try:
        async with asyncio.timeout(START_WITHIN * 2):
            await mesh.start()
        results["turnLatency"], _ = await mesh.latency()
        if not args.skip_gateway:
            results["gateway"] = await GatewayBench(mesh).run()
        if not args.skip_streaming:
            results["streaming"] = await StreamingBench(mesh).run()
        if not args.skip_tools:
            results["tools"] = await ToolRoundsBench(mesh).run()
        results["throughput"] = await mesh.throughput()
        if not args.skip_replicas:
            results["replicas"] = await mesh.replicas()
        if not args.skip_growth:
            results["growth"] = await mesh.growth()
        if not args.skip_isolation:
            results["isolation"] = await mesh.isolation()
        if not args.skip_scale:
            results["scale"] = await mesh.scale()
        if not args.skip_tracing:  # last: it restarts the services, and leaves them traced
            results["tracing"] = await TracingBench(mesh).run()
        failed = False
    finally:
        codes = await mesh.stop()
        if failed or any(code != 0 for code in codes.values()):
            progress(f"services' logs (YOKE_LOG_LEVEL=WARNING): {mesh.log_dir}")


def child_env(box: Sandbox, args: argparse.Namespace) -> dict[str, str]:
    env = {
        **os.environ,
        "YOKE_AMQP_URL": box.amqp_url,
        "YOKE_MONGODB_URL": box.mongodb_url,
        "YOKE_SHARDS": str(args.shards),
        "YOKE_LOG_LEVEL": "WARNING",
    }
    if args.profile:
        env[PROFILE_ENV] = str(Path(args.profile).resolve())
    return env


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    configure_logging("bench", None, "WARNING")
    try:
        asyncio.run(run(args))
    except (KeyboardInterrupt, asyncio.CancelledError):
        print("bench interrupted", file=sys.stderr)
        return 130
    except RuntimeError as error:
        print(f"bench failed: {error}", file=sys.stderr)
        return 1
    except Exception as error:  # a server gone away mid-run, say: name it, no stack
        print(f"bench failed: {type(error).__name__}: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

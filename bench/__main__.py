"""``python -m bench`` (``make bench``): bus hop vs raw relay, in a throwaway vhost and database.

Each side gets the same shape: a warm-up, then ``--events`` events over ``--conversations``
closed loops (one in flight per conversation), then ``--serial`` events one at a time (the
hop's latency with nothing queued). The raw side runs first so the store's after-work
(PostgreSQL's vacuum and checkpoints) cannot slow it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from bench import bus_hop, raw_relay
from bench.child import PROFILE_ENV
from bench.cpu import servers_cpu, servers_delta
from bench.loop import Side, closed_loop
from bench.sandbox import Sandbox, management_url_for, sandbox
from bench.stats import Run, Samples, percentile, summary, table
from yoke.logs import configure_logging
from yoke.settings import Settings

EVENTS_ENV = "YOKE_BENCH_EVENTS"
# Connecting, declaring quorum queues and starting a relay process: generous, but not forever
# (a store that accepts connections and never answers would otherwise hang the run).
START_WITHIN = 120.0


def progress(text: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {text}", flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench",
        description=(
            "Events per second and latency through one hop of the yoke bus (a real Service "
            "that writes to MongoDB and posts a reply) against a raw aio-pika relay, measured "
            "in the same run. Uses YOKE_AMQP_URL / YOKE_MONGODB_URL (and "
            "YOKE_RABBITMQ_MANAGEMENT_URL) when set; works in a fresh vhost and database "
            "that it removes afterwards. Prints figures, asserts nothing."
        ),
    )
    parser.add_argument(
        "--events",
        type=int,
        default=int(os.environ.get(EVENTS_ENV, "2000")),
        help=f"events per side in the loaded phase (default ${EVENTS_ENV} or 2000)",
    )
    parser.add_argument(
        "--conversations",
        type=int,
        default=50,
        help="conversations, one closed loop and so one event in flight each (default 50)",
    )
    parser.add_argument(
        "--warmup", type=int, default=200, help="unmeasured events per side first (default 200)"
    )
    parser.add_argument(
        "--serial",
        type=int,
        default=200,
        help="events sent one at a time after the loaded phase; 0 skips it (default 200)",
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
    if args.profile:
        Path(args.profile).mkdir(parents=True, exist_ok=True)
    for name in ("events", "conversations", "shards"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1")
    if args.warmup < 0 or args.serial < 0:
        parser.error("--warmup and --serial cannot be negative")
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


def redact(url: str) -> str:
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
    return urlunsplit(parts._replace(netloc=netloc))


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
        f"servers: {redact(settings.amqp_url)} (management {management}), "
        f"{redact(settings.mongodb_url)}"
    )
    async with sandbox(settings.amqp_url, settings.mongodb_url, management) as box:
        progress(f"sandbox: vhost {box.vhost}, database {box.database}")
        raw = await measure(
            raw_relay.RawRelay(
                box, child_env(box, args), args.shards, bus_hop.typical_event_bytes()
            ),
            args,
        )
        bus = await measure(bus_hop.BusHop(box, child_env(box, args)), args)
        progress("removing the vhost and the database")
    runs = [bus.load, raw.load, *(r for r in (bus.serial, raw.serial) if r is not None)]
    print()
    print(table(runs))
    print()
    print(breakdown(bus, raw))
    print()
    print(summary(bus.load, raw.load))
    if busy:
        print(f"note: {busy}; figures from a quiet machine compare better")
    if args.profile:
        print(f"relay profiles: {args.profile}/*.pstats (python -m pstats FILE)")


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

"""Relays run in a child OS process, as a service would: the driver and the relay then get a
core each, for the bus and the raw side alike, and neither side's relay competes with the
driver's event loop.

Protocol on the child's stdout: ``ready`` once it consumes; after SIGTERM, one JSON line of its
samples, then exit. Its stderr goes straight to ours, so its errors show.
"""

from __future__ import annotations

import asyncio
import contextlib
import cProfile
import json
import os
import signal
import sys
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

from bench.cpu import process_cpu
from bench.stats import Samples

ROOT = Path(__file__).resolve().parents[1]
READY = "ready"
# Set by ``--profile DIR``: each relay writes cProfile stats there, to see where its CPU goes.
PROFILE_ENV = "BENCH_PROFILE_DIR"
# The report is one line with every sample: far beyond asyncio's 64 KiB default line limit.
REPORT_LIMIT = 256 * 1024 * 1024


class Child:
    """Parent side: one relay process, started until ready and stopped for its report."""

    def __init__(self, process: asyncio.subprocess.Process, module: str) -> None:
        self.process = process
        self.module = module

    @classmethod
    async def start(cls, module: str, env: dict[str, str], *, within: float = 90) -> Child:
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            module,
            cwd=ROOT,
            env=env,
            stdout=asyncio.subprocess.PIPE,
            limit=REPORT_LIMIT,
        )
        child = cls(process, module)
        try:
            async with asyncio.timeout(within):
                line = await child._readline()
        except BaseException:
            await child.kill()
            raise
        if line != READY:
            await child.kill()
            raise RuntimeError(f"{module} did not start (exit code {process.returncode})")
        return child

    @property
    def cpu(self) -> float:
        return process_cpu(self.process.pid)

    async def stop(self, *, within: float = 60) -> Samples:
        """SIGTERM, then the samples it reports as it exits."""
        with contextlib.suppress(ProcessLookupError):  # gone already (Ctrl-C reaches it too)
            self.process.send_signal(signal.SIGTERM)
        report: dict[str, Any] = {}
        try:
            async with asyncio.timeout(within):
                while line := await self._readline():
                    report = json.loads(line)
                await self.process.wait()
        except TimeoutError:
            await self.kill()
            raise RuntimeError(f"{self.module} did not stop within {within}s") from None
        if self.process.returncode != 0:
            raise RuntimeError(f"{self.module} exited with code {self.process.returncode}")
        return Samples.from_json(report)

    async def kill(self) -> None:
        if self.process.returncode is None:
            self.process.kill()
            await self.process.wait()

    async def _readline(self) -> str:
        assert self.process.stdout is not None
        return (await self.process.stdout.readline()).decode().strip()


def run_relay(name: str, main: Callable[[], Coroutine[Any, Any, None]]) -> None:
    """Child side: ``asyncio.run(main())``, under cProfile when the parent asks for it."""
    directory = os.environ.get(PROFILE_ENV)
    if not directory:
        asyncio.run(main())
        return
    profiler = cProfile.Profile(time.process_time)  # CPU, not waits: where the work goes
    profiler.enable()
    try:
        asyncio.run(main())
    finally:
        profiler.disable()
        profiler.dump_stats(Path(directory) / f"{name}.pstats")


def announce_ready() -> None:
    """Child side: tell the parent the relay consumes."""
    print(READY, flush=True)


def report(samples: Samples) -> None:
    """Child side: hand the samples to the parent as the last line before exiting."""
    print(json.dumps(samples.to_json()), flush=True)


def stop_on_signals(stopping: asyncio.Event) -> None:
    """Child side: SIGTERM (the parent) and SIGINT (Ctrl-C at a terminal) stop cleanly."""
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stopping.set)

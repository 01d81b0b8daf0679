"""A TCP proxy in its own process: a store server a test may freeze, kill and start again.

Tests must not stop the shared FerretDB (other runs use it), so services under fault get this
proxy's port instead. Freezing the proxy (SIGSTOP) behaves like a frozen server: connections are
still accepted by the kernel, but nothing comes back. Killing it resets every connection and
refuses new ones until it is started again on the same port.

    python -m tests.support.tcp_proxy LISTEN_PORT TARGET_HOST TARGET_PORT
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from tests.support.processes import ROOT


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        with contextlib.suppress(Exception):
            writer.close()


async def serve(listen_port: int, target_host: str, target_port: int) -> None:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            upstream_reader, upstream_writer = await asyncio.open_connection(
                target_host, target_port
            )
        except OSError:
            writer.close()
            return
        await asyncio.gather(_pipe(reader, upstream_writer), _pipe(upstream_reader, writer))

    server = await asyncio.start_server(handle, "127.0.0.1", listen_port, reuse_address=True)
    async with server:
        await server.serve_forever()


class ProxyProcess:
    """Controls one proxy process; ``start`` again after ``kill`` reuses the port."""

    def __init__(self, target_host: str, target_port: int, port: int, log_path: Path) -> None:
        self.target_host = target_host
        self.target_port = target_port
        self.port = port
        self.log_path = log_path
        self.popen: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 10) -> None:
        with self.log_path.open("ab") as log:
            self.popen = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "tests.support.tcp_proxy",
                    str(self.port),
                    self.target_host,
                    str(self.target_port),
                ],
                cwd=ROOT,
                stdout=log,
                stderr=log,
            )
        deadline = time.monotonic() + timeout
        while not _answers(self.port):
            if self.popen.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"TCP proxy on :{self.port} did not start; see {self.log_path}")
            time.sleep(0.05)

    def freeze(self) -> None:
        self._signal(signal.SIGSTOP)

    def thaw(self) -> None:
        self._signal(signal.SIGCONT)

    def kill(self) -> None:
        if self.popen is not None and self.popen.poll() is None:
            os.kill(self.popen.pid, signal.SIGCONT)  # a frozen process dies only once resumed
            self.popen.kill()
            self.popen.wait(10)

    def _signal(self, signum: signal.Signals) -> None:
        assert self.popen is not None and self.popen.poll() is None, "proxy is not running"
        os.kill(self.popen.pid, signum)


def _answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


if __name__ == "__main__":
    asyncio.run(serve(int(sys.argv[1]), sys.argv[2], int(sys.argv[3])))

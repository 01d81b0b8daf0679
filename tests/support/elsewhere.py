"""Run a mesh service as if on another machine: its replica document names another host.

    python -m tests.support.elsewhere processor

Replicas on one machine see at once that a killed neighbour's process is gone; across
machines they can only wait out its heartbeats. A replica run through this wrapper is one the
others must wait out, so a test can kill -9 it and measure the cross-machine takeover.
"""

from __future__ import annotations

import importlib
import socket
import sys

from yoke.runtime.service import run_service


def main() -> None:
    name = sys.argv[1]
    socket.gethostname = lambda: "elsewhere.invalid"
    app = importlib.import_module(f"services.{name}.app")
    run_service(name, app.register)


if __name__ == "__main__":
    main()

"""``python -m bench.tool_worker TOOL``: the bench's worker tool, a process of its own as an
operator's worker is, written with :func:`yoke.tools.worker.serve` (the SDK's worker).

It answers each call with its input's ``text``, so the bench can tell its answer from an error
result. It connects as the URL in ``YOKE_TOOL_AMQP_URL`` says (the tool's user, the mesh's
vhost: kept off the command line, where ``ps`` would show the password) and stops on SIGTERM
once the calls in hand are answered.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys

from yoke.core.logs import configure_logging
from yoke.core.models import ToolCallRequest
from yoke.tools.worker import serve

URL_ENV = "YOKE_TOOL_AMQP_URL"


async def echo(call: ToolCallRequest) -> str:
    return str(call.input.get("text", ""))


async def run(tool: str) -> None:
    stopping = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stopping.set)
    await serve(os.environ[URL_ENV], tool, echo, stopping=stopping)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m bench.tool_worker TOOL", file=sys.stderr)
        return 2
    configure_logging("bench-tool-worker", None, "WARNING")
    asyncio.run(run(argv[0]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""The worker tool of the tools scenario: the SDK's ``serve``, recording each run it starts.

    python -m tests.chaos.tool_worker --url amqp://tool-NAME:PASSWORD@HOST/VHOST --tool NAME \
        --runs FILE [--seconds 1]

It takes ``--seconds`` over each call, so that a ``kill -9`` finds calls in its hands: those
come back (at least once), and the harness allows a second run of a call only when a crash came
between the two (tests/chaos/tools.py).
"""

from __future__ import annotations

import argparse
import asyncio
import os

from tests.chaos.runs import ToolRun, record_run
from yoke.core.models import ToolCallRequest
from yoke.tools.worker import serve


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--url", required=True)
    parser.add_argument("--tool", required=True)
    parser.add_argument("--runs", required=True)
    parser.add_argument("--seconds", type=float, default=1.0)
    args = parser.parse_args()

    async def handle(call: ToolCallRequest) -> str:
        tag = str(call.input.get("tag", "?"))
        run = ToolRun(
            tag=tag,
            tool=args.tool,
            pid=os.getpid(),
            call_id=call.call_id,
            idempotency_key=call.idempotency_key,
        )
        record_run(args.runs, run)
        await asyncio.sleep(args.seconds)
        return f"ran {tag}"

    asyncio.run(serve(args.url, args.tool, handle))


if __name__ == "__main__":
    main()

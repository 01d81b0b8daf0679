"""Run an egress replica that forwards each agent line late.

    YOKE_TEST_EGRESS_DELAY=0.3 python -m tests.support.slow_egress

Each monologue line waits ``YOKE_TEST_EGRESS_DELAY`` seconds (default 0) before it is
forwarded, so the lines of the monologues this replica owns fall behind those another replica
forwards: what a busy or distant replica does. The product modules know nothing of this.
"""

from __future__ import annotations

import asyncio
import os

from services.egress.app import Egress, register
from yoke.core.models import MessagePosted
from yoke.runtime.service import run_service


def main() -> None:
    delay = float(os.environ.get("YOKE_TEST_EGRESS_DELAY", "0"))
    original = Egress.forward_agent_text

    async def forward_agent_text(self: Egress, event: MessagePosted) -> None:
        await asyncio.sleep(delay)
        await original(self, event)

    Egress.forward_agent_text = forward_agent_text  # type: ignore[method-assign]
    run_service("egress", register)


if __name__ == "__main__":
    main()

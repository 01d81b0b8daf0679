"""What a tool ran, as the tool itself saw it: one line a run, appended to a file of the run's.

The MCP server (tests/chaos/tool_server.py) and the worker (tests/chaos/tool_worker.py) append
a line each time they start a call's work, before doing it: so a run cut short by a kill still
counts, and the harness counts runs per call at the tool side, not from the mesh's own story.
Each line is one ``write`` on a file opened for appending (atomic for lines this short), so
the two processors' stdio servers may share one file.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from pydantic import BaseModel, Field

# The environment variable naming the file (a stdio server gets it through ``--env``).
RUNS_VARIABLE = "CHAOS_RUNS"


class ToolRun(BaseModel):
    tag: str  # the call's input ``tag``: which call of which round of which agent
    tool: str
    pid: int
    call_id: str | None = None  # a worker's: the callId it was given
    idempotency_key: str | None = None
    at: float = Field(default_factory=time.time)  # when it started (wall clock)


def record_run(path: str, run: ToolRun) -> None:
    line = (run.model_dump_json(exclude_none=True) + "\n").encode()
    descriptor = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(descriptor, line)
    finally:
        os.close(descriptor)


def read_runs(path: Path) -> list[ToolRun]:
    if not path.exists():
        return []
    runs = []
    for raw in path.read_text().splitlines():
        try:
            runs.append(ToolRun.model_validate(json.loads(raw)))
        except ValueError:
            continue  # a line cut short by a kill -9 mid-write: not a run anyone saw
    return runs

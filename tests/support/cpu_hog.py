"""A plugin tool that takes CPU and never awaits: a plugin written carelessly, or with ill will.

    plugin_path(directory)

writes the metadata of a distribution ``yoke-test-cpu-hog`` into ``directory``, whose one
``yoke.tools`` entry point is ``cpu_hog = tests.support.cpu_hog:TOOLS``: a process started with
``directory`` on its ``PYTHONPATH`` loads it as it would a plugin installed beside it (the
product modules know nothing of this). ``cpu_hog`` computes for ``seconds`` in an ``async``
function without one ``await``; its timeout is :data:`HOG_TIMEOUT`.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from pydantic import BaseModel, Field

from yoke.tools.base import Tool, ToolContext

HOG_TIMEOUT = 1.0


class BurnInput(BaseModel):
    seconds: float = Field(ge=0, le=60, description="How long to compute")


async def _burn(arguments: BurnInput, _: ToolContext) -> str:
    end = time.monotonic() + arguments.seconds
    while time.monotonic() < end:
        pass
    return f"burned {arguments.seconds:g} s"


TOOLS = [Tool("cpu_hog", "Computes for a while.", BurnInput, _burn, timeout=HOG_TIMEOUT)]


def plugin_path(directory: Path) -> str:
    """A ``PYTHONPATH`` on which ``cpu_hog`` is an installed plugin (and the rest as it was)."""
    info = directory / "yoke_test_cpu_hog-0.1.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: yoke-test-cpu-hog\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[yoke.tools]\ncpu_hog = tests.support.cpu_hog:TOOLS\n")
    return os.pathsep.join(filter(None, [str(directory), os.environ.get("PYTHONPATH")]))

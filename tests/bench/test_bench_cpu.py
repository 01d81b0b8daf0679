"""The bench's CPU readings from /proc count what a server's exited workers spent.

PostgreSQL serves each connection from a backend of its own; FerretDB's pool closes some
between two readings, and a sum over the processes alive at each reading went negative
(-5.8 ms a turn at 200 forums). The CPU of a reaped child is in its parent's cutime/cstime.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from bench.cpu import process_cpu

BURN = "import time\nend = time.process_time() + 0.4\nwhile time.process_time() < end: pass\n"


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc")
def test_a_reaped_child_s_cpu_counts_for_its_parent() -> None:
    before = process_cpu(os.getpid())
    subprocess.run([sys.executable, "-c", BURN], check=True)  # waited for: reaped by us
    spent = process_cpu(os.getpid()) - before
    assert spent >= 0.3, f"{spent:.2f} s counted for a child that burned 0.4 s"

"""What the model reads when a call ends without its tool's answer.

Each is the ``output`` of the error result that stands in for the answer: it says what happened
to the call, which is all the model can act on.
"""

from __future__ import annotations

from yoke.runtime.calls.records import OpenCall

# How a call cut short by a crash ends (invariant 15: never run a second time).
CUT_SHORT = "the run was cut short by a restart of the process running it; it was not run again"


def timeout_text(call: OpenCall) -> str:
    return f"{call.tool} gave no answer within {call.timeout_seconds:g} s"


def overdue_text(call: OpenCall) -> str:
    """A call past its deadline: a worker's is late; an in-process or MCP call's own timeout
    would have ended it, so what ran it stopped."""
    if call.source == "worker":
        return timeout_text(call)
    return f"{timeout_text(call)}: {CUT_SHORT}"


def cut_short_text(tool: str) -> str:
    return f"{tool}: {CUT_SHORT}"


def no_decision_text(call: OpenCall) -> str:
    return f"no decision within {call.approval_timeout_seconds or 0:g} s"

"""The table of what a line does while the agent is busy (yoke.runtime.while_busy): each mode of
``whileBusy`` against each situation, and what the policy decides.

Pure: no broker, no store. That the processor does what the policy says is pinned by
tests/processor/test_while_busy.py and tests/runtime/test_in_flight.py.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest

from yoke.core.models import Message, MessageMeta, Part, TextPart, ToolCallPart, ToolResultPart
from yoke.runtime.instances import ProcessorState, Progress, StopMark
from yoke.runtime.join_config import WhileBusy
from yoke.runtime.while_busy import ArrivalEffect, LineKind, WhileBusyPolicy, line_kind

MODES: tuple[WhileBusy, ...] = ("queue", "coalesce", "interrupt")
MONOLOGUE = "m"


@dataclass(frozen=True)
class Call:
    """A model call in flight: its trigger, and the newest line its prompt holds."""

    trigger_seq: int
    covered_seq: int


def line(seq: int, text: str = "", *parts: Part, role: str = "user", **meta: Any) -> Message:
    return Message(
        id=f"line-{seq}",
        conversation_id=MONOLOGUE,
        seq=seq,
        author_actor_id="agent" if role == "agent" else "alice",
        role="agent" if role == "agent" else "user",
        parts=[TextPart(text=text)] if text else list(parts),
        meta=MessageMeta(**meta),
    )


# --- what a line does as it arrives --------------------------------------------------------

# situation: (what arrives, its seq, the call in flight) -> what it does, by mode
ARRIVALS: dict[str, tuple[LineKind, int, Call | None, dict[WhileBusy, ArrivalEffect]]] = {
    "a person's line the call was not shown": (
        "person",
        7,
        Call(5, 6),
        {"queue": "waits", "coalesce": "waits", "interrupt": "interrupts"},
    ),
    "a person's line the call was shown (a burst it answers, or a redelivery)": (
        "person",
        6,
        Call(5, 6),
        {"queue": "waits", "coalesce": "waits", "interrupt": "waits"},
    ),
    "a person's line while the step gets ready (no call yet: asked again when it starts)": (
        "person",
        7,
        None,
        {"queue": "waits", "coalesce": "waits", "interrupt": "waits"},
    ),
    "a person's /stop after the call's trigger": (
        "stop",
        7,
        Call(5, 9),
        {"queue": "stops", "coalesce": "stops", "interrupt": "stops"},
    ),
    "a person's /stop while the step gets ready": (
        "stop",
        7,
        None,
        {"queue": "stops", "coalesce": "stops", "interrupt": "stops"},
    ),
    "a redelivered /stop, older than the call's trigger": (
        "stop",
        4,
        Call(5, 5),
        {"queue": "waits", "coalesce": "waits", "interrupt": "waits"},
    ),
    "an agent's line, a tool result, an instruction, another slash command": (
        "other",
        7,
        Call(5, 5),
        {"queue": "waits", "coalesce": "waits", "interrupt": "waits"},
    ),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("situation", list(ARRIVALS))
def test_what_an_arriving_line_does(mode: WhileBusy, situation: str) -> None:
    kind, seq, call, expected = ARRIVALS[situation]
    assert WhileBusyPolicy(mode).on_arrival(kind, seq, call) == expected[mode]


def copied(text: str, **meta: Any) -> Message:
    """A monologue line copied from the forum (a person's, unless ``meta`` says otherwise)."""
    fields: dict[str, Any] = {"source_conversation_id": "forum", "source_message_id": "f", **meta}
    return line(4, text, **fields)


@pytest.mark.parametrize(
    ("arriving", "kind"),
    [
        (copied("hello"), "person"),
        (copied("/stop"), "stop"),
        (copied("  /stop now "), "stop"),
        (copied("/stopwatch"), "other"),  # a slash command, but not /stop
        (copied("/status"), "other"),  # answered in its turn by the processor itself
        (copied("/stop", agent_hops=1), "other"),  # another agent's line
        (copied("/stop", instruction="follow-up"), "other"),
        (copied("/stop", carried_from="old-monologue"), "other"),
        (line(4, "hello"), "other"),  # not copied from the forum
    ],
)
def test_only_people_interrupt_and_stop(arriving: Message, kind: LineKind) -> None:
    assert line_kind(arriving) == kind


# --- which lines a step answers ------------------------------------------------------------


def answered(seq: int) -> Progress:
    return Progress(conversation_id=MONOLOGUE, seq=seq)


# A step's trigger (3) answered nothing yet beyond 2; an answer to an earlier line (4) was
# stored after a burst began (5, 6: another agent's line, then a person's).
TRIGGER = line(3, "first question")
BURST = [
    line(1, "hello"),
    line(2, "hi there", role="agent"),
    TRIGGER,
    line(4, "an answer to hello", role="agent"),
    line(5, "an agent chimes in", agent_hops=1),
    line(6, "second thought"),
]
# A tool round (call 2, results 4) while a person spoke (3); the results line is the trigger.
CALL = ToolCallPart(call_id="c1", name="clock", input={})
RESULTS = line(4, "", ToolResultPart(call_id="c1", name="clock", output="noon"))
ROUND = [line(1, "what time is it?"), line(2, "", CALL, role="agent"), line(3, "and?"), RESULTS]


def reply(policy: WhileBusyPolicy) -> str:
    target = policy.reply_to(TRIGGER, BURST, answered(2))
    return f"{target.id} hops {target.meta.agent_hops}"


def reply_during_round(policy: WhileBusyPolicy) -> str | None:
    target = policy.reply_to(TRIGGER, BURST, answered(2), round_open=True)
    return None if target is None else target.id


def round_reply(policy: WhileBusyPolicy) -> str:
    return policy.reply_to(RESULTS, ROUND, answered(1)).id


def reply_past_a_slash_command(policy: WhileBusyPolicy) -> str:
    return policy.reply_to(TRIGGER, [TRIGGER, line(4, "/status")], answered(2)).id


def skipped_after_a_burst(policy: WhileBusyPolicy) -> bool:
    state = ProcessorState(monologue_id=MONOLOGUE, agent_participant_id="p", answered=answered(6))
    return policy.answered_before(state, line(5, "burst line"))


def skipped_before_a_stop(policy: WhileBusyPolicy) -> bool:
    stop = StopMark(conversation_id=MONOLOGUE, seq=6, by="bob")
    state = ProcessorState(monologue_id=MONOLOGUE, agent_participant_id="p", stopped=stop)
    return policy.answered_before(state, line(5, "before the stop"))


def prompt_order(policy: WhileBusyPolicy) -> list[int]:
    return [each.seq for each in policy.prompt(BURST, answered(2), TRIGGER)]


def reads(policy: WhileBusyPolicy) -> str:
    return "to the newest line" if policy.reads_to_newest else "to the trigger"


# situation: what the policy is asked -> its answer, by mode
STEPS: dict[str, tuple[Callable[[WhileBusyPolicy], object], dict[WhileBusy, object]]] = {
    "the window a step reads": (
        reads,
        {
            "queue": "to the trigger",
            "coalesce": "to the newest line",
            "interrupt": "to the newest line",
        },
    ),
    # Each on its own, or the newest of the burst, as near to people as its nearest.
    "the line a reply answers": (
        reply,
        {"queue": "line-3 hops 0", "coalesce": "line-6 hops 0", "interrupt": "line-6 hops 0"},
    ),
    "a line sent while a tool round is open": (
        reply_during_round,
        {"queue": None, "coalesce": None, "interrupt": None},
    ),
    "the reply to a round's results, a line sent meanwhile": (
        round_reply,
        {"queue": "line-4", "coalesce": "line-3", "interrupt": "line-3"},
    ),
    "a burst of only a slash command": (
        reply_past_a_slash_command,
        {"queue": "line-3", "coalesce": "line-3", "interrupt": "line-3"},
    ),
    "the step of a line a burst's reply was shown": (
        skipped_after_a_burst,
        {"queue": False, "coalesce": True, "interrupt": True},
    ),
    "the step of a line a /stop came after": (
        skipped_before_a_stop,
        {"queue": True, "coalesce": True, "interrupt": True},
    ),
    # The burst goes last, so the prompt does not end with the agent's earlier answer.
    "the prompt's order": (
        prompt_order,
        {
            "queue": [1, 2, 3, 4, 5, 6],
            "coalesce": [1, 2, 4, 3, 5, 6],
            "interrupt": [1, 2, 4, 3, 5, 6],
        },
    ),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("situation", list(STEPS))
def test_which_lines_a_step_answers(mode: WhileBusy, situation: str) -> None:
    ask, expected = STEPS[situation]
    assert ask(WhileBusyPolicy(mode)) == expected[mode]


def test_a_line_past_the_hop_cap_is_not_what_a_burst_answers() -> None:
    capped = [TRIGGER, line(4, "an agent again", agent_hops=4)]
    assert WhileBusyPolicy("coalesce", hop_cap=4).reply_to(TRIGGER, capped, answered(2)).seq == 3
    assert WhileBusyPolicy("coalesce", hop_cap=5).reply_to(TRIGGER, capped, answered(2)).seq == 4

"""What a line does while the agent is busy: the join's ``whileBusy``, decided here only.

A step is pending for a monologue (its lane busy) and a line arrives (docs/architecture.md,
"While the agent is busy"). :class:`WhileBusyPolicy` answers both questions that raises:

- what the line does now, as its delivery arrives (:meth:`WhileBusyPolicy.on_arrival`): it
  waits its turn, it interrupts the model call in flight (a person's line under ``interrupt``),
  or it stops the agent (a person's ``/stop``, whatever the mode);
- which lines a step answers when its turn comes: under ``queue`` each line on its own, the
  step reading up to its trigger (invariant 1); under ``coalesce`` and ``interrupt`` every
  unanswered line at once, read up to the newest and answered in reply to it, the steps of the
  lines it covered calling no model; in every mode, a line sent while a tool round is open is
  answered in the reply to the round's results (invariant 10), and the lines a stop came after
  are not answered.

Pure: it reads what it is given (the mode, the lines, the progress a state records) and
decides; the processor's step and its model call, and the registry of calls in flight
(:mod:`yoke.runtime.in_flight`), do what it says. Its table is
tests/runtime/test_while_busy_policy.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol, overload

from yoke.core.ids import SYSTEM_ACTOR_ID
from yoke.core.models import Message
from yoke.core.slash import TAKEOVER, is_stop, slash_command
from yoke.llm.prompting import unanswered_last
from yoke.runtime.instances import DEFAULT_HOP_CAP, ProcessorConfig, ProcessorState, Progress
from yoke.runtime.join_config import WhileBusy

# What a line is to a busy agent: a person's line, a person's ``/stop``, or anything else (an
# agent's line, a tool result, an instruction, a person's other slash command).
LineKind = Literal["person", "stop", "other"]
# What it does as it arrives: nothing now (it waits its turn), cancel the model call in flight
# (it is answered with the lines that call was shown), or stop (the earlier lines' steps answer
# nothing, and the call in flight for one of them is cancelled).
ArrivalEffect = Literal["waits", "interrupts", "stops"]


class Shown(Protocol):
    """The model call in flight, as an arrival sees it: its trigger and the newest line of its
    prompt (past the trigger when it answers a burst)."""

    @property
    def trigger_seq(self) -> int: ...

    @property
    def covered_seq(self) -> int: ...


def is_person_line(line: Message) -> bool:
    """A person's line copied from the forum: never an agent's (agentHops above 0), a tool
    result, a nudge or steering (instructions) or context a compaction carried."""
    meta = line.meta
    return (
        line.role == "user"
        and line.type == "message"
        and meta.agent_hops == 0
        and meta.source_message_id is not None
        and not meta.instruction
        and not meta.carried_from
        and line.author_actor_id != SYSTEM_ACTOR_ID
        and bool(line.text)
    )


def is_stop_line(line: Message) -> bool:
    """A person's ``/stop``."""
    return is_person_line(line) and is_stop(line.text)


def _is_takeover(text: str) -> bool:
    command = slash_command(text)
    return command is not None and command.name == TAKEOVER


def is_slash_command(line: Message) -> bool:
    """A person's ``/command`` (:func:`yoke.core.slash.slash_command` decides what one is):
    answered by the processor itself, never by the model."""
    return line.meta.agent_hops == 0 and slash_command(line.text) is not None


def line_kind(line: Message) -> LineKind:
    """What ``line`` is to a busy agent: only people interrupt and stop, and a person's other
    slash commands wait their turn like an agent's lines."""
    if not is_person_line(line):
        return "other"
    if is_stop(line.text) or _is_takeover(line.text):
        return "stop"  # a takeover stops the agent as a stop does, then holds the forum
    return "other" if is_slash_command(line) else "person"


def answered_through(answered: Progress | None, line: Message) -> int:
    """The seq in the line's conversation up to which every line has been answered."""
    if answered is not None and answered.conversation_id == line.conversation_id:
        return answered.seq
    return line.seq - 1


@dataclass(frozen=True)
class WhileBusyPolicy:
    """A join's ``whileBusy`` and the lines its model answers (below its ``hop_cap``)."""

    mode: WhileBusy = "queue"
    hop_cap: int = DEFAULT_HOP_CAP

    @classmethod
    def of(cls, config: ProcessorConfig) -> WhileBusyPolicy:
        return cls(config.while_busy, config.hop_cap)

    # --- a line arriving while a step is pending --------------------------------------------

    def on_arrival(self, kind: LineKind, seq: int, call: Shown | None) -> ArrivalEffect:
        """What a line arriving at ``seq`` does to ``call``, the model call in flight (None: the
        step is still getting ready; the registry asks again when its call starts).

        By seq, never by arrival order: a redelivered line is older than what the call was
        shown, so it interrupts nothing, and a redelivered stop stops nothing twice."""
        if kind == "stop":
            return "stops" if call is None or call.trigger_seq < seq else "waits"
        if kind == "person" and self.mode == "interrupt":
            return "interrupts" if call is not None and seq > call.covered_seq else "waits"
        return "waits"

    # --- which lines a step answers ----------------------------------------------------------

    @property
    def reads_to_newest(self) -> bool:
        """Whether a step reads up to the conversation's newest line (to answer the burst)
        rather than up to its trigger."""
        return self.mode != "queue"

    def wants_answer(self, line: Message) -> bool:
        """A user text line the model answers: not a slash command, not past the hop cap."""
        return (
            line.type == "message"
            and bool(line.text)
            and not is_slash_command(line)
            and line.meta.agent_hops < self.hop_cap
        )

    def answered_before(self, state: ProcessorState, line: Message) -> bool:
        """Whether the step of ``line`` answers nothing: a person's ``/stop`` came after it, or
        a model call answering a burst was shown it. Under ``queue`` every line is answered on
        its own, so a line set aside and replayed after later lines were answered still is."""
        if state.stopped is not None and state.stopped.covers(line):
            return True
        return self.reads_to_newest and state.answered is not None and state.answered.covers(line)

    @overload
    def reply_to(
        self,
        line: Message,
        transcript: list[Message],
        answered: Progress | None,
        *,
        round_open: Literal[False] = False,
    ) -> Message: ...

    @overload
    def reply_to(
        self,
        line: Message,
        transcript: list[Message],
        answered: Progress | None,
        *,
        round_open: bool,
    ) -> Message | None: ...

    def reply_to(
        self,
        line: Message,
        transcript: list[Message],
        answered: Progress | None,
        *,
        round_open: bool = False,
    ) -> Message | None:
        """The line a step's reply answers, ``line`` unless it answers a burst: then the newest
        line of ``transcript`` not yet ``answered`` that the model answers, its ``agentHops``
        the lowest of the burst (a person in it is never capped: invariant 6). None while a
        tool round is open (``round_open``): the reply to its results answers the line."""
        if round_open:
            return None
        if not self.reads_to_newest or not transcript:
            return line
        since = answered_through(answered, transcript[-1])
        wanted = [
            each
            for each in transcript
            if each.seq > since and each.role == "user" and self.wants_answer(each)
        ]
        if not wanted:
            return line
        target = wanted[-1].model_copy(deep=True)
        target.meta.agent_hops = min(each.meta.agent_hops for each in wanted)
        return target

    def prompt(
        self, transcript: list[Message], answered: Progress | None, trigger: Message
    ) -> list[Message]:
        """The transcript as the model reads it: a burst goes last (some of what the step read
        was written after the burst began: :func:`yoke.llm.prompting.unanswered_last`)."""
        if not self.reads_to_newest:
            return transcript
        return unanswered_last(transcript, answered_through(answered, trigger))

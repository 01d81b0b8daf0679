"""What chaos found: every person line answered exactly once and in order, and the table.

The forums as stored are the truth. A person line counts once it is stored or the door said
"accepted"; its answer is the agent's forum line whose ``meta.inReplyTo`` names it. The tools
scenario adds its own accounting of calls, results and runs (tests/chaos/tools.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from tests.chaos.load import Line, parse_text
from tests.chaos.tools import ToolAccounting
from yoke.core.models import Message

FaultKind = Literal["kill", "broker", "store"]


@dataclass
class FaultRecord:
    kind: FaultKind
    what: str
    started: float
    ended: float  # when the fault was over (killed / server back); recovery counts from here
    recovered: float | None = None  # first answer to a line first typed after ``ended``

    @property
    def recovery(self) -> float | None:
        return None if self.recovered is None else self.recovered - self.ended


@dataclass
class Accounting:
    lines: int = 0
    lost: list[str] = field(default_factory=list)
    duplicated: list[str] = field(default_factory=list)
    out_of_order: list[str] = field(default_factory=list)
    never_accepted: list[str] = field(default_factory=list)
    rejected: list[str] = field(default_factory=list)
    notices: list[str] = field(default_factory=list)


def account(lines: list[Line], forums: dict[str, list[Message]]) -> Accounting:
    """Match stored forum lines against what the people typed."""
    result = Accounting()
    typed = {(line.forum, line.index): line for line in lines}
    forum_numbers = {line.forum_id: line.forum for line in lines}
    stored_ids: dict[str, Line] = {}
    answers: dict[str, list[Message]] = {}
    for forum_id, messages in forums.items():
        person_seen: dict[int, Message] = {}
        for message in messages:
            if message.role == "user":
                parsed = parse_text(message.text)
                line = typed.get(parsed) if parsed else None
                if line is None:
                    continue
                if line.index in person_seen and person_seen[line.index].id != message.id:
                    result.duplicated.append(
                        f"{line.describe()} stored twice: ids {person_seen[line.index].id} "
                        f"(seq {person_seen[line.index].seq}) and {message.id} (seq {message.seq})"
                    )
                person_seen[line.index] = message
                line.message_id = line.message_id or message.id
                stored_ids[message.id] = line
            elif message.type == "notice":
                result.notices.append(f"forum {forum_numbers.get(forum_id)}: {message.text!r}")
            elif message.meta.in_reply_to:
                answers.setdefault(message.meta.in_reply_to, []).append(message)
        number = forum_numbers.get(forum_id, -1)
        _check_order(number, "person line", [(m.seq, i) for i, m in person_seen.items()], result)
        firsts = [
            (replies[0].seq, stored_ids[line_id].index)
            for line_id, replies in answers.items()
            if line_id in stored_ids and stored_ids[line_id].forum_id == forum_id
        ]
        _check_order(number, "the answer to line", firsts, result)

    for line in lines:
        if line.rejected:
            result.rejected.append(f"{line.describe()}: {line.rejected}")
            continue
        if line.message_id is None:
            result.never_accepted.append(f"{line.describe()} after {line.attempts} attempts")
            continue
        result.lines += 1
        replies = answers.get(line.message_id, [])
        if line.message_id not in stored_ids:
            result.lost.append(f"{line.describe()}: accepted but not in its forum")
        elif not replies:
            result.lost.append(f"{line.describe()}: never answered")
        elif len(replies) > 1:
            seqs = ", ".join(f"{m.id} (seq {m.seq})" for m in replies)
            result.duplicated.append(f"{line.describe()} answered {len(replies)} times: {seqs}")
    return result


def _check_order(
    forum: int, noun: str, seq_and_index: list[tuple[int, int]], result: Accounting
) -> None:
    """In seq order, each entry must be for a later line than every one before it."""
    highest: tuple[int, int] | None = None
    for seq, index in sorted(seq_and_index):
        if highest is not None and index < highest[1]:
            result.out_of_order.append(
                f"forum {forum}: {noun} {index} (seq {seq}) comes after "
                f"{noun} {highest[1]} (seq {highest[0]})"
            )
        if highest is None or index > highest[1]:
            highest = (seq, index)


@dataclass
class Report:
    forums: int
    seconds: float
    accounting: Accounting
    faults: list[FaultRecord]
    problems: list[str] = field(default_factory=list)  # beyond lost / dup / order
    notes: list[str] = field(default_factory=list)
    tools: ToolAccounting | None = None

    @property
    def ok(self) -> bool:
        a = self.accounting
        return not (
            a.lost
            or a.duplicated
            or a.out_of_order
            or a.rejected
            or a.never_accepted
            or self.problems
            or (self.tools is not None and not self.tools.ok)
        )

    def table(self) -> str:
        a = self.accounting
        recoveries = [f.recovery for f in self.faults]
        if any(r is None for r in recoveries):
            longest = "never"
        else:
            longest = f"{max((r or 0.0) for r in recoveries):.1f} s" if recoveries else "-"
        header = [
            "lines",
            "kills",
            "broker restarts",
            "store outages",
            "lost",
            "duplicated",
            "out of order",
            "longest recovery",
        ]
        row = [
            str(a.lines),
            str(sum(f.kind == "kill" for f in self.faults)),
            str(sum(f.kind == "broker" for f in self.faults)),
            str(sum(f.kind == "store" for f in self.faults)),
            str(len(a.lost)),
            str(len(a.duplicated)),
            str(len(a.out_of_order)),
            longest,
        ]
        widths = [max(len(h), len(c)) for h, c in zip(header, row, strict=True)]
        return "\n".join(
            "| " + " | ".join(c.rjust(w) for c, w in zip(cells, widths, strict=True)) + " |"
            for cells in (header, ["-" * w for w in widths], row)
        )

    def render(self) -> str:
        a = self.accounting
        parts = [
            f"chaos: {self.forums} forums, {self.seconds:.0f} s, "
            + ("OK" if self.ok else "FAILED"),
            self.table(),
            *(["", "tools:", self.tools.table()] if self.tools is not None else []),
            "",
            "faults (recovery: from the fault's end until a line typed after it is answered):",
        ]
        for fault in self.faults:
            recovery = "never" if fault.recovery is None else f"{fault.recovery:.1f} s"
            parts.append(
                f"  {fault.what:<44} lasted {fault.ended - fault.started:5.1f} s, "
                f"recovery {recovery}"
            )
        tool_sections = self.tools.sections() if self.tools is not None else []
        for title, items in (
            *tool_sections,
            ("lost", a.lost),
            ("duplicated", a.duplicated),
            ("out of order", a.out_of_order),
            ("problems", self.problems),
            ("rejected by the door", a.rejected),
            ("never accepted (the person gave up retrying)", a.never_accepted),
            ("notices in the forums", a.notices),
            ("notes", self.notes),
        ):
            if items:
                parts.append(f"{title} ({len(items)}):")
                parts.extend(f"  {item}" for item in items[:50])
                if len(items) > 50:
                    parts.append(f"  ... and {len(items) - 50} more")
        return "\n".join(parts)

"""What a slash command is: the one rule every reader of a line uses.

A person's line is a command when, leading and trailing white space aside, it starts with
``/``; its name is the first word, in lower case (``" /STOP "`` is ``/stop``), and the rest,
stripped, is its argument. The processor's arrival hook (a stop cancels the model call at
once), its step (which answers the command) and whatever submits a stop for a person (the
CLI's ``yoke stop``, the gateway's ``POST .../stop``) all go through here, so no two of them can
disagree about a line.
"""

from __future__ import annotations

from dataclasses import dataclass

STOP = "/stop"  # the line a stop submits, and the command's name
# A person holds the forum (its agents post nothing there) until someone hands it back
# (docs/people-take-over.md); the door decides who may type them.
TAKEOVER = "/takeover"
HANDBACK = "/handback"
HOLD_COMMANDS = (TAKEOVER, HANDBACK)


@dataclass(frozen=True)
class SlashCommand:
    name: str  # lower case, with its slash: ``/model``
    argument: str  # the rest of the line, stripped ("" when none)


def slash_command(text: str) -> SlashCommand | None:
    """The command ``text`` is, or None when it is no command."""
    stripped = text.strip()
    if not stripped.startswith("/"):
        return None
    word, *rest = stripped.split(None, 1)  # on any white space, not just a space
    return SlashCommand(name=word.lower(), argument=rest[0].strip() if rest else "")


def is_stop(text: str) -> bool:
    command = slash_command(text)
    return command is not None and command.name == STOP


def takeover_text(reason: str | None) -> str:
    """The ``/takeover`` line whatever submits one for a person writes (the CLI, the gateway)."""
    reason = (reason or "").strip()
    return f"{TAKEOVER} {reason}" if reason else TAKEOVER


def hold_command(text: str) -> SlashCommand | None:
    """The ``/takeover`` or ``/handback`` that ``text`` is, or None."""
    command = slash_command(text)
    return command if command is not None and command.name in HOLD_COMMANDS else None

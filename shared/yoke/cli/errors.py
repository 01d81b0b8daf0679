"""How a ``yoke`` verb fails: a message on stderr and an exit code."""

from __future__ import annotations


class CommandError(Exception):
    """Printed to stderr; exit code 1."""


class UsageError(CommandError):
    """A command's input is invalid (say, a join configuration): exit code 2, like argparse."""

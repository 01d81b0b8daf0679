"""The ``yoke`` command: every verb, ``yoke up`` (the supervisor) and the demo."""

from yoke.cli.main import main

__all__ = ["main"]

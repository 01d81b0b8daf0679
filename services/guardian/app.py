"""The guardian service: wiring only; the watching and steering live in :mod:`yoke.guardian`."""

from __future__ import annotations

from yoke import guardian
from yoke.service import Service


def register(service: Service) -> None:
    guardian.register(service)

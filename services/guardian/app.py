"""The guardian service: wiring only; the watching and steering live in :mod:`.guardian`."""

from __future__ import annotations

from services.guardian import guardian
from yoke.runtime.service import Service


def register(service: Service) -> None:
    guardian.register(service)

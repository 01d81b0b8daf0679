"""The core: what every other part of the SDK stands on, and nothing of a broker or a database.

The wire and store schemas (``models``), ids, the failure taxonomy (``errors``), ``YOKE_*``
settings, Prometheus series, structured logs, tracing, TLS options, and the small guards for
outside input (text, JSON depth, regexes, URLs). It imports no other ``yoke`` package; inside
it, ``models``, ``ids``, ``errors`` and ``settings`` import nothing of the project at all.
"""

__all__ = [
    "ages",
    "errors",
    "hardening",
    "ids",
    "json_limits",
    "logs",
    "lru",
    "metrics",
    "models",
    "outbound",
    "redact",
    "safe_regex",
    "settings",
    "slash",
    "text",
    "tls",
    "tracing",
]

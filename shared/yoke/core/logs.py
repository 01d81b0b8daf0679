"""Structured logs: JSON lines off a terminal, readable text on one (``YOKE_LOG_FORMAT``).

Pass ids through ``extra={"conversationId": ..., "messageId": ...}``; they become fields. A line
written inside a span (tracing on: :mod:`yoke.core.tracing`) also names its ``trace_id`` and
``span_id``, so a trace in Jaeger and the lines of its steps find each other.
"""

from __future__ import annotations

import json
import logging
import sys
from datetime import UTC, datetime

from yoke.core import tracing
from yoke.core.redact import RedactingFormatter, install_excepthook
from yoke.core.text import printable

CONTEXT_FIELDS = ("service", "event", "conversationId", "messageId", "causationId", "queue")
TRACE_FIELDS = ("trace_id", "span_id")


def _trace_fields(record: logging.LogRecord) -> None:
    """The span the line was written in (formatting happens on the writer's task: its span is
    the current one), unless the caller named one."""
    if "trace_id" in record.__dict__:
        return
    found = tracing.ids()
    if found is not None:
        record.trace_id, record.span_id = found


class JsonFormatter(logging.Formatter):
    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        _trace_fields(record)
        line: dict[str, object] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(),
            "level": record.levelname.lower(),
            "service": self.service,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for field in (*CONTEXT_FIELDS, *TRACE_FIELDS):
            value = record.__dict__.get(field)
            if value is not None:
                line[field] = value
        if record.exc_info:
            line["error"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


class TextFormatter(logging.Formatter):
    """One line per record for a terminal. Messages carry outside text (lines, names, errors):
    its control characters are shown escaped (:func:`yoke.core.text.printable`), so none clears the
    operator's screen and no newline in it starts a forged line; a traceback keeps its lines."""

    def __init__(self, service: str) -> None:
        super().__init__("%(asctime)s %(levelname)-7s " + service + " %(message)s%(context)s")

    def formatMessage(self, record: logging.LogRecord) -> str:
        _trace_fields(record)
        pairs = [
            f"{field}={record.__dict__[field]}"
            for field in (*CONTEXT_FIELDS, *TRACE_FIELDS)
            if record.__dict__.get(field) is not None
        ]
        record.context = (" [" + " ".join(pairs) + "]") if pairs else ""
        return printable(super().formatMessage(record))

    def formatException(self, ei: logging._SysExcInfoType) -> str:
        return printable(super().formatException(ei), multiline=True)


def configure_logging(service: str, fmt: str | None = None, level: str = "INFO") -> None:
    chosen = fmt or ("text" if sys.stderr.isatty() else "json")
    handler = logging.StreamHandler(sys.stderr)
    formatter = JsonFormatter(service) if chosen == "json" else TextFormatter(service)
    # Connection URLs in messages and tracebacks are shown without their passwords.
    handler.setFormatter(RedactingFormatter(formatter))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    install_excepthook()
    for noisy in ("aiormq", "aio_pika", "pymongo"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def configure_cli_logging() -> None:
    """The CLI's warnings as Python would print them (message only, stderr), but redacted."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(RedactingFormatter(logging.Formatter("%(message)s")))
    handler.setLevel(logging.WARNING)
    logging.getLogger().handlers[:] = [handler]
    install_excepthook()

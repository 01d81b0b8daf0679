"""The services' text logs (a terminal's) show outside text with its control characters escaped:
a line's text or a display name in a log message cannot clear the operator's screen or forge a
log line of its own."""

from __future__ import annotations

import logging

from yoke.core.logs import JsonFormatter, TextFormatter

HOSTILE = "hello\x1b[2J\x07\nWARNING forged line\u202e"


def _record(message: str, **extra: object) -> logging.LogRecord:
    record = logging.LogRecord("yoke.test", logging.WARNING, __file__, 1, message, None, None)
    record.__dict__.update(extra)
    return record


def test_a_text_log_line_shows_control_characters_escaped() -> None:
    line = TextFormatter("ingestion").format(
        _record("rejected command: %s", conversationId="forum\x1b]0;title\x07")
    )
    assert line.count("\n") == 0
    assert "\x1b" not in line and "\x07" not in line
    line = TextFormatter("ingestion").format(_record(f"rejected command: {HOSTILE}"))
    assert "\x1b" not in line and "\x07" not in line and "\u202e" not in line
    assert "\n" not in line, "a newline in outside text must not start a forged log line"
    assert "hello\\x1b[2J\\x07\\x0aWARNING forged line\\u202e" in line


def test_a_text_log_keeps_a_tracebacks_own_lines() -> None:
    try:
        raise ValueError("bad\x1b[2J")
    except ValueError:
        import sys

        record = _record("failed")
        record.exc_info = sys.exc_info()
    line = TextFormatter("processor").format(record)
    assert "Traceback (most recent call last)" in line and "\n" in line
    assert "\x1b" not in line


def test_a_json_log_line_escapes_them_already() -> None:
    line = JsonFormatter("ingestion").format(_record(HOSTILE))
    assert "\x1b" not in line and "\n" not in line

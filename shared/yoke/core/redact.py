"""Connection URLs with their passwords masked, for everything the mesh shows people.

Logs, error messages, ``/healthz`` bodies and CLI output may carry a connection URL (a failed
connect names its node, a traceback quotes its arguments). Every one of those paths goes through
:func:`redact`, so ``amqp://yoke:s3cret@host/`` is shown as ``amqp://yoke:***@host/`` and a
password set in ``.env`` never reaches a terminal, a log store or a monitoring probe.
"""

from __future__ import annotations

import logging
import re
import sys
import traceback
from types import TracebackType

MASK = "***"

# ``scheme://user:password@`` anywhere in a text. A password in a URL cannot hold a raw ``@``,
# ``/`` or whitespace (they must be percent-encoded), so the match ends at the first of them;
# several URLs in one text (``YOKE_AMQP_URL`` may list nodes) are each masked.
_USERINFO = re.compile(
    r"(?P<head>\b[A-Za-z][A-Za-z0-9+.-]*://[^:@/\s]*:)(?P<password>[^@/\s]+)(?P<at>@)"
)


def redact(text: str) -> str:
    """``text`` with the password of every URL in it replaced by ``***``."""
    return _USERINFO.sub(lambda match: f"{match['head']}{MASK}{match['at']}", text)


def redact_url(url: str) -> str:
    """One URL (or a comma-separated list of them) as it may be shown: no password."""
    return redact(url)


class RedactingFormatter(logging.Formatter):
    """Wraps another formatter: the whole formatted record, traceback included, redacted."""

    def __init__(self, inner: logging.Formatter) -> None:
        super().__init__()
        self.inner = inner

    def format(self, record: logging.LogRecord) -> str:
        return redact(self.inner.format(record))


def _redacting_excepthook(
    kind: type[BaseException], error: BaseException, tb: TracebackType | None
) -> None:
    sys.stderr.write(redact("".join(traceback.format_exception(kind, error, tb))))
    sys.stderr.flush()


def install_excepthook() -> None:
    """An uncaught exception's traceback is printed redacted (it may quote a URL)."""
    sys.excepthook = _redacting_excepthook

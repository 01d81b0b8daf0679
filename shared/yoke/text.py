"""Outside text made safe for an operator's terminal (the CLI's output, the services' text logs).

Lines, display names, tool descriptions and errors come from people, models and outside
systems; printed as they are, an ESC sequence could clear the screen, retitle the window,
rewrite what was printed before or hide text, and a BEL rings. Every CLI output and text log
line that shows such text passes it through :func:`printable`, which shows each control
character escaped (``\\x1b``), so the operator sees what was sent instead of what it would do.
``--json`` output and JSON logs need none of this: ``json.dumps`` escapes them itself.
"""

from __future__ import annotations

import unicodedata

# Kept as they are in multi-line text (a line of several paragraphs, a table in a tool's text).
_LAYOUT = frozenset("\n\t")
# Format characters that only shape what they join (a soft hyphen, the joiners of emoji and of
# Persian script): harmless, and escaping them would garble ordinary text.
_SHAPING = frozenset("\u00ad\u200c\u200d")


def _escaped(char: str) -> str:
    code = ord(char)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def _unsafe(char: str) -> bool:
    # Cc: C0, DEL and C1 (0x9b is a one-byte CSI); Cf: bidi overrides and invisible marks
    # that reorder or hide what is shown; Zl/Zp: line breaks a terminal may honour.
    return char not in _SHAPING and unicodedata.category(char) in ("Cc", "Cf", "Zl", "Zp")


def printable(text: str, *, multiline: bool = False) -> str:
    """``text`` with every control character shown escaped; with ``multiline``, newlines
    and tabs stay (a line's own layout), otherwise they are escaped too (a name, a field)."""
    if text.isprintable() and not any(_unsafe(char) for char in text):
        return text  # the common case, unchanged
    kept = _LAYOUT if multiline else frozenset()
    return "".join(_escaped(char) if _unsafe(char) and char not in kept else char for char in text)

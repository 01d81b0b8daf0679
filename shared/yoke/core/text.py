"""Outside text made safe: for the store (:func:`storable`) and for an operator's terminal
(:func:`printable`).

A tool's answer (an MCP ``read_text_file`` of a binary file) or a model's output may hold
U+0000, which FerretDB cannot store, or a lone surrogate, which is not UTF-8 and so not BSON:
such a line fails to store on every attempt. :func:`storable` replaces each with U+FFFD, once,
where the text enters the mesh (a tool's result, a worker's answer at the door, a model's
output); people's own lines are refused at the door instead, so they can type them again.

For the terminal: lines, display names, tool descriptions and errors come from people, models
and outside systems; printed as they are, an ESC sequence could clear the screen, retitle the
window, rewrite what was printed before or hide text, and a BEL rings. Every CLI output and text
log line that shows such text passes it through :func:`printable`, which shows each control
character escaped (``\\x1b``), so the operator sees what was sent instead of what it would do.
``--json`` output and JSON logs need none of this: ``json.dumps`` escapes them itself.
"""

from __future__ import annotations

import re
import unicodedata
from typing import TypeVar, cast

REPLACEMENT = "\ufffd"
# What the store cannot hold: U+0000, and any surrogate code point (a Python str holds a pair
# as two of them only when it came from surrogate-escaped bytes; each alone is not UTF-8).
_UNSTORABLE = re.compile("[\x00\ud800-\udfff]")

JsonT = TypeVar("JsonT")


def storable(text: str) -> str:
    """``text`` with U+0000 and each lone surrogate replaced by U+FFFD (a surrogate pair held
    as two code points becomes the character it encodes); the common case is returned as is."""
    if _UNSTORABLE.search(text) is None:
        return text
    # UTF-16 joins each pair and replaces each lone half (one U+FFFD each).
    joined = text.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "replace")
    return joined.replace("\x00", REPLACEMENT)


def storable_json(value: JsonT) -> JsonT:
    """A JSON value (a tool call's arguments) with every string in it, keys too, storable."""
    made: object = value
    if isinstance(value, str):
        made = storable(value)
    elif isinstance(value, dict):
        made = {storable(str(k)): storable_json(v) for k, v in value.items()}
    elif isinstance(value, list):
        made = [storable_json(item) for item in value]
    return cast(JsonT, made)


def storable_input(value: object) -> object:
    """A pydantic ``BeforeValidator``: a string made storable, anything else left to the field."""
    return storable(value) if isinstance(value, str) else value


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

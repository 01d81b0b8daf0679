"""How deep a JSON body nests, counted without parsing it: both doors (AMQP and HTTP) refuse a
body nested past :data:`MAX_BODY_DEPTH` before any parser recursion is at risk."""

from __future__ import annotations

import re

# Deeper than any good command (its meta nests at most MAX_META_DEPTH levels), and shallow
# enough that no parser recursion is ever at risk.
MAX_BODY_DEPTH = 32

# A JSON string; an unterminated one runs to the end, so a match never fails and the scan
# stays linear (a pattern that can fail after a long run is quadratic on '"\\"\\"...').
_JSON_STRING = re.compile(rb'"(?:[^"\\]++|\\.)*+"?', re.DOTALL)
_NOT_BRACKETS = bytes(byte for byte in range(256) if byte not in b"[]{}")


def nesting_depth(body: bytes, limit: int = MAX_BODY_DEPTH) -> int:
    """How deep a JSON body nests (at most ``limit + 1``: it stops there).

    Counted on the raw bytes, brackets inside strings left out, so that no parser recursion is
    risked: ``json.loads`` raises ``RecursionError`` about 1,000 levels down.
    """
    depth = deepest = 0
    for byte in _JSON_STRING.sub(b"", body).translate(None, _NOT_BRACKETS):
        if byte in b"[{":
            depth += 1
            if depth > limit:
                return depth
            deepest = max(deepest, depth)
        else:
            depth -= 1
    return deepest

"""Regular expressions from configuration, refused when they can backtrack catastrophically.

Python's ``re`` has no timeout and holds the GIL while matching, so one pattern such as
``(a+)+b`` over a long agent line would stall a whole service. A pattern is refused when an
unbounded repetition contains another variable repetition or an alternation (star height above
one: the shapes whose backtracking grows exponentially); what is matched is also capped in
length, which bounds the polynomial cases.
"""

from __future__ import annotations

import importlib
import re
from typing import Any

# The standard library's own pattern parser (what ``re.compile`` uses); untyped, hence Any.
sre_parser: Any = importlib.import_module("re._parser")
sre_constants: Any = importlib.import_module("re._constants")

# Characters of text a rule is matched against; the rest of a longer text is not looked at.
MAX_MATCHED_CHARS = 8000

_REPEATS = (sre_constants.MAX_REPEAT, sre_constants.MIN_REPEAT, sre_constants.POSSESSIVE_REPEAT)


def _unbounded_inside(items: Any, inside_unbounded: bool) -> str | None:
    """Why the parsed ``items`` can backtrack without bound, or None."""
    for op, argument in items:
        if op in _REPEATS:
            low, high, body = argument
            unbounded = high == sre_constants.MAXREPEAT or high > 100
            if inside_unbounded and low != high:
                return "a repetition inside a repetition"
            if problem := _unbounded_inside(body, inside_unbounded or unbounded):
                return problem
        elif op == sre_constants.BRANCH:
            if inside_unbounded:
                return "an alternation inside a repetition"
            for branch in argument[1]:
                if problem := _unbounded_inside(branch, inside_unbounded):
                    return problem
        elif op == sre_constants.SUBPATTERN:
            if problem := _unbounded_inside(argument[3], inside_unbounded):
                return problem
        elif op in (sre_constants.ASSERT, sre_constants.ASSERT_NOT) and (
            problem := _unbounded_inside(argument[1], inside_unbounded)
        ):
            return problem
    return None


def compile_safe(pattern: str) -> re.Pattern[str]:
    """The compiled pattern; ``ValueError`` saying why when it is invalid or unsafe."""
    try:
        compiled = re.compile(pattern)
        parsed = sre_parser.parse(pattern)
    except re.error as error:
        raise ValueError(f"not a regular expression: {error}") from None
    problem = _unbounded_inside(parsed, False)
    if problem is not None:
        raise ValueError(f"refused: {problem} can take exponential time to match")
    return compiled


def search(pattern: re.Pattern[str], text: str) -> bool:
    """Whether ``pattern`` occurs in the first :data:`MAX_MATCHED_CHARS` of ``text``."""
    return pattern.search(text[:MAX_MATCHED_CHARS]) is not None

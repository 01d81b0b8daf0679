"""Rule patterns from configuration: valid ones compile, catastrophic ones are refused."""

from __future__ import annotations

import pytest

from yoke.core.safe_regex import MAX_MATCHED_CHARS, compile_safe, search


@pytest.mark.parametrize(
    "pattern", [r"(?i)refund", r"promise.{0,40}refund", r"(foo|bar)", r"(ab{2})+", r"\w+ing"]
)
def test_ordinary_patterns_compile(pattern: str) -> None:
    compile_safe(pattern)


@pytest.mark.parametrize(
    ("pattern", "why"),
    [
        (r"(a+)+b", "repetition inside a repetition"),
        (r"(x{1,5})+", "repetition inside a repetition"),
        (r"(a|aa)+", "alternation inside a repetition"),
        (r"(?=(a+)+)", "repetition inside a repetition"),
        (r"(ab", "not a regular expression"),
    ],
)
def test_invalid_or_catastrophic_patterns_are_refused_naming_why(pattern: str, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        compile_safe(pattern)


def test_only_the_head_of_a_long_text_is_matched() -> None:
    pattern = compile_safe("needle")
    assert search(pattern, "x" * 10 + "needle")
    assert not search(pattern, "x" * MAX_MATCHED_CHARS + "needle")

"""Outside text made storable once, where it enters (yoke.core.text.storable; invariant 15)."""

from __future__ import annotations

import pytest

from yoke.core.models import ToolCallPart
from yoke.core.text import storable, storable_json
from yoke.llm.base import InferenceResult


@pytest.mark.parametrize(
    ("text", "made"),
    [
        ("plain text, é and 😀", "plain text, é and 😀"),
        ("a\x00b", "a\ufffdb"),
        ("lone \ud800 high", "lone \ufffd high"),
        ("lone \udc00 low", "lone \ufffd low"),
        ("\ud83d\ude00", "😀"),  # a pair held as two code points: the character it encodes
        ("\ud800\ud800\x00", "\ufffd\ufffd\ufffd"),
    ],
)
def test_storable_replaces_nul_and_lone_surrogates(text: str, made: str) -> None:
    assert storable(text) == made
    made.encode()  # valid UTF-8


def test_plain_text_is_returned_as_it_is() -> None:
    text = "nothing to change " * 100
    assert storable(text) is text


def test_storable_json_reaches_every_string_keys_included() -> None:
    value = {"a\x00": ["\ud800", {"k": "v\x00"}, 1, None, True]}
    assert storable_json(value) == {"a\ufffd": ["\ufffd", {"k": "v\ufffd"}, 1, None, True]}


def test_every_providers_result_is_storable_as_it_is_made() -> None:
    result = InferenceResult(
        text="t\x00",
        tool_calls=[ToolCallPart(call_id="c", name="n", input={"x": "\ud800"}, input_error="\x00")],
    )
    assert result.text == "t\ufffd"
    [call] = result.tool_calls
    assert (call.input, call.input_error) == ({"x": "\ufffd"}, "\ufffd")

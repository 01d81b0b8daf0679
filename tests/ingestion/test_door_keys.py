"""Which call an answer too large to take is of (services.ingestion.app.oversize_call_id): the
door ends that call at once rather than leave the model waiting for its deadline."""

from __future__ import annotations

import json

from services.ingestion.app import MAX_KEYED_BODY_BYTES, UNKEYED, oversize_call_id

BIG = "x" * (MAX_KEYED_BODY_BYTES + 10)


def test_a_body_within_the_keyed_bound_is_parsed() -> None:
    body = json.dumps({"output": "x" * 50_000, "callId": "c-1"}).encode()
    assert oversize_call_id(body) == "c-1"


def test_past_the_bound_the_call_id_is_found_at_either_end() -> None:
    assert oversize_call_id(json.dumps({"callId": "c-head", "output": BIG}).encode()) == "c-head"
    assert oversize_call_id(json.dumps({"output": BIG, "callId": "c-tail"}).encode()) == "c-tail"
    spaced = ('{ "callId" :\t"c-spaced", "output": "' + BIG + '"}').encode()
    assert oversize_call_id(spaced) == "c-spaced"


def test_a_call_id_quoted_inside_the_output_is_not_taken_for_it() -> None:
    quoted = json.dumps({"output": '{"callId": "c-inner"}' + BIG}).encode()
    assert oversize_call_id(quoted) == UNKEYED
    assert oversize_call_id(b"{" + b" " * (MAX_KEYED_BODY_BYTES + 1) + b"}") == UNKEYED

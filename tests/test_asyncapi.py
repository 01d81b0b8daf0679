"""docs/asyncapi.json is what `yoke asyncapi` prints, and every reference in it resolves."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from yoke.cli.asyncapi import asyncapi_document, render

ROOT = Path(__file__).resolve().parents[1]


def refs(node: Any) -> list[str]:
    if isinstance(node, dict):
        found = [node["$ref"]] if isinstance(node.get("$ref"), str) else []
        return found + [ref for value in node.values() for ref in refs(value)]
    if isinstance(node, list):
        return [ref for value in node for ref in refs(value)]
    return []


def test_checked_in_document_matches_the_models() -> None:
    assert (ROOT / "docs/asyncapi.json").read_text() == render(), (
        "run: yoke asyncapi > docs/asyncapi.json"
    )


def test_every_reference_resolves_and_the_command_schema_is_the_wire_shape() -> None:
    document = asyncapi_document()
    for ref in refs(document):
        node: Any = document
        for part in ref.removeprefix("#/").split("/"):
            node = node[part]
    submit = document["components"]["schemas"]["SubmitMessage"]
    assert set(submit["required"]) == {"conversationId", "author", "text", "idempotencyKey"}
    posted = document["components"]["schemas"]["MessagePostedEvent"]
    assert posted["properties"]["type"]["const"] == "conversation.message.posted"

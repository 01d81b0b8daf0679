"""docs/asyncapi.json is what `yoke asyncapi` prints, and every reference in it resolves."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from yoke.bus import topology
from yoke.cli.asyncapi import asyncapi_document, render
from yoke.core.models import ToolCallRequest

ROOT = Path(__file__).resolve().parents[2]


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


def test_the_worker_contract_is_described_from_the_wire_models() -> None:
    """A worker's side: calls on its tool's queue (what the mesh publishes there), answers on
    yoke.commands keyed tool.result.submit, the door's reply on direct reply-to with the codes
    a rejected answer carries."""
    document = asyncapi_document()
    schemas = document["components"]["schemas"]
    messages = document["components"]["messages"]
    calls = document["channels"]["toolCalls"]
    assert calls["address"] == topology.tool_queue("{tool}") == "yoke.tool.{tool}"
    assert calls["bindings"]["amqp"]["queue"]["name"] == calls["address"]
    (call,) = calls["messages"]
    assert messages[call]["payload"] == {"$ref": "#/components/schemas/ToolCallRequest"}
    request = ToolCallRequest(
        call_id="c", tool="t", idempotency_key="k", deadline=datetime.now(UTC)
    ).to_wire()
    assert set(schemas["ToolCallRequest"]["required"]) == set(request) - {"input"}
    assert "message_id = callId" in messages[call]["summary"]
    assert "expiration" in messages[call]["summary"]
    published = document["operations"]["callTool"]
    assert (published["action"], published["channel"]) == ("send", {"$ref": "#/channels/toolCalls"})

    results = document["channels"]["toolResults"]
    assert results["address"] == topology.TOOL_RESULT_COMMAND == "tool.result.submit"
    assert results["bindings"]["amqp"]["exchange"]["name"] == topology.COMMANDS_EXCHANGE
    (answer,) = results["messages"]
    assert messages[answer]["payload"] == {"$ref": "#/components/schemas/SubmitToolResult"}
    assert set(schemas["SubmitToolResult"]["required"]) == {"callId", "output"}
    assert "user_id" in messages[answer]["summary"]
    submit = document["operations"]["submitToolResult"]
    assert submit["action"] == "receive"
    reply_channel = document["channels"]["toolResultReplies"]
    assert submit["reply"]["channel"] == {"$ref": "#/channels/toolResultReplies"}
    assert reply_channel["address"] == "amq.rabbitmq.reply-to"
    (reply,) = reply_channel["messages"]
    assert messages[reply]["payload"] == {"$ref": "#/components/schemas/SubmitReply"}
    codes = set(schemas["SubmitReply"]["properties"]["code"]["anyOf"][0]["enum"])
    assert {"unknown_call", "call_closed", "wrong_tool", "missing_user_id"} <= codes
    assert "duplicate" in schemas["SubmitReply"]["properties"]


def test_drafts_have_their_channel_on_the_forum_exchange() -> None:
    """agent.delta.<forum> on yoke.forum, what a bridge binds beside the forum's lines."""
    document = asyncapi_document()
    deltas = document["channels"]["forumDeltas"]
    assert deltas["address"] == "agent.delta.{forumId}"
    assert deltas["bindings"]["amqp"]["exchange"]["name"] == topology.FORUM_EXCHANGE
    (message,) = deltas["messages"]
    summary = document["components"]["messages"][message]
    assert summary["payload"] == {"$ref": "#/components/schemas/AgentDeltaEvent"}
    schema = document["components"]["schemas"]["AgentDelta"]
    assert set(schema["required"]) == {"forumId", "agentActorId", "messageId", "index", "text"}
    assert set(schema["properties"]["end"]["anyOf"][0]["enum"]) == {"posted", "abandoned"}
    assert document["operations"]["publishForumDeltas"]["action"] == "send"

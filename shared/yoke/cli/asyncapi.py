"""The AsyncAPI 3 contract of the mesh, generated from the pydantic models (``yoke asyncapi``).

``docs/asyncapi.json`` is this document, checked in; a test keeps the two equal.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from yoke.bus import topology
from yoke.core.models import (
    AgentActivity,
    AgentDelta,
    AgentForumJoined,
    ApprovalDecided,
    ApprovalRequested,
    Envelope,
    EscalationClaimed,
    EscalationEnded,
    EscalationOpened,
    MessagePosted,
    MonologueCompacted,
    SubmitApproval,
    SubmitEscalation,
    SubmitMessage,
    SubmitReply,
    SubmitToolResult,
    ToolCallRequest,
)
from yoke.tools.worker import DIRECT_REPLY_TO

EVENTS = (
    MessagePosted,
    AgentForumJoined,
    MonologueCompacted,
    AgentActivity,
    AgentDelta,
    ApprovalRequested,
    ApprovalDecided,
    EscalationOpened,
    EscalationClaimed,
    EscalationEnded,
)
# What yoke.forum carries (published with yoke-kind=forum): all an outside system may read.
FORUM_EVENTS = (MessagePosted, AgentActivity)
APPROVAL_EVENTS = (ApprovalRequested, ApprovalDecided)
ESCALATION_EVENTS = (EscalationOpened, EscalationClaimed, EscalationEnded)


def _key(event: type[BaseModel]) -> str:
    return event.__name__[0].lower() + event.__name__[1:]


def _component_schemas() -> dict[str, Any]:
    models: list[type[BaseModel]] = [
        SubmitMessage,
        SubmitReply,
        ToolCallRequest,
        SubmitToolResult,
        SubmitApproval,
        SubmitEscalation,
        *EVENTS,
    ]
    _, definitions = models_json_schema(
        [(model, "serialization") for model in models],
        ref_template="#/components/schemas/{model}",
        by_alias=True,
    )
    schemas: dict[str, Any] = dict(definitions.get("$defs", {}))
    envelope = Envelope.model_json_schema(by_alias=True)
    for event in EVENTS:
        properties = {**envelope["properties"]}
        properties["type"] = {"const": event.TYPE, "type": "string"}
        properties["payload"] = {"$ref": f"#/components/schemas/{event.__name__}"}
        schemas[f"{event.__name__}Event"] = {
            "title": f"{event.__name__}Event",
            "type": "object",
            "properties": properties,
            "required": envelope["required"],
        }
    return schemas


def _topic_binding(exchange: str) -> dict[str, Any]:
    """The AMQP binding of a channel on one of the mesh's durable topic exchanges."""
    return {
        "amqp": {
            "is": "routingKey",
            "exchange": {"name": exchange, "type": "topic", "durable": True},
        }
    }


def _message(name: str, schema: str, summary: str) -> dict[str, Any]:
    return {
        "name": name,
        "contentType": "application/json",
        "summary": summary,
        "payload": {"$ref": f"#/components/schemas/{schema}"},
    }


def asyncapi_document() -> dict[str, Any]:
    messages = {
        "submitMessage": _message(
            "conversation.message.submit",
            "SubmitMessage",
            "A line from an outside system. Set reply_to for an answer with the same "
            "correlation_id; each idempotencyKey is accepted once per conversation.",
        ),
        "submitReply": _message(
            "submit reply",
            "SubmitReply",
            "The door's answer. To tool.result.submit: accepted (the first answer, or a repeat "
            "by the same tool's user, with duplicate: true), or rejected with code "
            "unknown_call, call_closed (ended already: deadline, stop, rejected approval), "
            "wrong_tool (another tool's call), missing_user_id or too_large (the answer past "
            "the size limit: the call ends at once with an error result saying so), and a "
            "sentence. A worker's user may send nothing but answers: anything else is "
            "rejected not_allowed.",
        ),
        "toolCallRequest": _message(
            "tool call",
            "ToolCallRequest",
            "A call of the tool. AMQP message_id = callId; expiration = the milliseconds left "
            "until deadline (then the broker drops it, and the mesh ends the call with an "
            "error result). Delivered at least once: use idempotencyKey to tolerate a repeat.",
        ),
        "submitToolResult": _message(
            topology.TOOL_RESULT_COMMAND,
            "SubmitToolResult",
            "A worker's answer to a call, published with the AMQP user_id property set to its "
            f"RabbitMQ user ({topology.TOOL_USER_PREFIX}<tool>, or {topology.TOOL_USER_PREFIX}"
            "<vhost>.<tool> off the default vhost; the broker verifies it, and an "
            f"answer without it is rejected) and reply_to {DIRECT_REPLY_TO}. The first answer "
            "is the call's result.",
        ),
        "submitApproval": _message(
            topology.APPROVAL_COMMAND,
            "SubmitApproval",
            "A person's decision on a call that waits for approval, keyed by callId. Taken "
            "only from a publisher made with yoke publisher create --can-approve (or the "
            "mesh's own user: the CLI, the HTTP gateway), published with the AMQP user_id "
            "property set to it (the broker verifies it). by names the person as your system "
            "knows them. The first decision stands: a later one is rejected with code "
            "already_decided; others are not_allowed, missing_user_id, unknown_call, "
            "not_awaiting_approval.",
        ),
        "submitEscalation": _message(
            topology.ESCALATION_COMMAND,
            "SubmitEscalation",
            "Claim an escalation (its claimer takes the forum over), cancel it, or end it at its "
            "deadline, keyed by the forum (conversationId). Taken only from the mesh's own user "
            "(the CLI, the follow-up service) and the HTTP gateway. The first decision stands: "
            "a later one is rejected already_claimed or escalation_ended; others are "
            "not_allowed, unknown_escalation, held (the forum is held by someone else).",
        ),
    }
    for event in EVENTS:
        key = _key(event)
        messages[key] = _message(
            event.TYPE, f"{event.__name__}Event", f"Routing key {event.TYPE}.<id>."
        )
    messages[_key(AgentDelta)]["summary"] = (
        f"Routing key {AgentDelta.TYPE}.<forum id>. A piece of the text an agent is writing for "
        "the forum, as the model produces it (pieces merged, at most about 20 a second per "
        "draft). Ephemeral: never stored nor sent again, published with an expiration, and a "
        "delta may be missing; ordered by index from 0 within a draft (index 0 again: the step "
        "ran again after a failure, and its draft starts over). messageId is the id the "
        "forum line will have (its conversation.message.posted replaces the draft); the last "
        "delta of a draft has end: posted (the line follows) or abandoned (no line comes). "
        "Only text that reaches the forum is streamed, never tool calls."
    )
    messages[_key(ApprovalRequested)]["summary"] = (
        f"Routing key {ApprovalRequested.TYPE}.<forum id>. A call of a gated tool waits for a "
        "person's decision until deadline: approve or reject it with "
        f"{topology.APPROVAL_COMMAND}. input is the call's input, shown to the forum's "
        "approvers on purpose (the one piece of a monologue that leaves the mesh)."
    )
    messages[_key(ApprovalDecided)]["summary"] = (
        f"Routing key {ApprovalDecided.TYPE}.<forum id>. The decision that stands on a gated "
        "call: approve (the tool runs now), reject (its result is the error 'rejected by NAME: "
        "REASON'), expired (nobody decided by the deadline) or stopped (a stop in the forum); "
        "by as the deciding door named the person, absent for expired."
    )
    messages[_key(EscalationOpened)]["summary"] = (
        f"Routing key {EscalationOpened.TYPE}.<forum id>. An agent asked for a person (its "
        "handoff tool): claim it before deadline with "
        f"{topology.ESCALATION_COMMAND}, or it ends with the join's fallback."
    )
    messages[_key(EscalationClaimed)]["summary"] = (
        f"Routing key {EscalationClaimed.TYPE}.<forum id>. A person claimed the escalation: "
        "they hold the forum (a takeover) until they hand it back."
    )
    messages[_key(EscalationEnded)]["summary"] = (
        f"Routing key {EscalationEnded.TYPE}.<forum id>. The escalation is over: handed_back "
        "(its claimer returned the forum), timed_out or canceled."
    )
    event_refs = {_key(e): {"$ref": f"#/components/messages/{_key(e)}"} for e in EVENTS}
    return {
        "asyncapi": "3.0.0",
        "info": {
            "title": "Yoke mesh",
            "version": "1.0.0",
            "description": "LLM agents in conversations, over RabbitMQ. Outside systems publish "
            f"commands to the {topology.COMMANDS_EXCHANGE} exchange and bind their own queues "
            f"(bridge.*) to {topology.FORUM_EXCHANGE} to receive forum lines and agent activity; "
            f"{topology.EVENTS_EXCHANGE}, with every agent's monologue, stays inside the mesh. "
            f"A tool worker takes its tool's calls from {topology.TOOL_QUEUE_PREFIX}<tool> and "
            f"answers with {topology.TOOL_RESULT_COMMAND} on {topology.COMMANDS_EXCHANGE}.",
        },
        "defaultContentType": "application/json",
        "channels": {
            "commands": {
                "address": topology.SUBMIT_COMMAND,
                "description": f"Topic exchange {topology.COMMANDS_EXCHANGE}.",
                "messages": {"submitMessage": {"$ref": "#/components/messages/submitMessage"}},
                "bindings": _topic_binding(topology.COMMANDS_EXCHANGE),
            },
            "replies": {
                "address": None,
                "description": "The reply_to queue of the command.",
                "messages": {"submitReply": {"$ref": "#/components/messages/submitReply"}},
            },
            "forum": {
                "address": "{eventType}.{forumId}",
                "description": f"Topic exchange {topology.FORUM_EXCHANGE}, what bridges bind "
                "to: forum lines (conversation.message.posted.<forum id>) and agent activity "
                "(agent.activity.<forum id>), and drafts (agent.delta.<forum id>, the "
                "forumDeltas channel), never a monologue's events. Bind "
                "conversation.message.posted.# for every forum's lines. The mesh feeds it from "
                f"{topology.EVENTS_EXCHANGE} (internal exchange: nobody publishes to it).",
                "parameters": {"eventType": {}, "forumId": {}},
                "messages": {
                    _key(event): {"$ref": f"#/components/messages/{_key(event)}"}
                    for event in FORUM_EVENTS
                },
                "bindings": _topic_binding(topology.FORUM_EXCHANGE),
            },
            "forumDeltas": {
                "address": topology.routing_key(AgentDelta.TYPE, "{forumId}"),
                "description": f"Topic exchange {topology.FORUM_EXCHANGE}: the drafts of the "
                "agents' lines in a forum, as they are written. Bind agent.delta.<forum id> "
                "beside conversation.message.posted.<forum id> to draw a line while it is "
                "written; a bridge that wants finished lines only leaves it unbound.",
                "parameters": {"forumId": {}},
                "messages": {
                    _key(AgentDelta): {"$ref": f"#/components/messages/{_key(AgentDelta)}"}
                },
                "bindings": _topic_binding(topology.FORUM_EXCHANGE),
            },
            "toolCalls": {
                "address": topology.tool_queue("{tool}"),
                "description": "A worker tool's call queue, declared by the mesh (quorum, "
                f"x-delivery-limit {topology.DELIVERY_LIMIT}); a worker never declares it and "
                f"reads it as {topology.TOOL_USER_PREFIX}<tool> ({topology.TOOL_USER_PREFIX}"
                "<vhost>.<tool> off the default vhost), the one queue that user may "
                "read. Several workers of one tool share it (competing consumers); each call is "
                "delivered at least once: ack it once the door has answered your result.",
                "parameters": {
                    "tool": {"description": "The tool's name (yoke tools add-worker NAME)."}
                },
                "messages": {"toolCallRequest": {"$ref": "#/components/messages/toolCallRequest"}},
                "bindings": {
                    "amqp": {
                        "is": "queue",
                        "queue": {
                            "name": topology.tool_queue("{tool}"),
                            "durable": True,
                            "exclusive": False,
                            "autoDelete": False,
                        },
                    }
                },
            },
            "toolResults": {
                "address": topology.TOOL_RESULT_COMMAND,
                "description": f"Topic exchange {topology.COMMANDS_EXCHANGE}; keyed by callId "
                "(a result has no conversationId).",
                "messages": {
                    "submitToolResult": {"$ref": "#/components/messages/submitToolResult"}
                },
                "bindings": _topic_binding(topology.COMMANDS_EXCHANGE),
            },
            "forumApprovals": {
                "address": "{eventType}.{forumId}",
                "description": f"Topic exchange {topology.FORUM_EXCHANGE}: approvals in a "
                "forum (tool.approval.requested.<forum id>, tool.approval.decided.<forum id>). "
                "Bind tool.approval.*.<forum id> to show the forum's approvers what waits.",
                "parameters": {"eventType": {}, "forumId": {}},
                "messages": {
                    _key(event): {"$ref": f"#/components/messages/{_key(event)}"}
                    for event in APPROVAL_EVENTS
                },
                "bindings": _topic_binding(topology.FORUM_EXCHANGE),
            },
            "forumEscalations": {
                "address": "{eventType}.{forumId}",
                "description": f"Topic exchange {topology.FORUM_EXCHANGE}: escalations in a "
                "forum (escalation.opened|claimed|ended.<forum id>). Bind escalation.*.# to "
                "pick up every forum's requests for a person (docs/people-take-over.md).",
                "parameters": {"eventType": {}, "forumId": {}},
                "messages": {
                    _key(event): {"$ref": f"#/components/messages/{_key(event)}"}
                    for event in ESCALATION_EVENTS
                },
                "bindings": _topic_binding(topology.FORUM_EXCHANGE),
            },
            "escalations": {
                "address": topology.ESCALATION_COMMAND,
                "description": f"Topic exchange {topology.COMMANDS_EXCHANGE}; keyed by the "
                "forum (conversationId). Set reply_to for the door's answer.",
                "messages": {
                    "submitEscalation": {"$ref": "#/components/messages/submitEscalation"}
                },
                "bindings": _topic_binding(topology.COMMANDS_EXCHANGE),
            },
            "approvals": {
                "address": topology.APPROVAL_COMMAND,
                "description": f"Topic exchange {topology.COMMANDS_EXCHANGE}; keyed by callId. "
                "Set reply_to for the door's answer.",
                "messages": {"submitApproval": {"$ref": "#/components/messages/submitApproval"}},
                "bindings": _topic_binding(topology.COMMANDS_EXCHANGE),
            },
            "toolResultReplies": {
                "address": DIRECT_REPLY_TO,
                "description": "RabbitMQ's direct reply-to (consume it before publishing): the "
                "door's answer to a tool result, with the command's correlation_id.",
                "messages": {"submitReply": {"$ref": "#/components/messages/submitReply"}},
            },
            "events": {
                "address": "{eventType}.{id}",
                "description": f"Topic exchange {topology.EVENTS_EXCHANGE}, inside the mesh: "
                "every event, monologues' included; the id is the conversation for "
                "conversation.* events and the forum for agent.* events. A publisher may not "
                f"read it ({topology.FORUM_EXCHANGE} carries what it may).",
                "parameters": {"eventType": {}, "id": {}},
                "messages": event_refs,
                "bindings": _topic_binding(topology.EVENTS_EXCHANGE),
            },
        },
        "operations": {
            "submit": {
                "action": "receive",
                "channel": {"$ref": "#/channels/commands"},
                "reply": {"channel": {"$ref": "#/channels/replies"}},
            },
            "callTool": {
                "action": "send",
                "channel": {"$ref": "#/channels/toolCalls"},
                "summary": "The mesh publishes each call of a worker tool to its queue (default "
                "exchange, persistent).",
                "bindings": {"amqp": {"deliveryMode": 2, "ack": True}},
            },
            "submitToolResult": {
                "action": "receive",
                "channel": {"$ref": "#/channels/toolResults"},
                "summary": "A worker answers a call; the door checks the call and who sent it.",
                "reply": {"channel": {"$ref": "#/channels/toolResultReplies"}},
            },
            "submitApproval": {
                "action": "receive",
                "channel": {"$ref": "#/channels/approvals"},
                "summary": "A person approves or rejects a gated call; the first decision stands.",
                "reply": {"channel": {"$ref": "#/channels/replies"}},
            },
            "submitEscalation": {
                "action": "receive",
                "channel": {"$ref": "#/channels/escalations"},
                "summary": "Claim, cancel or time out an escalation; the first decision stands.",
                "reply": {"channel": {"$ref": "#/channels/replies"}},
            },
            "publishForum": {"action": "send", "channel": {"$ref": "#/channels/forum"}},
            "publishForumEscalations": {
                "action": "send",
                "channel": {"$ref": "#/channels/forumEscalations"},
                "summary": "The mesh says when an agent asks for a person and how that ends.",
            },
            "publishForumApprovals": {
                "action": "send",
                "channel": {"$ref": "#/channels/forumApprovals"},
                "summary": "The mesh asks a forum's approvers, then says what was decided.",
            },
            "publishForumDeltas": {
                "action": "send",
                "channel": {"$ref": "#/channels/forumDeltas"},
                "summary": "The processor publishes a draft's deltas while the model writes.",
            },
            "publishEvents": {"action": "send", "channel": {"$ref": "#/channels/events"}},
        },
        "components": {"schemas": _component_schemas(), "messages": messages},
    }


def render() -> str:
    return json.dumps(asyncapi_document(), indent=2, sort_keys=True) + "\n"

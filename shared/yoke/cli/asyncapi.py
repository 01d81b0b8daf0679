"""The AsyncAPI 3 contract of the mesh, generated from the pydantic models (``yoke asyncapi``).

``docs/asyncapi.json`` is this document, checked in; a test keeps the two equal.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from yoke import topology
from yoke.models import (
    AgentActivity,
    AgentForumJoined,
    Envelope,
    MessagePosted,
    MonologueCompacted,
    SubmitMessage,
    SubmitReply,
)

EVENTS = (MessagePosted, AgentForumJoined, MonologueCompacted, AgentActivity)
# What yoke.forum carries (published with yoke-kind=forum): all an outside system may read.
FORUM_EVENTS = (MessagePosted, AgentActivity)


def _key(event: type[BaseModel]) -> str:
    return event.__name__[0].lower() + event.__name__[1:]


def _component_schemas() -> dict[str, Any]:
    models: list[type[BaseModel]] = [SubmitMessage, SubmitReply, *EVENTS]
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
        "submitReply": _message("submit reply", "SubmitReply", "The door's answer."),
    }
    for event in EVENTS:
        key = _key(event)
        messages[key] = _message(
            event.TYPE, f"{event.__name__}Event", f"Routing key {event.TYPE}.<id>."
        )
    event_refs = {
        key: {"$ref": f"#/components/messages/{key}"}
        for key in messages
        if key not in ("submitMessage", "submitReply")
    }
    return {
        "asyncapi": "3.0.0",
        "info": {
            "title": "Yoke mesh",
            "version": "1.0.0",
            "description": "LLM agents in conversations, over RabbitMQ. Outside systems publish "
            f"commands to the {topology.COMMANDS_EXCHANGE} exchange and bind their own queues "
            f"(bridge.*) to {topology.FORUM_EXCHANGE} to receive forum lines and agent activity; "
            f"{topology.EVENTS_EXCHANGE}, with every agent's monologue, stays inside the mesh.",
        },
        "defaultContentType": "application/json",
        "channels": {
            "commands": {
                "address": topology.SUBMIT_COMMAND,
                "description": f"Topic exchange {topology.COMMANDS_EXCHANGE}.",
                "messages": {"submitMessage": {"$ref": "#/components/messages/submitMessage"}},
                "bindings": {
                    "amqp": {
                        "is": "routingKey",
                        "exchange": {
                            "name": topology.COMMANDS_EXCHANGE,
                            "type": "topic",
                            "durable": True,
                        },
                    }
                },
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
                "(agent.activity.<forum id>), never a monologue's events. Bind "
                "conversation.message.posted.# for every forum's lines. The mesh feeds it from "
                f"{topology.EVENTS_EXCHANGE} (internal exchange: nobody publishes to it).",
                "parameters": {"eventType": {}, "forumId": {}},
                "messages": {
                    _key(event): {"$ref": f"#/components/messages/{_key(event)}"}
                    for event in FORUM_EVENTS
                },
                "bindings": {
                    "amqp": {
                        "is": "routingKey",
                        "exchange": {
                            "name": topology.FORUM_EXCHANGE,
                            "type": "topic",
                            "durable": True,
                        },
                    }
                },
            },
            "events": {
                "address": "{eventType}.{id}",
                "description": f"Topic exchange {topology.EVENTS_EXCHANGE}, inside the mesh: "
                "every event, monologues' included; the id is the conversation for "
                "conversation.* events and the forum for agent.* events. A publisher may not "
                f"read it ({topology.FORUM_EXCHANGE} carries what it may).",
                "parameters": {"eventType": {}, "id": {}},
                "messages": event_refs,
                "bindings": {
                    "amqp": {
                        "is": "routingKey",
                        "exchange": {
                            "name": topology.EVENTS_EXCHANGE,
                            "type": "topic",
                            "durable": True,
                        },
                    }
                },
            },
        },
        "operations": {
            "submit": {
                "action": "receive",
                "channel": {"$ref": "#/channels/commands"},
                "reply": {"channel": {"$ref": "#/channels/replies"}},
            },
            "publishForum": {"action": "send", "channel": {"$ref": "#/channels/forum"}},
            "publishEvents": {"action": "send", "channel": {"$ref": "#/channels/events"}},
        },
        "components": {"schemas": _component_schemas(), "messages": messages},
    }


def render() -> str:
    return json.dumps(asyncapi_document(), indent=2, sort_keys=True) + "\n"

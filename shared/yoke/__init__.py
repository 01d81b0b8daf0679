"""Yoke: the SDK every Yoke mesh service is built on, and what outside code may use of it.

The names below are the public surface: a bridge's client, the bootstrap calls, the tool
type, the wire models a bridge reads, the publisher's permissions and the webhook signature
check. Everything else is the mesh's own and may change.

They are resolved on first use (PEP 562): ``import yoke`` loads no broker, database, model
or HTTP library, and neither does importing any of its modules (``yoke.models`` in a tool
plugin, say), which would otherwise drag all of them in through this package.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

# Public name -> the module that defines it.
_EXPORTS = {
    "Client": "yoke.client",
    "create_agent": "yoke.runtime.joins",
    "create_forum": "yoke.runtime.joins",
    "join_conversation": "yoke.runtime.joins",
    "leave_conversation": "yoke.runtime.joins",
    "Tool": "yoke.tools",
    "ToolContext": "yoke.tools",
    "Message": "yoke.models",
    "Envelope": "yoke.models",
    "MessagePosted": "yoke.models",
    "AgentActivity": "yoke.models",
    "SubmitMessage": "yoke.models",
    "SubmitReply": "yoke.models",
    "ToolCallRequest": "yoke.models",
    "SubmitToolResult": "yoke.models",
    "ApprovalRequested": "yoke.models",
    "ApprovalDecided": "yoke.models",
    "SubmitApproval": "yoke.models",
    "Part": "yoke.models",
    "TextPart": "yoke.models",
    "ToolCallPart": "yoke.models",
    "ToolResultPart": "yoke.models",
    "publisher_permissions": "yoke.topology",
    "signature_matches": "yoke.webhooks",
}

__all__ = [
    "AgentActivity",
    "ApprovalDecided",
    "ApprovalRequested",
    "Client",
    "Envelope",
    "Message",
    "MessagePosted",
    "Part",
    "SubmitApproval",
    "SubmitMessage",
    "SubmitReply",
    "SubmitToolResult",
    "TextPart",
    "Tool",
    "ToolCallPart",
    "ToolCallRequest",
    "ToolContext",
    "ToolResultPart",
    "__version__",
    "create_agent",
    "create_forum",
    "join_conversation",
    "leave_conversation",
    "publisher_permissions",
    "signature_matches",
]

if TYPE_CHECKING:
    from yoke.client import Client as Client
    from yoke.models import AgentActivity as AgentActivity
    from yoke.models import ApprovalDecided as ApprovalDecided
    from yoke.models import ApprovalRequested as ApprovalRequested
    from yoke.models import Envelope as Envelope
    from yoke.models import Message as Message
    from yoke.models import MessagePosted as MessagePosted
    from yoke.models import Part as Part
    from yoke.models import SubmitApproval as SubmitApproval
    from yoke.models import SubmitMessage as SubmitMessage
    from yoke.models import SubmitReply as SubmitReply
    from yoke.models import SubmitToolResult as SubmitToolResult
    from yoke.models import TextPart as TextPart
    from yoke.models import ToolCallPart as ToolCallPart
    from yoke.models import ToolCallRequest as ToolCallRequest
    from yoke.models import ToolResultPart as ToolResultPart
    from yoke.runtime.joins import create_agent as create_agent
    from yoke.runtime.joins import create_forum as create_forum
    from yoke.runtime.joins import join_conversation as join_conversation
    from yoke.runtime.joins import leave_conversation as leave_conversation
    from yoke.tools import Tool as Tool
    from yoke.tools import ToolContext as ToolContext
    from yoke.topology import publisher_permissions as publisher_permissions
    from yoke.webhooks import signature_matches as signature_matches

    __version__: str
else:

    def __getattr__(name: str) -> object:
        if name == "__version__":
            value: object = _version()
        elif name in _EXPORTS:
            value = getattr(importlib.import_module(_EXPORTS[name]), name)
        else:
            raise AttributeError(f"module 'yoke' has no attribute {name!r}")
        globals()[name] = value  # resolved once
        return value

    def __dir__() -> list[str]:
        return sorted({*globals(), *__all__})


def _version() -> str:
    """The installed distribution's version (``yoke-mesh``); a bare checkout has none."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("yoke-mesh")
    except PackageNotFoundError:
        return "0+unknown"

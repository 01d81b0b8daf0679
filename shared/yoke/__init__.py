"""Yoke: the SDK every Yoke mesh service is built on, and what outside code may use of it.

The names below are the public surface: a bridge's client, the bootstrap calls, the tool
type, the wire models a bridge reads, the publisher's permissions and the webhook signature
check. Everything else is the mesh's own and may change.

They are resolved on first use (PEP 562): ``import yoke`` loads no broker, database, model
or HTTP library, and neither does importing any of its modules (``yoke.core.models`` in a tool
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
    "Message": "yoke.core.models",
    "Envelope": "yoke.core.models",
    "MessagePosted": "yoke.core.models",
    "AgentActivity": "yoke.core.models",
    "SubmitMessage": "yoke.core.models",
    "SubmitReply": "yoke.core.models",
    "ToolCallRequest": "yoke.core.models",
    "SubmitToolResult": "yoke.core.models",
    "ApprovalRequested": "yoke.core.models",
    "ApprovalDecided": "yoke.core.models",
    "SubmitApproval": "yoke.core.models",
    "Part": "yoke.core.models",
    "TextPart": "yoke.core.models",
    "ToolCallPart": "yoke.core.models",
    "ToolResultPart": "yoke.core.models",
    "publisher_permissions": "yoke.bus.topology",
    "signature_matches": "yoke.store.webhooks",
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
    from yoke.bus.topology import publisher_permissions as publisher_permissions
    from yoke.client import Client as Client
    from yoke.core.models import AgentActivity as AgentActivity
    from yoke.core.models import ApprovalDecided as ApprovalDecided
    from yoke.core.models import ApprovalRequested as ApprovalRequested
    from yoke.core.models import Envelope as Envelope
    from yoke.core.models import Message as Message
    from yoke.core.models import MessagePosted as MessagePosted
    from yoke.core.models import Part as Part
    from yoke.core.models import SubmitApproval as SubmitApproval
    from yoke.core.models import SubmitMessage as SubmitMessage
    from yoke.core.models import SubmitReply as SubmitReply
    from yoke.core.models import SubmitToolResult as SubmitToolResult
    from yoke.core.models import TextPart as TextPart
    from yoke.core.models import ToolCallPart as ToolCallPart
    from yoke.core.models import ToolCallRequest as ToolCallRequest
    from yoke.core.models import ToolResultPart as ToolResultPart
    from yoke.runtime.joins import create_agent as create_agent
    from yoke.runtime.joins import create_forum as create_forum
    from yoke.runtime.joins import join_conversation as join_conversation
    from yoke.runtime.joins import leave_conversation as leave_conversation
    from yoke.store.webhooks import signature_matches as signature_matches
    from yoke.tools import Tool as Tool
    from yoke.tools import ToolContext as ToolContext

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

"""Tools an agent can call: the ``Tool`` type, the built-ins, and running them in-process."""

from yoke.tools.base import Tool, ToolContext
from yoke.tools.builtin import BUILTIN_TOOLS

__all__ = ["BUILTIN_TOOLS", "Tool", "ToolContext"]

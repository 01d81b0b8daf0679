"""Entry points that load but offer no Tool, and one whose module raises at import."""

# A plugin author's slip: the tool's description where the Tool should be.
not_a_tool = {"name": "not_a_tool", "description": "a dict, not a Tool"}

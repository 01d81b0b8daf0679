"""Egress: forwards the text of agents' monologue lines to their forums."""

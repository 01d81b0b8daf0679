"""Processor: one short LLM or tool step per monologue message (its decision tree in app.py)."""

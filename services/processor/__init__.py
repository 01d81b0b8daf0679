"""Processor: one short LLM or tool step per monologue message (the seed's decision tree)."""

"""Followup: runs as a process with health and metrics; its handlers arrive with its feature."""

"""Ingestion: the door for outside commands, and the copier of forum lines into monologues."""

"""The Yoke mesh services, each runnable as ``python -m services.<name>``."""

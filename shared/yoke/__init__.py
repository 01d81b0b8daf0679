"""Yoke: the SDK every Yoke mesh service is built on."""

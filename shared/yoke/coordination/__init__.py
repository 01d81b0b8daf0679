"""Coordination: how replicas share work and who may speak, over both the bus and the store.

Which replica consumes which shard (``ownership``), changing the shard count (``reshard``), and
the namespaces a door's speakers may use (``speakers``). It may import ``yoke.bus``,
``yoke.store`` and ``yoke.core``.
"""

__all__ = ["ownership", "reshard", "speakers"]

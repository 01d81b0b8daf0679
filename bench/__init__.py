"""``make bench``: one hop of the yoke bus against a raw aio-pika relay, measured in one run.

The figures are for reading, never asserted: they show what the SDK's guarantees (store first,
confirmed publish, sharded single-active-consumer queues, lanes) cost over the broker's floor.
"""

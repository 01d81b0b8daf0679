"""The bus: RabbitMQ, and nothing of the database.

The names of every exchange, queue, header and permission (``topology``), a connection over a
cluster's nodes (``amqp_nodes``), ``Bus`` (declare, publish with confirms, consume: ``broker``),
the ``Dispatcher`` that turns deliveries into lanes, retries and acks (``consumer``), the dead
letters (``dead_letters``) and a deployment's RabbitMQ users (``provisioning``). It may import
``yoke.core`` only; ``_lanes`` and ``_upgrades`` are its own.
"""

__all__ = ["amqp_nodes", "broker", "consumer", "dead_letters", "provisioning", "topology"]

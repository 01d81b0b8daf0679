"""A worker tool's RabbitMQ user (``tool-NAME``, ``tool-VHOST.NAME`` off the default vhost:
:func:`yoke.bus.topology.tool_user`): what ``yoke tools add-worker`` gives a worker.

The user may read only its tool's call queue and write only to ``yoke.commands``
(:func:`yoke.bus.topology.tool_worker_permissions`); the door knows which tool an answer comes
from by the AMQP ``user_id`` RabbitMQ verified, so this user is the worker's whole identity.
Made through the management API in the mesh's vhost, as ``yoke publisher create`` makes a
bridge's user.
"""

from __future__ import annotations

from urllib.parse import quote

from yoke.bus import topology
from yoke.bus.amqp_nodes import amqp_vhost
from yoke.cli.publishers import (
    Management,
    PublisherRefused,
    create_user,
    delete_user,
    management_delete,
    management_of,
)
from yoke.core.settings import Settings
from yoke.tools.catalog import name_problem


class ToolUserRefused(Exception):
    """The name is not a tool's, the user exists already, or the management API said no."""


def tool_user_name(settings: Settings, tool: str) -> str:
    """The RabbitMQ user of ``tool``'s workers in the mesh ``settings`` connect to."""
    return topology.tool_user(tool, amqp_vhost(settings.amqp_url))


async def create_tool_user(settings: Settings, tool: str) -> str:
    """Create the tool's user with exactly the worker permissions; returns its (random)
    password.

    An existing user is refused rather than given a new password: its workers would be cut
    off. Users are the broker's, not a vhost's; the name carries the mesh's vhost, so another
    mesh on the same broker never holds it.
    """
    problem = name_problem(tool)
    if problem is not None:
        raise ToolUserRefused(problem)
    management = management_of(settings.amqp_url, settings.management_url)
    try:
        return await create_user(
            management, tool_user_name(settings, tool), topology.tool_worker_permissions(tool)
        )
    except PublisherRefused as error:
        raise ToolUserRefused(str(error)) from error


async def delete_tool_user(settings: Settings, tool: str) -> bool:
    """Delete the tool's user; False if there was none. Its workers' connections close with it.

    Off the default vhost, a ``tool-NAME`` made before names carried the vhost, which the door
    still takes as the tool's worker, loses its permissions here too (only here: the user is
    the broker's, and another vhost's grants are not this mesh's to take).
    """
    management = management_of(settings.amqp_url, settings.management_url)
    try:
        deleted = await delete_user(management, tool_user_name(settings, tool))
        if management.vhost != "/":
            legacy = topology.tool_user(tool, "/")
            deleted = await revoke_permissions(management, legacy) or deleted
        return deleted
    except PublisherRefused as error:
        raise ToolUserRefused(str(error)) from error


async def revoke_permissions(management: Management, user: str) -> bool:
    """Take ``user``'s permissions on the mesh's vhost away; False if it had none."""
    path = f"/api/permissions/{quote(management.vhost, safe='')}/{quote(user, safe='')}"
    return await management_delete(management, path, f"revoke {user!r}'s permissions")

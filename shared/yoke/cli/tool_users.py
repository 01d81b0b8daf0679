"""A worker tool's RabbitMQ user (``tool-NAME``, ``tool-VHOST.NAME`` off the default vhost:
:func:`yoke.topology.tool_user`): what ``yoke tools add-worker`` gives a worker.

The user may read only its tool's call queue and write only to ``yoke.commands``
(:func:`yoke.topology.tool_worker_permissions`); the door knows which tool an answer comes
from by the AMQP ``user_id`` RabbitMQ verified, so this user is the worker's whole identity.
Made through the management API in the mesh's vhost, as ``yoke publisher create`` makes a
bridge's user.
"""

from __future__ import annotations

from yoke import topology
from yoke.cli.publishers import PublisherRefused, create_user, delete_user, management_of
from yoke.settings import Settings
from yoke.speakers import amqp_vhost
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
    """Delete the tool's user; False if there was none. Its workers' connections close with it."""
    management = management_of(settings.amqp_url, settings.management_url)
    try:
        return await delete_user(management, tool_user_name(settings, tool))
    except PublisherRefused as error:
        raise ToolUserRefused(str(error)) from error

"""``yoke publisher create``: a bridge's RabbitMQ user, with exactly the bridge permissions.

Made through RabbitMQ's management API in the mesh's vhost (YOKE_AMQP_URL's), so an operator
never types the permission patterns: they are :func:`yoke.bus.topology.publisher_permissions` (a
bridge NAME owns only ``bridge.NAME.*`` queues), and the policy that bounds every ``bridge.``
queue (:func:`yoke.bus.topology.bridge_queue_policy`) is set in the same vhost first.
"""

from __future__ import annotations

import argparse
import secrets
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, unquote, urlsplit, urlunsplit

import httpx

from yoke.bus import topology
from yoke.bus.amqp_nodes import amqp_vhost
from yoke.cli.base import with_store
from yoke.core.settings import Settings
from yoke.runtime.calls.approvers import grant_approver, revoke_approver
from yoke.store.database import Store

MANAGEMENT_PORT = 15672


class PublisherRefused(Exception):
    """The management API could not be reached or said no: nothing (more) was created."""


@dataclass(frozen=True)
class Management:
    """Where the management API is (no credentials in ``url``), as whom, and for which vhost."""

    url: str
    auth: tuple[str, str]
    vhost: str


def management_of(amqp_url: str, management_url: str | None = None) -> Management:
    """The management API for the mesh's vhost.

    The vhost is the AMQP URL's (its first node when YOKE_AMQP_URL lists several). The API is
    ``management_url`` (YOKE_MANAGEMENT_URL) when given, else ``http://<AMQP host>:15672``. It
    is called as the user ``management_url`` names, if it names one (an operator with the
    management tag, when the services' own user has none), else as the AMQP URL's user, which
    in a development setup is the one administrator there is.
    """
    amqp = urlsplit(amqp_url.split(",")[0].strip())
    vhost = amqp_vhost(amqp_url)
    auth = (unquote(amqp.username or "guest"), unquote(amqp.password or "guest"))
    if management_url:
        given = urlsplit(management_url)
        if given.username is not None:
            auth = (unquote(given.username), unquote(given.password or ""))
        netloc = given.hostname or ""
        if ":" in netloc:  # an IPv6 literal
            netloc = f"[{netloc}]"
        if given.port is not None:
            netloc = f"{netloc}:{given.port}"
        base = urlunsplit((given.scheme, netloc, given.path.rstrip("/"), "", ""))
    else:
        host = amqp.hostname or "127.0.0.1"
        if ":" in host:
            host = f"[{host}]"
        base = f"http://{host}:{MANAGEMENT_PORT}"
    return Management(base, auth, vhost)


def _why(response: httpx.Response) -> str:
    try:
        body: Any = response.json()
    except ValueError:
        body = None
    reason = body.get("reason") if isinstance(body, dict) else None
    why = f"{response.status_code} {reason or response.reason_phrase}"
    if response.status_code in (401, 403):
        why += " (set YOKE_MANAGEMENT_URL to http://USER:PASSWORD@HOST:15672 of a user "
        why += "tagged administrator)"
    return why


async def create_publisher(
    management: Management,
    name: str,
    password: str | None = None,
    *,
    settings: Settings | None = None,
) -> str:
    """Create user ``name`` with the bridge permissions in the vhost; returns its password.

    A name starting ``tool-`` is refused: those are tool workers' users, and the door takes
    the answer to a tool call by the user that published it. So is the HTTP gateway's user
    (the door trusts it to name tokens' people), and a name with a '.': bridge ``a`` owns the
    queues ``bridge.a.*``, which would hold those of a bridge ``a.b``.
    """
    settings = settings or Settings()
    if name.startswith(topology.TOOL_USER_PREFIX):
        raise PublisherRefused(
            f"user name {name!r} starts with {topology.TOOL_USER_PREFIX!r}, which is kept for "
            "tool workers (yoke tools add-worker makes those); choose another"
        )
    if name == settings.gateway_amqp_user:
        raise PublisherRefused(
            f"user name {name!r} is the HTTP gateway's (YOKE_GATEWAY_AMQP_USER); choose another"
        )
    if "." in name:
        raise PublisherRefused(f"user name {name!r} holds a '.'; choose one without")
    await set_bridge_policy(
        management, settings.bridge_queue_max_length, settings.bridge_queue_max_bytes
    )
    return await create_user(management, name, topology.publisher_permissions(name), password)


async def set_bridge_policy(management: Management, max_length: int, max_bytes: int) -> None:
    """Bound every ``bridge.`` queue of the vhost (invariant 14: a slow or absent bridge never
    makes the broker hold its lines without limit); idempotent."""
    policy = (
        f"/api/policies/{quote(management.vhost, safe='')}/"
        f"{quote(topology.BRIDGE_QUEUE_POLICY, safe='')}"
    )
    try:
        async with httpx.AsyncClient(
            base_url=management.url, auth=management.auth, timeout=30
        ) as api:
            answer = await api.put(policy, json=topology.bridge_queue_policy(max_length, max_bytes))
    except httpx.HTTPError as error:
        raise PublisherRefused(
            f"cannot reach the management API at {management.url}: {error!r}"
        ) from error
    if answer.is_error:
        raise PublisherRefused(
            f"the management API at {management.url} refused the policy bounding bridge queues "
            f"in vhost {management.vhost!r}: {_why(answer)}"
        )


async def create_user(
    management: Management,
    name: str,
    permissions: Mapping[str, str],
    password: str | None = None,
) -> str:
    """Create user ``name`` with exactly ``permissions`` in the vhost; returns its password.

    An existing user is refused, not overwritten: the name might be the services' own user,
    whose tags and password a PUT would replace. If the permissions cannot be set, the user
    just made is removed again.
    """
    if not name or name != name.strip():
        raise PublisherRefused(f"invalid user name {name!r}")
    password = password or secrets.token_urlsafe(24)
    user = f"/api/users/{quote(name, safe='')}"
    grant = f"/api/permissions/{quote(management.vhost, safe='')}/{quote(name, safe='')}"
    try:
        async with httpx.AsyncClient(
            base_url=management.url, auth=management.auth, timeout=30
        ) as api:
            existing = await api.get(user)
            if existing.status_code == 200:
                raise PublisherRefused(f"RabbitMQ user {name!r} exists already; choose another")
            if existing.status_code != 404:
                raise PublisherRefused(
                    f"the management API at {management.url} refused: {_why(existing)}"
                )
            created = await api.put(user, json={"password": password, "tags": ""})
            if created.is_error:
                raise PublisherRefused(
                    f"the management API at {management.url} refused to create user "
                    f"{name!r}: {_why(created)}"
                )
            granted = await api.put(grant, json=dict(permissions))
            if granted.is_error:
                await api.delete(user)
                raise PublisherRefused(
                    f"the management API at {management.url} refused permissions in vhost "
                    f"{management.vhost!r}: {_why(granted)}"
                )
    except httpx.HTTPError as error:
        raise PublisherRefused(
            f"cannot reach the management API at {management.url}: {error!r}"
        ) from error
    return password


async def management_delete(management: Management, path: str, what: str) -> bool:
    """DELETE ``path`` on the management API; False if there was nothing there (404)."""
    try:
        async with httpx.AsyncClient(
            base_url=management.url, auth=management.auth, timeout=30
        ) as api:
            answer = await api.delete(path)
    except httpx.HTTPError as error:
        raise PublisherRefused(
            f"cannot reach the management API at {management.url}: {error!r}"
        ) from error
    if answer.status_code == 404:
        return False
    if answer.is_error:
        raise PublisherRefused(
            f"the management API at {management.url} refused to {what}: {_why(answer)}"
        )
    return True


async def delete_user(management: Management, name: str) -> bool:
    """Delete RabbitMQ user ``name`` (its connections close with it); False if there was none."""
    return await management_delete(
        management, f"/api/users/{quote(name, safe='')}", f"delete user {name!r}"
    )


async def publisher_create(args: argparse.Namespace) -> None:
    settings = Settings()
    management = management_of(settings.amqp_url, settings.management_url)
    try:
        password = await create_publisher(management, args.name, settings=settings)
    except PublisherRefused as error:
        raise SystemExit(f"yoke: {error}") from error

    # In the mesh's store, which the door reads: RabbitMQ users are per broker, and this mesh
    # is the one whose approvals it may decide. Set either way: a user made again under the
    # name of one deleted (here or behind the mesh's back) starts with no right of the old
    # one's. Nobody holds the new password yet, so nobody speaks with the old rights meanwhile.
    async def set_rights(store: Store) -> None:
        if args.can_approve:
            await grant_approver(store, args.name)
        else:
            await revoke_approver(store, args.name)

    await with_store(set_rights)
    print(
        f"created RabbitMQ user {args.name!r} in vhost {management.vhost!r}: it may submit to "
        f"{topology.COMMANDS_EXCHANGE} and bind its {topology.bridge_queue_prefix(args.name)}* "
        f"queues to {topology.FORUM_EXCHANGE}"
        + (f" and decide on approvals ({topology.APPROVAL_COMMAND})" if args.can_approve else "")
        + "; its password is the last line",
        file=sys.stderr,
    )
    print(password)


async def publisher_revoke(args: argparse.Namespace) -> None:
    """The right to decide approvals taken away (``--can-approve``), or the user deleted with
    every right it had (its connections close with it)."""
    settings = Settings()

    had: list[bool] = []

    async def revoke(store: Store) -> None:
        had.append(await revoke_approver(store, args.name))

    await with_store(revoke)
    had_right = had == [True]
    if args.can_approve:
        if not had_right:
            raise SystemExit(f"yoke: publisher {args.name!r} may not decide approvals anyway")
    else:
        management = management_of(settings.amqp_url, settings.management_url)
        try:
            deleted = await delete_user(management, args.name)
        except PublisherRefused as error:
            raise SystemExit(f"yoke: {error}") from error
        if not deleted and not had_right:
            raise SystemExit(f"yoke: no RabbitMQ user {args.name!r}")
    print(args.name)


def register(commands: Any) -> None:
    """``yoke publisher create --name NAME [--can-approve]``, ``yoke publisher revoke --name
    NAME [--can-approve]``."""
    publisher = commands.add_parser("publisher", help="bridges' RabbitMQ users").add_subparsers(
        dest="sub", required=True
    )
    help = (
        "create a RabbitMQ user with exactly a bridge's permissions in the mesh's vhost "
        "(through the management API); prints its password bare on the last line"
    )
    create = publisher.add_parser("create", help=help, description=help)
    create.set_defaults(handler=publisher_create)
    create.add_argument("--name", required=True, help="the new user's name")
    create.add_argument(
        "--can-approve",
        action="store_true",
        help=f"it may also decide on calls waiting for approval ({topology.APPROVAL_COMMAND})",
    )
    help = (
        "delete a publisher's RabbitMQ user and every right it had; with --can-approve, take "
        "away only its right to decide approvals (the user stays)"
    )
    revoke = publisher.add_parser("revoke", help=help, description=help)
    revoke.set_defaults(handler=publisher_revoke)
    revoke.add_argument("--name", required=True, help="the user's name")
    revoke.add_argument(
        "--can-approve", action="store_true", help="take away only the right to decide approvals"
    )

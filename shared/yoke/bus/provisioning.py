"""RabbitMQ's users for a deployment, their passwords taken from the environment.

RabbitMQ cannot interpolate environment variables into a definitions file, and a file loaded at
boot (``load_definitions``) also stops the node from creating its default user. So the
repository's ``deploy/rabbitmq/definitions.json`` names the users (with their tags), their
permissions and the exchanges, and holds no password or hash; compose's one-shot
``rabbitmq-init`` service runs ``python -m yoke.bus.provisioning`` as the operator (the node's
default user, from ``RABBITMQ_DEFAULT_USER``/``_PASS``), which imports that file through the
management API with each user's password hash computed from the environment (``.env``, written
by ``make env``). Running it again sets the same users and permissions again: after editing
``.env``, ``docker compose up`` applies the new passwords.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import hashlib
import json
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit, urlunsplit

import httpx

from yoke.core.redact import redact

# Each user in the definitions file takes its password from this environment variable.
PASSWORD_VARIABLES = {
    "yoke": "YOKE_RABBITMQ_SERVICES_PASSWORD",
    "publisher": "YOKE_RABBITMQ_PUBLISHER_PASSWORD",
    "yoke-gateway": "YOKE_RABBITMQ_GATEWAY_PASSWORD",
}
HASHING_ALGORITHM = "rabbit_password_hashing_sha256"


class ProvisioningError(Exception):
    """Says what is missing or refused (exit 1 from the command line)."""


def password_hash(password: str, salt: bytes | None = None) -> str:
    """RabbitMQ's salted SHA-256 hash: base64(salt + sha256(salt + password)), 4-byte salt."""
    salt = os.urandom(4) if salt is None else salt
    return base64.b64encode(salt + hashlib.sha256(salt + password.encode()).digest()).decode()


def with_passwords(definitions: Mapping[str, Any], passwords: Mapping[str, str]) -> dict[str, Any]:
    """The definitions with every user's password hash set from ``passwords`` (by user name)."""
    users = []
    for user in definitions.get("users", []):
        name = user["name"]
        password = passwords.get(name)
        if not password:
            raise ProvisioningError(f"no password for the RabbitMQ user {name!r}")
        hashed = {"password_hash": password_hash(password), "hashing_algorithm": HASHING_ALGORITHM}
        users.append({**user, **hashed})
    return {**definitions, "users": users}


def passwords_from_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """Each known user's password from its variable; a missing one names the variable."""
    found = {}
    for user, variable in PASSWORD_VARIABLES.items():
        value = environ.get(variable, "")
        if not value:
            raise ProvisioningError(f"{variable} is not set: run `make env` (it writes .env)")
        found[user] = value
    return found


def split_credentials(url: str) -> tuple[str, tuple[str, str]]:
    """``http://user:pass@host:15672`` -> (``http://host:15672``, (user, pass))."""
    parts = urlsplit(url)
    if not parts.username or not parts.password:
        raise ProvisioningError(f"{redact(url)}: the management URL needs user:password@")
    netloc = parts.hostname or ""
    if parts.port:
        netloc += f":{parts.port}"
    bare = urlunsplit(parts._replace(netloc=netloc))
    return bare, (unquote(parts.username), unquote(parts.password))


async def import_definitions(
    management_url: str, definitions: Mapping[str, Any], *, deadline: float = 120.0
) -> None:
    """POST the definitions to ``/api/definitions``, waiting up to ``deadline`` s for the API."""
    base, auth = split_credentials(management_url)
    loop = asyncio.get_running_loop()
    give_up = loop.time() + deadline
    async with httpx.AsyncClient(base_url=base, auth=auth, timeout=30) as api:
        while True:
            # A node still booting refuses connections or answers 503 for a moment.
            try:
                response = await api.post("/api/definitions", json=definitions)
                if response.status_code < 500:
                    break
                problem = f"{response.status_code} {response.text[:200]}"
            except httpx.TransportError as error:
                problem = repr(error)
            if loop.time() > give_up:
                raise ProvisioningError(
                    f"the management API at {base} did not answer within {deadline:g} s: {problem}"
                )
            await asyncio.sleep(1.0)
        if response.status_code >= 300:
            raise ProvisioningError(
                f"importing the definitions was refused ({response.status_code}): "
                f"{response.text[:300]}"
            )


async def provision(
    management_url: str, definitions: Mapping[str, Any], environ: Mapping[str, str]
) -> int:
    """Import the definitions with passwords from ``environ``; returns how many users it set."""
    filled = with_passwords(definitions, passwords_from_environment(environ))
    await import_definitions(management_url, filled)
    return len(filled["users"])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m yoke.bus.provisioning",
        description="Create RabbitMQ's users (passwords from YOKE_RABBITMQ_*_PASSWORD), "
        "permissions and exchanges from a definitions file, through the management API at "
        "YOKE_MANAGEMENT_URL (http://operator:PASSWORD@host:15672).",
    )
    parser.add_argument("definitions", type=Path)
    args = parser.parse_args(argv)
    url = os.environ.get("YOKE_MANAGEMENT_URL", "")
    try:
        if not url:
            raise ProvisioningError("YOKE_MANAGEMENT_URL is not set")
        definitions = json.loads(args.definitions.read_text())
        count = asyncio.run(provision(url, definitions, os.environ))
    except ProvisioningError as error:
        print(f"provisioning: {redact(str(error))}", file=sys.stderr)
        sys.exit(1)
    print(f"provisioning: {count} RabbitMQ users and their permissions set", file=sys.stderr)


if __name__ == "__main__":
    main()

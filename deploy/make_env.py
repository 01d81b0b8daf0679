"""``make env``: a git-ignored ``.env`` with a random password for every user compose creates.

Idempotent: a variable ``.env`` already sets is never changed (a password in use stays the
same), only missing ones are appended; nothing secret is printed, only the names it added.
Standard library only, so it runs before the virtualenv exists. Passwords are URL-safe
(``[A-Za-z0-9_-]``) because compose puts them into connection URLs.
"""

from __future__ import annotations

import argparse
import os
import secrets
import sys
from pathlib import Path

# name -> (what it is for, whether it is a generated secret or a default value)
VARIABLES: dict[str, tuple[str, str | None]] = {
    "YOKE_RABBITMQ_OPERATOR_PASSWORD": (
        "RabbitMQ's operator (administrator: management UI, yoke publisher create)",
        None,
    ),
    "YOKE_RABBITMQ_SERVICES_PASSWORD": ("RabbitMQ's yoke user: the services (only yoke.*)", None),
    "YOKE_RABBITMQ_PUBLISHER_PASSWORD": ("RabbitMQ's publisher user: bridges", None),
    "YOKE_RABBITMQ_GATEWAY_PASSWORD": (
        "RabbitMQ's yoke-gateway user: the HTTP gateway (yoke.commands, yoke.forum)",
        None,
    ),
    "YOKE_MONGODB_ROOT_PASSWORD": ("MongoDB's root user", None),
    "YOKE_MONGODB_PASSWORD": ("MongoDB's yoke user: readWrite on the yoke database", None),
    "YOKE_MONGODB_GATEWAY_PASSWORD": (
        "MongoDB's yoke-gateway user: reads, and writes only webhook bookkeeping",
        None,
    ),
    "YOKE_GRAFANA_ADMIN_PASSWORD": ("Grafana's admin user", None),
    "YOKE_BIND_ADDRESS": (
        "where compose publishes every port; 0.0.0.0 opens them to the network",
        "127.0.0.1",
    ),
}


def new_password() -> str:
    return secrets.token_urlsafe(24)


def assigned(text: str) -> set[str]:
    """Variables a ``.env`` text sets to a non-empty value."""
    names = set()
    for line in text.splitlines():
        name, sep, value = line.strip().partition("=")
        if sep and not name.startswith("#") and value.strip():
            names.add(name.strip())
    return names


def complete(path: Path) -> list[str]:
    """Append to ``path`` every variable it lacks; returns their names (empty: nothing to do)."""
    existing = path.read_text() if path.exists() else ""
    missing = [name for name in VARIABLES if name not in assigned(existing)]
    if not missing:
        return []
    lines = (
        []
        if existing
        else ["# Written by `make env`: secrets for docker compose. Never commit it."]
    )
    for name in missing:
        purpose, default = VARIABLES[name]
        lines += [f"# {purpose}", f"{name}={default if default is not None else new_password()}"]
    text = existing + ("\n" if existing and not existing.endswith("\n") else "")
    text += "\n".join(lines) + "\n"
    temporary = path.with_name(path.name + ".tmp")
    # Owner-only from the first byte: the file holds every password of the deployment.
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "w") as file:
        file.write(text)
    os.replace(temporary, path)
    return missing


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("path", nargs="?", default=".env", type=Path)
    args = parser.parse_args(argv)
    added = complete(args.path)
    if added:
        print(f"[env] {args.path}: added {', '.join(added)}", file=sys.stderr)


if __name__ == "__main__":
    main()

"""``yoke post`` as a user RabbitMQ refuses: one line naming the refusal, never a traceback.

The users are compose's own (deploy/rabbitmq/definitions.json): the services' user may not
declare a bridge's reply queue, the publisher may.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote, unquote, urlsplit, urlunsplit

import httpx
import pytest

from tests.support.cli import cli_env, run_yoke
from yoke.bus import topology
from yoke.bus.broker import Bus

DEFINITIONS = Path(__file__).resolve().parents[2] / "deploy/rabbitmq/definitions.json"


@pytest.fixture(scope="module")
def as_compose_user(servers: tuple[str, str, str], amqp_url: str) -> Iterator[dict[str, str]]:
    """Compose's user name -> an AMQP URL on this module's vhost as a user with its permissions."""
    _, _, management = servers
    parts = urlsplit(amqp_url)
    vhost = unquote(parts.path[1:])
    permissions = json.loads(DEFINITIONS.read_text())["permissions"]
    made: dict[str, str] = {}
    with httpx.Client(
        base_url=management, auth=(parts.username or "guest", parts.password or "guest")
    ) as api:
        for grant in permissions:
            user, password = f"{grant['user']}-{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
            api.put(
                f"/api/users/{user}", json={"password": password, "tags": ""}
            ).raise_for_status()
            granted = {key: grant[key] for key in ("configure", "write", "read")}
            if grant["user"] == "publisher":
                # A bridge's queues are named by its user (bridge.NAME.*): they follow the name.
                granted = topology.publisher_permissions(user)
            api.put(
                f"/api/permissions/{quote(vhost, safe='')}/{user}", json=granted
            ).raise_for_status()
            netloc = f"{user}:{password}@{parts.hostname}:{parts.port or 5672}"
            made[grant["user"]] = urlunsplit(parts._replace(netloc=netloc))
        yield made
        for url in made.values():
            api.delete(f"/api/users/{urlsplit(url).username}")


async def post_as(url: str, mongodb_url: str) -> tuple[int, str, str]:
    code, out, err = await run_yoke(
        cli_env(url, mongodb_url),
        *("post", "--forum", "f-nowhere", "--author", "ada", "--timeout", "1", "hello?"),
        timeout=30,
    )
    return code, err, out


async def test_post_as_the_services_user_is_refused_in_one_line(
    as_compose_user: dict[str, str], amqp_url: str, mongodb_url: str
) -> None:
    bus = Bus(amqp_url, name="test-refused")
    await bus.connect()  # the topology exists; only the user's permissions stand in the way
    await bus.close()
    code, err, out = await post_as(as_compose_user["yoke"], mongodb_url)
    assert code == 1, err
    assert err.count("\n") == 1 and err.startswith("yoke: RabbitMQ refused: ACCESS_REFUSED"), err
    assert "bridge." in err and "publisher" in err, err
    assert out == ""


async def test_post_as_the_publisher_gets_past_the_reply_queue(
    as_compose_user: dict[str, str], amqp_url: str, mongodb_url: str
) -> None:
    bus = Bus(amqp_url, name="test-refused")
    await bus.connect()
    await bus.close()
    code, err, _ = await post_as(as_compose_user["publisher"], mongodb_url)
    # No ingestion consumes the commands here: the publisher's line waits for an answer.
    assert (code, err) == (1, "yoke: no answer within 1 s\n")

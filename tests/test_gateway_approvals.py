"""The gateway's and the CLI's doors for stopping agents and deciding approvals, end to end.

The mesh and the gateway run as real processes. ``POST /v1/forums/{id}/stop`` and ``yoke stop``
submit the line ``/stop`` for the person named (namespaced as any of the door's people); only a
token made with ``yoke token create --can-approve`` and scoped to the forum may list or decide
its approvals.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from tests.support.cli import run_yoke
from tests.support.gateway_process import running_gateway
from tests.support.mesh import Mesh, lines_until
from yoke.ids import new_id
from yoke.models import Message
from yoke.runtime.joins import create_forum
from yoke.store import Store
from yoke.tokens import create_token, ensure_token_indexes

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
async def gateway_url(
    amqp_url: str, module_mongodb_url: str, mesh: Mesh, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[str]:
    log_dir = Path(tmp_path_factory.mktemp("gateway"))
    async with running_gateway(amqp_url, module_mongodb_url, log_dir) as url:
        yield url


@pytest.fixture(scope="module")
async def http(gateway_url: str) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=gateway_url, timeout=30) as client:
        yield client


@pytest.fixture(scope="module")
def cli_env(amqp_url: str, module_mongodb_url: str) -> dict[str, str]:
    return {"YOKE_AMQP_URL": amqp_url, "YOKE_MONGODB_URL": module_mongodb_url}


async def token(
    store: Store, forums: list[str] | None, *, can_approve: bool = False
) -> tuple[str, str]:
    """A new token's name and secret."""
    await ensure_token_indexes(store)
    name = f"t{new_id()[:10]}"
    _, secret = await create_token(store, name, forums, can_approve=can_approve)
    return name, secret


def bearer(secret: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}"}


async def author_of(store: Store, line: Message) -> tuple[str | None, str]:
    actor = await store.get_actor(line.author_actor_id)
    assert actor is not None
    return actor.external_id, actor.name


# --- stop -------------------------------------------------------------------------------


async def test_stop_over_http_submits_the_stop_line_for_the_person_named(
    http: httpx.AsyncClient, store: Store
) -> None:
    forum = await create_forum(store, "stop over http")
    name, secret = await token(store, [forum.id])
    answer = await http.post(
        f"/v1/forums/{forum.id}/stop",
        json={"author": {"externalId": "ada", "displayName": "Ada"}},
        headers=bearer(secret),
    )
    assert answer.status_code == 202, answer.text
    accepted = answer.json()
    assert accepted["duplicate"] is False
    lines = await lines_until(store, forum.id, lambda lines: len(lines) >= 1)
    line = next(line for line in lines if line.id == accepted["messageId"])
    assert (line.role, line.type, line.text) == ("user", "message", "/stop")
    assert await author_of(store, line) == (f"http:{name}:ada", "Ada")

    # A body without an author, or with an empty one, is refused and writes nothing.
    for body in ({}, {"author": {"externalId": "", "displayName": "x"}}, {"text": "/stop"}):
        refused = await http.post(f"/v1/forums/{forum.id}/stop", json=body, headers=bearer(secret))
        assert refused.status_code == 400 and refused.json()["code"] == "invalid_body", body
    other = await create_forum(store, "someone else's")
    outside = await http.post(
        f"/v1/forums/{other.id}/stop",
        json={"author": {"externalId": "ada", "displayName": "Ada"}},
        headers=bearer(secret),
    )
    assert outside.status_code == 403
    assert [line.text for line in await store.history(forum.id)] == ["/stop"]
    assert await store.history(other.id) == []


async def test_yoke_stop_submits_the_stop_line_as_the_cli_person(
    store: Store, mesh: Mesh, cli_env: dict[str, str]
) -> None:
    forum = await create_forum(store, "stop from the cli")
    code, out, err = await run_yoke(cli_env, "stop", "--forum", forum.id, "--as", "grace")
    assert code == 0, err
    message_id = out.strip()
    lines = await lines_until(store, forum.id, lambda lines: len(lines) >= 1)
    line = next(line for line in lines if line.id == message_id)
    assert line.text == "/stop" and line.role == "user"
    assert await author_of(store, line) == ("cli:grace", "grace")
    code, _, err = await run_yoke(cli_env, "stop", "--forum", "no-such-forum", "--as", "grace")
    assert code == 1 and "no-such-forum" in err, err


# --- tokens that may decide -------------------------------------------------------------


async def test_yoke_token_create_can_approve_is_stored_and_listed(
    store: Store, cli_env: dict[str, str]
) -> None:
    forum = await create_forum(store, "approvers")
    approver, plain = f"a{new_id()[:10]}", f"p{new_id()[:10]}"
    code, out, err = await run_yoke(
        cli_env, "token", "create", "--name", approver, "--forum", forum.id, "--can-approve"
    )
    assert code == 0, err
    assert "may decide approvals" in out and out.strip().splitlines()[-1].startswith("yoke_")
    code, out, err = await run_yoke(cli_env, "token", "create", "--name", plain)
    assert code == 0 and "approvals" not in out, err
    code, out, err = await run_yoke(cli_env, "token", "list")
    assert code == 0, err
    listed = {entry["name"]: entry for entry in map(json.loads, out.splitlines())}
    assert listed[approver]["canApprove"] is True and listed[approver]["forums"] == [forum.id]
    assert listed[plain]["canApprove"] is False and listed[plain]["forums"] is None

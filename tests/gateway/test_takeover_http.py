"""Taking a forum over through the HTTP gateway, end to end: the mesh and the gateway run as
real processes.

Only a token made with ``yoke token create --can-take-over`` and scoped to the forum may
``POST .../takeover`` or ``.../handback``; any other gets 403 and nothing is written. The
gateway submits ``/takeover [reason]`` and ``/handback`` for the person named, in the token's
namespace, and answers the door's refusals (a forum held already, one nobody holds) with 409.
"""

from __future__ import annotations

import json
import re

import httpx
import pytest

from tests.support.cli import run_yoke
from tests.support.mesh import Mesh, lines_until
from yoke.core.ids import new_id
from yoke.core.models import Message
from yoke.runtime.holds import MAX_HOLD_REASON_CHARS, Holds
from yoke.runtime.joins import create_forum
from yoke.store.database import Store
from yoke.store.tokens import create_token, ensure_token_indexes

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cli_env(amqp_url: str, module_mongodb_url: str) -> dict[str, str]:
    return {"YOKE_AMQP_URL": amqp_url, "YOKE_MONGODB_URL": module_mongodb_url}


async def token(
    store: Store, forums: list[str] | None, *, can_take_over: bool = False
) -> tuple[str, str]:
    """A new token's name and secret."""
    await ensure_token_indexes(store)
    name = f"t{new_id()[:10]}"
    _, secret = await create_token(store, name, forums, can_take_over=can_take_over)
    return name, secret


def bearer(secret: str, key: str | None = None) -> dict[str, str]:
    headers = {"Authorization": f"Bearer {secret}"}
    if key is not None:
        headers["Idempotency-Key"] = key
    return headers


async def author_of(store: Store, line: Message) -> tuple[str | None, str]:
    actor = await store.get_actor(line.author_actor_id)
    assert actor is not None
    return actor.external_id, actor.name


async def test_yoke_token_create_can_take_over_is_stored_and_listed(
    store: Store, mesh: Mesh, cli_env: dict[str, str]
) -> None:
    forum = await create_forum(store, "a token's right, listed")
    taker, plain = f"taker{new_id()[:8]}", f"plain{new_id()[:8]}"
    code, out, err = await run_yoke(
        cli_env, "token", "create", "--name", taker, "--forum", forum.id, "--can-take-over"
    )
    assert code == 0, err
    assert "take its forums over" in out
    code, _, err = await run_yoke(cli_env, "token", "create", "--name", plain)
    assert code == 0, err
    code, out, err = await run_yoke(cli_env, "token", "list")
    assert code == 0, err
    listed = {entry["name"]: entry for entry in map(json.loads, out.splitlines())}
    assert listed[taker]["canTakeOver"] is True and listed[taker]["forums"] == [forum.id]
    assert listed[plain]["canTakeOver"] is False


async def test_a_token_without_the_right_or_the_forum_gets_403_and_nothing_is_written(
    http: httpx.AsyncClient, store: Store
) -> None:
    forum = await create_forum(store, "not yours to take")
    other = await create_forum(store, "another's")
    _, plain = await token(store, [forum.id])  # in scope, without the right
    _, everywhere = await token(store, None)  # every forum, without the right
    _, elsewhere = await token(store, [other.id], can_take_over=True)  # the right, not the forum
    for secret in (plain, everywhere, elsewhere):
        for route, body in (("takeover", {"as": "ada", "reason": "mine"}), ("handback", {})):
            answer = await http.post(
                f"/v1/forums/{forum.id}/{route}", json=body, headers=bearer(secret)
            )
            assert answer.status_code == 403, (route, answer.text)
            assert answer.json()["code"] == "forbidden"
    no_right = await http.post(f"/v1/forums/{forum.id}/takeover", headers=bearer(plain))
    assert "--can-take-over" in no_right.json()["error"]
    # An unknown forum is a 403 to a scoped token too (it learns nothing of other forums).
    unknown = await http.post("/v1/forums/no-such-forum/takeover", headers=bearer(elsewhere))
    assert unknown.status_code == 403
    assert await store.history(forum.id) == []
    assert await Holds(store).get(forum.id) is None


async def test_takeover_and_handback_submit_the_hold_lines_for_the_person_named(
    http: httpx.AsyncClient, store: Store
) -> None:
    forum = await create_forum(store, "taken over over http")
    name, secret = await token(store, [forum.id], can_take_over=True)
    base = f"/v1/forums/{forum.id}"

    too_long = {"as": "ada", "reason": "x" * (MAX_HOLD_REASON_CHARS + 1)}
    refused = await http.post(f"{base}/takeover", json=too_long, headers=bearer(secret))
    assert refused.status_code == 400 and refused.json()["code"] == "invalid_body"
    assert await store.history(forum.id) == []

    body = {"as": "ada", "reason": "the customer asked for a person"}
    taken = await http.post(f"{base}/takeover", json=body, headers=bearer(secret, "take-1"))
    assert taken.status_code == 202, taken.text
    assert taken.json()["duplicate"] is False
    again = await http.post(f"{base}/takeover", json=body, headers=bearer(secret, "take-1"))
    assert again.status_code == 202, again.text
    assert again.json() == {"messageId": taken.json()["messageId"], "duplicate": True}

    lines = await lines_until(store, forum.id, lambda lines: len(lines) >= 1)
    line = next(line for line in lines if line.id == taken.json()["messageId"])
    assert (line.role, line.text) == ("user", "/takeover the customer asked for a person")
    external_id, display_name = await author_of(store, line)
    assert re.fullmatch(rf"http:{name}~[0-9a-f]{{16}}:ada", external_id or "")
    assert display_name == "ada"
    hold = await Holds(store).get(forum.id)
    assert hold is not None and hold.line_id == line.id and hold.holder.display_name == "ada"

    # Held: a second takeover, by anyone, is refused and writes nothing.
    second = await http.post(f"{base}/takeover", json={"as": "bob"}, headers=bearer(secret))
    assert second.status_code == 409, second.text
    assert second.json()["code"] == "held" and "ada" in second.json()["error"]

    back = await http.post(f"{base}/handback", headers=bearer(secret))
    assert back.status_code == 202, back.text
    lines = await lines_until(store, forum.id, lambda lines: len(lines) >= 2)
    handback = next(line for line in lines if line.id == back.json()["messageId"])
    assert handback.text == "/handback"
    external_id, _ = await author_of(store, handback)
    assert (external_id or "").endswith(f":{name}")  # the token's own name when none is given
    assert await Holds(store).get(forum.id) is None

    nobody = await http.post(f"{base}/handback", json={"as": "ada"}, headers=bearer(secret))
    assert nobody.status_code == 409 and nobody.json()["code"] == "not_held", nobody.text
    assert [line.text for line in await store.history(forum.id)] == [
        "/takeover the customer asked for a person",
        "/handback",
    ]

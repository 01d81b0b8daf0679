"""Hostile HTTP at the gateway: every request of tests/data/hostile_http.json gets its status and
a JSON error, never a 500, over a bare socket to a real gateway process; and the gateway still
serves good requests after the whole corpus (the HTTP twin of test_hostile_commands.py).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest

from tests.support.gateway_process import running_gateway
from tests.support.raw_http import exchange, request_bytes
from yoke.ids import new_id
from yoke.models import Message, TextPart
from yoke.runtime.joins import create_forum
from yoke.runtime.posting import Poster
from yoke.store import Store
from yoke.tokens import create_token, ensure_token_indexes

pytestmark = pytest.mark.slow

CORPUS = json.loads((Path(__file__).parents[1] / "data" / "hostile_http.json").read_text())["cases"]
CHUNK = 16384


@pytest.fixture(scope="module")
async def gateway_port(
    amqp_url: str,
    module_mongodb_url: str,
    poster: Poster,  # its bus declares the exchanges the gateway reads
    tmp_path_factory: pytest.TempPathFactory,
) -> AsyncIterator[int]:
    log_dir = Path(tmp_path_factory.mktemp("hostile-gateway"))
    # No mesh behind it: a POST that got past the gateway's checks would wait for the door, and
    # answer 503 after this (a status no case expects).
    async with running_gateway(
        amqp_url, module_mongodb_url, log_dir, YOKE_GATEWAY_SUBMIT_TIMEOUT_SECONDS="1"
    ) as url:
        yield urlsplit(url).port or 0


@pytest.fixture(scope="module")
async def forum_and_token(store: Store, poster: Poster) -> tuple[str, str]:
    await ensure_token_indexes(store)
    forum = await create_forum(store, "hostile http")
    _, secret = await create_token(store, f"hostile-{new_id()[:8]}", [forum.id])
    line = Message(
        id=new_id(),
        conversation_id=forum.id,
        author_actor_id="someone",
        parts=[TextPart(text="kept")],
    )
    await poster.post(line)
    return forum.id, secret


def _value(value: str, replacements: dict[str, str]) -> bytes:
    for placeholder, real in replacements.items():
        value = value.replace(placeholder, real)
    return value.encode("latin-1")


def _body(case: dict[str, Any]) -> bytes | None:
    if "bodyHex" in case:
        return bytes.fromhex(case["bodyHex"])
    if "bodyRepeat" in case:
        spec: dict[str, Any] = case["bodyRepeat"]
        text: str = spec["prefix"] + spec["unit"] * spec["times"] + spec["suffix"]
        return text.encode()
    body: str | None = case["body"]
    return None if body is None else body.encode()


def _request(case: dict[str, Any], forum_id: str, secret: str) -> bytes:
    replacements = {"{forum}": forum_id, "{token}": secret}
    path = case["path"].replace("{forum}", forum_id)
    target = path.encode("latin-1") if case.get("rawTarget") else path
    headers: list[tuple[str, bytes | str]] = [
        (name, _value(value, replacements)) for name, value in case["headers"]
    ]
    body = _body(case)
    raw = request_bytes(
        case["method"], target, headers, body, content_length=not case.get("chunked")
    )
    if case.get("rawHeaderLine"):
        head, _, rest = raw.partition(b"\r\n")
        raw = head + b"\r\n" + case["rawHeaderLine"].encode() + b"\r\n" + rest
    if case.get("chunked") and body is not None:
        head, _, _ = raw.partition(b"\r\n\r\n")
        chunks = b"".join(
            b"%x\r\n%s\r\n" % (len(body[i : i + CHUNK]), body[i : i + CHUNK])
            for i in range(0, len(body), CHUNK)
        )
        raw = head + b"\r\nTransfer-Encoding: chunked\r\n\r\n" + chunks + b"0\r\n\r\n"
    return raw


async def test_every_hostile_request_gets_its_status_and_a_json_error(
    gateway_port: int, forum_and_token: tuple[str, str]
) -> None:
    forum_id, secret = forum_and_token
    wrong = []
    for case in CORPUS:
        response = await exchange(gateway_port, _request(case, forum_id, secret))
        try:
            error = response.json().get("error")
        except ValueError:
            error = None
        if response.status != case["status"] or not error:
            wrong.append(f"{case['name']}: {response.status} {response.body[:200]!r}")
    assert not wrong, "\n".join(wrong)


async def test_the_gateway_still_serves_good_requests_after_the_corpus(
    gateway_port: int, forum_and_token: tuple[str, str]
) -> None:
    forum_id, secret = forum_and_token
    for case in CORPUS:
        await exchange(gateway_port, _request(case, forum_id, secret))
    headers = {"Authorization": f"Bearer {secret}"}
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{gateway_port}", timeout=10) as http:
        page = await http.get(f"/v1/forums/{forum_id}/messages", headers=headers)
        assert page.status_code == 200, page.text
        assert [line["parts"][0]["text"] for line in page.json()["messages"]] == ["kept"]
        async with http.stream("GET", f"/v1/forums/{forum_id}/stream", headers=headers) as live:
            assert live.status_code == 200
            assert (await anext(live.aiter_bytes())).startswith(b"retry:")
        assert (await http.get("/healthz")).text == "ok\n"

"""An agent's memories in the console, over a real gateway process (no mesh: memories and lines
are written in the store directly) and in Debian's headless Chromium.

The data route shows only a ``--can-manage-memory`` token the memories its forums taught, each
with the line that taught it read by the line's id (never a line of another forum, whatever a
memory's source claims); the page lists them with their lines and forgets one. ``yoke token
create --can-manage-memory`` makes such a token, and ``yoke token list`` shows it.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from datetime import timedelta
from pathlib import Path

import httpx
import pytest
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver

from services.gateway.console import PAGE_HEADERS
from tests.support.browser import texts, wait_for
from tests.support.cli import cli_env, run_yoke
from tests.support.gateway_process import running_gateway
from tests.support.processes import eventually
from yoke.core.ids import new_id
from yoke.core.models import Message, TextPart, utcnow
from yoke.runtime.joins import create_agent, create_forum
from yoke.runtime.memories import Memories, Memory, MemorySource, person_id_of
from yoke.store.database import Store
from yoke.store.tokens import create_token, ensure_token_indexes

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
async def gateway_url(
    amqp_url: str, module_mongodb_url: str, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[str]:
    """A gateway with no mesh under it (conftest's would start one first)."""
    log_dir = Path(tmp_path_factory.mktemp("gateway"))
    async with running_gateway(amqp_url, module_mongodb_url, log_dir) as url:
        yield url


async def token(store: Store, forums: list[str] | None, *, can_manage_memory: bool = True) -> str:
    await ensure_token_indexes(store)
    name = f"c{new_id()[:10]}"
    _, secret = await create_token(store, name, forums, can_manage_memory=can_manage_memory)
    return secret


async def get(url: str, path: str, secret: str | None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {secret}"} if secret else {}
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        return await http.get(path, headers=headers)


async def line(store: Store, forum_id: str, author: str, text: str) -> Message:
    parts = [TextPart(text=text)]
    message = Message(id=new_id(), conversation_id=forum_id, author_actor_id=author, parts=parts)
    stored, _ = await store.insert_message(message)
    return stored


async def taught(
    store: Store, agent: str, forum_id: str, message_id: str, text: str, author: str
) -> str:
    source = MemorySource(
        forum_id=forum_id,
        message_id=message_id,
        author_actor_id=author,
        author_name="Ada",
        at=utcnow() - timedelta(seconds=1),
    )
    memory = Memory.new(new_id(), agent, "person", author, text, source)
    await Memories(store).remember(memory)
    return memory.id


async def test_the_console_shows_a_token_its_forums_memories_with_their_lines(
    gateway_url: str, store: Store
) -> None:
    agent = await create_agent(store, "concierge")
    mine = (await create_forum(store, "mine")).id
    theirs = (await create_forum(store, "theirs")).id
    ada = person_id_of("http:t:ada")
    said = await line(store, mine, ada, "I am vegan, by the way")
    secret_line = await line(store, theirs, ada, "my vault code is 1234")
    vegan = await taught(store, agent.id, mine, said.id, "ada is vegan", ada)
    # A memory of the token's forum whose source names another forum's line: the line is not
    # shown (it is read by id, and must be of the forum the memory names).
    forged = await taught(store, agent.id, mine, secret_line.id, "ada has a vault", ada)
    hidden = await taught(store, agent.id, theirs, secret_line.id, "ada's code is 1234", ada)
    scoped = await token(store, [mine])
    path = f"/console/api/agents/{agent.id}/memories"

    body = (await get(gateway_url, path, scoped)).json()
    assert body["name"] == "concierge" and body["agentActorId"] == agent.id
    shown = {memory["id"]: memory for memory in body["memories"]}
    assert set(shown) == {vegan, forged}
    assert shown[vegan]["line"]["text"] == "I am vegan, by the way"
    assert shown[vegan]["line"]["seq"] == said.seq and shown[vegan]["source"]["forumId"] == mine
    assert shown[forged].get("line") is None
    assert "1234" not in str(body)

    everything = (await get(gateway_url, path, await token(store, None))).json()
    assert {memory["id"] for memory in everything["memories"]} == {vegan, forged, hidden}
    plain = await token(store, [mine], can_manage_memory=False)
    refused = await get(gateway_url, path, plain)
    assert refused.status_code == 403 and "--can-manage-memory" in refused.json()["error"]
    info = (await get(gateway_url, f"/console/api/forums/{mine}", scoped)).json()
    assert info["canManageMemory"] is True
    assert (await get(gateway_url, f"/console/api/forums/{mine}", plain)).json()[
        "canManageMemory"
    ] is False
    # A token that sees none of an agent's memories is not told its name.
    other = await token(store, [(await create_forum(store, "other")).id])
    unseen = (await get(gateway_url, path, other)).json()
    assert unseen == {"agentActorId": agent.id, "name": None, "memories": []}

    page = await get(gateway_url, "/agents/%3Cscript%3E/memories", None)
    assert page.status_code == 200 and "<script>" not in page.text.split("</head>")[1]
    assert page.headers["content-security-policy"] == PAGE_HEADERS["Content-Security-Policy"]


async def test_the_memories_page_lists_each_memory_with_its_line_and_forgets_one(
    store: Store, gateway_url: str, browser: WebDriver
) -> None:
    agent = await create_agent(store, "librarian")
    forum = (await create_forum(store, "the library")).id
    ada = person_id_of("http:t:ada2")
    said = await line(store, forum, ada, "call me Ada, not Adelaide")
    kept = await taught(store, agent.id, forum, said.id, "prefers to be called Ada", ada)
    other = await line(store, forum, ada, "I read crime novels")
    forgotten = await taught(store, agent.id, forum, other.id, "reads crime novels", ada)
    secret = await token(store, [forum])

    driver = browser
    driver.get(f"{gateway_url}/agents/{agent.id}/memories")
    wait_for(
        driver, "the token form", lambda d: d.find_element(By.ID, "token-input").is_displayed()
    )
    driver.find_element(By.ID, "token-input").send_keys(secret)
    driver.find_element(By.CSS_SELECTOR, "#token-form button").click()
    wait_for(driver, "two memories", lambda d: len(texts(d, "li.memory")) == 2)
    assert driver.find_element(By.ID, "memories-title").text == "librarian's memories"
    item = driver.find_element(By.CSS_SELECTOR, f'li.memory[data-memory-id="{kept}"]')
    assert "prefers to be called Ada" in item.text
    assert "call me Ada, not Adelaide" in item.find_element(By.CSS_SELECTOR, ".source-line").text
    driver.find_element(
        By.CSS_SELECTOR, f'li.memory[data-memory-id="{forgotten}"] button.forget'
    ).click()
    wait_for(driver, "the memory forgotten", lambda d: len(texts(d, "li.memory")) == 1)

    async def gone() -> bool:
        return await Memories(store).get(forgotten) is None

    await eventually(gone, timeout=10, what="the memory forgotten in the store")
    assert await Memories(store).get(kept) is not None


async def test_yoke_token_create_can_manage_memory_is_stored_and_listed(
    amqp_url: str, module_mongodb_url: str, gateway_url: str
) -> None:
    env = cli_env(amqp_url, module_mongodb_url)
    manager, plain = f"mm{new_id()[:8]}", f"pl{new_id()[:8]}"
    code, out, err = await run_yoke(
        env, "token", "create", "--name", manager, "--can-manage-memory"
    )
    assert code == 0, err
    assert "forget and erase the memories" in out
    secret = out.splitlines()[-1]
    code, _, err = await run_yoke(env, "token", "create", "--name", plain)
    assert code == 0, err
    code, out, err = await run_yoke(env, "token", "list")
    assert code == 0, err
    listed = {entry["name"]: entry for entry in map(json.loads, out.splitlines())}
    assert listed[manager]["canManageMemory"] is True
    assert listed[plain]["canManageMemory"] is False
    answer = await get(gateway_url, f"/console/api/agents/{new_id()}/memories", secret)
    assert answer.status_code == 200 and answer.json()["memories"] == []

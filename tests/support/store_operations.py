"""What a turn costs the store: ``yoke_store_operations_total`` of the mesh and a gateway.

The services' operations made while handling deliveries (``origin="delivery"``: their own
timers and sweeps left out) and the gateway's (but for its token watch's look-ups, one a second
for all its open streams and waiting calls, not a turn's), by ``<process>:<command>``; a test takes
the counts before and after a turn, once nothing has moved for a second.
"""

from __future__ import annotations

import asyncio
from collections import Counter

import httpx
from prometheus_client.parser import text_string_to_metric_families

from services.gateway.deps import TOKEN_WATCH_ORIGIN
from tests.support.mesh import Mesh
from tests.support.processes import eventually
from yoke.store.database import Store


async def store_operations(mesh: Mesh, gateway_url: str) -> Counter[str]:
    """Store operations so far: the services' while handling deliveries, and the gateway's."""
    counts: Counter[str] = Counter()
    texts = {name: await process.metrics() for name, process in mesh.processes.items()}
    async with httpx.AsyncClient(timeout=30) as client:
        texts["gateway"] = (await client.get(f"{gateway_url}/metrics")).text
    for name, text in texts.items():
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name != "yoke_store_operations_total":
                    continue
                origin = sample.labels.get("origin")
                if origin == "delivery" or (name == "gateway" and origin != TOKEN_WATCH_ORIGIN):
                    counts[f"{name}:{sample.labels['command']}"] += int(sample.value)
    return counts


async def settled_operations(mesh: Mesh, gateway_url: str) -> Counter[str]:
    """The counts once nothing has moved for a second (a turn's tail deliveries are done)."""
    loop = asyncio.get_running_loop()
    last = await store_operations(mesh, gateway_url)
    quiet_since = loop.time()
    while loop.time() - quiet_since < 1.0:
        await asyncio.sleep(0.25)
        now = await store_operations(mesh, gateway_url)
        if now != last:
            last, quiet_since = now, loop.time()
    return last


def total(counts: Counter[str], *, gateway: bool) -> int:
    """The gateway's operations, or the services'."""
    return sum(value for key, value in counts.items() if key.startswith("gateway:") == gateway)


def breakdown(counts: Counter[str]) -> str:
    return ", ".join(f"{key}={value}" for key, value in sorted(counts.items()) if value)


async def http_turn(
    http: httpx.AsyncClient, store: Store, forum_id: str, secret: str, text: str
) -> None:
    """The baseline the caller doors' costs are held against: a line posted over REST and its
    answer read back as a REST client would (polling the page after the line)."""
    auth = {"Authorization": f"Bearer {secret}"}
    body = {"author": {"externalId": "ada", "displayName": "Ada"}, "text": text}
    posted = await http.post(f"/v1/forums/{forum_id}/messages", json=body, headers=auth)
    assert posted.status_code == 202, posted.text
    line = await store.get_message(posted.json()["messageId"])
    assert line is not None

    async def answered() -> bool:
        page = await http.get(
            f"/v1/forums/{forum_id}/messages", params={"after": line.seq}, headers=auth
        )
        return any(m["role"] == "agent" for m in page.json()["messages"])

    await eventually(answered, timeout=60, what=f"the answer to {text!r}", interval=0.05)

"""A processor killed in the middle of a ``remember`` (``os._exit`` at the named point, as a
``kill -9`` there): the step is redelivered to the processor started again, and the memory is
written once, counted once, answered in one results line.
"""

from __future__ import annotations

from collections import Counter

import pytest
from prometheus_client.parser import text_string_to_metric_families

from services.processor import remembering
from tests.support import faults
from tests.support.mesh import Mesh, lines_until, say
from tests.support.processes import eventually
from yoke.client import Client
from yoke.core.models import Message, ToolResultPart
from yoke.llm.base import ScriptedCall, ScriptedOutput
from yoke.runtime.join_config import JoinConfig, MemoryConfig
from yoke.runtime.joins import create_agent, create_forum, join_conversation
from yoke.runtime.memories import Memories
from yoke.runtime.posting import Poster
from yoke.store.database import Store

pytestmark = pytest.mark.slow

WAIT = 60
TAUGHT = "Ana's order number is 4711"

# Right after the memory is written (not yet counted), and right after it is counted (its
# result not yet in a line).
POINTS = [faults.fault("after", Memories.remember), faults.fault("after", remembering.remember)]


async def stored_count(mesh: Mesh) -> Counter[str]:
    counts: Counter[str] = Counter()
    for family in text_string_to_metric_families(await mesh.processes["processor"].metrics()):
        for sample in family.samples:
            if sample.name == "yoke_memories_stored_total":
                counts[sample.labels["scope"]] += int(sample.value)
    return counts


def remember_results(lines: list[Message]) -> list[tuple[str, list[ToolResultPart]]]:
    return [
        (line.id, parts)
        for line in lines
        if (parts := [p for p in line.parts if isinstance(p, ToolResultPart)])
    ]


@pytest.mark.parametrize("point", POINTS)
async def test_a_processor_killed_mid_remember_writes_the_memory_once(
    point: str, store: Store, poster: Poster, client: Client, mesh: Mesh
) -> None:
    agent = await create_agent(store, "keeper")
    forum = await create_forum(store, "orders")
    config = JoinConfig(
        model="fixture-script",
        script=[
            ScriptedOutput(tool_calls=[ScriptedCall(name="remember", input={"text": TAUGHT})]),
            ScriptedOutput(text="Noted."),
        ],
        memory=MemoryConfig(),
        hop_cap=1,
    )
    join = await join_conversation(store, poster, agent.id, forum.id, config)
    faulty = mesh.start_faulty("processor", point)
    await faulty.wait_healthy()
    await say(client, forum.id, "my order is 4711", "ana")

    async def dead() -> bool:
        return faulty.popen.poll() is not None

    await eventually(dead, timeout=WAIT, what="the processor to die mid-remember")
    assert faulty.popen.wait(10) == faults.EXIT_CODE, faulty.output()[-2000:]
    faulty.stop()
    (written,) = await Memories(store).listed(agent_actor_id=agent.id)  # before the restart
    assert written.text == TAUGHT
    mesh.start("processor")
    await mesh.processes["processor"].wait_healthy()

    lines = await lines_until(
        store, forum.id, lambda lines: any(line.text == "Noted." for line in lines), timeout=WAIT
    )
    assert [line.text for line in lines if line.role == "agent"] == ["Noted."]
    (memory,) = await Memories(store).listed(agent_actor_id=agent.id)
    assert memory.id == written.id and memory.created_at == written.created_at
    ((_, results),) = remember_results(await store.history(join.monologue_id))
    assert [(r.output, r.is_error) for r in results] == [(f"remembered {memory.id}", False)]
    # The restarted processor found the memory written: it does not count it again.
    assert await stored_count(mesh) == Counter()

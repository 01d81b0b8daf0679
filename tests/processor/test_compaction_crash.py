"""A processor killed inside a compaction: the swap resumes and no forum line is lost or repeated.

docs/architecture.md, invariant 9. For each fault point the processor runs under
``tests.support.faults``, which kills it (``os._exit``) right after one step of the monologue swap;
it is then started again normally while people keep talking.
"""

from __future__ import annotations

import asyncio
import itertools

import pytest

from tests.support import faults
from tests.support.mesh import JoinFactory, Mesh, agent_lines, lines_until, say
from tests.support.processes import eventually
from yoke.client import Client
from yoke.core.models import Message, Part, TextPart, ToolCallPart, ToolResultPart
from yoke.runtime import compaction
from yoke.runtime.actor import ActorContext, instance_state_id
from yoke.runtime.chain import SWAPPING, carriable, chain_of
from yoke.runtime.compaction import SWAP_STEPS, needs_compaction, split_for_compaction
from yoke.runtime.instances import PROCESSOR, ProcessorConfig
from yoke.runtime.joins import Join, join_id
from yoke.store.database import PROCEDURES, Store

pytestmark = pytest.mark.slow

# Small enough that a handful of short lines compacts, and it compacts again soon after.
THRESHOLD = 120
KEEP = 2

# Right after each step of the swap, in order (yoke.runtime.compaction.SWAP_STEPS); the repoint step
# is the runtime's ActorContext.repoint (where today's code lost the join), and after the last
# step there is nothing left to resume.
FAULT_TARGETS = [
    compaction.record_intent,
    compaction.open_monologue,
    compaction.write_summary,
    compaction.write_context,
    compaction.arm_wake,
    ActorContext.repoint,
    compaction.rouse,
    compaction.move_participant,
    compaction.carry_over,
    compaction.announce,
]
FAULT_POINTS = [faults.fault("after", target) for target in FAULT_TARGETS]


@pytest.fixture(scope="module")
def mesh_env() -> dict[str, str]:
    return {"YOKE_OUTBOX_GRACE_SECONDS": "1"}


def test_every_step_of_the_swap_has_a_fault_point() -> None:
    assert [step.__name__ for step in SWAP_STEPS[:-1]] == [
        target.__name__ for target in FAULT_TARGETS
    ]


CASES = [(point, True) for point in FAULT_POINTS] + [
    # Nobody speaks until the swap is over: the wake-up left in the outbox alone finishes it.
    (faults.fault("after", ActorContext.repoint), False)
]


@pytest.mark.parametrize(("point", "speak_while_down"), CASES)
async def test_a_crash_inside_a_compaction_loses_and_repeats_no_line(
    point: str,
    speak_while_down: bool,
    store: Store,
    client: Client,
    new_join: JoinFactory,
    mesh: Mesh,
) -> None:
    forum_id, join = await new_join(compaction_threshold_tokens=THRESHOLD, compaction_keep=KEEP)
    faulty = mesh.start_faulty("processor", point)
    await faulty.wait_healthy()
    texts: list[str] = []

    # One line at a time, each answered, until the processor dies inside the first compaction.
    for index in range(40):
        texts.append(f"line {index:02d}")
        await say(client, forum_id, texts[-1])

        async def answered_or_dead() -> bool:
            if faulty.popen.poll() is not None:
                return True
            return len(agent_lines(await store.history(forum_id))) == len(texts)

        await eventually(answered_or_dead, timeout=30, what=f"an answer to {texts[-1]}")
        if faulty.popen.poll() is not None:
            break
    assert faulty.popen.wait(10) == faults.EXIT_CODE, faulty.output()[-2000:]
    faulty.stop()

    if speak_while_down:  # ingestion meets the half-done swap
        texts.append("while the processor is down")
        await say(client, forum_id, texts[-1])
    mesh.start("processor")
    await mesh.processes["processor"].wait_healthy()

    # Nobody needs to speak again for the interrupted swap to finish and answer the lines.
    try:
        await lines_until(
            store, forum_id, lambda lines: len(agent_lines(lines)) == len(texts), timeout=30
        )
    except AssertionError:
        print(await where_the_join_is(store, join))
        raise
    # And the agent keeps answering, through more compactions.
    for index in range(8):
        texts.append(f"after {index:02d}")
        await say(client, forum_id, texts[-1])
    await lines_until(
        store, forum_id, lambda lines: len(agent_lines(lines)) >= len(texts), timeout=60
    )
    await asyncio.sleep(1)  # a quiet period: a line answered twice would show up here

    forum = await store.history(forum_id)
    humans = [line for line in forum if line.role == "user"]
    replies = agent_lines(forum)
    assert [h.text for h in humans] == texts
    assert [r.text for r in replies] == texts
    assert [r.meta.in_reply_to for r in replies] == [h.id for h in humans]

    participant = await store.get_participant(join.forum_participant_id)
    assert participant is not None
    chain = chain_of(participant)
    assert len(chain) >= 2
    assert participant.metadata["monologueId"] == chain[-1].to_monologue_id
    assert not participant.metadata.get(SWAPPING)
    for earlier, later in itertools.pairwise(chain):
        assert earlier.to_monologue_id == later.from_monologue_id
    swaps = await store.db[PROCEDURES].find({"forumParticipantId": participant.id}).to_list()
    assert sorted(swap["toMonologueId"] for swap in swaps if swap["done"]) == sorted(
        link.to_monologue_id for link in chain
    )
    state_id = instance_state_id(PROCESSOR, join_id(join.agent_actor_id, forum_id))
    state = await store.load_state(state_id)
    assert state is not None and state["watch"] == chain[-1].to_monologue_id

    async def egress_follows() -> bool:
        found = await store.db["egress_joins"].find_one({"forumId": forum_id})
        return found is not None and found["monologueId"] == chain[-1].to_monologue_id

    await eventually(egress_follows, timeout=10, what="egress to follow the last swap")


async def where_the_join_is(store: Store, join: Join) -> str:
    """The swap's documents and the monologues' lines, for a failure's report."""
    report = []
    participant = await store.get_participant(join.forum_participant_id)
    report.append(f"participant metadata: {participant.metadata if participant else None}")
    state_id = instance_state_id(PROCESSOR, join_id(join.agent_actor_id, join.forum_id))
    state = await store.load_state(state_id) or {}
    report.append(f"processor: watch={state.get('watch')} watermark={state.get('watermark')}")
    swaps = store.db[PROCEDURES].find({"forumParticipantId": join.forum_participant_id})
    monologues = [join.monologue_id]
    for swap in await swaps.to_list():
        report.append(f"procedure: {swap}")
        monologues.append(str(swap["toMonologueId"]))
    for monologue in dict.fromkeys(monologues):
        report.append(f"monologue {monologue}:")
        for line in await store.history(monologue):
            report.append(
                f"  {line.seq} {line.role} {line.text[:40]!r} id={line.id}"
                f" carriedFrom={line.meta.carried_from}"
            )
    return "\n".join(report)


# --- tool rounds across a swap (no services needed) ----------------------------------------


def line(seq: int, role: str = "user", *parts: Part, text: str = "") -> Message:
    return Message(
        id=f"m{seq}",
        conversation_id="monologue",
        seq=seq,
        author_actor_id="agent" if role == "agent" else "someone",
        role="agent" if role == "agent" else "user",
        parts=[*parts, *([TextPart(text=text)] if text else [])],
    )


def call(call_id: str) -> ToolCallPart:
    return ToolCallPart(call_id=call_id, name="clock")


def result(call_id: str) -> ToolResultPart:
    return ToolResultPart(call_id=call_id, name="clock", output="noon")


def test_the_context_keeps_each_tool_result_with_its_call() -> None:
    transcript = [
        line(1, text="hello"),
        line(2, "agent", call("c1")),
        line(3, text="typed while the tool ran"),
        line(4, "user", result("c1")),
        line(5, "agent", text="it is noon"),
        line(6, text="the trigger"),
    ]
    older, recent = split_for_compaction(transcript, keep=3)
    assert [m.seq for m in older] == [1]
    assert [m.seq for m in recent] == [2, 3, 4, 5]
    older, recent = split_for_compaction(transcript, keep=1)
    assert [m.seq for m in recent] == [5]


def test_no_swap_while_a_tool_round_is_open() -> None:
    config = ProcessorConfig(
        source_conversation_id="forum",
        forum_participant_id="participant",
        agent_actor_id="agent",
        monologue_id="monologue",
        agent_participant_id="agent-participant",
        compaction_threshold_tokens=10,
        compaction_keep=1,
    )
    chatter = [line(seq, text="a long line " * 10) for seq in range(1, 6)]
    open_round = [*chatter, line(6, "agent", call("c1")), line(7, text="the trigger")]
    assert not needs_compaction(config, open_round)
    closed = [*open_round[:-1], line(7, "user", result("c1")), line(8, text="the trigger")]
    assert needs_compaction(config, closed)


def test_a_tool_result_is_never_carried() -> None:
    assert carriable(line(1, text="a person"))
    assert not carriable(line(2, "user", result("c1")))
    assert not carriable(line(3, "agent", call("c1"), text="let me look"))

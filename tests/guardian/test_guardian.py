"""The guardian in the running mesh: policies, steering lines, cooldown, leases, failures.

The mesh's guardian runs under ``tests.support.slow_guardian``, which records every runner's
start and end (and can slow it down); the product code is the same.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable
from pathlib import Path

import pytest

from services.guardian.guardian import COLLECTION, GUARDIAN_ACTOR_ID
from tests.support.fake_openai import openai_env
from tests.support.mesh import JoinFactory, Launch, Mesh, lines_until, say
from tests.support.processes import ServiceProcess, eventually, free_port
from tests.support.slow_guardian import RUNS
from yoke.client import Client
from yoke.core.models import Message, ToolCallPart
from yoke.llm.base import ScriptedCall, ScriptedOutput
from yoke.runtime.join_config import (
    GuardianConfig,
    JoinConfig,
    LlmPolicy,
    NoProgressPolicy,
    RulePolicy,
    load_join_config,
    save_join_config,
)
from yoke.runtime.joins import Join, join_id
from yoke.store.database import Store

pytestmark = pytest.mark.slow

REFUND_STEER = "Never promise refunds."


@pytest.fixture(scope="module")
def mesh_env() -> dict[str, str]:
    # An OpenAI-compatible server that is not there: the "failing guardian model".
    return openai_env(f"http://127.0.0.1:{free_port()}/v1", give_up_seconds=1)


@pytest.fixture(scope="module")
def mesh_launch() -> Launch:
    """The guardian recording each runner's start and end."""
    return {"guardian": (["-m", "tests.support.slow_guardian", "guardian"], {})}


@pytest.fixture(scope="module")
async def before_mesh(module_mongodb_url: str) -> None:
    """The runners' record, made before traffic (see Store.create_collections)."""
    store = Store(module_mongodb_url)
    await store.ensure_indexes()
    await store.create_collections(RUNS)
    await store.close()


async def guard(store: Store, join: Join, guardian: GuardianConfig) -> None:
    """Turn the guardian on for the join (as ``yoke join --config`` would store it)."""
    key = join_id(join.agent_actor_id, join.forum_id)
    config = await load_join_config(store, key) or JoinConfig()
    await save_join_config(store, key, config.model_copy(update={"guardian": guardian}))


def steering(lines: list[Message]) -> list[Message]:
    return [
        line for line in lines if line.meta.instruction == "guardian" and line.type == "message"
    ]


def agent_said(text: str) -> Callable[[list[Message]], bool]:
    return lambda lines: any(line.role == "agent" and line.text == text for line in lines)


def the_agent_line(lines: list[Message], text: str) -> Message:
    [line] = [line for line in lines if line.role == "agent" and line.text == text]
    return line


async def logged(process: ServiceProcess, message_id: str, words: str) -> None:
    """Wait for the process to log ``words`` about ``message_id`` (its JSON log lines)."""

    async def found() -> bool:
        for raw in process.output().splitlines():
            try:
                entry = json.loads(raw)
            except ValueError:
                continue
            if entry.get("messageId") == message_id and words in entry.get("message", ""):
                return True
        return False

    await eventually(found, timeout=30, what=f"a log line {words!r} about {message_id}")


async def checked(store: Store, message_id: str) -> None:
    """Wait until a guardian finished checking ``message_id``."""

    async def done() -> bool:
        found = await store.db[COLLECTION].find_one({"kind": "checked", "messageId": message_id})
        return found is not None

    await eventually(done, timeout=30, what=f"the guardian's check of {message_id}")


def refund_rule(cooldown: float) -> GuardianConfig:
    return GuardianConfig(
        cooldown_seconds=cooldown,
        policies=[RulePolicy(kind="rule", pattern=r"(?i)refund", steer=REFUND_STEER)],
    )


async def test_a_rule_match_injects_the_steering_line(
    store: Store, client: Client, new_join: JoinFactory
) -> None:
    forum_id, join = await new_join()
    await guard(store, join, refund_rule(cooldown=30))
    await say(client, forum_id, "can I get a refund?")

    lines = await lines_until(store, join.monologue_id, agent_said(REFUND_STEER))
    trigger = the_agent_line(lines, "can I get a refund?")
    [steer] = steering(lines)
    assert steer.text == REFUND_STEER
    assert (steer.role, steer.author_actor_id) == ("user", GUARDIAN_ACTOR_ID)
    assert steer.meta.source_conversation_id == forum_id
    assert steer.meta.causation_id == trigger.id
    assert steer.meta.agent_hops == trigger.meta.agent_hops
    assert steer.seq > trigger.seq
    guardian = await store.get_actor(GUARDIAN_ACTOR_ID)
    assert guardian is not None and (guardian.kind, guardian.name) == ("system", "guardian")
    # The processor answered it like any other line (fixture-echo repeats it), into the forum.
    await lines_until(store, forum_id, agent_said(REFUND_STEER))


async def test_its_own_line_never_triggers_it_again(
    store: Store, client: Client, new_join: JoinFactory
) -> None:
    forum_id, join = await new_join()
    # No cooldown: only the guardian's own rule keeps the echoed steer from steering again.
    await guard(store, join, refund_rule(cooldown=0))
    await say(client, forum_id, "refund one?")
    await lines_until(store, join.monologue_id, agent_said(REFUND_STEER))
    await say(client, forum_id, "refund two?")
    # The guardian handles the monologue in order: by the second steer, the echo of the first
    # (which matches the rule too) has been passed over.
    lines = await lines_until(store, join.monologue_id, lambda lines: len(steering(lines)) >= 2)
    causes = [line.meta.causation_id for line in steering(lines)]
    assert causes == [
        the_agent_line(lines, "refund one?").id,
        the_agent_line(lines, "refund two?").id,
    ]


async def test_the_cooldown_holds_across_a_restart(
    store: Store, client: Client, new_join: JoinFactory, mesh: Mesh
) -> None:
    forum_id, join = await new_join()
    await guard(store, join, refund_rule(cooldown=600))
    await say(client, forum_id, "refund one?")
    await lines_until(store, join.monologue_id, agent_said(REFUND_STEER))

    await say(client, forum_id, "refund two?")
    lines = await lines_until(store, join.monologue_id, agent_said("refund two?"))
    second = the_agent_line(lines, "refund two?")
    await logged(mesh.processes["guardian"], second.id, "during the cooldown")

    guardian = await mesh.restart("guardian")  # the cooldown is in MongoDB, not in the process
    await say(client, forum_id, "refund three?")
    lines = await lines_until(store, join.monologue_id, agent_said("refund three?"))
    third = the_agent_line(lines, "refund three?")
    await logged(guardian, third.id, "during the cooldown")
    assert len(steering(await store.history(join.monologue_id))) == 1


async def test_a_scripted_agent_repeating_a_tool_call_triggers_no_progress(
    store: Store, client: Client, new_join: JoinFactory
) -> None:
    stuck = "Stop repeating; ask the person."
    forum_id, join = await new_join(
        name="looper",
        model="fixture-script",
        tools=["clock"],
        script=[ScriptedOutput(tool_calls=[ScriptedCall(name="clock")], repeat=True)],
    )
    await guard(
        store,
        join,
        GuardianConfig(
            policies=[
                NoProgressPolicy(
                    kind="noProgress", repeated_calls=3, steps_without_text=None, steer=stuck
                )
            ]
        ),
    )
    await say(client, forum_id, "what time is it?")
    lines = await lines_until(store, join.monologue_id, lambda lines: bool(steering(lines)))
    [steer] = steering(lines)
    assert steer.text == stuck
    calls = [
        line
        for line in lines
        if line.role == "agent" and any(isinstance(p, ToolCallPart) for p in line.parts)
    ]
    # The third identical call is the one that set it off.
    assert steer.meta.causation_id == calls[2].id


async def test_an_llm_check_that_calls_steer_posts_its_text(
    store: Store, client: Client, new_join: JoinFactory
) -> None:
    text = "Ask which order they mean before answering."
    forum_id, join = await new_join()
    await guard(
        store,
        join,
        GuardianConfig(
            model="fixture-script",
            policies=[LlmPolicy(kind="llm")],
            script=[
                ScriptedOutput(tool_calls=[ScriptedCall(name="steer", input={"text": text})]),
                ScriptedOutput(text="Steered."),
            ],
        ),
    )
    await say(client, forum_id, "where is my order?")
    lines = await lines_until(store, join.monologue_id, agent_said(text))
    [steer] = steering(lines)
    assert steer.text == text
    assert steer.meta.causation_id == the_agent_line(lines, "where is my order?").id


async def test_an_llm_check_that_does_not_steer_posts_nothing(
    store: Store, client: Client, new_join: JoinFactory
) -> None:
    forum_id, join = await new_join()
    await guard(
        store,
        join,
        GuardianConfig(
            model="fixture-script",
            policies=[LlmPolicy(kind="llm")],
            script=[ScriptedOutput(text="All good.")],
        ),
    )
    await say(client, forum_id, "hello there")
    lines = await lines_until(store, join.monologue_id, agent_said("hello there"))
    await checked(store, the_agent_line(lines, "hello there").id)
    lines = await store.history(join.monologue_id)
    assert steering(lines) == []
    assert [line for line in lines if line.type == "notice"] == []


async def test_a_failing_guardian_model_leaves_a_notice_and_the_agent_goes_on(
    store: Store, client: Client, new_join: JoinFactory
) -> None:
    forum_id, join = await new_join()
    await guard(
        store, join, GuardianConfig(model="gpt-not-there", policies=[LlmPolicy(kind="llm")])
    )
    await say(client, forum_id, "first line")
    lines = await lines_until(
        store, join.monologue_id, lambda lines: any(line.type == "notice" for line in lines)
    )
    [notice] = [line for line in lines if line.type == "notice"]
    assert notice.author_actor_id == GUARDIAN_ACTOR_ID
    assert "check failed" in notice.text
    assert notice.meta.causation_id == the_agent_line(lines, "first line").id
    assert steering(lines) == []
    await say(client, forum_id, "second line")
    await lines_until(store, forum_id, agent_said("second line"))


async def test_two_guardian_processes_run_one_runner_per_join_at_a_time(
    store: Store, client: Client, new_join: JoinFactory, mesh: Mesh, tmp_path: Path
) -> None:
    """Two more guardian deployments (queues of their own) receive every event too, and their
    runners take a second: without the lease, runners of one join would overlap."""
    slow = {**mesh.env, "YOKE_TEST_GUARDIAN_DELAY": "1"}
    others = [
        ServiceProcess(["-m", "tests.support.slow_guardian", name], slow, tmp_path / name)
        for name in ("guardian-b", "guardian-c")
    ]
    try:
        for process in others:
            await process.wait_healthy()
        forum_id, join = await new_join()
        await guard(
            store,
            join,
            GuardianConfig(
                cooldown_seconds=0,
                model="fixture-script",
                policies=[LlmPolicy(kind="llm")],
                script=[ScriptedOutput(text="All good.")],
            ),
        )
        texts = [f"line {n}" for n in range(4)]
        for text in texts:
            await say(client, forum_id, text)
        lines = await lines_until(
            store, join.monologue_id, lambda lines: all(agent_said(t)(lines) for t in texts)
        )
        for text in texts:
            await checked(store, the_agent_line(lines, text).id)
        key = join_id(join.agent_actor_id, join.forum_id)
        runs = sorted(
            await store.db[RUNS].find({"joinKey": key}).to_list(), key=lambda run: run["start"]
        )
        assert len(runs) >= len(texts)
        for earlier, later in itertools.pairwise(runs):
            assert later["start"] >= earlier["end"], (earlier, later)
        # Each check ran once, whichever process got to it first.
        assert sorted(run["messageId"] for run in runs) == sorted(
            the_agent_line(lines, text).id for text in texts
        )
    finally:
        codes = [process.stop() for process in others]
    assert codes == [0, 0]


async def test_it_follows_the_monologue_across_a_compaction(
    store: Store, client: Client, new_join: JoinFactory
) -> None:
    forum_id, join = await new_join(compaction_threshold_tokens=60, compaction_keep=2)
    await guard(store, join, refund_rule(cooldown=0))
    for index in range(6):
        text = f"a line long enough to fill the monologue, number {index}"
        await say(client, forum_id, text)
        await lines_until(store, forum_id, agent_said(text))
    participant = await store.get_participant(join.forum_participant_id)
    assert participant is not None
    assert participant.metadata["monologueId"] != join.monologue_id  # compacted

    await say(client, forum_id, "and a refund?")
    await lines_until(store, forum_id, agent_said(REFUND_STEER))
    participant = await store.get_participant(join.forum_participant_id)
    assert participant is not None
    chain = participant.metadata["compactions"]
    assert isinstance(chain, list)
    monologues = [join.monologue_id, *(str(link["toMonologueId"]) for link in chain)]  # type: ignore[call-overload, index]
    found = [line for m in monologues for line in steering(await store.history(m))]
    [steer] = [line for line in found if not line.meta.carried_from]
    assert steer.conversation_id != join.monologue_id
    trigger = await store.get_message(str(steer.meta.causation_id))
    assert trigger is not None and trigger.text == "and a refund?"

"""The processor's steps around a tool round, against the real store: a line that lands while
the tools run waits for their results, unless the results will never come."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

from services.processor.processor import Processor
from yoke.core.models import (
    Envelope,
    Message,
    MessageMeta,
    Part,
    TextPart,
    ToolCallPart,
    ToolResultPart,
)
from yoke.core.settings import Settings
from yoke.runtime.actor import ActorContext
from yoke.runtime.calls.records import (
    OpenCall,
    open_call_id,
    own_result_line_id,
    round_results_line_id,
)
from yoke.runtime.calls.repository import OpenCalls
from yoke.runtime.catalog_store import LocalTools, ToolCatalog
from yoke.runtime.dispatch import ToolDispatch
from yoke.runtime.in_flight import InFlight
from yoke.runtime.instances import ProcessorConfig, ProcessorState
from yoke.runtime.rounds import open_round
from yoke.runtime.tails import Tails
from yoke.store.database import Store


class DeltaSink:
    """Takes the drafts' ``agent.delta`` events a step publishes (kept, not sent)."""

    def __init__(self) -> None:
        self.published: list[Envelope] = []

    async def publish_event(
        self, envelope: Envelope, key: str, headers: object = None, *, expiration: object = None
    ) -> None:
        self.published.append(envelope)


class StorePoster:
    """Writes what a step posts straight to the store (no events: one step at a time here)."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.bus = DeltaSink()
        self.posted: list[Message] = []

    async def post(self, message: Message, *, route: object = None) -> Message:
        stored, _ = await self.store.insert_message(message)
        self.posted.append(stored)
        return stored


class Monologue:
    def __init__(self, store: Store) -> None:
        self.store = store
        self.id = uuid.uuid4().hex
        self.poster = StorePoster(store)
        self.config = ProcessorConfig(
            source_conversation_id="forum",
            forum_participant_id="fp",
            agent_actor_id="agent",
            monologue_id=self.id,
            agent_participant_id="ap",
            hop_cap=2,
        )
        self.state = ProcessorState(monologue_id=self.id, agent_participant_id="ap")
        # The processor's tools (this process's own, unless a test sets a dispatch of its own).
        self.dispatch: ToolDispatch | None = None
        self.in_flight = InFlight()

    def processor(self) -> Processor:
        """The processor these steps run in: made for each step, since a test may swap the
        poster; it keeps no tails (every window is read from the store)."""
        open_calls = OpenCalls(self.store, self.poster)  # type: ignore[arg-type]
        if self.dispatch is None:
            local = LocalTools.load()
            catalog = ToolCatalog(self.store, local)
            self.dispatch = ToolDispatch(catalog, local, open_calls, None)  # type: ignore[arg-type]
        return Processor(
            dispatch=self.dispatch,
            open_calls=open_calls,
            in_flight=self.in_flight,
            tails=Tails(0, 1),
        )

    def context(self, trigger: Message) -> ActorContext[ProcessorConfig, ProcessorState]:
        return ActorContext(
            actor="processor",
            instance_id="join",
            config=self.config,
            state=self.state,
            store=self.store,
            poster=self.poster,  # type: ignore[arg-type]
            trigger=trigger,
            watch=self.id,
            service="processor",
            settings=Settings(),
        )

    async def write(
        self, role: str, *parts: Part, message_id: str | None = None, **meta: Any
    ) -> Message:
        stored, _ = await self.store.insert_message(
            Message(
                id=message_id or uuid.uuid4().hex,
                conversation_id=self.id,
                author_actor_id="agent" if role == "agent" else "h1",
                role="agent" if role == "agent" else "user",
                parts=list(parts),
                meta=MessageMeta(**meta),
            )
        )
        return stored

    async def say(self, text: str, **meta: Any) -> Message:
        return await self.write("user", TextPart(text=text), **meta)

    async def call(self) -> Message:
        return await self.write("agent", ToolCallPart(call_id="c1", name="clock"))

    async def results(self, call: Message, *, written: bool = True, **meta: Any) -> Message:
        """The round's results, under the id its step gives them (or another id: not written)."""
        part = ToolResultPart(call_id="c1", name="clock", output="noon")
        message_id = (
            round_results_line_id(self.context(call).instance_id, call.id) if written else None
        )
        return await self.write("user", part, message_id=message_id, **meta)

    async def step(self, trigger: Message) -> list[Message]:
        before = len(self.poster.posted)
        await self.processor().step(self.context(trigger), trigger)
        return self.poster.posted[before:]


async def test_a_line_during_the_round_is_answered_by_the_step_after_the_results(
    store: Store,
) -> None:
    monologue = Monologue(store)
    await monologue.say("time?")
    call = await monologue.call()
    during = await monologue.say("and the date?")
    results = await monologue.results(call)
    assert await monologue.step(during) == []
    assert await monologue.step(during) == []  # a redelivery decides the same
    [answer] = await monologue.step(results)
    assert answer.role == "agent" and answer.text == "and the date?"  # fixture-echo


async def test_a_line_after_a_round_whose_results_never_come_is_answered_at_once(
    store: Store,
) -> None:
    monologue = Monologue(store)
    await monologue.say("time?")
    await monologue.call()  # its step failed for good: no results will be written
    during = await monologue.say("hello?")
    [answer] = await monologue.step(during)
    assert answer.text == "hello?"
    assert open_round(await store.history(monologue.id)) is not None


async def test_a_refused_loop_stops_with_a_notice_unless_a_line_waits_for_an_answer(
    store: Store,
) -> None:
    quiet = Monologue(store)
    await quiet.say("loop")
    call = await quiet.call()
    capped = await quiet.say("an agent at the hop cap", agent_hops=2)
    command = await quiet.say("/status")
    refused = await quiet.results(call, loop_guard=True)
    assert await quiet.step(capped) == []
    [status] = await quiet.step(command)
    assert status.text.startswith("model fixture-echo")
    [notice] = await quiet.step(refused)
    assert notice.type == "notice" and "stopped a tool loop" in notice.text

    waiting = Monologue(store)
    await waiting.say("loop")
    call = await waiting.call()
    during = await waiting.say("stop that, please")
    refused = await waiting.results(call, loop_guard=True)
    assert await waiting.step(during) == []
    [answer] = await waiting.step(refused)
    assert answer.type == "message" and answer.text == "stop that, please"


async def test_results_whose_call_was_reset_away_start_no_model_call(store: Store) -> None:
    monologue = Monologue(store)
    await monologue.say("wait")
    call = await monologue.call()
    reset = await monologue.say("/reset")
    [_] = await monologue.step(reset)
    after = await monologue.say("hello again")
    [answer] = await monologue.step(after)  # the round is out of context: answered at once
    assert answer.text == "hello again"
    results = await monologue.results(call)
    assert await monologue.step(results) == []


async def open_call_for(monologue: Monologue, call: Message, model_call_id: str) -> OpenCall:
    """What the round's step records for a call that waits in the store (a worker's)."""
    opened = OpenCall(
        id=open_call_id("join", call.id, model_call_id),
        tool="lookup",
        source="worker",
        conversation_id=monologue.id,
        call_line_id=call.id,
        model_call_id=model_call_id,
        timeout_seconds=60,
        deadline=datetime.now(UTC) + timedelta(seconds=60),
    )
    assert await OpenCalls(monologue.store, monologue.poster).open(opened)  # type: ignore[arg-type]
    return opened


async def test_a_round_with_a_waiting_call_is_answered_once_its_last_result_lands(
    store: Store,
) -> None:
    monologue = Monologue(store)
    await monologue.say("time and order?")
    call = await monologue.write(
        "agent",
        ToolCallPart(call_id="c1", name="clock"),
        ToolCallPart(call_id="c2", name="lookup"),
    )
    opened = await open_call_for(monologue, call, "c2")
    inline = await monologue.results(call)  # c1's result; c2 waits in the store
    during = await monologue.say("and the weather?")
    assert await monologue.step(inline) == []  # c2 has no result yet: no model call
    assert await monologue.step(during) == []  # the open call's result step answers it
    open_calls = OpenCalls(store, monologue.poster)  # type: ignore[arg-type]
    won, _ = await open_calls.end(opened, outcome="answered", output="shipped", is_error=False)
    assert won
    [result_line] = [
        line for line in monologue.poster.posted if line.id == own_result_line_id(opened.id)
    ]
    assert result_line.parts == [
        ToolResultPart(call_id="c2", name="lookup", output="shipped", is_error=False)
    ]
    assert await open_calls.get(opened.id) is None
    [answer] = await monologue.step(result_line)
    assert answer.role == "agent" and answer.text == "and the weather?"  # fixture-echo
    again, end = await open_calls.end(opened, outcome="timeout", output="late", is_error=True)
    assert not again and end.output == "shipped"  # the first end stands


async def test_a_line_during_a_round_whose_waiting_call_is_gone_is_answered_at_once(
    store: Store,
) -> None:
    monologue = Monologue(store)
    await monologue.say("order?")
    await monologue.write("agent", ToolCallPart(call_id="c2", name="lookup"))
    during = await monologue.say("hello?")  # no open call was recorded: nothing will come
    [answer] = await monologue.step(during)
    assert answer.text == "hello?"

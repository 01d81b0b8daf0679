"""Escalations through the HTTP gateway, end to end: the mesh and the gateway run as real
processes, escalations are opened directly in the store (``Escalations.open``, as the
processor's ``handoff`` call would) and their events published on the bus as the mesh does.

``GET /v1/escalations`` lists only the escalations of the token's forums; claiming or canceling
one needs a token made with ``--can-take-over`` whose scope holds its forum (an escalation of
another forum is unknown: 404); of two claims racing, one is taken and the other answered
409; a forum's stream and its webhooks get ``escalation.opened`` when it is published; and in
Debian's headless Chromium the console's inbox lists an open escalation and claims it.
"""

from __future__ import annotations

import asyncio
from datetime import timedelta

import httpx
import pytest
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver

from tests.support.browser import texts, wait_for
from tests.support.mesh import Mesh, lines_until
from tests.support.processes import eventually
from tests.support.sse import EventReader
from tests.support.webhook_receiver import Receiver
from yoke.core.ids import new_id
from yoke.core.models import EscalationOpened, utcnow
from yoke.runtime.escalations import MAX_INBOX_PAGE, Escalation, Escalations
from yoke.runtime.holds import Holds
from yoke.runtime.joins import create_forum
from yoke.runtime.posting import Poster
from yoke.store.database import Store
from yoke.store.tokens import create_token, ensure_token_indexes
from yoke.store.webhooks import add_webhook, ensure_webhook_indexes, remove_webhook

pytestmark = pytest.mark.slow


async def token(
    store: Store, forums: list[str] | None, *, can_take_over: bool = False
) -> tuple[str, str]:
    """A new token's name and secret."""
    await ensure_token_indexes(store)
    name = f"t{new_id()[:10]}"
    _, secret = await create_token(store, name, forums, can_take_over=can_take_over)
    return name, secret


def bearer(secret: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}"}


async def escalation(store: Store, forum_id: str, reason: str = "the customer is angry") -> str:
    """An open escalation of the forum, as a ``handoff`` call opens one."""
    escalations = Escalations(store)
    await escalations.ensure_indexes()
    opened, _ = await escalations.open(
        Escalation(
            id=new_id(),
            forum_id=forum_id,
            agent_actor_id=f"agent-{new_id()[:8]}",
            join_key=new_id(),
            call_id=new_id(),
            reason=reason,
            deadline=utcnow() + timedelta(hours=1),
        )
    )
    return opened.id


async def listed(http: httpx.AsyncClient, secret: str, **params: str) -> list[dict[str, object]]:
    answer = await http.get("/v1/escalations", params=params, headers=bearer(secret))
    assert answer.status_code == 200, answer.text
    found: list[dict[str, object]] = answer.json()["escalations"]
    return found


async def test_a_scoped_token_lists_only_its_forums_escalations(
    http: httpx.AsyncClient, store: Store
) -> None:
    mine, theirs = await create_forum(store, "mine"), await create_forum(store, "theirs")
    own = await escalation(store, mine.id, "please, a person")
    other = await escalation(store, theirs.id, "someone else's customer")
    _, scoped = await token(store, [mine.id])
    _, scoped_taker = await token(store, [mine.id], can_take_over=True)
    _, everywhere = await token(store, None)

    for secret in (scoped, scoped_taker):
        shown = await listed(http, secret)
        assert [e["id"] for e in shown] == [own]
        assert shown[0]["forumId"] == mine.id and shown[0]["reason"] == "please, a person"
        assert shown[0]["state"] == "open"
        # Nothing of the monologue it was asked from.
        assert "callId" not in shown[0] and "joinKey" not in shown[0]
    every = {e["id"] for e in await listed(http, everywhere, limit=str(MAX_INBOX_PAGE))}
    assert {own, other} <= every
    assert await listed(http, scoped, state="ended") == []

    too_many = await http.get(
        "/v1/escalations", params={"limit": MAX_INBOX_PAGE + 1}, headers=bearer(everywhere)
    )
    assert too_many.status_code == 400
    unknown_state = await http.get(
        "/v1/escalations", params={"state": "lost"}, headers=bearer(everywhere)
    )
    assert unknown_state.status_code == 400
    assert (await http.get("/v1/escalations")).status_code == 401


async def test_deciding_needs_the_right_and_the_forum_and_a_refusal_decides_nothing(
    http: httpx.AsyncClient, store: Store
) -> None:
    mine, theirs = await create_forum(store, "to decide"), await create_forum(store, "not mine")
    own = await escalation(store, mine.id)
    other = await escalation(store, theirs.id)
    _, plain = await token(store, [mine.id])
    _, everywhere = await token(store, None)
    _, taker = await token(store, [mine.id], can_take_over=True)
    escalations = Escalations(store)

    for secret in (plain, everywhere):
        for action, body in (("claim", {"as": "ada"}), ("cancel", {})):
            answer = await http.post(
                f"/v1/escalations/{own}/{action}", json=body, headers=bearer(secret)
            )
            assert answer.status_code == 403, (action, answer.text)
            assert "--can-take-over" in answer.json()["error"]
    # Another forum's escalation is unknown to the token, exactly as one that does not exist.
    for escalation_id in (other, "no-such-escalation"):
        answer = await http.post(
            f"/v1/escalations/{escalation_id}/claim", json={"as": "ada"}, headers=bearer(taker)
        )
        assert answer.status_code == 404, answer.text
        assert answer.json()["code"] == "unknown_escalation"
    # A claim names who claims.
    nameless = await http.post(f"/v1/escalations/{own}/claim", json={}, headers=bearer(taker))
    assert nameless.status_code == 400
    for escalation_id in (own, other):
        assert await escalations.get_decision(escalation_id) is None
        stored = await escalations.get(escalation_id)
        assert stored is not None and stored.state == "open"
    assert await store.history(mine.id) == [] and await store.history(theirs.id) == []


async def test_of_two_claims_racing_one_is_taken_and_the_other_is_409(
    http: httpx.AsyncClient, store: Store
) -> None:
    forum = await create_forum(store, "two people, one escalation")
    escalation_id = await escalation(store, forum.id)
    _, first = await token(store, [forum.id], can_take_over=True)
    _, second = await token(store, None, can_take_over=True)

    answers = await asyncio.gather(
        *(
            http.post(
                f"/v1/escalations/{escalation_id}/claim", json={"as": who}, headers=bearer(secret)
            )
            for who, secret in (("ada", first), ("bob", second))
        )
    )
    statuses = sorted(answer.status_code for answer in answers)
    assert statuses == [202, 409], [answer.text for answer in answers]
    won = next(answer for answer in answers if answer.status_code == 202).json()
    lost = next(answer for answer in answers if answer.status_code == 409).json()
    assert lost["code"] == "already_claimed"
    assert won["escalationId"] == escalation_id and won["action"] == "claim"
    winner = "ada" if answers[0].status_code == 202 else "bob"

    decision = await Escalations(store).get_decision(escalation_id)
    assert decision is not None and decision.action == "claim"
    assert decision.by is not None and decision.by.display_name == winner
    # The claim took the forum over for its winner: one /takeover line, the hold theirs.
    lines = await lines_until(store, forum.id, lambda lines: len(lines) >= 1)
    assert [line.text.split()[0] for line in lines] == ["/takeover"]
    hold = await Holds(store).get(forum.id)
    assert hold is not None and hold.holder.display_name == winner
    assert hold.escalation_id == escalation_id
    # Claimed, it cannot be canceled.
    cancel = await http.post(f"/v1/escalations/{escalation_id}/cancel", headers=bearer(first))
    assert cancel.status_code == 409, cancel.text


async def test_a_forums_stream_and_webhook_get_escalation_opened(
    http: httpx.AsyncClient,
    store: Store,
    poster: Poster,
    receiver: Receiver,
    gateway_url: str,
) -> None:
    forum = await create_forum(store, "someone asked for a person")
    elsewhere = await create_forum(store, "quiet")
    _, secret = await token(store, [forum.id, elsewhere.id])
    await ensure_webhook_indexes(store)
    subscription = await add_webhook(store, forum.id, receiver.url("/escalations"))
    try:
        # The webhook's subscription held by the gateway: it hears the event from then on.
        async def held() -> bool:
            metrics = (await http.get("/metrics")).text
            return "yoke_webhook_subscriptions_held 1.0" in metrics

        await eventually(held, timeout=60, what="the webhook's subscription held")
        opened = EscalationOpened(
            escalation_id=new_id(),
            forum_id=forum.id,
            agent_actor_id="agent-1",
            reason="I cannot refund this myself",
            urgency="high",
            opened_at=utcnow(),
            deadline=utcnow() + timedelta(minutes=15),
        )
        async with (
            http.stream("GET", f"/v1/forums/{forum.id}/stream", headers=bearer(secret)) as response,
            http.stream(
                "GET", f"/v1/forums/{elsewhere.id}/stream", headers=bearer(secret)
            ) as quiet,
        ):
            assert response.status_code == 200 and quiet.status_code == 200
            await poster.bus.publish_forum_event(new_id(), opened)
            event = await EventReader(response).next(timeout=30)
            assert event.event == "escalation.opened" and event.id is None
            assert event.data["escalationId"] == opened.escalation_id
            assert event.data["reason"] == "I cannot refund this myself"
            assert event.data["urgency"] == "high" and event.data["forumId"] == forum.id
            # Another forum's stream hears nothing of it (its next event is a line of its own).
            await poster.bus.publish_forum_event(
                new_id(), opened.model_copy(update={"forum_id": elsewhere.id})
            )
            other = await EventReader(quiet).next(timeout=30)
            assert other.event == "escalation.opened" and other.data["forumId"] == elsewhere.id

        async def delivered() -> bool:
            return len(receiver.delivered("/escalations")) >= 1

        await eventually(delivered, timeout=60, what="the webhook's escalation event")
        delivery = receiver.delivered("/escalations")[0]
        body = delivery.json
        assert delivery.delivery_id == body["deliveryId"]
        assert body["event"] == "escalation.opened" and body["forumId"] == forum.id
        assert body["escalation"]["escalationId"] == opened.escalation_id
        assert body["subscriptionId"] == subscription.id
    finally:
        await remove_webhook(store, subscription.id)


async def test_the_console_inbox_lists_an_open_escalation_and_claims_it(
    store: Store, mesh: Mesh, gateway_url: str, browser: WebDriver
) -> None:
    forum = await create_forum(store, "the inbox's forum")
    escalation_id = await escalation(store, forum.id, "the invoice is wrong, ask a person")
    _, secret = await token(store, [forum.id], can_take_over=True)
    driver = browser
    driver.get(gateway_url + "/inbox")
    wait_for(
        driver, "the token form", lambda d: d.find_element(By.ID, "token-input").is_displayed()
    )
    driver.find_element(By.ID, "token-input").send_keys(secret)
    driver.find_element(By.CSS_SELECTOR, "#token-form button").click()
    wait_for(
        driver,
        "the open escalation",
        lambda d: any("ask a person" in text for text in texts(d, "li.escalation")),
    )
    item = driver.find_element(
        By.CSS_SELECTOR, f'li.escalation[data-escalation-id="{escalation_id}"]'
    )
    driver.find_element(By.ID, "claim-as").send_keys("Grace")
    item.find_element(By.CSS_SELECTOR, "button.claim-button").click()
    wait_for(driver, "the claim", lambda d: "Claimed" in d.find_element(By.ID, "status").text)

    async def claimed() -> bool:
        hold = await Holds(store).get(forum.id)
        return hold is not None and hold.holder.display_name == "Grace"

    await eventually(claimed, timeout=30, what="Grace's hold of the forum")
    # The forum page says who holds it, and offers to hand it back.
    driver.find_element(By.CSS_SELECTOR, "a.claimed-link").click()
    wait_for(
        driver,
        "the forum's hold",
        lambda d: "Held by Grace" in d.find_element(By.ID, "hold-status").text,
    )
    handback = driver.find_element(By.ID, "handback-button")
    assert handback.is_displayed()
    handback.click()
    wait_for(
        driver,
        "the forum handed back",
        lambda d: "Nobody holds" in d.find_element(By.ID, "hold-status").text,
    )
    assert await Holds(store).get(forum.id) is None

"""Published agents and the tokens that may call them, for the tests of the gateway's MCP and
A2A doors: each agent under a fresh name, each caller a token of its own."""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from tests.support.fake_openai import FakeOpenAI, completion
from yoke.runtime.join_config import ApprovalConfig
from yoke.runtime.joins import create_agent
from yoke.store.database import Store
from yoke.store.publishing import PublishedAgent, publish_agent
from yoke.store.tokens import Token, create_token


@dataclass
class Caller:
    """A token that may call some names, and the secret its client sends."""

    token: Token
    secret: str

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.secret}"}


@dataclass
class Agents:
    """Publishes agents under fresh names and makes tokens to call them."""

    store: Store
    gateway_url: str

    async def publish(
        self, model: str = "fixture-echo", description: str = "", **options: object
    ) -> PublishedAgent:
        agent = await create_agent(
            self.store,
            f"agent-{uuid.uuid4().hex[:6]}",
            model=model,
            **options,  # type: ignore[arg-type]
        )
        name = f"a-{uuid.uuid4().hex[:8]}"
        return await publish_agent(self.store, name, agent.id, description or f"Ask {name}.")

    async def caller(self, *names: str) -> Caller:
        token, secret = await create_token(
            self.store, f"caller-{uuid.uuid4().hex[:8]}", can_call=list(names)
        )
        return Caller(token, secret)

    async def gated(self, fake_openai: FakeOpenAI) -> tuple[PublishedAgent, Caller, str]:
        """An agent (the fake OpenAI model) whose calculator call waits for a person's approval,
        then answers "it is 42"; a caller of it, and the secret of a token that may approve."""
        agent = await self.publish(
            model="gpt-test",
            tools=["calculator"],
            approval=ApprovalConfig(tools=["calculator"], timeout_seconds=600),
        )
        fake_openai.script(
            completion(tool_calls=[("call-1", "calculator", '{"expression": "6 * 7"}')]),
            completion("it is 42"),
        )
        _, approver = await create_token(
            self.store, f"approver-{uuid.uuid4().hex[:6]}", can_approve=True
        )
        return agent, await self.caller(agent.id), approver

    def url(self, agent: PublishedAgent) -> str:
        """The A2A agent's base URL."""
        return f"{self.gateway_url}/a2a/{agent.id}"

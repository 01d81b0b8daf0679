"""A published agent's A2A agent card: who it is, where to call it, and how to authenticate.

The card is built from the published record at request time (``yoke agent publish`` again
changes it at once): its name, its description as the one skill, streaming and push
notifications, the bearer scheme a ``yoke token create --can-call NAME`` token fills, and the
JSON-RPC interface at ``/a2a/NAME`` in both protocol versions the door speaks (1.0, and the 0.3
method names many clients still send).
"""

from __future__ import annotations

from a2a.types.a2a_pb2 import (
    AgentCapabilities,
    AgentCard,
    AgentInterface,
    AgentProvider,
    AgentSkill,
    HTTPAuthSecurityScheme,
    SecurityRequirement,
    SecurityScheme,
    StringList,
)
from a2a.utils.constants import PROTOCOL_VERSION_0_3, PROTOCOL_VERSION_1_0, TransportProtocol

from yoke.store.publishing import PublishedAgent

BEARER = "bearer"
TEXT = "text/plain"


def agent_card(agent: PublishedAgent, url: str) -> AgentCard:
    """The card of ``agent`` served at ``url`` (``.../a2a/NAME``, as the caller reached it)."""
    name = agent.id
    description = agent.description or f"The agent published as {name}."
    scheme = HTTPAuthSecurityScheme(
        scheme="Bearer",
        description=f"A token of the mesh's gateway made with: yoke token create --can-call {name}",
    )
    interfaces = [
        AgentInterface(
            url=url, protocol_binding=TransportProtocol.JSONRPC.value, protocol_version=version
        )
        for version in (PROTOCOL_VERSION_1_0, PROTOCOL_VERSION_0_3)
    ]
    return AgentCard(
        name=name,
        description=description,
        supported_interfaces=interfaces,
        provider=AgentProvider(organization="Yoke mesh", url=url.rsplit("/a2a/", 1)[0] + "/"),
        # Published again, it is another card: clients that cache one see it changed.
        version=agent.published_at.strftime("%Y.%m.%d.%H%M%S"),
        capabilities=AgentCapabilities(streaming=True, push_notifications=True),
        security_schemes={BEARER: SecurityScheme(http_auth_security_scheme=scheme)},
        security_requirements=[SecurityRequirement(schemes={BEARER: StringList()})],
        default_input_modes=[TEXT],
        default_output_modes=[TEXT],
        skills=[
            AgentSkill(
                id=name,
                name=name,
                description=description,
                tags=["conversation"],
                input_modes=[TEXT],
                output_modes=[TEXT],
            )
        ],
    )


def template_card() -> AgentCard:
    """What the request handler checks a request against (every published agent streams and
    pushes alike); each agent's own card is :func:`agent_card`'s."""
    return AgentCard(
        name="a2a",
        description="The A2A door of the mesh's gateway.",
        version="1",
        capabilities=AgentCapabilities(streaming=True, push_notifications=True),
        default_input_modes=[TEXT],
        default_output_modes=[TEXT],
        supported_interfaces=[
            AgentInterface(
                url="/a2a",
                protocol_binding=TransportProtocol.JSONRPC.value,
                protocol_version=PROTOCOL_VERSION_1_0,
            )
        ],
        skills=[AgentSkill(id="a2a", name="a2a", description="A published agent.", tags=["x"])],
    )

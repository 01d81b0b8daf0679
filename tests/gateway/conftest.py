"""What the gateway's door tests share: agents published under fresh names on the module's
mesh, and tokens to call them (tests/support/published.py)."""

from __future__ import annotations

import pytest

from tests.support.mesh import Mesh
from tests.support.published import Agents
from yoke.store.database import Store
from yoke.store.tokens import ensure_token_indexes


@pytest.fixture(scope="module")
async def agents(store: Store, mesh: Mesh, gateway_url: str) -> Agents:
    await ensure_token_indexes(store)
    return Agents(store, gateway_url)

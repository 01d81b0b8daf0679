"""Example tools a user brings: a ``Tool`` is a name, a description, a pydantic input model
and an async function from that model to the string the model reads.

``pyproject.toml`` exports ``ORDER_TOOLS`` (a list) and ``slugify`` (one Tool) as entry points
in the ``yoke.tools`` group. Answers are deterministic, so tests can pin them.
"""

from __future__ import annotations

import json
import re
import unicodedata

from pydantic import BaseModel, Field

from yoke.tools import Tool, ToolContext


class OrderInput(BaseModel):
    # The alias is the name the model sees in the tool's JSON Schema.
    order_id: str = Field(
        alias="orderId", min_length=1, max_length=40, description="The order's id, e.g. A1001"
    )


def _status(order_id: str) -> str:
    return "shipped" if order_id.upper().startswith("A") else "processing"


async def _lookup_order(arguments: OrderInput, context: ToolContext) -> str:
    status = _status(arguments.order_id)
    return json.dumps(
        {
            "orderId": arguments.order_id,
            "status": status,
            "carrier": "PostNord" if status == "shipped" else None,
        }
    )


class DeliveryInput(OrderInput):
    country: str = Field(
        default="SE", pattern=r"^[A-Z]{2}$", description="ISO 3166 country code, e.g. SE"
    )


async def _estimate_delivery(arguments: DeliveryInput, context: ToolContext) -> str:
    days = (2 if arguments.country == "SE" else 5) + (
        0 if _status(arguments.order_id) == "shipped" else 2
    )
    return json.dumps({"orderId": arguments.order_id, "country": arguments.country, "days": days})


class SlugifyInput(BaseModel):
    text: str = Field(max_length=500, description="Any text, e.g. a title")


async def _slugify(arguments: SlugifyInput, context: ToolContext) -> str:
    # Accents come off (é -> e), then every run of other characters becomes one hyphen.
    ascii_text = unicodedata.normalize("NFKD", arguments.text).encode("ascii", "ignore").decode()
    return re.sub(r"[^a-z0-9]+", "-", ascii_text.lower()).strip("-")


lookup_order = Tool(
    name="lookup_order",
    description="Looks up an order's status and carrier by its id.",
    input_model=OrderInput,
    run=_lookup_order,
    timeout=10.0,
)
estimate_delivery = Tool(
    name="estimate_delivery",
    description="Estimates in how many days an order reaches a country.",
    input_model=DeliveryInput,
    run=_estimate_delivery,
)
ORDER_TOOLS = [lookup_order, estimate_delivery]

slugify = Tool(
    name="slugify",
    description="Turns text into a URL slug: lowercase ASCII words joined by hyphens.",
    input_model=SlugifyInput,
    run=_slugify,
)

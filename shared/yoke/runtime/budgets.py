"""A join's cost controls: whether its budgets allow a model call, and what a call cost.

One place for every model call a join makes (the processor's answers and compaction's
summaries), so that no kind of call runs past a budget or goes uncounted. Prices come from
``YOKE_PRICES`` through :mod:`yoke.llm.providers`; a model without a price is never taken for
free: a cost budget refuses it, and without one its calls are counted as unpriced.
"""

from __future__ import annotations

import logging

from yoke.core.metrics import LLM_COST, LLM_TOKENS, LLM_UNPRICED_CALLS, model_label
from yoke.core.models import Usage
from yoke.core.settings import Settings
from yoke.llm.providers import cost_of, price_of, priced_family
from yoke.runtime.instances import ProcessorConfig, ProcessorState

log = logging.getLogger(__name__)

# Models whose calls were counted unpriced, told once per process in the log (metric labels,
# so bounded).
_UNPRICED_TOLD: set[str] = set()


def budget_spent(config: ProcessorConfig, state: ProcessorState) -> str | None:
    """Why the join's budget allows no more model calls (None: it allows them)."""
    if config.budget_tokens is not None and state.tokens_used >= config.budget_tokens:
        return f"token budget spent ({state.tokens_used} of {config.budget_tokens})"
    if config.budget_usd is not None and state.cost_usd >= config.budget_usd:
        return f"cost budget spent (${state.cost_usd:.4f} of ${config.budget_usd:.4f})"
    return None


def unpriced_under_budget(
    config: ProcessorConfig, state: ProcessorState, settings: Settings
) -> str | None:
    """Why a cost budget cannot be kept: the join's model has no price. Counting its calls as
    free would let them run past any budget, so such a model is refused instead."""
    model = config.model_for(state)
    if config.budget_usd is None or price_of(model, settings.prices) is not None:
        return None
    return (
        f"no answer: model {model} has no price, so the cost budget "
        f"(${config.budget_usd:.4f}) cannot be kept; add its price to YOKE_PRICES "
        f'(USD per million tokens, input and output: {{"{model}": [0.15, 0.6]}})'
    )


def charge(state: ProcessorState, usage: Usage, requested: str, settings: Settings) -> str:
    """Price ``usage`` and add it to the join's totals; returns its model's metric label (the
    priced family of a dated snapshot). An unpriced model's cost is unknown: counted as such
    (:data:`LLM_UNPRICED_CALLS`), never passed off as free."""
    prices = settings.prices
    cost = cost_of(usage, settings, requested)
    family = priced_family(usage.model, prices) or priced_family(requested, prices)
    label = model_label(family or usage.model, prices)
    if cost is None:
        LLM_UNPRICED_CALLS.labels(label).inc()
        if label not in _UNPRICED_TOLD:
            _UNPRICED_TOLD.add(label)
            log.warning("model %s has no price in YOKE_PRICES: its cost is unknown", usage.model)
    usage.cost_usd = cost or 0.0
    state.tokens_used += usage.input_tokens + usage.output_tokens
    state.cost_usd += usage.cost_usd
    return label


def count_usage(label: str, usage: Usage) -> None:
    """A charged call's tokens and cost in the metrics, by model."""
    LLM_TOKENS.labels(label, "input").inc(usage.input_tokens)
    LLM_TOKENS.labels(label, "output").inc(usage.output_tokens)
    LLM_COST.labels(label).inc(usage.cost_usd)

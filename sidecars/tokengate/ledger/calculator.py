"""The billing formula: what one request costs, from vLLM's usage and per-model weights.

Inputs (tokens, from the usage event)::

    P = prompt_tokens       vLLM usage.prompt_tokens; includes the cached ones
    C = cached_tokens       usage.prompt_tokens_details.cached_tokens (prefix-cache hits)
    O = completion_tokens   usage.completion_tokens
    S = system_tokens       system-message tokens of the prompt (counter breakdown)

Weights (per model, ``models.<name>.cost`` in tokengate.yaml, currency per 1M tokens;
defaults input 1.0, output 1.35, cached 0.1) and options (``billing:``; defaults
threshold 32768 tokens, rate 0.00015, exclude_system_tokens false)::

    cached_billed = C - Sc                  Sc = system tokens taken from the cached part
    input_billed  = (P - C) - Su            Su = system tokens taken from the uncached part
        with S' = min(S, P) excluded when exclude_system_tokens, else S' = 0;
        Sc = min(S', C), Su = S' - Sc       (the system message opens the prompt, so
                                             prefix caching serves it first)
    factor        = 1 + rate * (P - threshold)   if P > threshold, else 1
    input_units   = input_billed * factor        (the context-window penalty)
    cost = (input_units * input + O * output + cached_billed * cached) / 1e6
    a batch line's (an event with batch_id, the Batch API) is that times models.<name>.
    cost.batch (default 0.5: OpenAI's Batch API is billed at half price)

Cached tokens are billed at the cached rate *instead of* the input rate: vLLM's
``prompt_tokens`` counts them too, so billing them as input as well would charge them
twice (the OpenAI pricing convention for ``cached_tokens``). The penalty's factor grows
with the context length ``P`` (the work attention does per token grows with it) and
applies to the billed input tokens; with no cache hits and no exclusion it is exactly
``input_tokens * (1 + rate * (input_tokens - threshold))``.

Worked examples (weights 1.0 / 1.35 / 0.1, threshold 32768, rate 0.00015) are in the
docs/operators/billing.md and in tests/ledger/test_calculator.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokengate.config import BillingConfig, Config, ModelCost
from tokengate.ledger.event import UsageEvent

PER_TOKENS = 1_000_000


@dataclass(frozen=True, slots=True)
class Charge:
    """One request's bill: tokens by kind as billed, and the cost in the currency."""

    input_tokens: int          # uncached, non-excluded prompt tokens, tokens
    input_units: float         # input_tokens times the context-window factor, tokens
    cached_tokens: int         # cached, non-excluded prompt tokens, tokens
    output_tokens: int         # completion tokens, tokens
    excluded_tokens: int       # system tokens left out of the bill, tokens
    factor: float              # the context-window factor (1.0 below the threshold)
    cost: float                # currency units (e.g. USD)


def charge(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0,
           system_tokens: int = 0, *, weights: ModelCost | None = None,
           billing: BillingConfig | None = None, batch: bool = False) -> Charge:
    """Bill one request; see the module docstring for the formula.

    Token counts are non-negative integers; ``cached_tokens`` is clamped to
    ``prompt_tokens`` and ``system_tokens`` to ``prompt_tokens``. ``weights`` default to
    ``ModelCost()`` (1.0 / 1.35 / 0.1 per 1M tokens), ``billing`` to ``BillingConfig()``;
    ``batch``: a batch line, its cost times ``weights.batch``. Raises ``ValueError`` on a negative count.
    """
    if min(prompt_tokens, completion_tokens, cached_tokens, system_tokens) < 0:
        raise ValueError("token counts must be >= 0")
    w = weights or ModelCost()
    b = billing or BillingConfig()
    p = prompt_tokens
    c = min(cached_tokens, p)
    excluded = min(system_tokens, p) if b.exclude_system_tokens else 0
    from_cached = min(excluded, c)
    cached_billed = c - from_cached
    input_billed = (p - c) - (excluded - from_cached)
    pen = b.context_penalty
    factor = 1.0 + pen.rate * (p - pen.threshold) if p > pen.threshold else 1.0
    units = input_billed * factor
    cost = (units * w.input + completion_tokens * w.output + cached_billed * w.cached) \
        / PER_TOKENS
    if batch:
        cost *= w.batch
    return Charge(input_tokens=input_billed, input_units=units, cached_tokens=cached_billed,
                  output_tokens=completion_tokens, excluded_tokens=excluded, factor=factor,
                  cost=cost)


class Calculator:
    """Bills usage events with the weights and options of one configuration."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg

    def weights(self, model: str | None) -> ModelCost:
        """The model's weights; the defaults for an unknown or missing model."""
        m = self.cfg.models.get(model or "")
        return m.cost if m is not None else ModelCost()

    def charge(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int,
               system_tokens: int, model: str | None, batch: bool = False) -> Charge:
        """``charge()`` with this configuration's weights for ``model``; ``batch``: a
        batch line's price."""
        return charge(prompt_tokens, completion_tokens, cached_tokens, system_tokens,
                      weights=self.weights(model), billing=self.cfg.billing, batch=batch)

    def charge_event(self, ev: UsageEvent) -> Charge:
        """Bill one usage event (its vLLM usage; a rejected request costs 0)."""
        return self.charge(ev.prompt_tokens, ev.completion_tokens, ev.cached_tokens,
                           ev.system_tokens, ev.model, ev.batch_id is not None)

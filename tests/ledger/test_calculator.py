"""The billing formula: docs/operators/billing.md's worked examples, number for number.

Weights 1.0 / 1.35 / 0.1 (input / output / cached, USD per 1M tokens), context
penalty threshold 32768 tokens, rate 0.00015.
"""

from __future__ import annotations

import pytest
from tokengate.config import BillingConfig, ContextPenalty, ModelCost
from tokengate.ledger.calculator import Calculator, charge

from tests.fixtures_ledger import make_event

# pure: starts no process of the stack (make test-unit)
pytestmark = pytest.mark.unit

EXCLUDE = BillingConfig(exclude_system_tokens=True)


def test_example_1_plain_chat():
    # 1,200 prompt tokens, 350 completion: (1200 * 1.0 + 350 * 1.35) / 1e6
    c = charge(1200, 350)
    assert (c.input_tokens, c.cached_tokens, c.output_tokens, c.factor) == (1200, 0, 350, 1.0)
    assert c.cost == pytest.approx(0.0016725, abs=1e-15)


def test_example_2_prefix_cache_hit_bills_cached_tokens_at_the_cached_rate_only():
    # 1,024 of the 1,200 prompt tokens from the prefix cache:
    # (176 * 1.0 + 350 * 1.35 + 1024 * 0.1) / 1e6
    c = charge(1200, 350, cached_tokens=1024)
    assert (c.input_tokens, c.cached_tokens) == (176, 1024)
    assert c.cost == pytest.approx(0.0007509, abs=1e-15)


def test_example_3_long_context_penalty():
    # 40,000 prompt tokens: factor 1 + 0.00015 * (40000 - 32768) = 2.0848,
    # (40000 * 2.0848 * 1.0 + 1000 * 1.35) / 1e6
    c = charge(40_000, 1000)
    assert c.factor == pytest.approx(2.0848, abs=1e-12)
    assert c.input_units == pytest.approx(83_392.0, abs=1e-6)
    assert c.cost == pytest.approx(0.084742, abs=1e-15)


def test_example_4_penalty_with_cache_hits_applies_to_billed_input():
    # 40,000 prompt tokens, 30,000 cached: factor still 2.0848 (context length),
    # (10000 * 2.0848 + 1000 * 1.35 + 30000 * 0.1) / 1e6
    c = charge(40_000, 1000, cached_tokens=30_000)
    assert c.cost == pytest.approx(0.025198, abs=1e-15)


def test_example_5_system_tokens_left_out_come_from_the_cached_prefix_first():
    # 300 system tokens inside the 1,024 cached ones: cached billed 724,
    # (176 * 1.0 + 350 * 1.35 + 724 * 0.1) / 1e6
    c = charge(1200, 350, cached_tokens=1024, system_tokens=300, billing=EXCLUDE)
    assert (c.input_tokens, c.cached_tokens, c.excluded_tokens) == (176, 724, 300)
    assert c.cost == pytest.approx(0.0007209, abs=1e-15)


def test_example_6_system_tokens_beyond_the_cache_come_off_the_input():
    # 300 system tokens, 100 cached: 100 off the cached part, 200 off the input,
    # (900 * 1.0 + 350 * 1.35) / 1e6
    c = charge(1200, 350, cached_tokens=100, system_tokens=300, billing=EXCLUDE)
    assert (c.input_tokens, c.cached_tokens) == (900, 0)
    assert c.cost == pytest.approx(0.0013725, abs=1e-15)


def test_system_tokens_are_billed_when_the_option_is_off():
    assert charge(1200, 350, system_tokens=300) == charge(1200, 350)


def test_no_penalty_at_the_threshold_and_just_above_it():
    assert charge(32_768, 0).factor == 1.0
    just_above = charge(32_769, 0)
    assert just_above.factor == pytest.approx(1.00015, abs=1e-12)
    assert just_above.cost == pytest.approx(32_769 * 1.00015 / 1e6, abs=1e-15)


def test_penalty_parameters_come_from_the_configuration():
    off = BillingConfig(context_penalty=ContextPenalty(threshold=10**9, rate=0.5))
    assert charge(40_000, 0, billing=off).cost == pytest.approx(0.04, abs=1e-15)
    steep = BillingConfig(context_penalty=ContextPenalty(threshold=1000, rate=0.001))
    # 2000 tokens: factor 1 + 0.001 * 1000 = 2
    assert charge(2000, 0, billing=steep).cost == pytest.approx(0.004, abs=1e-15)


def test_a_rejected_request_costs_nothing():
    assert charge(0, 0).cost == 0.0


def test_model_weights_come_from_the_configuration(cfg):
    calc = Calculator(cfg)
    assert calc.weights("tiny-qwen3") == ModelCost(input=1.0, output=1.35, cached=0.1)
    assert calc.weights("not-configured") == ModelCost()   # defaults
    custom = ModelCost(input=0.5, output=2.0, cached=0.05)
    # (1000 * 0.5 + 500 * 2.0 + 200 * 0.05) / 1e6 for 1200 prompt tokens, 200 cached
    assert charge(1200, 500, 200, weights=custom).cost == pytest.approx(0.00151, abs=1e-15)


def test_an_event_is_billed_from_its_vllm_usage(cfg):
    ev = make_event(prompt_tokens=1200, completion_tokens=350, cached_tokens=1024,
                    token_estimate=9999, reserved=9999)
    assert Calculator(cfg).charge_event(ev).cost == pytest.approx(0.0007509, abs=1e-15)


def test_negative_counts_are_refused():
    with pytest.raises(ValueError):
        charge(-1, 0)

"""TokenStorm's schedules: arrival processes, token-rate targets and length profiles.

Every schedule is seeded, so each number below is the same on every run; the
tolerances are the sampling error of the stated sample size (several standard errors
wide), not slack for flakiness.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from tokenstorm.arrivals import ArrivalSpec, schedule
from tokenstorm.profiles import (
    BurstProfile,
    LongTailProfile,
    NormalProfile,
    OutputPolicy,
    TokenLimits,
    make_profile,
)

# pure: starts no process of the stack (make test-unit)
pytestmark = pytest.mark.unit

LIMITS = TokenLimits(min_input=9, max_model_len=8192, min_output=16)
FIXED = NormalProfile(limits=LIMITS, mean=1000, sd=0)


def gaps(times: np.ndarray) -> np.ndarray:
    return np.diff(times)


def test_constant_arrivals_are_exactly_one_over_rate() -> None:
    plan = schedule(ArrivalSpec("constant", rate=250.0), FIXED, duration_s=2.0)
    assert len(plan) == 500
    np.testing.assert_allclose(plan.times, np.arange(500) / 250.0, rtol=0, atol=1e-9)


def test_poisson_gaps_are_exponential_with_mean_one_over_rate() -> None:
    plan = schedule(ArrivalSpec("poisson", rate=1000.0), FIXED, duration_s=200.0, seed=1)
    g = gaps(plan.times)
    assert abs(len(plan) - 200_000) < 3 * np.sqrt(200_000)
    assert g.mean() == pytest.approx(1e-3, rel=0.01)
    assert g.std() / g.mean() == pytest.approx(1.0, abs=0.01)  # coefficient of variation
    # Kolmogorov-Smirnov distance to Exp(rate): critical value at 200k samples ~0.004.
    x = np.sort(g)
    ks = np.max(np.abs(np.arange(1, x.size + 1) / x.size - (1 - np.exp(-1000.0 * x))))
    assert ks < 0.005


@pytest.mark.parametrize("burstiness", [0.25, 4.0])
def test_gamma_gaps_have_cv_one_over_sqrt_burstiness(burstiness: float) -> None:
    plan = schedule(ArrivalSpec("gamma", rate=500.0, burstiness=burstiness), FIXED,
                    duration_s=200.0, seed=2)
    g = gaps(plan.times)
    assert g.mean() == pytest.approx(1 / 500.0, rel=0.02)
    assert g.std() / g.mean() == pytest.approx(1 / np.sqrt(burstiness), rel=0.03)


def test_token_rate_target_offers_that_many_tokens_per_second() -> None:
    """Token clock: tokens offered over the run equal token_rate x duration, whatever
    the mix of lengths (long_tail here: 5 % of prompts are ~8k tokens)."""
    profile = LongTailProfile(limits=LIMITS)
    plan = schedule(ArrivalSpec("poisson", token_rate=2_000_000.0), profile, duration_s=300.0,
                    seed=3)
    offered = int((plan.inputs + plan.outputs).sum())
    assert offered / 300.0 == pytest.approx(2_000_000.0, rel=0.02)


def test_token_rate_schedule_with_time_varying_lengths_covers_the_whole_run() -> None:
    """Burst windows bring long prompts, so fewer requests per second arrive in them;
    the schedule still runs to the end and offers the token rate on average."""
    profile = BurstProfile(limits=LIMITS, period_s=4.0, burst_s=1.0)
    plan = schedule(ArrivalSpec("poisson", token_rate=300_000.0), profile, duration_s=40.0,
                    seed=8)
    assert plan.times.max() > 39.9
    assert int((plan.inputs + plan.outputs).sum()) / 40.0 == pytest.approx(300_000, rel=0.03)
    per_s_burst = plan.burst.sum() / 10.0       # 10 burst seconds in 40
    per_s_steady = (~plan.burst).sum() / 30.0
    assert per_s_steady > 5 * per_s_burst


def test_normal_profile_moments_and_output_ratio() -> None:
    profile = make_profile("normal", LIMITS, OutputPolicy())
    plan = schedule(ArrivalSpec("constant", rate=1000.0), profile, duration_s=50.0, seed=4)
    assert plan.inputs.mean() == pytest.approx(2000, rel=0.01)
    assert plan.inputs.std() == pytest.approx(500, rel=0.02)
    # Output = round(1.8 x input) capped by the context, exactly, for every request.
    expected = np.minimum(np.rint(1.8 * plan.inputs), 8192 - plan.inputs)
    np.testing.assert_array_equal(plan.outputs, expected)


def test_long_tail_is_95_percent_near_1000_and_5_percent_at_the_context() -> None:
    profile = make_profile("long_tail", LIMITS, OutputPolicy(fixed=16))
    plan = schedule(ArrivalSpec("constant", rate=1000.0), profile, duration_s=100.0, seed=5)
    tail = plan.inputs > 4000
    assert tail.mean() == pytest.approx(0.05, abs=0.005)
    assert plan.inputs[~tail].mean() == pytest.approx(1000, rel=0.01)
    # 10000-token prompts do not fit an 8192-token context: clipped to leave 16 out.
    assert plan.inputs.max() == 8192 - 16
    assert (plan.outputs == 16).all()


def test_burst_profile_lengths_follow_the_minute() -> None:
    profile = BurstProfile(limits=LIMITS)
    plan = schedule(ArrivalSpec("poisson", rate=50.0), profile, duration_s=180.0, seed=6)
    in_burst = (plan.times % 60.0) < 10.0
    np.testing.assert_array_equal(plan.burst, in_burst)
    assert plan.inputs[in_burst].min() >= 500 and plan.inputs[in_burst].max() <= 8000
    assert plan.inputs[~in_burst].min() >= 100 and plan.inputs[~in_burst].max() <= 500
    assert plan.inputs[in_burst].mean() == pytest.approx(4250, rel=0.05)
    # Output tokens stay inside the context: 1.8 x 8000 does not fit.
    assert ((plan.inputs + plan.outputs) <= 8192).all()
    assert plan.outputs[plan.inputs == plan.inputs.max()][0] == 8192 - plan.inputs.max()


def test_trace_replay_keeps_times_and_lengths(tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    rows = [{"timestamp": 100.0, "input_tokens": 120, "output_tokens": 7},
            {"timestamp": 100.5, "input_tokens": 3000},
            {"timestamp": 102.0, "input_length": 9000, "output_length": 50},
            {"timestamp": 131.0, "input_tokens": 10}]
    trace.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    profile = make_profile(f"trace:path={trace},speed=2", LIMITS, OutputPolicy())
    plan = schedule(ArrivalSpec("poisson", rate=1.0), profile, duration_s=10.0)
    np.testing.assert_allclose(plan.times, [0.0, 0.25, 1.0])  # 131 s / 2 is past 10 s
    np.testing.assert_array_equal(plan.inputs, [120, 3000, 8176])
    np.testing.assert_array_equal(plan.outputs, [7, 5192, 16])


def test_same_seed_same_schedule_other_seed_other_schedule() -> None:
    spec = ArrivalSpec("gamma", rate=300.0, burstiness=0.5)
    profile = make_profile("normal", LIMITS, OutputPolicy())
    a = schedule(spec, profile, 5.0, seed=11)
    b = schedule(spec, profile, 5.0, seed=11)
    c = schedule(spec, profile, 5.0, seed=12)
    np.testing.assert_array_equal(a.times, b.times)
    np.testing.assert_array_equal(a.inputs, b.inputs)
    assert not np.array_equal(a.inputs[:100], c.inputs[:100])


@pytest.mark.parametrize("bad", [{"rate": None}, {"rate": 5.0, "token_rate": 5.0},
                                 {"rate": -1.0}, {"rate": 1.0, "burstiness": 0.0}])
def test_arrival_spec_rejects_bad_targets(bad: dict[str, float | None]) -> None:
    with pytest.raises(ValueError):
        ArrivalSpec("gamma", **bad)  # type: ignore[arg-type]

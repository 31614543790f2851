"""Tiered access-log sampling: the rule, its shared test vectors, its ratios."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
from tokengate.config import AccessLogConfig

from tests.sampling_reference import bucket, keep, threshold

# pure: starts no process of the stack (make test-unit)
pytestmark = pytest.mark.unit

VECTORS = Path(__file__).parents[1] / "sampling_vectors.json"
N = 10_000


def ids(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [f"{rng.getrandbits(128):032x}" for _ in range(n)]


def within(kept: int, n: int, p: float) -> bool:
    """kept is within 4.5 standard deviations of the binomial mean (false alarm
    probability about 7e-6 per check)."""
    return abs(kept - n * p) <= 4.5 * math.sqrt(n * p * (1 - p))


def test_the_shared_vectors_hold():
    doc = json.loads(VECTORS.read_text())
    rules = AccessLogConfig(**doc["rules"])
    assert len(doc["vectors"]) >= 50
    for v in doc["vectors"]:
        assert bucket(v["request_id"]) == v["bucket"], v
        assert keep(v["request_id"], v["status"], v["total_ms"], rules) == v["keep"], v


def test_the_rule_spelled_out():
    assert bucket("00000063" + "0" * 24) == 99 and keep("00000063" + "0" * 24, 200, 1.0)
    assert bucket("00000064" + "0" * 24) == 100 and not keep("00000064" + "0" * 24, 200, 1.0)
    # slower than 5 s (strictly): 10 %, buckets 0..999
    assert keep("000003e7" + "0" * 24, 200, 5000.5)
    assert not keep("000003e7" + "0" * 24, 200, 5000.0)
    assert not keep("000003e8" + "0" * 24, 200, 9000.0)
    # 0xffffffff % 10000 == 7295; uppercase hex is the same id
    assert bucket("ffffffff" + "0" * 24) == bucket("FFFFFFFF" + "0" * 24) == 7295
    # every status >= 400 is kept; an id that cannot be bucketed is kept
    assert keep("ffffffff" + "0" * 24, 400, 1.0) and keep("ffffffff" + "0" * 24, 503, 1.0)
    assert keep("not-hex-at-all", 200, 1.0) and keep("", 200, 1.0)
    assert (threshold(0.01), threshold(0.1), threshold(0.00005), threshold(1.0)) == \
        (100, 1000, 1, 10_000)


def test_ratios_on_10k_synthetic_requests():
    fast = ids(N, 1)
    slow = ids(N, 2)
    errors = ids(N, 3)
    kept_fast = sum(keep(r, 200, 120.0) for r in fast)
    kept_slow = sum(keep(r, 200, 7000.0) for r in slow)
    kept_err = sum(keep(r, s, 50.0) for r, s in zip(errors, [400, 401, 429, 500, 503] * N))
    assert within(kept_fast, N, 0.01), kept_fast
    assert within(kept_slow, N, 0.10), kept_slow
    assert kept_err == N


@pytest.mark.parametrize("rate", [0.0, 0.05, 0.25, 1.0])
def test_ratios_follow_the_configuration(rate):
    rules = AccessLogConfig(rate=rate, slow_rate=rate, error_status=600)
    kept = sum(keep(r, 500, 1.0, rules) for r in ids(N, 4))
    assert within(kept, N, rate) if 0 < rate < 1 else kept == N * rate


def test_the_decision_is_reproducible():
    rids = ids(1000, 5)
    first = [keep(r, 200, 10.0) for r in rids]
    assert first == [keep(r, 200, 10.0) for r in rids]
    # the slow tier keeps a superset of the fast tier (same buckets, larger threshold)
    assert all(keep(r, 200, 6000.0) for r, k in zip(rids, first) if k)

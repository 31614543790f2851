"""Teams' and organizations' windows and budgets in tokengate-limits (gRPC, real sidecar,
real Redis): one script reserves a key and its levels, all or none; settlements and the
quota read every level; the ledger settles a level's reservation the edge could not."""

from __future__ import annotations

import time
from datetime import date, timedelta
from pathlib import Path
from typing import Any

import pytest
import redis
import yaml
from tokengate import config as tg_config
from tokengate import redis_client
from tokengate import redis_keys as store
from tokengate.budget_store import nano
from tokengate.ledger.calculator import Calculator
from tokengate.ledger.ledger import Ledger
from tokengate.limits.budget import budget_keys, reservation_key, this_hour
from tokengate.limits.window import window_keys
from tokengate.v1 import limits_pb2 as pb
from tokengate.v1 import limits_pb2_grpc as pb_grpc

from tests.conftest import MODEL, key_digest
from tests.fixtures_ledger import UsageWriter, make_event
from tests.limits.test_limits import limits, reserve, rid

__all__ = ["limits"]  # the fixture, shared with test_limits

TEAM = pb.LevelWindow(id="team:t", rpm_limit=1000, tpm_limit=500)
ORG = pb.LevelWindow(id="org:o", rpm_limit=2, tpm_limit=100_000)
DAY = int(time.time() // 86400)


def test_a_team_window_holds_every_member_and_names_itself_when_it_refuses(
        limits: pb_grpc.GlobalLimitsStub, ledger_redis: redis.Redis) -> None:
    first = reserve(limits, 1, 300, key="k1", levels=[TEAM])
    assert (first.admitted, first.level) == (True, 1)  # the team is the tightest
    assert first.remaining_tokens == 200
    refused = reserve(limits, 2, 300, key="k2", levels=[TEAM])
    assert (refused.admitted, refused.limited_by, refused.level) == \
        (False, pb.LIMIT_TOKENS, 1)
    assert (refused.remaining_tokens, refused.remaining_requests) == (200, 999)
    # all or none: the refused request is in no window, k2's own included
    assert ledger_redis.zcard(window_keys("k2")[0]) == 0
    assert int(ledger_redis.hget(window_keys("team:t")[1], "#sum")) == 300
    # the organization's RPM of 2 refuses the third request, whatever the team says
    assert reserve(limits, 3, 10, key="k3", levels=[TEAM, ORG]).admitted
    third = reserve(limits, 4, 10, key="k3", levels=[TEAM, ORG])
    assert (third.admitted, third.limited_by, third.level) == (True, 0, 1)
    org = reserve(limits, 5, 10, key="k4", levels=[TEAM, ORG])
    assert (org.admitted, org.limited_by, org.level) == (False, pb.LIMIT_REQUESTS, 2)
    # a retry of an admitted request is answered from its record (idempotent)
    again = reserve(limits, 1, 300, key="k1", levels=[TEAM])
    assert again.admitted and int(ledger_redis.hget(window_keys("team:t")[1], "#sum")) == 320


def test_settle_corrects_the_key_and_every_level(limits: pb_grpc.GlobalLimitsStub,
                                                 ledger_redis: redis.Redis) -> None:
    assert reserve(limits, 1, 300, key="k1", levels=[TEAM, ORG]).admitted
    got = limits.Settle(pb.SettleRequest(key_id="k1", model=MODEL, request_id=rid(1),
                                         actual_tokens=120,
                                         levels=[pb.LevelWindow(id="team:t"),
                                                 pb.LevelWindow(id="org:o")]), timeout=2)
    assert (got.found, got.delta, got.window_tokens) == (True, -180, 120)
    assert [int(ledger_redis.hget(window_keys(w)[1], "#sum")) for w in
            ("k1", "team:t", "org:o")] == [120, 120, 120]


def test_quota_reads_every_window_and_counter_without_changing_them(
        limits: pb_grpc.GlobalLimitsStub, ledger_redis: redis.Redis) -> None:
    assert reserve(limits, 1, 300, key="k1", levels=[TEAM]).admitted
    assert reserve(limits, 2, 100, key="k2", levels=[TEAM]).admitted
    team_counter = pb.BudgetCounter(name=f"team:t/*:day:{DAY}", spend_limit_nano=10**9,
                                    ttl_s=172800)
    budget = limits.ReserveBudget(pb.BudgetReserveRequest(
        key_id="k1", request_id=rid(1), counters=[team_counter], cost_nano=5000,
        tokens=300), timeout=2)
    assert budget.admitted
    q = limits.Quota(pb.QuotaRequest(key_id="k1", levels=[TEAM], counters=[team_counter]),
                     timeout=2)
    assert [(w.requests, w.tokens) for w in q.windows] == [(1, 300), (2, 400)]
    assert 59_000 <= q.windows[1].reset_ms <= 60_000
    (c,) = q.counters
    assert (c.spent_nano, c.tokens, c.reserved_nano, c.reserved_tokens) == (0, 0, 5000, 300)
    # k2 sees the same team counter (a level's counter is the level's, not the key's)
    q2 = limits.Quota(pb.QuotaRequest(key_id="k2", counters=[team_counter]), timeout=2)
    assert q2.counters[0].reserved_nano == 5000
    assert q2.windows[0].requests == 1
    # what the ledger billed in the period, where the settled counters hold less (the
    # requests before the budget was set): spent as admission counts it
    iso = (date(1970, 1, 1) + timedelta(days=DAY)).isoformat()
    ledger_redis.hset(store.usage_key(iso, "k3", MODEL),
                      mapping={"cost": "0.000004", "prompt_tokens": 30, "completion_tokens": 12})
    ledger_redis.hset(store.level_usage_key(iso, "team:t", MODEL),
                      mapping={"cost": "0.000007", "prompt_tokens": 50, "completion_tokens": 20})
    key_counter = pb.BudgetCounter(name=f"*:day:{DAY}", spend_limit_nano=10**9, ttl_s=172800)
    q3 = limits.Quota(pb.QuotaRequest(key_id="k3", counters=[key_counter, team_counter]),
                      timeout=2)
    assert [(c.spent_nano, c.tokens, c.reserved_nano) for c in q3.counters] == \
        [(4000, 42, 0), (7000, 70, 5000)]


@pytest.fixture
def team_config(config_path: Path, tmp_path: Path) -> tg_config.Config:
    raw: dict[str, Any] = yaml.safe_load(config_path.read_text())
    raw["global_limits"] = {"enabled": True}
    raw["teams"] = {"t": {"budgets": [{"period": "day", "spend": 1.0}]}}
    raw["keys"]["tm-1"] = {"sha256": key_digest("tg-test-tm-1"), "rpm": 10, "tpm": 10_000,
                           "team": "t"}
    path = tmp_path / "tokengate.yaml"
    path.write_text(yaml.safe_dump(raw))
    return tg_config.load(path)


def test_the_ledger_settles_a_team_reservation_the_edge_could_not(
        limits: pb_grpc.GlobalLimitsStub, ledger_redis: redis.Redis, redis_url: str,
        team_config: tg_config.Config, tmp_path: Path) -> None:
    """A member key without a budget of its own: its reservation names only the team's
    counters, and the ledger, applying the usage event, settles them with the real cost
    (the edge's settlement was lost), once."""
    counter = pb.BudgetCounter(name=f"team:t/*:day:{DAY}", spend_limit_nano=10**9,
                               ttl_s=172800)
    request_id = rid(77)
    assert limits.ReserveBudget(pb.BudgetReserveRequest(
        key_id="tm-1", request_id=request_id, counters=[counter], cost_nano=900_000,
        tokens=500), timeout=2).admitted
    writer = UsageWriter(tmp_path / "usage.jsonl")
    now = time.strftime("%Y-%m-%dT%H:%M:%S.000Z", time.gmtime())
    ev = make_event(request_id=request_id, key_id="tm-1", model=MODEL, ts=now)
    writer.write(ev)
    writer.close()
    ledger = Ledger(team_config, redis_client.connect(team_config.redis, url=redis_url),
                    writer.path)
    ledger.drain()
    assert ledger.totals.budgets_settled == 1
    assert ledger_redis.get(reservation_key("tm-1", request_id)) == "settled"
    s, t, rs, rt, *_ = budget_keys("tm-1", counter.name, this_hour())
    assert s.startswith("tg:bg:{team%3At}:")  # the team's, not the key's
    real = nano(Calculator(team_config).charge_event(ev).cost)
    assert (int(ledger_redis.get(s)), int(ledger_redis.get(t))) == \
        (real, ev.prompt_tokens + ev.completion_tokens)
    assert (int(ledger_redis.get(rs)), int(ledger_redis.get(rt))) == (0, 0)
    ledger.client.close()

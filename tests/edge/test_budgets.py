"""Budgets at the edge: spend limits and token quotas per key per UTC day / month.

Real nginx (2 workers), the real counter, TokenStorm's fast upstream (it generates
exactly max_tokens and caches nothing, so a request's real cost equals its worst case
and the expected numbers are exact), the official openai client. The edge's formula is
checked against the ledger's calculator (one formula, two languages).

Budgets need ``global_limits.enabled`` (Redis keeps their spend; tests/edge/test_edge_global.py
shows two edges sharing it). Here each budget is heard from once through a real limits
sidecar (a private Redis), which is then stopped, so the requests after are decided by
the edge's own budget counters and what Redis last said, the tier that decides while
Redis or the sidecar is unreachable: it must be as exact on its own.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from tokengate import redis_keys as store
from tokengate.config import BillingConfig, ContextPenalty, ModelCost
from tokengate.ledger.calculator import charge
from tokengate_dev import devstack

from tests.conftest import MODEL, TEST_DIR, key_digest
from tests.fixtures_edge import Edge, free_port, patient_redis_config, run_lua
from tests.fixtures_ledger import PrivateRedis, svc_name, wait_until

MAX_TOKENS = 100


def amount(nano: int) -> str:
    """Nano-units as the edge writes an amount in a message: to the nano-unit, without
    trailing zeros."""
    return re.sub(r"\.?0+$", "", f"{nano / 1e9:.9f}")
BUDGET_KEYS: dict[str, tuple[str, list[dict[str, Any]]]] = {
    "bg-spend": ("tg-test-bg-spend", [{"period": "day", "spend": 0.001}]),
    "bg-tokens": ("tg-test-bg-tokens", [{"period": "month", "tokens": 1000,
                                         "model": MODEL}]),
    "bg-probe": ("tg-test-bg-probe", []),
    "bg-big": ("tg-test-bg-big", [{"period": "day", "tokens": 1_000_000}]),
}


def test_the_edge_bills_with_the_ledgers_formula() -> None:
    cases = [(9, 100, 0, 0, False), (40_000, 17, 1_000, 30, False),
             (40_000, 17, 1_000, 30, True), (33_000, 0, 33_000, 500, True),
             (100, 5, 200, 300, True), (0, 0, 0, 0, False)]
    weights = ModelCost(input=1.0, output=1.35, cached=0.1)
    lua_cases = ", ".join(f"{{{p}, {o}, {c}, {s}, {str(x).lower()}}}"
                          for p, o, c, s, x in cases)
    out = run_lua(f"""
        local budget = require "tokengate.budget"
        local cjson = require "cjson"
        local res = {{}}
        for _, c in ipairs({{{lua_cases}}}) do
            local billing = {{exclude_system_tokens = c[5],
                             context_penalty = {{threshold = 32768, rate = 0.00015}}}}
            res[#res + 1] = string.format("%.17g", budget.cost(
                {{input = 1.0, output = 1.35, cached = 0.1}}, billing, c[1], c[2], c[3], c[4]))
        end
        return cjson.encode(res)""")
    got = [float(x) for x in json.loads(out)]
    want = [charge(p, o, c, s, weights=weights,
                   billing=BillingConfig(exclude_system_tokens=x,
                                         context_penalty=ContextPenalty())).cost
            for p, o, c, s, x in cases]
    assert got == pytest.approx(want, rel=1e-12, abs=1e-15)


def day_budget_lua(spend_nano: int) -> str:
    """Lua that the edge's budget tests start from: ``budget`` (tokengate.budget on the
    test dict), ``key`` "k" with a daily spend budget of ``spend_nano`` nano-units,
    ``model`` "m" at 0.5 per 1M tokens in and out (200 + 200 tokens cost 200,000
    nano-units), ``doc`` (no system-token exclusion, no context penalty) and ``t0``
    (01:00 UTC of day 20,000, epoch s)."""
    return f"""
        local budget = require "tokengate.budget"
        assert(budget.init("tokengate_limits"))
        local key = {{id = "k", budgets = {{{{period = "day", spend = {spend_nano / 1e9!r},
                                           spend_nano = {spend_nano}}}}}}}
        local model = {{name = "m", cost = {{input = 0.5, output = 0.5, cached = 0}}}}
        local doc = {{currency = "USD", billing = {{exclude_system_tokens = false,
                     context_penalty = {{threshold = 1000000, rate = 0}}}}}}
        local t0 = 20000 * 86400 + 3600"""


def test_a_reservation_never_settled_stops_holding_the_budget_within_two_hours() -> None:
    # A request admitted at 01:00 UTC whose nginx worker crashed (no settlement) holds
    # the edge's own budget counters in its hour and the next, not the rest of the day;
    # its settlement, when it comes late, is charged once. Each request may cost up to
    # 200 + 200 tokens x 0.5 per 1M = 0.0002; the limit is 0.0003 a day.
    out = run_lua(day_budget_lua(300_000) + """
        local res = {}
        local function try(at)
            local bud = budget.request(key, model, doc, 200, 200, t0 + at)
            local ok = budget.reserve(bud)
            res[#res + 1] = (ok and "admitted " .. bud.items[1].spent or "refused")
            return bud
        end
        local crashed = try(0)
        try(1800)   -- the same hour
        try(3600)   -- the next hour still counts it
        local b = try(7200)  -- two hours on: it no longer does
        budget.settle(b, 300, 0.0001)
        try(7300)   -- 0.0001 settled + its own 0.0002
        budget.settle(crashed, 400, 0.0002)  -- late: charged once, its bucket not read
        try(7400)   -- 0.0003 settled + 0.0002 in flight + its own
        return table.concat(res, ", ")""")
    assert out == ("admitted 200000, refused, refused, admitted 200000, admitted 300000, "
                   "refused")


def test_in_fallback_a_budget_counts_from_what_redis_last_said_and_a_restart_knows_nothing(
        ) -> None:
    # One edge, a daily limit of 0.001 (1,000,000 nano-units); each request may cost up
    # to 200 + 200 tokens x 0.5 per 1M = 200,000 and costs that. A fresh shared dict (an
    # nginx restarted with kill -9) has heard nothing from Redis: in fallback the budget is
    # refused (503) rather than counted from 0 again. Once Redis answered (700,000 spent
    # by every edge, this one's 200,000 reservation included), fallback admits what is
    # left of the limit counted from there, and no more. A new period of a budget heard
    # from counts from 0.
    out = run_lua(day_budget_lua(1_000_000) + """
        local res = {}
        local function admit(at)  -- reserved on this edge's counters, Redis unreachable
            local bud = budget.request(key, model, doc, 200, 200, t0 + at)
            local ok, err = budget.reserve(bud)  -- (its own counters may refuse first)
            if not ok then
                res[#res + 1] = err.status .. " " .. err.code
                return bud
            end
            local refusal = budget.fallback(bud)
            if refusal then
                budget.uncommit(bud)
                local err = budget.refusal(bud, refusal.index, refusal.kind, refusal.used)
                res[#res + 1] = err.status .. " " .. (err.code or err.type)
            else
                res[#res + 1] = "admitted " .. bud.items[1].spent
                budget.settle(bud, 400, 0.0002)
            end
            return bud
        end
        admit(0)
        local seen = budget.request(key, model, doc, 200, 200, t0 + 1)
        assert(budget.reserve(seen))
        budget.learn(seen, {{spent_nano = 700000, tokens = 400}}, true)
        res[#res + 1] = "redis " .. seen.items[1].spent
        budget.settle(seen, 400, 0.0002)
        admit(2)   -- 700,000 + 200,000
        admit(3)   -- 900,000 + 200,000 > 1,000,000
        admit(86400)  -- the next day: heard from, nothing known of the new period
        -- Redis answers before the ledger billed what this edge admitted alone (the
        -- 200,000 just before): Redis holds 200,000 to this edge's 400,000, and what it
        -- holds beyond this edge is 0, not -200,000 (which would count 200,000 short)
        local late = budget.request(key, model, doc, 200, 200, t0 + 86401)
        assert(budget.reserve(late))
        budget.learn(late, {{spent_nano = 200000, tokens = 400}}, true)
        budget.settle(late, 400, 0.0002)
        for at = 86402, 86405 do admit(at) end
        return table.concat(res, ", ")""")
    assert out == ("503 budget_unavailable, redis 700000, admitted 900000, "
                   "429 insufficient_quota, admitted 200000, admitted 600000, "
                   "admitted 800000, admitted 1000000, 429 insufficient_quota")


LIMITS_SOCKET = TEST_DIR / "budgets-limits.sock"


def _with_budgets(upstream: str) -> Callable[[dict[str, Any]], None]:
    def edit(raw: dict[str, Any]) -> None:
        raw["models"][MODEL]["upstreams"] = [upstream]
        raw["models"][MODEL]["embedded"] = False
        for key_id, (key, budgets) in BUDGET_KEYS.items():
            raw["keys"][key_id] = {"sha256": key_digest(key), "rpm": 10_000,
                                   "tpm": 10_000_000, "budgets": budgets}
        raw["global_limits"] = {"enabled": True, "listen": "127.0.0.1:1",
                                "unix_socket": str(LIMITS_SOCKET)}
        # the sidecar's Redis deadline is patient (patient_redis_config): so is the edge
        raw["edge"]["global_limits_timeout_ms"] = 5000
    return edit


@pytest.fixture
def budgets_redis(private_redis: Callable[..., PrivateRedis]) -> PrivateRedis:
    """A Redis of this test only: the one ``limits_sidecar`` keeps the budgets in."""
    return private_redis()


@pytest.fixture
def limits_sidecar(config_path: Path,
                   budgets_redis: PrivateRedis) -> Iterator[devstack.Service]:
    """tokengate-limits (1 worker on ``LIMITS_SOCKET.0``) on ``budgets_redis``."""
    r = budgets_redis
    Path(f"{LIMITS_SOCKET}.0").unlink(missing_ok=True)  # (a stale one would pass the wait)
    path = patient_redis_config(config_path, "budgets-limits")
    svc = devstack.limits_service(path, free_port(), r.url, unix_socket=LIMITS_SOCKET,
                                  workers=1, name=svc_name("test-budgets-limits"))
    svc.start()
    wait_until(lambda: Path(f"{LIMITS_SOCKET}.0").exists(), 20, what="the limits socket")
    try:
        yield svc
    finally:
        svc.stop()


@pytest.fixture
def budget_edge(edge_variant_off_vllm: Callable[..., Edge], fast_upstream_url: str,
                limits_sidecar: devstack.Service) -> Edge:
    hostport = fast_upstream_url.removeprefix("http://").removesuffix("/v1")
    return edge_variant_off_vllm("budgets", _with_budgets(hostport))


def heard_then_alone(edge: Edge, sidecar: devstack.Service, key: str) -> httpx.Response:
    """One request of ``key`` decided by Redis (the edge learns the budget's total), then
    the limits sidecar stopped: what follows is decided by the edge alone."""
    first = post(edge, key)
    assert (first.status_code, first.headers["x-tokengate-limits"]) == (200, "global")
    sidecar.stop()
    return first


def post(edge: Edge, key: str) -> httpx.Response:
    return httpx.post(f"{edge.base_url}/chat/completions",
                      headers={"Authorization": f"Bearer {key}"},
                      json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                            "max_tokens": MAX_TOKENS}, timeout=60)


def _burst(edge: Edge, key: str, n: int = 64) -> list[httpx.Response]:
    with ThreadPoolExecutor(16) as pool:
        return list(pool.map(lambda _: post(edge, key), range(n)))


def test_64_concurrent_requests_never_spend_past_a_spend_limit(
        budget_edge: Edge, limits_sidecar: devstack.Service) -> None:
    probe = post(budget_edge, BUDGET_KEYS["bg-probe"][0])
    assert probe.status_code == 200
    prompt = int(probe.headers["x-token-count"])
    cost = charge(prompt, MAX_TOKENS).cost  # the defaults are the test model's weights
    nano = math.ceil(cost * 1e9 - 1e-6)
    fits = int(1_000_000 // nano)  # 0.001 in nano-units of the currency
    first = heard_then_alone(budget_edge, limits_sidecar, BUDGET_KEYS["bg-spend"][0])
    answers = _burst(budget_edge, BUDGET_KEYS["bg-spend"][0])
    ok = [r for r in answers if r.status_code == 200]
    refused = [r for r in answers if r.status_code != 200]
    assert len(ok) == fits - 1  # and the first, which Redis admitted
    assert {r.headers["x-tokengate-limits"] for r in ok} == {"local"}
    assert {r.status_code for r in refused} == {429}
    err = refused[0].json()["error"]
    assert (err["type"], err["code"]) == ("insufficient_quota", "insufficient_quota")
    assert err["message"].startswith("You exceeded your current quota on key bg-spend: the "
                                     "daily spend limit of 0.001 USD (every model): ")
    # (what is spent or reserved may include a concurrent refusal's reservation, taken
    # back a moment later: incr-then-check)
    assert f" spent or reserved, this request may cost up to {amount(nano)}. " in err["message"]
    assert "It resets at " in err["message"] and "T00:00:00Z" in err["message"]
    assert 1 <= int(refused[0].headers["retry-after"]) <= 86_400
    # what the ledger bills for them (its formula, on the edge's usage events)
    events = [budget_edge.event(r.headers["x-request-id"]) for r in [first, *ok]]
    spent = sum(charge(ev["prompt_tokens"], ev["completion_tokens"], ev["cached_tokens"],
                       ev["system_tokens"]).cost for ev in events)
    assert spent <= 0.001
    assert spent == pytest.approx(fits * cost)
    # remaining after each admission, down to what is left for less than one more
    remaining = min(float(r.headers["x-budget-remaining-spend"]) for r in ok)
    assert remaining == pytest.approx((1_000_000 - fits * nano) / 1e9, abs=1e-9)
    assert ok[0].headers["x-budget-limit-spend"] == "0.001000"


def test_a_token_quota_per_model_and_month(budget_edge: Edge,
                                           limits_sidecar: devstack.Service) -> None:
    first = heard_then_alone(budget_edge, limits_sidecar, BUDGET_KEYS["bg-tokens"][0])
    answers = _burst(budget_edge, BUDGET_KEYS["bg-tokens"][0], 32)
    ok = [first] + [r for r in answers if r.status_code == 200]
    prompt = int(ok[0].headers["x-token-count"])
    assert len(ok) == 1000 // (prompt + MAX_TOKENS)
    assert min(int(r.headers["x-budget-remaining-tokens"]) for r in ok) == \
        1000 - len(ok) * (prompt + MAX_TOKENS)
    refused = [r.json()["error"] for r in answers if r.status_code == 429]
    assert len(refused) == 32 - (len(ok) - 1)
    assert refused[0]["code"] == "insufficient_quota"
    assert f"monthly token quota of 1000 tokens (model {MODEL})" in refused[0]["message"]


def test_without_the_counter_a_budget_reserves_the_whole_completion_the_body_allows(
        edge_variant_off_vllm: Callable[..., Edge], fast_upstream_url: str,
        limits_sidecar: devstack.Service) -> None:
    """The counter is down (on_counter_failure: open): the prompt is the bytes/3 estimate
    and a request without max_tokens gets min(max_tokens_cap, room) written into its body;
    the budget reserves all of that, not the TPM's smaller output_reserve."""
    hostport = fast_upstream_url.removeprefix("http://").removesuffix("/v1")
    edge = edge_variant_off_vllm("budgets-no-counter", _with_budgets(hostport),
                                 counter_socket=TEST_DIR / "no-counter.sock")
    answer = httpx.post(f"{edge.base_url}/chat/completions",
                        headers={"Authorization": f"Bearer {BUDGET_KEYS['bg-big'][0]}"},
                        json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
                        timeout=60)
    assert answer.status_code == 200, answer.text
    ev = edge.event(answer.headers["x-request-id"])
    assert ev["count_source"] == "estimate"
    estimate = int(answer.headers["x-token-count"])
    # tiny-qwen3: max_model_len 8192 (the suite's), max_tokens_cap 4096, output_reserve 256
    assert int(answer.headers["x-budget-remaining-tokens"]) == \
        1_000_000 - (estimate + min(4096, 8192 - estimate))


def test_the_agent_apis_are_refused_by_budgets_and_model_rules_in_their_own_shapes(
        edge_variant: Callable[..., Edge], vllm_url: str, counter_addr: str,
        limits_sidecar: devstack.Service, vllm_requests: Callable[[], int]) -> None:
    """A Responses and a Messages request whose completion budget alone passes the key's
    token quota (1000 a month) are refused as chat is (429 insufficient_quota), in
    OpenAI's and in Anthropic's shape; so is a model the key may not use (404); their
    count endpoints, which spend no tokens, still answer; nothing refused reaches vLLM."""
    hostport = vllm_url.removeprefix("http://").removesuffix("/v1")

    def edit(raw: dict[str, Any]) -> None:
        _with_budgets(hostport)(raw)
        raw["keys"]["bg-tokens"]["allowed_models"] = [MODEL]
    edge = edge_variant("budgets-agents", edit)
    key = BUDGET_KEYS["bg-tokens"][0]
    bearer, x_api_key = {"authorization": f"Bearer {key}"}, {"x-api-key": key}
    hello = [{"role": "user", "content": "hi"}]
    before = vllm_requests()
    r = httpx.post(f"{edge.base_url}/responses", headers=bearer, timeout=60,
                   json={"model": MODEL, "input": "hi", "max_output_tokens": 2000})
    assert r.status_code == 429, r.text
    assert r.headers["x-token-count-source"] == "counter"
    assert r.json()["error"]["code"] == "insufficient_quota"
    assert "monthly token quota of 1000 tokens" in r.json()["error"]["message"]
    r = httpx.post(f"{edge.base_url}/messages", headers=x_api_key, timeout=60,
                   json={"model": MODEL, "messages": hello, "max_tokens": 2000})
    assert r.status_code == 429, r.text
    assert r.json()["type"] == "error" and r.json()["error"]["type"] == "rate_limit_error"
    assert edge.event(r.headers["x-request-id"])["error"] == "insufficient_quota"
    r = httpx.post(f"{edge.base_url}/responses", headers=bearer, timeout=60,
                   json={"model": "other-qwen3", "input": "hi"})
    assert (r.status_code, r.json()["error"]["code"]) == (404, "model_not_found")
    r = httpx.post(f"{edge.base_url}/messages", headers=x_api_key, timeout=60,
                   json={"model": "other-qwen3", "messages": hello, "max_tokens": 5})
    assert (r.status_code, r.json()["error"]["type"]) == (404, "not_found_error")
    assert vllm_requests() == before
    for path, body, headers in (
            ("responses/input_tokens", {"model": MODEL, "input": "hi"}, bearer),
            ("messages/count_tokens", {"model": MODEL, "messages": hello}, x_api_key)):
        r = httpx.post(f"{edge.base_url}/{path}", headers=headers, json=body, timeout=60)
        assert r.status_code == 200, (path, r.text)


def test_a_key_whose_spend_a_ledger_rebuilds_is_answered_503_budget_unavailable(
        budget_edge: Edge, budgets_redis: PrivateRedis) -> None:
    """After Redis lost its data a ledger holds every budgeted key while it rebuilds the
    bill (tokengate.ledger.ledger: the hold ``redis_keys.rebuild_key`` names it and the
    Redis time its lease ends): the key's requests are refused with 503
    ``budget_unavailable`` and Retry-After, and admitted again once the hold is gone."""
    key_id, (key, _budgets) = "bg-big", BUDGET_KEYS["bg-big"]
    redis = budgets_redis.client()
    seconds, micros = redis.time()
    now_ms = seconds * 1000 + micros // 1000
    redis.hset(store.rebuild_key(key_id), "edge-host:/var/log/tokengate/usage.jsonl",
               now_ms + 60_000)
    held = post(budget_edge, key)
    assert held.status_code == 503, held.text
    err = held.json()["error"]
    assert (err["type"], err["code"]) == ("server_error", "budget_unavailable")
    assert "rebuilding the key's spend" in err["message"]
    assert held.headers["retry-after"] == "1"
    assert budget_edge.event(held.headers["x-request-id"])["error"] == "budget_unavailable"
    redis.delete(store.rebuild_key(key_id))  # the ledger released it
    assert post(budget_edge, key).status_code == 200

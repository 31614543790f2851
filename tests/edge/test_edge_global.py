"""Global limits at the edge: two nginx edges, one Redis, one tokengate-limits sidecar.
(Over 600 lines: two edges, one Redis and one limits sidecar started once per module
for every case here; a split would start them once per file.)

Real processes: the counter (exact prompt tokens), the global-limit sidecar (2 workers,
one unix socket each), Redis, two nginx edges with ``global_limits.enabled``, and
TokenStorm's fast upstream as the model server (it generates exactly max_tokens, so a
request's real usage equals its reservation when max_tokens <= output_reserve, and the
expected numbers are exact). The local shared-dict limiter stays the first gate; what it
admits is reserved in Redis; a Redis refusal is the same 429 as a local one; when the
sidecar or Redis fails, the edge admits on its local limits and says so
(``X-Tokengate-Limits: local``, ``/tokengate/status`` counters).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
import redis
import yaml
from tokengate import config as tg_config
from tokengate import redis_client
from tokengate.budget_store import budget_keys, nano, this_hour
from tokengate.config import ModelCost
from tokengate.ledger.calculator import charge
from tokengate.ledger.ledger import Ledger
from tokengate.limits.budget import reservation_key
from tokengate.limits.window import window_keys
from tokengate.v1 import counter_pb2
from tokengate.v1 import limits_pb2 as pb
from tokengate.v1 import limits_pb2_grpc as pb_grpc
from tokengate_dev import devstack

from tests.conftest import MODEL, TEST_DIR, key_digest
from tests.edge.test_budgets import amount
from tests.fixtures_edge import (
    EDGE_DIR,
    Edge,
    FakeUpstream,
    _edge_yaml,
    free_port,
    movable_clock,
    patient_redis_config,
    run_lua,
)
from tests.fixtures_ledger import svc_name, wait_until

# key id -> (key, rpm, tpm); the fast upstream's answers cost prompt + max_tokens.
GLOBAL_KEYS: dict[str, tuple[str, int, int]] = {
    "gl-burst": ("tg-test-gl-burst", 10_000, 3000),
    "gl-rpm": ("tg-test-gl-rpm", 3, 1_000_000),
    "gl-settle": ("tg-test-gl-settle", 10_000, 1_000_000),
    "gl-local": ("tg-test-gl-local", 3, 1_000_000),
    "gl-recover": ("tg-test-gl-recover", 10_000, 1_000_000),
    # RPMs a uint32 cannot hold (2^32 arrived as 0, 2^32 + 5 as 5), and the schema's largest
    "gl-rpm-2p32": ("tg-test-gl-rpm-2p32", 2**32, 1_000_000),
    "gl-rpm-wrap": ("tg-test-gl-rpm-wrap", 2**32 + 5, 1_000_000),
    "gl-rpm-max": ("tg-test-gl-rpm-max", 10**12, 1_000_000),
}
LIMITS_SOCKET = TEST_DIR / "edge-limits.sock"
# this machine's first IPv4 address that is not loopback, to reach the admin view from
# "outside" (None on a machine with loopback only: that step is then left out)
NON_LOOPBACK = next((a for a in subprocess.run(["hostname", "-I"], capture_output=True,
                                               text=True, check=False).stdout.split()
                     if "." in a), None)
# a key with a daily spend limit, at prices that make one answer cost cents (per 1M
# tokens; the fast upstream's answers cost prompt x input + max_tokens x output)
BUDGET_KEY = ("gl-budget", "tg-test-gl-budget", 10.0)
# a key with a daily spend limit and token quota (10 USD, 1000 tokens)
QUOTA_KEY = ("gl-quota", "tg-test-gl-quota", 10.0, 1000)
PRICES = {"input": 10_000.0, "output": 13_500.0, "cached": 1_000.0}


def _with_global(upstream: str, socket_path: Path, timeout_ms: int = 3000,
                 name: str = "") -> Callable[[dict[str, Any]], None]:
    """YAML edit: the fast upstream as the model, global limits on via ``socket_path``."""

    def edit(raw: dict[str, Any]) -> None:
        raw["models"][MODEL]["upstreams"] = [upstream]
        raw["models"][MODEL]["cost"] = PRICES
        for key_id, (key, rpm, tpm) in GLOBAL_KEYS.items():
            raw["keys"][key_id] = {"sha256": key_digest(key), "rpm": rpm, "tpm": tpm}
        key_id, key, spend = BUDGET_KEY
        raw["keys"][key_id] = {"sha256": key_digest(key), "rpm": 10_000, "tpm": 10_000_000,
                               "budgets": [{"period": "day", "spend": spend}]}
        key_id, key, spend, tokens = QUOTA_KEY
        raw["keys"][key_id] = {"sha256": key_digest(key), "rpm": 10_000, "tpm": 10_000_000,
                               "budgets": [{"period": "day", "spend": spend,
                                            "tokens": tokens}]}
        raw["global_limits"] = {"enabled": True, "listen": "127.0.0.1:1",
                                "unix_socket": str(socket_path)}
        # a 2-core machine also runs the counter and two edges: no timeouts in the
        # burst, so every answer is the shared window's (the timeout case has its own test)
        raw["edge"]["global_limits_timeout_ms"] = timeout_ms
        raw["access_log"] = {"file": str(EDGE_DIR / name / "access.sampled.log")}

    return edit


def start_edge(config_path: Path, name: str, upstream: str, socket_path: Path,
               timeout_ms: int = 3000, limits_workers: int = 2,
               edit: Callable[[dict[str, Any]], None] | None = None) -> Edge:
    """An edge with global limits on (the test configuration ``config_path`` edited by
    ``edit``, default ``_with_global``'s); stop it with ``edge.service.stop()``."""
    usage = EDGE_DIR / name / "usage.jsonl"
    usage.unlink(missing_ok=True)
    path = _edge_yaml(config_path, EDGE_DIR / name / "tokengate.yaml",
                      edit or _with_global(upstream, socket_path, timeout_ms, name), usage)
    port, status_port = free_port(), free_port()
    svc = devstack.nginx_service(path, port=port, counter_socket=TEST_DIR / "counter.sock",
                                 counter_workers=2, workers=2, name=svc_name(f"test-{name}"),
                                 prefix=EDGE_DIR / name, limits_workers=limits_workers,
                                 status_port=status_port)
    movable_clock(svc, EDGE_DIR / name)
    svc.log_path.unlink(missing_ok=True)
    svc.start()
    return Edge(f"http://127.0.0.1:{port}/v1", port, usage, svc, status_port)


@dataclass
class Pair:
    """Two edges sharing one global-limit sidecar and Redis."""

    a: Edge
    b: Edge
    redis: redis.Redis


@pytest.fixture(scope="module")
def upstream_hostport(fast_upstream_url: str) -> str:
    return fast_upstream_url.removeprefix("http://").removesuffix("/v1")


@pytest.fixture(scope="module")
def limits_sidecar(config_path: Path, redis_url: str) -> Iterator[Path]:
    """tokengate-limits with 2 workers on ``LIMITS_SOCKET.<i>``, on the session Redis
    (a patient Redis deadline: these tests are about the shared windows, not timeouts)."""
    path = patient_redis_config(config_path, "edge-limits")
    svc = devstack.limits_service(path, free_port(), redis_url,
                                  unix_socket=LIMITS_SOCKET, workers=2,
                                  name=svc_name("test-edge-limits"))
    svc.start()
    wait_until(lambda: all(Path(f"{LIMITS_SOCKET}.{i}").exists() for i in range(2)), 20,
               what="both limits worker sockets")
    try:
        yield LIMITS_SOCKET
    finally:
        svc.stop()


@pytest.fixture(scope="module")
def pair(config_path: Path, counter_addr: str, redis_url: str, limits_sidecar: Path,
         upstream_hostport: str) -> Iterator[Pair]:
    a = start_edge(config_path, "gl-a", upstream_hostport, limits_sidecar)
    b = start_edge(config_path, "gl-b", upstream_hostport, limits_sidecar)
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    try:
        yield Pair(a, b, client)
    finally:
        client.close()
        a.service.stop()
        b.service.stop()


@pytest.fixture
def clean_redis(pair: Pair) -> Pair:
    pair.redis.flushdb()
    return pair


def post(edge: Edge, key: str, max_tokens: int = 40, content: str = "hi") -> httpx.Response:
    return httpx.post(f"{edge.base_url}/chat/completions",
                      headers={"Authorization": f"Bearer {key}"},
                      json={"model": MODEL, "messages": [{"role": "user", "content": content}],
                            "max_tokens": max_tokens}, timeout=60)


def status(edge: Edge) -> dict[str, Any]:
    """The edge's /tokengate/status counters (from its loopback status server)."""
    return edge.status()


def to_hex(lua_expr: str) -> str:
    """Lua source: the hex of the string ``lua_expr``."""
    return f'(({lua_expr}):gsub(".", function(c) return string.format("%02x", c:byte()) end))'


def test_lua_codec_matches_the_pinned_wire_bytes() -> None:
    # The bytes test_wire_bytes_of_the_messages_the_edge_handles pins, through pb.lua.
    rid = "5d41402abc4b2a76b9719d911017c592"
    settle = pb.SettleRequest(key_id="demo", model="tiny-qwen3", per_model=True,
                              request_id=rid, actual_tokens=1).SerializeToString()
    refused = pb.ReserveReply(admitted=False, limited_by=pb.LIMIT_TOKENS, never_fits=True,
                              remaining_requests=3, remaining_tokens=2**40,
                              reset_requests_ms=59_999, reset_tokens_ms=1,
                              retry_after_ms=12_345).SerializeToString()
    body = "[" + "x" * 300 + "]"  # two length bytes
    out = run_lua(f"""
        local pb = require "tokengate.pb"
        local cjson = require "cjson"
        local function unhex(h) return (h:gsub("%x%x", function(x)
            return string.char(tonumber(x, 16)) end)) end
        local function flat(t)  -- a frame's pieces (nested lists), as a cosocket sends them
            if type(t) == "string" then return t end
            local out = {{}}
            for i = 1, #t do out[i] = flat(t[i]) end
            return table.concat(out)
        end
        return cjson.encode({{
            reserve = {to_hex('pb.reserve_request("demo", "tiny-qwen3", false, 600, 200000, '
                              f'268, "{rid}", {{}})')},
            settle = {to_hex(f'pb.settle_request("demo", "tiny-qwen3", true, "{rid}", 1, {{}})')},
            settle_zero = {to_hex('pb.settle_request("k", "m", false, "r", 0, {})')},
            leveled = {to_hex('pb.reserve_request("k", "m", false, 5, 900, 268, "r", '
                              '{{id = "team:eng", rpm = 10, tpm = 2^40}, '
                              '{id = "org:acme", rpm = 1, tpm = 1}})')},
            leveled_settle = {to_hex('pb.settle_request("k", "m", false, "r", 7, '
                                     '{{id = "team:eng", rpm = 10, tpm = 20}})')},
            at_level = pb.reserve_reply(unhex("{pb.ReserveReply(admitted=True,
                level=2).SerializeToString().hex()}")),
            reply = pb.reserve_reply(unhex("080120d70428b4980c30e0d40338e0d403")),
            refused = pb.reserve_reply(unhex("{refused.hex()}")),
            settled = pb.settle_reply("\\8\\1\\16\\159\\6\\24\\200\\1"),
            positive = pb.settle_reply(unhex("{pb.SettleReply(found=True, delta=44,
                window_tokens=309).SerializeToString().hex()}")),
            framed = {to_hex('flat(pb.frame("abc"))')},
            framed_size = select(2, pb.frame("abc")),
            count = {to_hex(f'flat(pb.frame(pb.count_request("tiny-qwen3", 1, "{body}")))')},
            count_size = select(2, pb.frame(pb.count_request("tiny-qwen3", 1, "{body}"))),
        }})""")
    got = json.loads(out)
    assert got["reserve"] == ("0a0464656d6f" "120a74696e792d7177656e33" "20d804" "28c09a0c"
                              "308c02" "3a20" + rid.encode().hex())
    assert got["settle"] == settle.hex()
    assert got["settle_zero"] == pb.SettleRequest(key_id="k", model="m", request_id="r",
                                                  actual_tokens=0).SerializeToString().hex()
    # a key of a team: its team's and organization's windows ride along (settlements
    # name them by id)
    assert got["leveled"] == pb.ReserveRequest(
        key_id="k", model="m", rpm_limit=5, tpm_limit=900, tokens=268, request_id="r",
        levels=[pb.LevelWindow(id="team:eng", rpm_limit=10, tpm_limit=2**40),
                pb.LevelWindow(id="org:acme", rpm_limit=1, tpm_limit=1)]
    ).SerializeToString().hex()
    assert got["leveled_settle"] == pb.SettleRequest(
        key_id="k", model="m", request_id="r", actual_tokens=7,
        levels=[pb.LevelWindow(id="team:eng")]).SerializeToString().hex()
    assert (got["at_level"]["admitted"], got["at_level"]["level"]) == (True, 2)
    assert got["reply"] == {"admitted": True, "limited_by": 0, "never_fits": False,
                            "remaining_requests": 599, "remaining_tokens": 199_732,
                            "reset_requests_ms": 60_000, "reset_tokens_ms": 60_000,
                            "retry_after_ms": 0, "level": 0}
    assert got["refused"] == {"admitted": False, "limited_by": 2, "never_fits": True,
                              "remaining_requests": 3, "remaining_tokens": 2**40,
                              "reset_requests_ms": 59_999, "reset_tokens_ms": 1,
                              "retry_after_ms": 12_345, "level": 0}
    assert got["settled"] == {"found": True, "delta": -400, "window_tokens": 200}
    assert got["positive"] == {"found": True, "delta": 44, "window_tokens": 309}
    assert (got["framed"], got["framed_size"]) == ("0000000003616263", 8)
    count = counter_pb2.CountRequest(model="tiny-qwen3", endpoint=counter_pb2.ENDPOINT_CHAT,
                                     body=body.encode()).SerializeToString()
    assert got["count"] == (b"\0" + len(count).to_bytes(4, "big") + count).hex()
    assert got["count_size"] == 5 + len(count)


def test_lua_budget_codec_matches_python() -> None:
    counters = [pb.BudgetCounter(name="*:day:20423", spend_limit_nano=10_000_000_000,
                                 ttl_s=172_800),
                pb.BudgetCounter(name="tiny-qwen3:month:671", token_limit=2_000_000,
                                 ttl_s=2_851_200)]
    want = pb.BudgetReserveRequest(key_id="demo", request_id="ab12", counters=counters,
                                   cost_nano=630_000_000, tokens=49).SerializeToString()
    settle = pb.BudgetSettleRequest(key_id="demo", request_id="ab12", cost_nano=0,
                                    tokens=7).SerializeToString()
    refused = pb.BudgetReserveReply(
        admitted=False, refused=2, limited_by=pb.BUDGET_TOKENS,
        usage=[pb.BudgetUsage(spent_nano=9_450_000_000, tokens=735),
               pb.BudgetUsage(tokens=1_999_990)]).SerializeToString()
    out = run_lua(f"""
        local pb = require "tokengate.pb"
        local cjson = require "cjson"
        local function unhex(h) return (h:gsub("%x%x", function(x)
            return string.char(tonumber(x, 16)) end)) end
        local counters = {{
            {{counter = "*:day:20423", spend_limit_nano = 10000000000, token_limit = 0,
              ttl_s = 172800}},
            {{counter = "tiny-qwen3:month:671", spend_limit_nano = 0, token_limit = 2000000,
              ttl_s = 2851200}}}}
        return cjson.encode({{
            reserve = {to_hex('pb.budget_request("demo", "ab12", counters, 630000000, 49)')},
            settle = {to_hex('pb.budget_request("demo", "ab12", {}, 0, 7)')},
            refused = pb.budget_reserve_reply(unhex("{refused.hex()}")),
            settled = pb.budget_settle_reply(unhex("{pb.BudgetSettleReply(
                applied=True).SerializeToString().hex()}")),
        }})""")
    got = json.loads(out)
    assert got["reserve"] == want.hex()
    assert got["settle"] == settle.hex()
    assert got["refused"] == {"admitted": False, "refused": 2, "limited_by": 2,
                              "usage": [{"spent_nano": 9_450_000_000, "tokens": 735},
                                        {"spent_nano": 0, "tokens": 1_999_990}]}
    assert got["settled"] == {"applied": True, "reserved": False}


def test_lua_codec_refuses_what_a_uint64_cannot_hold() -> None:
    """An infinite cost (a price of .inf) reached varint once and failed there as "bad
    argument #1 to 'char'" (a 500): the encoder now names the field and the value, and
    tokengate.budget caps a request's cost and tokens at 2^60, above every limit."""
    out = run_lua("""
        local pb = require "tokengate.pb"
        local budget = require "tokengate.budget"
        local cjson = require "cjson"
        local function refused(n)
            local ok, err = pcall(pb.reserve_request, "k", "m", false, 1, 1, n, "r")
            return ok and "encoded" or err:match("tokengate%.pb: .*$")
        end
        local key = { id = "k", budgets = { { period = "day", spend_nano = 1e18 } } }
        local model = { name = "m", cost = { input = 1e9, output = 1e9, cached = 0 } }
        local doc = { currency = "USD", billing = { exclude_system_tokens = false,
            context_penalty = { threshold = 0, rate = 1 } } }
        local bud = budget.request(key, model, doc, 1e12, 1e24, 0)
        return cjson.encode({
            inf = refused(math.huge), nan = refused(0 / 0), negative = refused(-1),
            fraction = refused(0.5), two_64 = refused(2 ^ 64),
            below_2_64 = refused(2 ^ 64 - 2 ^ 11), exact = refused(2 ^ 53 + 2),
            cost = string.format("%.0f", bud.cost), tokens = string.format("%.0f", bud.tokens),
            nano_inf = string.format("%.0f", budget.nano(math.huge)),
            wire = (pb.budget_request("k", "r", bud.items, bud.cost, bud.tokens)
                :gsub(".", function(c) return string.format("%02x", c:byte()) end)),
        })""")
    got = json.loads(out)
    field = "tokengate.pb: field 6: {} is not an integer in 0..2^64-1"
    assert {k: got[k] for k in ("inf", "nan", "negative", "fraction", "two_64")} == {
        "inf": field.format("inf"), "nan": field.format("nan"), "negative": field.format(-1),
        "fraction": field.format(0.5), "two_64": field.format("1.844674407371e+19")}
    assert (got["below_2_64"], got["exact"]) == ("encoded", "encoded")
    assert (got["cost"], got["tokens"], got["nano_inf"]) == (str(2**60),) * 3
    want = pb.BudgetReserveRequest(key_id="k", request_id="r", counters=[pb.BudgetCounter(
        name="*:day:0", spend_limit_nano=10**18, ttl_s=172_800)], cost_nano=2**60,
        tokens=2**60)
    assert got["wire"] == want.SerializeToString().hex()


def test_two_edges_never_spend_past_a_budget_and_bill_it_like_the_ledger(
        clean_redis: Pair, config_path: Path, redis_url: str,
        upstream_hostport: str) -> None:
    p = clean_redis
    key_id, key, spend = BUDGET_KEY
    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda e: (e, post(e, key)), [p.a, p.b] * 32))
    ok = [(e, r) for e, r in results if r.status_code == 200]
    refused = [r for _e, r in results if r.status_code != 200]
    prompt = int(ok[0][1].headers["x-token-count"])
    weights = ModelCost(**PRICES)
    cost_nano = math.ceil(charge(prompt, 40, weights=weights).cost * 1e9 - 1e-6)
    budget_nano = round(spend * 1e9)
    # each edge alone would have admitted budget // cost itself: Redis holds the total
    assert len(ok) == budget_nano // cost_nano
    assert {e.port for e, _r in ok} == {p.a.port, p.b.port}
    assert {r.status_code for r in refused} == {429}
    err = refused[0].json()["error"]
    assert (err["type"], err["code"]) == ("insufficient_quota", "insufficient_quota")
    # what Redis holds when it refuses: every admission of both edges
    assert err["message"].startswith(
        f"You exceeded your current quota on key {key_id}: the daily spend limit of 10 USD "
        f"(every model): {amount(len(ok) * cost_nano)} spent or reserved, this request "
        f"may cost up to {amount(cost_nano)}. It resets at ")
    assert min(float(r.headers["x-budget-remaining-spend"]) for _e, r in ok) == \
        pytest.approx((budget_nano - len(ok) * cost_nano) / 1e9, abs=1e-9)
    # every reservation settled (the fast upstream's answer costs its worst case)
    for _e, r in ok:
        rkey = reservation_key(key_id, r.headers["x-request-id"])
        wait_until(lambda k=rkey: p.redis.get(k) == "settled", 10, what="the settlement")
    (spend_key,) = p.redis.keys(f"tg:bg:{{{key_id}}}:*:day:*:s")
    spent_nano = int(p.redis.get(spend_key))
    assert spent_nano == len(ok) * cost_nano <= budget_nano
    assert int(p.redis.get(spend_key[:-1] + "t")) == len(ok) * (prompt + 40)
    # the ledger bills the two edges' usage events: `tokengate usage` agrees to the cent
    edge_yaml = EDGE_DIR / "gl-a" / "tokengate.yaml"
    cfg = tg_config.load(edge_yaml)
    for edge in (p.a, p.b):
        client = redis_client.connect(cfg.redis, url=redis_url)
        Ledger(cfg, client, edge.usage_file).drain()
        client.close()
    out = subprocess.run([sys.executable, "-m", "tokengate.cli", "usage", "--config", str(edge_yaml),
                          "--redis-url", redis_url, "--key", key_id, "--by", "key", "--json"],
                         capture_output=True, text=True, check=True).stdout
    billed = json.loads(out)["total"]
    assert billed["requests"] == len(ok) + len(refused)
    assert round(billed["cost"], 2) == round(spent_nano / 1e9, 2)
    assert billed["cost"] == pytest.approx(spent_nano / 1e9, abs=len(ok) * 1e-9)
    # `keys list --json` and the ledger's admin view show the same: the ledger's bill and
    # the live counter Redis decides on (nothing is in flight now)
    listed = subprocess.run([sys.executable, "-m", "tokengate.cli", "keys", "list", "--json",
                             "--config", str(edge_yaml), "--redis-url", redis_url],
                            capture_output=True, text=True, check=True).stdout
    entry = next(k for k in json.loads(listed)["keys"] if k["name"] == key_id)
    (b,) = entry["budgets"]
    assert (b["spend"], b["spent"], b["committed_spend"], b["tokens_used"]) == \
        (spend, round(billed["cost"], 9), spent_nano / 1e9, len(ok) * (prompt + 40))
    port = free_port()
    ledger = devstack.ledger_service(edge_yaml, p.a.usage_file, redis_url,
                                     name=svc_name("test-gl-admin"),
                                     metrics_listen=f"0.0.0.0:{port}")
    ledger.start()
    try:
        view = httpx.get(f"http://127.0.0.1:{port}/keys/{key_id}", timeout=10)
        assert view.status_code == 200
        assert view.json() == {"currency": "USD", **entry}
        assert [k["name"] for k in httpx.get(f"http://127.0.0.1:{port}/keys").json()["keys"]] \
            == [k["name"] for k in json.loads(listed)["keys"]]
        missing = httpx.get(f"http://127.0.0.1:{port}/keys/nobody", timeout=10)
        assert (missing.status_code, missing.json()) == (404, {"error": "no key named 'nobody'"})
        assert httpx.post(f"http://127.0.0.1:{port}/keys", timeout=10).status_code == 405
        assert httpx.get(f"http://127.0.0.1:{port}/keysx", timeout=10).status_code == 404
        # a key `tokengate keys` adds to the file is in the view at once (no reload)
        cli = [sys.executable, "-m", "tokengate.cli", "keys"]
        subprocess.run([*cli, "create", "late", "--rpm", "1", "--tpm", "10", "--config",
                        str(edge_yaml), "--no-apply"], capture_output=True, check=True)
        try:
            late = httpx.get(f"http://127.0.0.1:{port}/keys/late", timeout=10)
            assert (late.status_code, late.json()["rpm"]) == (200, 1)
        finally:
            subprocess.run([*cli, "revoke", "late", "--config", str(edge_yaml), "--no-apply"],
                           capture_output=True, check=True)
        if NON_LOOPBACK is not None:
            # bound to every address, the view still answers loopback clients only
            outside = httpx.get(f"http://{NON_LOOPBACK}:{port}/keys", timeout=10)
            assert outside.status_code == 403
            assert httpx.get(f"http://{NON_LOOPBACK}:{port}/metrics").status_code == 200
    finally:
        ledger.stop()
    # a fresh edge (an empty shared dict, as after a restart) is held to what Redis holds,
    # even without the budget's own counters (spend that never reached them: admitted
    # on an edge's own counters, its settlement lost): the ledger's bill holds it
    for k in p.redis.keys(f"tg:bg:{{{key_id}}}:*"):
        p.redis.delete(k)
    c = start_edge(config_path, "gl-c", upstream_hostport, LIMITS_SOCKET)
    try:
        again = post(c, key)
        assert again.status_code == 429
        assert again.json()["error"]["code"] == "insufficient_quota"
        assert status(c)["global_budget_refused"] == 1
    finally:
        c.service.stop()


def test_two_edges_share_one_tpm_limit(clean_redis: Pair) -> None:
    p = clean_redis
    key = GLOBAL_KEYS["gl-burst"][0]  # 3000 tokens per minute, on each edge and in Redis
    edges = [p.a, p.b] * 32
    before = [status(p.a), status(p.b)]
    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda e: (e, post(e, key)), edges))
    prompt = int(results[0][1].headers["x-token-count"])
    cost = prompt + 40  # max_tokens 40 < output_reserve: reserved == used
    admitted = [(e, r) for e, r in results if r.status_code == 200]
    refused = [r for _e, r in results if r.status_code == 429]
    assert len(admitted) + len(refused) == 64
    # the shared window admits exactly what fits; each edge alone would have admitted
    # 3000 // cost by itself, so the two together would have doubled the limit
    assert len(admitted) == 3000 // cost
    assert {e.port for e, _r in admitted} == {p.a.port, p.b.port}
    used = sum(r.json()["usage"]["prompt_tokens"] + r.json()["usage"]["completion_tokens"]
               for _e, r in admitted)
    assert used == cost * len(admitted) <= 3000 * 1.02
    assert all(r.headers["x-tokengate-limits"] == "global" for _e, r in results)
    for r in refused:
        err = r.json()["error"]
        assert (err["type"], err["code"]) == ("tokens", "rate_limit_exceeded")
        assert r.headers["retry-after"].isdigit() and 1 <= int(r.headers["retry-after"]) <= 60
        assert int(r.headers["x-ratelimit-remaining-tokens"]) < cost
    assert int(p.redis.hget(window_keys("gl-burst")[1], "#sum") or 0) == used
    after = [status(p.a), status(p.b)]

    def delta(name: str) -> int:
        return sum(a[name] - b[name] for a, b in zip(after, before, strict=True))

    assert (delta("global_admitted"), delta("global_refused"), delta("global_fallback")) == \
        (len(admitted), len(refused), 0)


def test_a_redis_refusal_has_the_local_429_shape(clean_redis: Pair) -> None:
    p = clean_redis
    key = GLOBAL_KEYS["gl-rpm"][0]  # 3 requests per minute
    answers = [post(e, key) for e in (p.a, p.b, p.a)]
    assert [r.status_code for r in answers] == [200, 200, 200]
    assert [r.headers["x-ratelimit-remaining-requests"] for r in answers] == ["2", "1", "0"]
    # edge b has admitted one request itself: its local window would admit this one
    r = post(p.b, key)
    assert r.status_code == 429, r.text
    err = r.json()["error"]
    assert (err["type"], err["code"], err["param"]) == ("requests", "rate_limit_exceeded", None)
    assert "requests per minute (RPM) on key gl-rpm: limit 3, remaining 0" in err["message"]
    retry = r.headers["retry-after"]
    # until the first of the three leaves the 60 s window (Redis's clock)
    assert retry.isdigit() and 50 <= int(retry) <= 60
    assert f"try again in {retry}s" in err["message"]
    assert r.headers["x-tokengate-limits"] == "global"
    assert (r.headers["x-ratelimit-limit-requests"], r.headers["x-ratelimit-remaining-requests"]) \
        == ("3", "0")
    assert r.headers["x-ratelimit-reset-requests"].endswith("s")
    ev = p.b.event(r.headers["x-request-id"])
    assert (ev["status"], ev["error"], ev["reserved"]) == (429, "rate_limit_exceeded", 0)
    # the refused request took its local admission back: edge b's local window still has
    # room for 2 more of its own, which the shared window refuses too
    again = post(p.b, key)
    assert again.status_code == 429 and again.headers["x-tokengate-limits"] == "global"


@pytest.mark.parametrize("key_id", ["gl-rpm-2p32", "gl-rpm-wrap", "gl-rpm-max"])
def test_an_rpm_above_2_to_the_32_is_enforced_exactly(clean_redis: Pair, key_id: str) -> None:
    """One bound for every limit from the schema (at most 1e12) through the wire (uint64)
    to Redis: as a uint32, rpm_limit 2^32 + 5 was enforced as 5 per minute and 2^32 failed
    every global call (0: INVALID_ARGUMENT; the edge fell back to its local limits)."""
    key, rpm, _tpm = GLOBAL_KEYS[key_id]
    for n in (1, 2):
        r = post(clean_redis.a if n == 1 else clean_redis.b, key)
        assert (r.status_code, r.headers["x-tokengate-limits"],
                r.headers["x-ratelimit-limit-requests"],
                r.headers["x-ratelimit-remaining-requests"]) == \
            (200, "global", str(rpm), str(rpm - n))


def test_settlement_corrects_the_shared_window(clean_redis: Pair) -> None:
    p = clean_redis
    key = GLOBAL_KEYS["gl-settle"][0]
    # max_tokens 300 > output_reserve 256: reserved prompt + 256, used prompt + 300
    r = post(p.a, key, max_tokens=300)
    assert r.status_code == 200, r.text
    prompt = int(r.headers["x-token-count"])
    assert r.json()["usage"]["completion_tokens"] == 300
    assert int(r.headers["x-ratelimit-remaining-tokens"]) == 1_000_000 - (prompt + 256)
    rid = r.headers["x-request-id"]
    _z, h = window_keys("gl-settle")
    wait_until(lambda: p.redis.hget(h, rid) == str(prompt + 300), 10,
               what="the settlement in Redis")
    assert int(p.redis.hget(h, "#sum") or 0) == prompt + 300
    # the other edge sees the settled window
    r2 = post(p.b, key, max_tokens=10)
    assert int(r2.headers["x-ratelimit-remaining-tokens"]) == \
        1_000_000 - (prompt + 300) - (prompt + 10)
    assert status(p.a)["global_settled"] >= 1


def test_limits_sidecar_down_serves_on_local_limits(config_path: Path, counter_addr: str,
                                                    upstream_hostport: str) -> None:
    edge = start_edge(config_path, "gl-down", upstream_hostport,
                      EDGE_DIR / "gl-down" / "nobody.sock")
    try:
        key = GLOBAL_KEYS["gl-local"][0]  # 3 requests per minute, enforced locally
        answers = [post(edge, key) for _ in range(4)]
        assert [r.status_code for r in answers] == [200, 200, 200, 429]
        assert [r.headers["x-tokengate-limits"] for r in answers] == ["local"] * 4
        assert [r.headers["x-ratelimit-remaining-requests"] for r in answers] == \
            ["2", "1", "0", "0"]
        assert answers[3].json()["error"]["type"] == "requests"
        m = status(edge)
        # the 4th was refused by the local limiter before the global tier was asked
        assert (m["global_fallback"], m["global_admitted"], m["global_refused"]) == (3, 0, 0)
        assert m["global_fallback_down"] + m["global_fallback_backoff"] == 3
        assert m["global_fallback_down"] >= 1
        assert m["global_limits_enabled"] is True
        # the status is on the status server only, never on the API listener
        r = httpx.get(f"http://127.0.0.1:{edge.port}/tokengate/status", timeout=10)
        assert (r.status_code, r.json()["error"]["code"]) == (404, "unknown_url")
    finally:
        edge.service.stop()


class StalledLimits(pb_grpc.GlobalLimitsServicer):
    """A GlobalLimits that never answers in time."""

    def Reserve(self, request: Any, context: Any) -> Any:
        time.sleep(5)
        return pb.ReserveReply(admitted=True)


def test_a_stalled_sidecar_times_out_to_local_limits(config_path: Path, counter_addr: str,
                                                     upstream_hostport: str) -> None:
    sock = EDGE_DIR / "gl-stalled" / "limits.sock"
    sock.parent.mkdir(parents=True, exist_ok=True)
    server = grpc.server(futures.ThreadPoolExecutor(4))
    pb_grpc.add_GlobalLimitsServicer_to_server(StalledLimits(), server)
    Path(f"{sock}.0").unlink(missing_ok=True)
    server.add_insecure_port(f"unix:{sock}.0")
    server.start()
    edge = start_edge(config_path, "gl-stalled", upstream_hostport, sock, timeout_ms=600,
                      limits_workers=1)
    try:
        key = GLOBAL_KEYS["gl-recover"][0]
        answers = [post(edge, key) for _ in range(2)]
        assert [r.status_code for r in answers] == [200, 200]
        assert [r.headers["x-tokengate-limits"] for r in answers] == ["local", "local"]
        m = status(edge)
        assert m["global_fallback"] == 2 and m["global_fallback_timeout"] >= 1
        assert m["global_fallback_timeout"] + m["global_fallback_backoff"] == 2
    finally:
        edge.service.stop()
        server.stop(0)


def test_redis_down_falls_back_then_recovers(config_path: Path, counter_addr: str,
                                             upstream_hostport: str,
                                             private_redis: Callable[..., Any]) -> None:
    r = private_redis()
    sock = EDGE_DIR / "gl-recover" / "limits.sock"
    sidecar = devstack.limits_service(config_path, free_port(), r.url, unix_socket=sock,
                                      workers=1, name=svc_name("test-edge-limits-recover"))
    sidecar.start()
    wait_until(lambda: Path(f"{sock}.0").exists(), 20, what="the limits socket")
    edge = start_edge(config_path, "gl-recover", upstream_hostport, sock, limits_workers=1)
    try:
        key = GLOBAL_KEYS["gl-recover"][0]
        assert post(edge, key).headers["x-tokengate-limits"] == "global"
        r.kill()
        down = post(edge, key)
        assert (down.status_code, down.headers["x-tokengate-limits"]) == (200, "local")
        m = status(edge)
        assert m["global_fallback"] >= 1
        assert m["global_fallback_unavailable"] + m["global_fallback_timeout"] >= 1
        r.start()
        wait_until(lambda: post(edge, key).headers["x-tokengate-limits"] == "global", 20,
                   step_s=0.2, what="the global tier back")
    finally:
        edge.service.stop()
        sidecar.stop()


@dataclass
class Stack:
    """One edge, its limits sidecar (1 worker) and a Redis of the test's own."""

    edge: Edge
    sidecar: devstack.Service
    redis: Any  # tests.fixtures_ledger.PrivateRedis
    yaml: Path

    def ledger(self, ledger_id: str | None = None) -> Ledger:
        """A ledger of the edge's usage file on the stack's Redis (drain() it)."""
        cfg = tg_config.load(self.yaml)
        return Ledger(cfg, redis_client.connect(cfg.redis, url=self.redis.url),
                      self.edge.usage_file, ledger_id=ledger_id)


@contextlib.contextmanager
def make_stack(name: str, config_path: Path, upstream: str,
               private_redis: Callable[..., Any]) -> Iterator[Stack]:
    """A ``Stack`` (edge ``name`` before ``upstream``), its Redis persistent (appendfsync
    always: a kill -9 loses nothing); stopped at the end."""
    r = private_redis(persist=True)
    sock = EDGE_DIR / name / "limits.sock"
    sock.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{sock}.0").unlink(missing_ok=True)  # (a stale one would pass the wait)
    sidecar = devstack.limits_service(config_path, free_port(), r.url, unix_socket=sock,
                                      workers=1, name=svc_name(f"test-{name}-limits"))
    sidecar.start()
    wait_until(lambda: Path(f"{sock}.0").exists(), 20, what="the limits socket")
    edge = start_edge(config_path, name, upstream, sock, limits_workers=1)
    try:
        yield Stack(edge, sidecar, r, EDGE_DIR / name / "tokengate.yaml")
    finally:
        edge.service.stop()
        sidecar.stop()


@contextlib.contextmanager
def _stopped(pid: int) -> Iterator[None]:
    """The process ``pid`` stopped (SIGSTOP) inside the block, continued (SIGCONT) after."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def _burst(edge: Edge, key: str, n: int = 64) -> list[httpx.Response]:
    with ThreadPoolExecutor(16) as pool:
        return list(pool.map(lambda _: post(edge, key), range(n)))


def _until_redis_answers(edge: Edge, key: str) -> tuple[httpx.Response, int]:
    """Posts until a request is admitted (Redis answered again); (it, the refused ones
    before it)."""
    refused = 0
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        r = post(edge, key)
        if r.status_code == 200:
            return r, refused
        assert (r.status_code, r.json()["error"]["code"]) == (503, "budget_unavailable")
        refused += 1
        time.sleep(0.1)
    raise AssertionError("Redis never answered again")


def test_one_edge_never_passes_a_budget_however_often_nginx_restarts_while_redis_stalls(
        config_path: Path, counter_addr: str, upstream_hostport: str,
        private_redis: Callable[..., Any]) -> None:
    """Spend with Redis up, then nginx killed with its shared dicts (kill -9 of its
    process group) and started again, Redis stopped (SIGSTOP) under 64 concurrent
    requests, twice: a budget the restarted edge has not heard of from Redis is refused
    (503 budget_unavailable), not counted from 0 again (which billed 0.006645 against a
    budget of 0.004). Once Redis answered, the next stall admits exactly what is left.
    The fast upstream's answers cost their reservation, so the bound is exact: over the
    whole run budget // cost requests are admitted, and the ledger (run as it runs
    beside the edge: after each stall) bills no more than the budget."""
    key_id, key, spend = BUDGET_KEY
    with make_stack("gl-restart", config_path, upstream_hostport, private_redis) as st:
        edge = st.edge
        sent = 0

        def burst() -> list[httpx.Response]:
            nonlocal sent
            sent += 64
            with _stopped(st.redis.svc.proc.pid):
                return _burst(edge, key)

        def ledger_catches_up() -> None:
            wait_until(lambda: len(edge.events()) >= sent, 10, what="every usage event")
            ledger = st.ledger()
            ledger.drain()
            ledger.client.close()

        first = post(edge, key)
        assert first.status_code == 200
        cost = nano(charge(int(first.headers["x-token-count"]), 40,
                           weights=ModelCost(**PRICES)).cost)
        budget = round(spend * 1e9)
        fits = budget // cost
        spent = [first] + [post(edge, key) for _ in range(fits * 2 // 3 - 1)]
        sent += len(spent)
        assert {r.status_code for r in spent} == {200}
        for _restart in range(2):
            # (nginx writes a usage event in the log phase, after the answer: a kill -9
            # right after the last answer would lose its event, which only the engine
            # records could then bill)
            wait_until(lambda: len(edge.events()) >= sent, 10, what="the answered events")
            assert edge.service.proc is not None
            os.killpg(edge.service.proc.pid, signal.SIGKILL)
            edge.service.stop()  # (returns once the group is gone)
            edge.service.start()
            stalled = burst()
            assert {r.status_code for r in stalled} == {503}
            err = stalled[0].json()["error"]
            assert (err["type"], err["code"]) == ("server_error", "budget_unavailable")
            assert err["message"].startswith(
                f"The daily budget of key {key_id} (every model) cannot be checked now: the "
                "global limits are unreachable")
            assert stalled[0].headers["retry-after"] == "1"
            assert status(edge)["global_budget_fallback"] >= 1
            ledger_catches_up()
        heard, refused = _until_redis_answers(edge, key)
        sent += refused + 1
        assert heard.headers["x-budget-remaining-spend"] == \
            f"{(budget - (len(spent) + 1) * cost) / 1e9:.6f}"
        alone = burst()
        ok = [r for r in alone if r.status_code == 200]
        assert {r.headers["x-tokengate-limits"] for r in ok} == {"local"}
        assert len(spent) + 1 + len(ok) == fits
        assert {r.json()["error"]["code"] for r in alone if r.status_code != 200} == \
            {"insufficient_quota"}
        ledger_catches_up()
        client = st.redis.client()
        rows = [client.hgetall(k) for k in client.keys(f"tg:{{ledger}}:usage:*:{key_id}:*")]
        client.close()
        billed = sum(float(r.get("cost", 0)) for r in rows)
        assert billed == pytest.approx(fits * cost / 1e9, abs=fits * 1e-9)
        assert billed <= spend
        # and Redis, deciding again, holds the budget spent
        _until_redis_answers_or_429 = post(edge, key)
        assert (_until_redis_answers_or_429.status_code,
                _until_redis_answers_or_429.json()["error"]["code"]) == \
            (429, "insufficient_quota")


class GatedUpstream(FakeUpstream):
    """A chat completion server that answers each request only once ``release`` is set
    (``arrived`` is set when one is waiting): usage prompt ``PROMPT``, completion
    ``COMPLETION``. GETs (health probes) get 200."""

    PROMPT, COMPLETION = 9, 7

    def __init__(self) -> None:
        self.arrived = threading.Event()
        self.release = threading.Event()
        super().__init__("gated")

    def _handle(self, conn: socket.socket) -> None:
        with conn:
            data = self.read_head(conn)
            if data is None:
                return
            if not data.startswith(b"POST "):
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
                return
            self.requests += 1
            self.arrived.set()
            self.release.wait(30)
            body = json.dumps({
                "id": "chatcmpl-gated", "object": "chat.completion", "created": 0,
                "model": MODEL, "choices": [{"index": 0, "finish_reason": "stop",
                                             "message": {"role": "assistant",
                                                         "content": "a"}}],
                "usage": {"prompt_tokens": self.PROMPT, "completion_tokens": self.COMPLETION,
                          "total_tokens": self.PROMPT + self.COMPLETION}}).encode()
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                         b"Connection: close\r\nContent-Length: %d\r\n\r\n%s"
                         % (len(body), body))


@pytest.fixture(scope="module")
def gated() -> Iterator[GatedUpstream]:
    up = GatedUpstream()
    try:
        yield up
    finally:
        up.release.set()
        up.close()


@pytest.fixture
def gated_hostport(gated: GatedUpstream) -> str:
    gated.arrived.clear()
    gated.release.clear()
    return f"127.0.0.1:{gated.port}"


@pytest.mark.parametrize("fault", ["limits sidecar killed", "redis killed"])
def test_a_settlement_lost_to_an_outage_is_made_once_by_the_ledger(
        fault: str, gated: GatedUpstream, gated_hostport: str, config_path: Path,
        counter_addr: str, private_redis: Callable[..., Any]) -> None:
    """A request admitted in Redis whose settlement fails (the limits sidecar or Redis
    killed while it runs: global_settle_failed) left its worst case in flight for two
    hours ("20558 used or reserved" against a bill of 19,305 of 20,000 tokens). The
    ledger, applying its usage event, settles it: once, also on a replay of the file,
    and the key's next request is admitted with exactly what is left."""
    key_id, key, spend, tokens = QUOTA_KEY
    name = "gl-phantom-" + fault.split()[0]
    with make_stack(name, config_path, gated_hostport, private_redis) as st:
        r = st.redis.client()
        with ThreadPoolExecutor(1) as pool:
            answer = pool.submit(post, st.edge, key)
            assert gated.arrived.wait(20)
            (record_key,) = r.keys(f"tg:bg:{{{key_id}}}:r:*")
            if fault == "redis killed":
                st.redis.kill()
            else:
                assert st.sidecar.proc is not None
                os.killpg(st.sidecar.proc.pid, signal.SIGKILL)
                st.sidecar.stop()
            gated.release.set()
            first = answer.result(30)
        assert first.status_code == 200
        wait_until(lambda: status(st.edge)["global_settle_failed"] >= 1, 10,
                   what="the failed settlement")
        if fault == "redis killed":
            st.redis.start()
            r = st.redis.client()
        else:
            st.sidecar.start()
        prompt = int(first.headers["x-token-count"])
        worst = nano(charge(prompt, 40, weights=ModelCost(**PRICES)).cost)
        real = nano(charge(GatedUpstream.PROMPT, GatedUpstream.COMPLETION,
                           weights=ModelCost(**PRICES)).cost)
        used = GatedUpstream.PROMPT + GatedUpstream.COMPLETION
        s, t, rs, rt, *_ = budget_keys(key_id, f"*:day:{int(time.time() // 86400)}",
                                       this_hour())
        # the phantom: the worst case still in flight, nothing settled
        assert r.get(record_key).startswith(f"{worst} {prompt + 40} ")
        assert (r.get(s), int(r.get(rs)), int(r.get(rt))) == (None, worst, prompt + 40)
        ledger = st.ledger()
        ledger.drain()
        assert ledger.totals.budgets_settled == 1
        assert r.get(record_key) == "settled"
        assert (int(r.get(s)), int(r.get(t)), int(r.get(rs)), int(r.get(rt))) == \
            (real, used, 0, 0)
        # a replay (another ledger id reads the file from its start) settles nothing more
        again = st.ledger("replay")
        again.drain()
        assert (again.totals.budgets_settled, again.totals.duplicates) == (0, 1)
        assert (int(r.get(s)), int(r.get(t))) == (real, used)
        # the next request is held to what is left, exactly, by Redis
        probe = GLOBAL_KEYS["gl-settle"][0]  # no budget
        wait_until(lambda: post(st.edge, probe).headers["x-tokengate-limits"] == "global",
                   20, step_s=0.2, what="the global tier back")
        nxt = post(st.edge, key)
        assert (nxt.status_code, nxt.headers["x-tokengate-limits"]) == (200, "global")
        assert nxt.headers["x-budget-remaining-tokens"] == str(tokens - used - (prompt + 40))
        assert nxt.headers["x-budget-remaining-spend"] == \
            f"{(round(spend * 1e9) - real - worst) / 1e9:.6f}"
        r.close()


def test_settlements_failing_through_a_redis_outage_are_two_log_lines_with_a_count(
        config_path: Path, counter_addr: str, upstream_hostport: str,
        private_redis: Callable[..., Any]) -> None:
    """A soak wrote one [warn] "global limits settle failed" per settlement while Redis
    or the limits sidecar was down, about 300 a run. Redis killed here, requests that the
    edge's budget counters admit meanwhile (each budget settlement fails), then Redis
    started again: one line when settlements begin to fail, one with their count when
    one is made again."""
    _key_id, key, _spend = BUDGET_KEY
    with make_stack("gl-settle-outage", config_path, upstream_hostport,
                    private_redis) as st:
        assert post(st.edge, key).headers["x-tokengate-limits"] == "global"
        wait_until(lambda: status(st.edge)["global_settled"] >= 1, 10,
                   what="the first request's budget settlement")
        st.redis.kill()
        down = [post(st.edge, key, max_tokens=4) for _ in range(8)]
        assert {r.status_code for r in down} == {200}
        wait_until(lambda: status(st.edge)["global_settle_failed"] == 8, 10,
                   what="the settlements failed")
        st.redis.start()
        probe = GLOBAL_KEYS["gl-settle"][0]  # max_tokens 300: its settlement is sent
        wait_until(lambda: post(st.edge, probe, max_tokens=300)
                   .headers["x-tokengate-limits"] == "global", 20, step_s=0.2,
                   what="the global tier back")
        wait_until(lambda: "settlements made again" in st.edge.log_path.read_text(), 10,
                   what="the line of the settlements made again")
        log = st.edge.log_path.read_text()
    assert "settle failed" not in log
    assert log.count("global limits settlements failing (") == 1, log[-3000:]
    assert log.count("global limits settlements made again; 8 failed over ") == 1, \
        log[-3000:]


def test_workers_told_to_stop_right_after_a_reload_exit_without_an_alert(
        config_path: Path, counter_addr: str, slow_upstream_url: str,
        private_redis: Callable[..., Any]) -> None:
    """The key commands reload nginx a second or two apart: in a soak a worker told to
    shut down a second after a reload started it exited with "[alert] *0 open socket #-2
    left in connection N" and "[alert] aborting". Its requests still in flight made its
    first ngx.timer (a settlement's) after the shutdown began, and the timer watcher that
    made (fd -2) was never closed. Requests that take 0.6 s and settle (max_tokens 300
    above the output reserve of 256) from six clients, through three pairs of reloads."""
    upstream = slow_upstream_url.removeprefix("http://").removesuffix("/v1")
    key = GLOBAL_KEYS["gl-settle"][0]
    with make_stack("gl-reloads", config_path, upstream, private_redis) as st:
        master = int((EDGE_DIR / "gl-reloads" / "nginx.pid").read_text())

        def workers() -> set[int]:
            return {int(p) for p in
                    Path(f"/proc/{master}/task/{master}/children").read_text().split()}
        stop = threading.Event()
        answered: list[int] = []

        def client() -> None:
            while not stop.is_set():
                answered.append(post(st.edge, key, max_tokens=300).status_code)
        threads = [threading.Thread(target=client, daemon=True) for _ in range(6)]
        for t in threads:
            t.start()
        try:
            for _ in range(3):
                first = workers()
                for _ in range(2):
                    old = workers()
                    os.kill(master, signal.SIGHUP)
                    wait_until(lambda: bool(workers() - old), 30, step_s=0.05,  # noqa: B023
                               what="the reload's workers")
                    # the new workers serve: 12 answers (2 s of requests) after they began
                    seen = len(answered)
                    wait_until(lambda: len(answered) >= seen + 12, 30, step_s=0.05,  # noqa: B023
                               what="answers from the new workers")
                wait_until(lambda: not workers() & first, 30, step_s=0.05,  # noqa: B023
                           what="the old workers gone")
        finally:
            stop.set()
            for t in threads:
                t.join(30)
        wait_until(lambda: len(workers()) == 2, 30, step_s=0.05, what="only the last workers")
        log = st.edge.log_path.read_text()
    assert set(answered) == {200}
    assert "[alert]" not in log, log[-3000:]


@pytest.mark.unit
def test_make_run_starts_the_limits_sidecar_only_when_enabled(
        config_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # the edge and ledger builders write under var/run (a running `make run`'s files)
    def stub(name: str) -> Callable[..., devstack.Service]:
        return lambda *a, **k: devstack.Service(name, ["true"], lambda: False)

    monkeypatch.setattr(devstack, "nginx_service", stub("nginx"))
    monkeypatch.setattr(devstack, "ledger_service", stub("ledger"))
    raw = yaml.safe_load(config_path.read_text())
    got = {}
    for enabled in (False, True):
        raw["global_limits"] = {"enabled": enabled, "listen": "127.0.0.1:50061",
                                "unix_socket": "run/limits.sock"}
        path = tmp_path / f"tokengate-{enabled}.yaml"
        path.write_text(yaml.safe_dump(raw))
        got[enabled] = devstack.stack(path)
    # the repository's tokengate.yaml turns the Batch API on: tokengate-batch comes last
    assert [s.name for s in got[False]] == ["redis", "counter", "vllm", "nginx", "ledger",
                                            "batch"]
    assert [s.name for s in got[True]] == \
        ["redis", "counter", "limits", "vllm", "nginx", "ledger", "batch"]
    argv = got[True][2].argv
    assert argv[argv.index("--listen") + 1] == "127.0.0.1:50061"
    assert argv[argv.index("--unix-socket") + 1] == str(tmp_path / "run/limits.sock")

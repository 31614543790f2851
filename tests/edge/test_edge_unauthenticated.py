"""Requests without a valid API key are bounded work: no usage event (so nothing for the
ledger or Redis), a counter per reason on the status server, at most
``edge.auth_failures.log_lines_per_s`` access-log lines per second and worker, and a
client that keeps sending invalid keys is answered 429 for a while, whatever key it
sends, while every other client's valid key goes on working. The status itself is on a
loopback server of its own, never on the API listener.

Clients are told apart by source address: 127.0.0.1 floods, 127.0.0.2 is the valid
client, 127.0.0.3 floods from the exempt network 127.0.0.2/31, 127.0.0.4 sends no key.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
import redis
from tokengate import redis_keys as store
from tokengate.ledger.report import query
from tokengate_dev import devstack
from tokenstorm.process import Service

from tests.conftest import MODEL
from tests.fixtures_edge import EDGE_DIR, MAIN_KEY, Edge, run_lua
from tests.fixtures_ledger import svc_name, wait_until

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


def client(source: str) -> httpx.Client:
    """A keep-alive client whose connections leave from ``source`` (a loopback address)."""
    return httpx.Client(transport=httpx.HTTPTransport(local_address=source), timeout=30)


def bad_keys(edge: Edge, source: str, n: int) -> Counter[int]:
    """``n`` GET /v1/models with random keys from ``source``; the statuses seen."""
    seen: Counter[int] = Counter()
    with client(source) as c:
        for _ in range(n):
            r = c.get(f"{edge.base_url}/models",
                      headers={"Authorization": f"Bearer tg-wrong-{uuid.uuid4().hex}"})
            seen[r.status_code] += 1
    return seen


def chat(c: httpx.Client, edge: Edge, key: str = MAIN_KEY) -> httpx.Response:
    return c.post(f"{edge.base_url}/chat/completions", json=CHAT,
                  headers={"Authorization": f"Bearer {key}"})


def redis_state(r: redis.Redis) -> dict[str, Any]:
    """Every key of the database with its whole value, for before/after comparisons."""
    out: dict[str, Any] = {}
    for k in sorted(r.scan_iter("*")):
        t = r.type(k)
        if t == "hash":
            v: Any = r.hgetall(k)
        elif t == "set":
            v = sorted(r.smembers(k))
        elif t == "zset":
            v = r.zrange(k, 0, -1, withscores=True)
        elif t == "stream":
            v = [fields for _id, fields in r.xrange(k)]
        else:
            v = r.dump(k)
        out[k] = (t, v)
    return out


@pytest.fixture
def ledger_on(redis_url: str,
              ledger_redis: redis.Redis) -> Iterator[Callable[[Edge, str], str]]:
    """``ledger_on(edge, name)``: a real tokengate-ledger tailing the usage file of the
    edge variant ``name`` into the session Redis (flushed); returns its ledger id once
    its first rebuild ended (no ready mark in the flushed Redis: until it sets one, the
    rebuild's own keys come and go). Stopped when the test ends."""
    started: list[Service] = []

    def start(edge: Edge, name: str) -> str:
        ledger_id = svc_name("test-ledger-unauth")
        started.append(devstack.ledger_service(
            EDGE_DIR / name / "tokengate.yaml", edge.usage_file, redis_url,
            ledger_id=ledger_id, name=ledger_id).start())
        wait_until(lambda: ledger_redis.exists(store.ready_key(ledger_id)), 60,
                   what="the ledger's first rebuild to end")
        return ledger_id

    yield start
    for s in started:
        s.stop()


def applied(r: redis.Redis, ledger_id: str) -> int:
    return int(r.hget(store.stats_key(ledger_id), "applied") or 0)


def test_a_flood_of_invalid_keys_leaves_the_ledger_unchanged_and_valid_keys_working(
        edge_variant_off_vllm: Callable[..., Edge], fast_upstream_url: str,
        ledger_on: Callable[[Edge, str], str], ledger_redis: redis.Redis) -> None:
    log = EDGE_DIR / "unauth-flood" / "access.sampled.log"
    log.unlink(missing_ok=True)

    def edit(raw: dict[str, Any]) -> None:
        raw["models"][MODEL]["upstreams"] = [fast_upstream_url.removeprefix("http://")
            .removesuffix("/v1")]
        raw["access_log"] = {"file": str(log)}
        raw["edge"]["auth_failures"] = {"threshold": 50, "window_s": 60, "block_s": 120,
                                        "exempt": ["127.0.0.2/31"], "log_lines_per_s": 5}
    e = edge_variant_off_vllm("unauth-flood", edit)
    ledger_id = ledger_on(e, "unauth-flood")
    with client("127.0.0.2") as good:
        assert chat(good, e).status_code == 200
        wait_until(lambda: applied(ledger_redis, ledger_id) == 1, what="the first event")
        before = redis_state(ledger_redis)
        usage_before = e.usage_file.read_bytes()

        # 3,100 invalid keys: 1,000 from 127.0.0.1 (blocked after 50), 2,100 from the
        # exempt 127.0.0.3 (401 each); valid requests from 127.0.0.2 all the while
        results: dict[str, Counter[int]] = {}

        def run(name: str, source: str, n: int) -> None:
            results[name] = bad_keys(e, source, n)
        floods = [threading.Thread(target=run, args=("blocked", "127.0.0.1", 1000))] + [
            threading.Thread(target=run, args=(f"exempt{i}", "127.0.0.3", 700))
            for i in range(3)]
        t0 = time.monotonic()
        for t in floods:
            t.start()
        valid = []
        while any(t.is_alive() for t in floods):
            valid.append(chat(good, e))
        for t in floods:
            t.join()
        elapsed = time.monotonic() - t0

    assert results["blocked"] == {401: 50, 429: 950}
    assert sum((results[f"exempt{i}"] for i in range(3)), Counter()) == {401: 2100}
    assert valid and {r.status_code for r in valid} == {200}
    # the usage file grew by the valid requests' events only
    valid_ids = [r.headers["x-request-id"] for r in valid]
    for rid in valid_ids:
        e.event(rid)
    added = e.usage_file.read_bytes()[len(usage_before):]
    assert e.usage_file.read_bytes().startswith(usage_before)
    assert [json.loads(x)["request_id"] for x in added.splitlines()] == valid_ids
    # and Redis by the ledger's work on those events only
    wait_until(lambda: applied(ledger_redis, ledger_id) == 1 + len(valid), 30,
               what="the valid requests applied")
    rows = query(ledger_redis)
    assert [(r.key_id, r.model, r.requests, r.errors) for r in rows] == \
        [("edge-main", MODEL, 1 + len(valid), 0)]
    seen = sum(ledger_redis.scard(k) for k in ledger_redis.scan_iter(store.seen_key("*")))
    assert seen == 1 + len(valid)
    after = redis_state(ledger_redis)
    assert set(after) == set(before)

    m = e.status()
    assert (m["unauthenticated_invalid_key"], m["unauthenticated_blocked"],
            m["unauthenticated_missing_key"], m["unauthenticated_refused"],
            m["auth_blocks"]) == (2150, 950, 0, 0, 1)
    # at most log_lines_per_s lines a second per worker (2 workers), and none shows a key
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    unauth = [x for x in lines if x["tier"] == "unauthenticated"]
    assert 0 < len(unauth) == m["unauthenticated_log_lines"] <= 5 * 2 * (int(elapsed) + 2)
    assert {(x["key_id"], x["sample_rate"], x["client"]) for x in unauth} <= \
        {(None, None, "127.0.0.1"), (None, None, "127.0.0.3")}
    assert {x["status"] for x in unauth} <= {401, 429}
    assert "tg-wrong-" not in log.read_text()
    assert "tg-wrong-" not in e.usage_file.read_text()


def test_a_blocked_client_gets_429_whatever_its_key_until_the_block_ends(
        edge_variant_off_vllm: Callable[..., Edge], fast_upstream_url: str) -> None:
    def edit(raw: dict[str, Any]) -> None:
        raw["models"][MODEL]["upstreams"] = [fast_upstream_url.removeprefix("http://")
            .removesuffix("/v1")]
        raw["edge"]["auth_failures"] = {"threshold": 5, "window_s": 60, "block_s": 2}
    e = edge_variant_off_vllm("unauth-block", edit)
    assert bad_keys(e, "127.0.0.1", 5) == {401: 5}
    with client("127.0.0.1") as flooder, client("127.0.0.2") as other, \
            client("127.0.0.4") as keyless:
        r = chat(flooder, e)  # a valid key, from the blocked client
        assert r.status_code == 429
        assert r.headers["retry-after"] in ("1", "2")
        assert r.json() == {"error": {
            "message": f"Too many requests with an invalid API key came from your address: "
                       f"its requests are refused for {r.headers['retry-after']} s more. "
                       "Check the key your client sends.",
            "type": "requests", "param": None, "code": "rate_limit_exceeded"}}
        e.assert_no_event(r.headers["x-request-id"])
        # another client's key is unaffected; requests without a key never block
        ok = chat(other, e)
        assert ok.status_code == 200
        assert e.event(ok.headers["x-request-id"])["key_id"] == "edge-main"
        assert [keyless.get(f"{e.base_url}/models").status_code for _ in range(10)] == \
            [401] * 10

        time.sleep(int(r.headers["retry-after"]) + 0.3)
        back = chat(flooder, e)
        assert back.status_code == 200
        assert e.event(back.headers["x-request-id"])["key_id"] == "edge-main"
        # its failures still count within the window: the next invalid key blocks again
        assert bad_keys(e, "127.0.0.1", 2) == {401: 1, 429: 1}
    # counted in the log phase, after the answers were sent
    wait_until(lambda: e.status()["unauthenticated_invalid_key"] == 6)
    m = e.status()
    assert (m["unauthenticated_invalid_key"], m["unauthenticated_blocked"],
            m["unauthenticated_missing_key"], m["auth_blocks"]) == (6, 2, 10, 2)


def test_the_status_is_served_on_the_loopback_status_server_only(
        edge_variant_off_vllm: Callable[..., Edge]) -> None:
    e = edge_variant_off_vllm("status-listener")
    r = httpx.get(f"http://127.0.0.1:{e.port}/tokengate/status", timeout=10)
    assert (r.status_code, r.json()["error"]["code"]) == (404, "unknown_url")
    # that 404 carried no key (counted in the log phase, after the answer)
    wait_until(lambda: e.status()["unauthenticated_refused"] == 1)
    assert httpx.get(f"http://127.0.0.1:{e.status_port}/v1/models", timeout=10) \
        .status_code == 404


def test_the_status_server_answers_only_its_own_host_names(
        edge_variant_off_vllm: Callable[..., Edge]) -> None:
    """A DNS-rebinding page reaches the status port through the browser's own loopback,
    with its own host name in Host: 421, and no key names or counts."""
    e = edge_variant_off_vllm("status-host")
    base = f"http://127.0.0.1:{e.status_port}"
    for path in ("/tokengate/status", "/metrics"):
        r = httpx.get(base + path, headers={"Host": f"rebind.example:{e.status_port}"},
                      timeout=10)
        assert (r.status_code, r.text) == (
            421, "this status server answers its own address only (Host)\n")
        for host in (f"127.0.0.1:{e.status_port}", f"localhost:{e.status_port}"):
            assert httpx.get(base + path, headers={"Host": host}, timeout=10
                             ).status_code == 200



def test_a_client_is_an_ipv4_address_or_an_ipv6_64_unless_exempt() -> None:
    # lockout.client() of raw addresses ($binary_remote_addr), inside nginx's LuaJIT
    mapped = "00000000000000000000ffff"
    addresses = [
        "0a01c803",                               # 10.1.200.3: in 10.1.0.0/16
        "0a020001",                               # 10.2.0.1
        "c0000207",                               # 192.0.2.7: the exempt /32
        "c0000208",                               # 192.0.2.8
        mapped + "0a010009",                      # ::ffff:10.1.0.9: IPv4, exempt
        mapped + "08080808",                      # ::ffff:8.8.8.8: IPv4 8.8.8.8
        "20010db87fff" + "0" * 16 + "0001",       # 2001:db8:7fff::1: in 2001:db8::/33
        "20010db88000" + "0" * 16 + "0001",       # 2001:db8:8000::1: outside
        "2a001111222233334444555566667777",       # two hosts of one /64
        "2a0011112222333399998888aaaabbbb",
    ]
    out = run_lua(f"""
local lockout = require "tokengate.lockout"
local nets = lockout.networks({{{{"0a010000", 16}}, {{"c0000207", 32}},
                               {{"20010db8{'0' * 24}", 33}}}})
local function raw(h)
    return (h:gsub("%x%x", function(x) return string.char(tonumber(x, 16)) end))
end
local function hex(s)
    return s and (s:gsub(".", function(c) return string.format("%02x", c:byte()) end))
        or "exempt"
end
local out = {{}}
for _, a in ipairs({{"{'", "'.join(addresses)}"}}) do
    out[#out + 1] = hex(lockout.client(raw(a), nets))
end
return table.concat(out, " ")
""")
    assert out.split() == [
        "exempt", "0a020001", "exempt", "c0000208", "exempt", "08080808", "exempt",
        "20010db880000000", "2a00111122223333", "2a00111122223333"]

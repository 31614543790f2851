"""KV-cache-aware admission: the edge reads each replica's vLLM /metrics and sends a new
request only to a replica whose KV cache, queue and running requests are below the
bounds of the key's priority, and whose prefill lane is free for a paced priority; when
none is, it holds the request up to the priority's hold_ms, then answers 503 overloaded
with a Retry-After, before reserving anything.

The replicas are TokenStorm's fast upstream, whose ``vllm:kv_cache_usage_perc``,
``vllm:num_requests_waiting``, ``vllm:num_requests_running`` and TTFT histogram a test
sets while it runs (``POST /tokenstorm/metrics``); the names and labels are vLLM 0.32's,
checked here against the installed vLLM's source.
"""

from __future__ import annotations

import importlib.util
import json
import re
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry, Gauge, Histogram, generate_latest
from prometheus_client import Counter as PromCounter
from prometheus_client.parser import text_string_to_metric_families
from tokenstorm.null_server import FastUpstream

from tests.conftest import MODEL, key_digest
from tests.fixtures_edge import Edge, run_lua

# keys of these tests: id -> (key, priority)
KV_KEYS = {"kv-normal": ("tg-test-kv-normal", "normal"), "kv-low": ("tg-test-kv-low", "low")}
RPM = 1000


def _edge(edge_variant_off_vllm: Callable[..., Edge], name: str, ups: list[FastUpstream],
          **admission: Any) -> Edge:
    """An edge in front of ``ups``, reading their metrics every 200 ms (stale after 1 s)."""
    def edit(raw: dict[str, Any]) -> None:
        raw["models"][MODEL]["upstreams"] = [f"127.0.0.1:{u.port}" for u in ups]
        raw["models"][MODEL]["embedded"] = False
        raw["edge"]["admission"] = {"metrics_interval_ms": 200, "metrics_timeout_ms": 200,
                                    "metrics_stale_ms": 1000, **admission}
        for key_id, (key, priority) in KV_KEYS.items():
            raw["keys"][key_id] = {"sha256": key_digest(key), "rpm": RPM, "tpm": 10_000_000,
                                   "priority": priority}
    return edge_variant_off_vllm(name, edit)


def _chat(e: Edge, key_id: str = "kv-normal", content: str = "hi") -> httpx.Response:
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}],
            "max_tokens": 4}
    return httpx.post(e.base_url + "/chat/completions", content=json.dumps(body),
                      headers={"Authorization": f"Bearer {KV_KEYS[key_id][0]}",
                               "Content-Type": "application/json"}, timeout=30)


def _set(up: FastUpstream, **values: float) -> None:
    r = httpx.post(f"http://127.0.0.1:{up.port}/tokenstorm/metrics", json=values, timeout=5)
    assert r.status_code == 200, r.text


def _name(up: FastUpstream) -> str:
    return f"127.0.0.1:{up.port}"


def _seen(e: Edge, up: FastUpstream, kv: float | None, waiting: int = 0) -> None:
    """Waits until the edge's status shows what ``up`` reports (kv None: unknown)."""
    deadline = time.monotonic() + 10
    while True:
        st = e.status()["upstreams"][MODEL][_name(up)]
        if kv is None and st["kv_cache_usage"] is None:
            return
        if kv is not None and st["kv_cache_usage"] == pytest.approx(kv) \
                and st["num_requests_waiting"] == waiting:
            return
        assert time.monotonic() < deadline, f"{_name(up)}: {st}, wanted kv {kv}"
        time.sleep(0.05)


def _until(what: Callable[[], bool], why: str) -> None:
    """Waits until ``what()`` holds (10 s at most: then fails with ``why``)."""
    deadline = time.monotonic() + 10
    while not what():
        assert time.monotonic() < deadline, why
        time.sleep(0.05)


def _served(answers: list[httpx.Response]) -> Counter[str]:
    assert [r.status_code for r in answers] == [200] * len(answers), \
        [r.text for r in answers if r.status_code != 200]
    return Counter(r.headers["x-tokengate-upstream"] for r in answers)


def _shed(e: Edge, key: str) -> httpx.Response:
    """A request of ``key`` that admission sheds: 503 ``overloaded``."""
    r = _chat(e, key)
    assert (r.status_code, r.json()["error"]["code"]) == (503, "overloaded"), r.text
    return r


def test_the_fast_upstream_serves_settable_vllm_metrics(
        replicas: Callable[..., FastUpstream]) -> None:
    up = replicas()
    _set(up, kv_cache_usage_perc=0.95, num_requests_waiting=3, num_requests_running=2,
         time_to_first_token_seconds_sum=1.5, time_to_first_token_seconds_count=3)
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert httpx.post(up.url + "/chat/completions", json=chat, timeout=10).status_code == 200
    r = httpx.get(f"http://127.0.0.1:{up.port}/metrics", timeout=5)
    assert r.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    samples = {(s.name, s.labels.get("finished_reason")): (s.labels, s.value)
               for f in text_string_to_metric_families(r.text) for s in f.samples}
    labels = {"engine": "0", "model_name": MODEL}
    assert samples == {
        ("vllm:num_requests_running", None): (labels, 2.0),
        ("vllm:num_requests_waiting", None): (labels, 3.0),
        ("vllm:kv_cache_usage_perc", None): (labels, 0.95),
        ("vllm:time_to_first_token_seconds_bucket", None): ({**labels, "le": "+Inf"}, 3.0),
        ("vllm:time_to_first_token_seconds_count", None): (labels, 3.0),
        ("vllm:time_to_first_token_seconds_sum", None): (labels, 1.5),
        ("vllm:request_success_total", "length"): ({**labels, "finished_reason": "length"},
                                                   1.0),
    }
    bad = httpx.post(f"http://127.0.0.1:{up.port}/tokenstorm/metrics",
                     json={"kv_cache": 1}, timeout=5)
    assert (bad.status_code, bad.json()["error"]["param"]) == (400, "kv_cache")


@pytest.mark.unit
def test_the_installed_vllm_exports_the_metrics_admission_reads() -> None:
    # read from the source rather than a running server: vLLM 0.32's stat logger declares
    # each of them with the labels model_name and engine (one sample per engine)
    spec = importlib.util.find_spec("vllm")
    assert spec is not None and spec.submodule_search_locations
    source = (Path(next(iter(spec.submodule_search_locations))) / "v1" / "metrics"
              / "loggers.py").read_text()
    assert 'labelnames = ["model_name", "engine"]' in source
    for gauge in ("vllm:kv_cache_usage_perc", "vllm:num_requests_waiting",
                  "vllm:num_requests_running"):
        assert re.search(r'self\._gauge_cls\(\s*name="' + gauge + r'",(?:.|\n)*?'
                         r'labelnames=labelnames,', source), gauge
    # a Counter named vllm:request_success is exposed as vllm:request_success_total
    assert re.search(r'self\._counter_cls\(\s*name="vllm:request_success",(?:.|\n)*?'
                     r'labelnames=labelnames \+ \["finished_reason"\]', source)
    # a Histogram: read as its _sum and _count
    assert re.search(r'self\._histogram_cls\(\s*name="vllm:time_to_first_token_seconds",'
                     r'(?:.|\n)*?labelnames=labelnames,', source)


def test_the_edge_reads_the_exposition_prometheus_client_writes() -> None:
    # two engines, the way vLLM's stat logger registers its metrics
    reg = CollectorRegistry()
    kv = Gauge("vllm:kv_cache_usage_perc", "KV-cache usage.", ["model_name", "engine"],
               registry=reg)
    waiting = Gauge("vllm:num_requests_waiting", "Waiting.", ["model_name", "engine"],
                    registry=reg)
    running = Gauge("vllm:num_requests_running", "Running.", ["model_name", "engine"],
                    registry=reg)
    done = PromCounter("vllm:request_success", "Finished.",
                       ["model_name", "engine", "finished_reason"], registry=reg)
    ttft = Histogram("vllm:time_to_first_token_seconds", "TTFT.", ["model_name", "engine"],
                     buckets=(0.01, 0.1, 1.0), registry=reg)
    waiting_by = Gauge("vllm:num_requests_waiting_by_reason", "By reason.",
                       ["model_name", "engine", "reason"], registry=reg)
    # an info gauge whose labels are CacheConfig's fields (vllm/v1/metrics/loggers.py
    # log_metrics_info; "None" before the engine counted its blocks)
    info = Gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                 ["block_size", "num_gpu_blocks", "prefix_caching_hash_algo", "engine"],
                 registry=reg)
    for engine, blocks in {"0": "1000", "1": "1200", "2": "None"}.items():
        info.labels("16", blocks, "sha256", engine).set(1)
    for engine, (k, w, r) in {"0": (0.5, 3, 7), "1": (0.955, 4, 1)}.items():
        kv.labels(MODEL, engine).set(k)
        waiting.labels(MODEL, engine).set(w)
        running.labels(MODEL, engine).set(r)
        waiting_by.labels(MODEL, engine, "capacity").set(100)
        done.labels(MODEL, engine, "stop").inc(10)
        done.labels(MODEL, engine, "length").inc(2)
        for x in (0.25, 0.5):
            ttft.labels(MODEL, engine).observe(x)
    text = generate_latest(reg).decode()
    out = run_lua(f"""
        local a = require "tokengate.admission"
        local got = a.parse([==[{text}]==])
        local names = {{}}
        for k in pairs(got) do names[#names + 1] = k end
        table.sort(names)
        local o = {{}}
        for _, k in ipairs(names) do o[#o + 1] = k .. "=" .. got[k] end
        return table.concat(o, " ")
    """)
    # KV cache: the fullest engine; requests: summed; blocks: the largest engine's
    # (tokengate.prefix: the capacity of the approximate index)
    assert out == ("num_gpu_blocks=1200 vllm:kv_cache_usage_perc=0.955 "
                   "vllm:num_requests_running=8 vllm:num_requests_waiting=7 "
                   "vllm:request_success_total=24 vllm:time_to_first_token_seconds_count=4 "
                   "vllm:time_to_first_token_seconds_sum=1.5")


def test_retry_after_is_the_queue_over_the_finish_rate() -> None:
    out = run_lua("""
        local e = require("tokengate.admission").estimate
        return table.concat({ e(9, 2.0, 30), e(0, 10, 30), e(100, 0.5, 30), e(3, 0, 30),
                              e(3, nil, 30), e(2, 0.7, 30) }, " ")
    """)
    # (9 + 1) / 2 = 5; at least 1; at most 30; nothing finishing: 30; 3 / 0.7 -> 5
    assert out == "5 1 30 30 30 5"


def test_requests_move_off_a_full_replica_then_shed_then_recover(
        edge_variant_off_vllm: Callable[..., Edge],
        replicas: Callable[..., FastUpstream]) -> None:
    a, b = replicas(), replicas()
    e = _edge(edge_variant_off_vllm, "kv-move", [a, b])
    with e.window_clock():
        _seen(e, a, 0.0)
        _seen(e, b, 0.0)
        assert set(_served([_chat(e) for _ in range(6)])) == {_name(a), _name(b)}
        # a above the threshold (0.92): new requests go to b
        _set(a, kv_cache_usage_perc=0.99)
        _seen(e, a, 0.99)
        assert _served([_chat(e) for _ in range(6)]) == {_name(b): 6}
        # a below it again, b's queue above its bound (32 for priority normal): to a
        _set(a, kv_cache_usage_perc=0.5)
        _set(b, kv_cache_usage_perc=0.1, num_requests_waiting=33)
        _seen(e, a, 0.5)
        _seen(e, b, 0.1, 33)
        assert _served([_chat(e) for _ in range(6)]) == {_name(a): 6}
        # both full: 503 overloaded, OpenAI's shape, before anything is reserved
        _set(a, kv_cache_usage_perc=0.99)
        _seen(e, a, 0.99)
        shed = [_chat(e) for _ in range(4)]
        for r in shed:
            assert r.status_code == 503, r.text
            err = r.json()["error"]
            assert (err["type"], err["code"], err["param"]) == ("server_error", "overloaded", None)
            retry = int(r.headers["retry-after"])
            assert 1 <= retry <= 30
            assert err["message"] == (
                f"Every replica of model {MODEL} is too busy to take this request now (KV cache "
                f"or queue above its bounds). Please retry after {retry} s.")
            # nothing was reserved: the key's window still shows the 18 admitted requests
            assert r.headers["x-ratelimit-remaining-requests"] == str(RPM - 18)
            assert "x-tokengate-upstream" not in r.headers
            # every shed request is a usage event
            ev = e.event(r.headers["x-request-id"])
            assert {k: ev[k] for k in ("key_id", "model", "status", "error", "reserved",
                                       "prompt_tokens", "completion_tokens", "usage_source",
                                       "upstream")} == \
                {"key_id": "kv-normal", "model": MODEL, "status": 503, "error": "overloaded",
                 "reserved": 0, "prompt_tokens": 0, "completion_tokens": 0, "usage_source": "none",
                 "upstream": None}
            assert ev["token_estimate"] > 0  # counted: the prompt's size decides admission
        assert e.status()["admission_shed"] == 4
        # both back down: served again, and the window counts only the admitted requests
        _set(a, kv_cache_usage_perc=0.3)
        _set(b, num_requests_waiting=0)
        _seen(e, a, 0.3)
        _seen(e, b, 0.1)
        answers = [_chat(e) for _ in range(6)]
        assert set(_served(answers)) == {_name(a), _name(b)}
        assert answers[-1].headers["x-ratelimit-remaining-requests"] == str(RPM - 24)


def test_a_low_priority_key_is_shed_first(edge_variant_off_vllm: Callable[..., Edge],
                                          replicas: Callable[..., FastUpstream]) -> None:
    up = replicas()
    e = _edge(edge_variant_off_vllm, "kv-priority", [up])
    # above low's threshold (0.85) and its headroom for small prompts (0.03), below
    # normal's (0.92)
    _set(up, kv_cache_usage_perc=0.89)
    _seen(e, up, 0.89)
    low = _shed(e, "kv-low")
    # the replica finished nothing since the edge started reading it: the longest wait
    assert low.headers["retry-after"] == "30"
    ev = e.event(low.headers["x-request-id"])
    assert (ev["key_id"], ev["status"], ev["error"]) == ("kv-low", 503, "overloaded")
    assert _chat(e, "kv-normal").status_code == 200
    # the queue: above low's bound (8), within normal's (32)
    _set(up, kv_cache_usage_perc=0.5, num_requests_waiting=9)
    _seen(e, up, 0.5, 9)
    assert _chat(e, "kv-low").status_code == 503
    assert _chat(e, "kv-normal").status_code == 200
    assert e.status()["admission_shed"] == 2


def test_a_priority_with_max_running_is_shed_while_that_many_requests_run(
        edge_variant_off_vllm: Callable[..., Edge],
        replicas: Callable[..., FastUpstream]) -> None:
    up = replicas()
    e = _edge(edge_variant_off_vllm, "kv-seats", [up], priorities={
        "low": {"max_running": 4}, "normal": {}})
    _set(up, kv_cache_usage_perc=0.31, num_requests_running=4)
    _seen(e, up, 0.31)
    _shed(e, "kv-low")
    assert _chat(e, "kv-normal").status_code == 200  # no bound of its own
    _set(up, kv_cache_usage_perc=0.32, num_requests_running=3)
    _seen(e, up, 0.32)
    assert _chat(e, "kv-low").status_code == 200
    # a waiting request takes the next seat that frees: it counts as running
    _set(up, kv_cache_usage_perc=0.33, num_requests_running=2, num_requests_waiting=2)
    _seen(e, up, 0.33, 2)
    assert _chat(e, "kv-low").status_code == 503
    assert e.status()["admission_shed"] == 2


def test_max_running_counts_what_the_edge_sent_before_the_metrics_show_it(
        edge_variant_off_vllm: Callable[..., Edge],
        replicas: Callable[..., FastUpstream]) -> None:
    # the replica's metrics say nothing runs; the edge has one request there, slow to
    # answer (a request on its way, or its prefill, is in no metric read before it)
    up = replicas(ttft_ms=60_000)
    e = _edge(edge_variant_off_vllm, "kv-in-flight", [up], priorities={
        "low": {"max_running": 1}, "normal": {}})
    _set(up, kv_cache_usage_perc=0.4)
    _seen(e, up, 0.4)
    slow = threading.Thread(target=lambda: _chat(e, "kv-low"), daemon=True)
    slow.start()
    _until(lambda: e.status()["upstreams"][MODEL][_name(up)]["outstanding_tokens"] > 0,
           "the first request never reached its replica")
    _shed(e, "kv-low")
    up.stop()  # the slow request ends (502), its thread with it
    slow.join(timeout=30)


def _ttft_seen(e: Edge, up: FastUpstream, mean_s: float) -> None:
    _until(lambda: e.status()["upstreams"][MODEL][_name(up)]["mean_ttft_s"]
           == pytest.approx(mean_s), f"{_name(up)}: mean TTFT never {mean_s} s")


def test_a_paced_priority_takes_the_prefill_lane_only_beside_other_traffic(
        edge_variant_off_vllm: Callable[..., Edge],
        replicas: Callable[..., FastUpstream]) -> None:
    up = replicas()
    e = _edge(edge_variant_off_vllm, "kv-lane", [up], priorities={
        "low": {"max_prefill_tokens": 1}, "normal": {}})
    _set(up, kv_cache_usage_perc=0.2)
    _seen(e, up, 0.2)
    # 10 first tokens in 100 s since the last read: a mean TTFT of 10 s
    _set(up, time_to_first_token_seconds_sum=100, time_to_first_token_seconds_count=10)
    _ttft_seen(e, up, 10.0)
    # nothing else runs there: no lane, lines alone slow only one another
    assert [_chat(e, "kv-low").status_code for _ in range(3)] == [200, 200, 200]
    # requests of other priorities run: the first takes the lane for its prompt tokens
    # / 1 x 10 s; the next finds it taken (no hold_ms: shed at once)
    _set(up, kv_cache_usage_perc=0.21, num_requests_running=3)
    _seen(e, up, 0.21)
    assert _chat(e, "kv-low").status_code == 200
    _shed(e, "kv-low")
    assert _chat(e, "kv-normal").status_code == 200  # not paced
    assert e.status()["admission_shed"] == 1


def test_a_held_request_takes_the_seat_that_frees_or_is_shed_after_hold_ms(
        edge_variant_off_vllm: Callable[..., Edge],
        replicas: Callable[..., FastUpstream]) -> None:
    up = replicas()
    e = _edge(edge_variant_off_vllm, "kv-hold", [up], priorities={
        "low": {"max_running": 4, "hold_ms": 60_000},
        "normal": {"max_running": 4, "hold_ms": 1}})
    _set(up, kv_cache_usage_perc=0.3, num_requests_running=4)
    _seen(e, up, 0.3)
    # held 1 ms, the replica still full: shed
    _shed(e, "kv-normal")
    assert (e.status()["admission_held"], e.status()["admission_shed"]) == (1, 1)
    # held while every seat is taken, answered once one frees
    got: list[httpx.Response] = []
    held = threading.Thread(target=lambda: got.append(_chat(e, "kv-low")), daemon=True)
    held.start()
    _until(lambda: e.status()["admission_held"] == 2, "the request was not held")
    assert not got
    _set(up, kv_cache_usage_perc=0.31, num_requests_running=3)
    held.join(timeout=30)
    assert [r.status_code for r in got] == [200]
    assert e.status()["admission_shed"] == 1


def test_a_small_prompt_may_use_the_headroom(edge_variant_off_vllm: Callable[..., Edge],
                                             replicas: Callable[..., FastUpstream]) -> None:
    up = replicas()
    e = _edge(edge_variant_off_vllm, "kv-headroom", [up], small_prompt_tokens=64,
              small_prompt_headroom=0.03)
    # above normal's threshold (0.92), within its headroom for small prompts (0.95)
    _set(up, kv_cache_usage_perc=0.94)
    _seen(e, up, 0.94)
    small = _chat(e, content="hi")
    assert small.status_code == 200 and int(small.headers["x-token-count"]) <= 64
    large = _chat(e, content="word " * 100)
    assert int(large.headers["x-token-count"]) > 64
    assert (large.status_code, large.json()["error"]["code"]) == (503, "overloaded")
    # beyond the headroom: no prompt is small enough
    _set(up, kv_cache_usage_perc=0.96)
    _seen(e, up, 0.96)
    assert _chat(e, content="hi").status_code == 503
    st = e.status()
    assert (st["admission_headroom"], st["admission_shed"]) == (1, 2)


def test_stale_metrics_are_unknown_not_healthy(edge_variant_off_vllm: Callable[..., Edge],
                                               replicas: Callable[..., FastUpstream]) -> None:
    a, b = replicas(), replicas()
    e = _edge(edge_variant_off_vllm, "kv-stale", [a, b])
    _set(a, kv_cache_usage_perc=0.99)
    _set(b, kv_cache_usage_perc=0.99)
    _seen(e, a, 0.99)
    _seen(e, b, 0.99)
    assert _chat(e).status_code == 503
    # a stops answering /metrics (slower than metrics_timeout_ms): after metrics_stale_ms
    # its last value (full) is forgotten: unknown, and it takes requests again
    _set(a, metrics_delay_ms=1500)
    _seen(e, a, None)
    assert e.status()["upstreams"][MODEL][_name(a)]["num_requests_waiting"] is None
    assert _served([_chat(e) for _ in range(4)]) == {_name(a): 4}
    # but a replica known to have room comes first: unknown is not healthy
    _set(b, kv_cache_usage_perc=0.2)
    _seen(e, b, 0.2)
    assert _served([_chat(e) for _ in range(6)]) == {_name(b): 6}
    assert f"upstream {_name(a)} of {MODEL} sends no vLLM metrics" in e.log_path.read_text()

"""The edge's /metrics (Prometheus text format) on its loopback status server, and its
/healthz and /readyz on the API listener.

A known workload goes through a fresh edge (its shared dicts start empty) in front of
TokenStorm's fast upstream and the session's real counter; /metrics then holds exactly
those requests, the tokens of their usage events and their 429s, and every histogram
parses with prometheus_client's own parser.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample
from tokengate_dev.bench import stack as bench_stack

from tests.conftest import MODEL, TEST_DIR, key_digest
from tests.fixtures_edge import MAIN_KEY, Edge
from tests.fixtures_ledger import wait_until

RPM_KEY, TPM_KEY = "tg-test-metrics-rpm", "tg-test-metrics-tpm"


def scrape(e: Edge) -> str:
    r = httpx.get(f"http://127.0.0.1:{e.status_port}/metrics", timeout=10)
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
    return r.text


def samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Every sample of an exposition, by (sample name, label set)."""
    out: dict[tuple[str, frozenset[tuple[str, str]]], float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            assert isinstance(s, Sample)
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(got: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str,
          **labels: str) -> float:
    return got.get((name, frozenset(labels.items())), 0.0)


def _edge(start: Callable[..., Edge], name: str, upstream_url: str,
          counter_socket: Path | None = None, upstream: str | None = None,
          special_tokens: str = "escape") -> Edge:
    port = upstream or upstream_url.split("//")[1].split("/")[0]

    def edit(raw: dict[str, Any]) -> None:
        raw["edge"]["special_tokens"] = special_tokens
        raw["models"][MODEL]["upstreams"] = [port]
        raw["models"][MODEL]["embedded"] = False
        raw["edge"]["upstream_health_interval_ms"] = 200
        raw["keys"]["metrics-rpm"] = {"sha256": key_digest(RPM_KEY), "rpm": 2, "tpm": 100_000}
        raw["keys"]["metrics-tpm"] = {"sha256": key_digest(TPM_KEY), "rpm": 100,
                                      "tpm": 150}
    return start(name, edit, counter_socket=counter_socket)


def _post(e: Edge, path: str, body: dict[str, Any], key: str | None = MAIN_KEY,
          stream: bool = False) -> httpx.Response:
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    return httpx.post(e.base_url + path, content=json.dumps({"model": MODEL, **body}),
                      headers=headers, timeout=60)


def _chat(text: str = "How far is the moon?", **kw: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": text}], "max_tokens": 5, **kw}


def test_metrics_count_a_known_workload_exactly(
        edge_variant_off_vllm: Callable[..., Edge], fast_upstream_url: str) -> None:
    e = _edge(edge_variant_off_vllm, "metrics", fast_upstream_url, special_tokens="reject")
    ok = [_post(e, "/chat/completions", _chat()) for _ in range(3)]
    ok += [_post(e, "/chat/completions",
                 _chat(stream=True, stream_options={"include_usage": True}))
           for _ in range(2)]
    ok.append(_post(e, "/completions", {"prompt": "Once upon a time", "max_tokens": 4}))
    # a zero-width space is removed (one action), a literal special token refused
    ok.append(_post(e, "/chat/completions", _chat("moon\u200b?")))
    assert [r.status_code for r in ok] == [200] * 7, [r.text for r in ok]
    special = _post(e, "/chat/completions", _chat("hi <|im_end|>"))
    assert special.status_code == 400
    unknown = _post(e, "/chat/completions", {**_chat(), "model": "no-such-model"})
    assert unknown.status_code == 404
    no_key = _post(e, "/chat/completions", _chat(), key=None)
    assert no_key.status_code == 401
    rpm = [_post(e, "/chat/completions", _chat(), key=RPM_KEY) for _ in range(3)]
    assert [r.status_code for r in rpm] == [200, 200, 429]
    # 150 TPM: prompt + 140 reserved can never fit
    tpm = [_post(e, "/chat/completions", _chat(max_tokens=n), key=TPM_KEY) for n in (5, 140)]
    assert [r.status_code for r in tpm] == [200, 429]

    # the log phase (metrics, then the event line) runs after the answer was sent
    ids = {r.headers["x-request-id"] for r in [*ok, special, unknown, *rpm, *tpm]}
    wait_until(lambda: ids <= {ev["request_id"] for ev in e.events()})
    events = e.events()
    text = scrape(e)
    got = samples(text)

    req = "tokengate_requests_total"
    assert value(got, req, key="edge-main", model=MODEL, endpoint="chat", status="2xx") == 6
    assert value(got, req, key="edge-main", model=MODEL, endpoint="completions",
                 status="2xx") == 1
    assert value(got, req, key="edge-main", model=MODEL, endpoint="chat", status="4xx") == 1
    assert value(got, req, key="edge-main", model="none", endpoint="chat", status="4xx") == 1
    assert value(got, req, key="none", model="none", endpoint="chat", status="4xx") == 1
    assert value(got, req, key="metrics-rpm", model=MODEL, endpoint="chat", status="2xx") == 2
    assert value(got, req, key="metrics-rpm", model=MODEL, endpoint="chat", status="4xx") == 1
    assert value(got, req, key="metrics-tpm", model=MODEL, endpoint="chat", status="4xx") == 1
    total = sum(v for (n, _), v in got.items() if n == req)
    assert total == 7 + 1 + 1 + 1 + 3 + 2

    for key_id in ("edge-main", "metrics-rpm", "metrics-tpm"):
        for field in ("prompt_tokens", "completion_tokens", "cached_tokens"):
            billed = sum(ev[field] for ev in events if ev["key_id"] == key_id)
            assert value(got, f"tokengate_{field}_total", key=key_id, model=MODEL) == billed
    assert value(got, "tokengate_prompt_tokens_total", key="edge-main", model=MODEL) > 0

    limited = "tokengate_rate_limited_total"
    assert value(got, limited, key="metrics-rpm", limit="rpm", tier="local", level="key") == 1
    assert value(got, limited, key="metrics-tpm", limit="tpm", tier="local", level="key") == 1
    assert sum(v for (n, _), v in got.items() if n == limited) == 2

    counted = [ev for ev in events if ev["count_source"] == "counter"]
    assert value(got, "tokengate_prompt_counts_total", model=MODEL,
                 source="counter") == len(counted)
    actions = "tokengate_sanitizer_actions_total"
    assert value(got, actions, action="remove_invisible_char") == 1
    assert value(got, actions, action="refuse_special_token") == 1
    assert value(got, "tokengate_unauthenticated_requests_total", reason="missing_key") == 1
    assert value(got, "tokengate_upstream_up", model=MODEL,
                 replica=fast_upstream_url.split("//")[1].split("/")[0]) == 1

    forwarded = [ev for ev in events if ev["upstream"] is not None]
    assert len(forwarded) == 7 + 2 + 1
    for name in ("tokengate_time_to_first_token_seconds", "tokengate_request_duration_seconds",
                 "tokengate_upstream_connect_duration_seconds"):
        assert value(got, name + "_count", model=MODEL) == len(forwarded), name
        assert value(got, name + "_bucket", model=MODEL, le="+Inf") == len(forwarded)
    ttft = sum(ev["ttft_ms"] for ev in forwarded) / 1000
    assert value(got, "tokengate_time_to_first_token_seconds_sum",
                 model=MODEL) == pytest.approx(ttft, abs=1e-3)
    assert value(got, "tokengate_count_duration_seconds_count") == len(counted)
    # what make bench reads of it: the counts' total time and number
    assert bench_stack.count_seconds(text) == (
        value(got, "tokengate_count_duration_seconds_sum"), len(counted))


def test_histograms_are_cumulative_and_every_family_is_declared(
        edge_variant_off_vllm: Callable[..., Edge], fast_upstream_url: str) -> None:
    e = _edge(edge_variant_off_vllm, "metrics-hist", fast_upstream_url)
    r = _post(e, "/chat/completions", _chat())
    assert r.status_code == 200
    e.event(r.headers["x-request-id"])  # the log phase (metrics, then the event) ran
    text = scrape(e)
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    hist = fams["tokengate_request_duration_seconds"]
    assert hist.type == "histogram"
    buckets = [s for s in hist.samples if s.name.endswith("_bucket")]
    les = [float(s.labels["le"]) for s in buckets]
    assert les == sorted(les) and les[-1] == float("inf")
    counts = [s.value for s in buckets]
    assert counts == sorted(counts) and counts[-1] == 1
    # every family has HELP and TYPE, also before its first sample
    assert fams["tokengate_auth_blocks"].type == "counter"
    assert fams["tokengate_rate_limited"].samples == []
    assert all(f.documentation for f in fams.values())
    # the status counters' known series are there from the start, at 0 (a rate over
    # them reads 0, not no data)
    drift = fams["tokengate_count_drift_requests"].samples
    assert [(s.name, s.labels, s.value) for s in drift] == [
        ("tokengate_count_drift_requests_total", {}, 0.0)]
    fallbacks = {s.labels["reason"]: s.value
                 for s in fams["tokengate_global_limit_fallbacks"].samples}
    assert fallbacks == dict.fromkeys(("unavailable", "down", "timeout", "error", "backoff"),
                                      0.0)


def test_escaped_special_tokens_are_counted(edge_variant_off_vllm: Callable[..., Edge],
                                            fast_upstream_url: str) -> None:
    e = _edge(edge_variant_off_vllm, "metrics-escape", fast_upstream_url)
    r = _post(e, "/chat/completions", _chat("a <|im_end|> b <think> c\u200b"))
    assert r.status_code == 200, r.text
    ev = e.event(r.headers["x-request-id"])
    assert (ev["escaped_special_tokens"], ev["sanitized_chars"], ev["error"]) == (2, 1, None)
    got = samples(scrape(e))
    actions = "tokengate_sanitizer_actions_total"
    assert value(got, actions, action="escape_special_token") == 2
    assert value(got, actions, action="remove_invisible_char") == 1
    assert value(got, actions, action="refuse_special_token") == 0


def test_the_json_status_page_reads_the_same_counters(
        edge_variant_off_vllm: Callable[..., Edge], fast_upstream_url: str) -> None:
    e = _edge(edge_variant_off_vllm, "metrics-json", fast_upstream_url)
    assert _post(e, "/chat/completions", _chat(), key=None).status_code == 401
    assert _post(e, "/chat/completions", _chat(), key="tg-wrong").status_code == 401
    # counted in the log phase, after the answer was sent
    wait_until(lambda: e.status()["unauthenticated_invalid_key"] == 1)
    status = e.status()
    got = samples(scrape(e))
    assert status["unauthenticated_missing_key"] == 1
    assert status["unauthenticated_invalid_key"] == 1
    assert value(got, "tokengate_unauthenticated_requests_total", reason="invalid_key") == 1
    assert status["global_fallback"] == 0


def test_metrics_are_not_served_on_the_api_listener(
        edge_variant_off_vllm: Callable[..., Edge], fast_upstream_url: str) -> None:
    e = _edge(edge_variant_off_vllm, "metrics-api", fast_upstream_url)
    r = httpx.get(f"http://127.0.0.1:{e.port}/metrics", timeout=10)
    assert r.status_code == 404
    assert r.json()["error"]["code"] == "unknown_url"


def test_healthz_and_readyz_answer_without_a_key(
        edge_variant_off_vllm: Callable[..., Edge], fast_upstream_url: str) -> None:
    e = _edge(edge_variant_off_vllm, "health", fast_upstream_url)
    r = httpx.get(f"http://127.0.0.1:{e.port}/healthz", timeout=10)
    assert (r.status_code, r.json()) == (200, {"object": "health", "status": "ok"})
    url = f"http://127.0.0.1:{e.port}/readyz"
    # ready once the replica's first health probe (at nginx's start) passed
    wait_until(lambda: httpx.get(url, timeout=10).status_code == 200)
    r = httpx.get(url, timeout=10)
    assert r.headers["content-type"] == "application/json"
    assert r.json() == {"object": "readiness", "status": "ready", "config": "ok",
                        "counter": "ok",
                        "models": {MODEL: {"replicas": 1, "healthy_replicas": 1}}}
    # a probe is read, never written: another method than GET or HEAD is refused
    for path, obj in (("/healthz", "health"), ("/readyz", "readiness")):
        r = httpx.head(f"http://127.0.0.1:{e.port}{path}", timeout=10)
        assert (r.status_code, r.content) == (200, b"")
        r = httpx.post(f"http://127.0.0.1:{e.port}{path}", json={}, timeout=10)
        assert (r.status_code, r.headers["allow"], r.json()) == (405, "GET, HEAD", {
            "object": obj, "status": "error", "error": {
                "message": f"Method not allowed: use GET {path} or HEAD {path}",
                "type": "invalid_request_error", "param": None,
                "code": "method_not_allowed"}})
    assert not e.events()  # no usage event


def test_a_streamed_request_refused_early_is_logged_as_streamed(
        edge_variant_off_vllm: Callable[..., Edge], fast_upstream_url: str) -> None:
    e = _edge(edge_variant_off_vllm, "metrics", fast_upstream_url)
    refused = [_post(e, "/chat/completions", _chat(stream=True, n=9)),        # validation
               _post(e, "/chat/completions", _chat(stream=True, model="nope")),  # model
               _post(e, "/chat/completions", _chat(stream=False, n=9))]
    assert [r.status_code for r in refused] == [400, 404, 400], [r.text for r in refused]
    streamed = [e.event(r.headers["x-request-id"])["stream"] for r in refused]
    assert streamed == [True, True, False]


def test_health_answers_get_and_head_without_a_key_as_vllm_does(
        edge_variant_off_vllm: Callable[..., Edge], fast_upstream_url: str) -> None:
    # guidellm and other vLLM-aware tools probe GET /health before they start
    e = _edge(edge_variant_off_vllm, "health-vllm", fast_upstream_url)
    url = f"http://127.0.0.1:{e.port}/health"
    wait_until(lambda: httpx.get(url, timeout=10).status_code == 200)
    r = httpx.get(url, timeout=10)
    assert (r.headers["content-type"], r.json()) == ("application/json", {
        "object": "health", "status": "ok",
        "models": {MODEL: {"replicas": 1, "healthy_replicas": 1}}})
    r = httpx.head(url, timeout=10)
    assert (r.status_code, r.content) == (200, b"")
    r = httpx.post(url, json={}, timeout=10)
    assert (r.status_code, r.headers["allow"], r.json()["error"]) == (405, "GET, HEAD", {
        "message": "Method not allowed: use GET /health or HEAD /health",
        "type": "invalid_request_error", "param": None, "code": "method_not_allowed"})
    assert not e.events()  # no usage event


def test_health_is_503_while_no_model_has_a_ready_replica(
        edge_variant_off_vllm: Callable[..., Edge], fast_upstream_url: str) -> None:
    from tokenstorm.process import free_port
    e = _edge(edge_variant_off_vllm, "health-down", fast_upstream_url,
              upstream=f"127.0.0.1:{free_port()}")
    url = f"http://127.0.0.1:{e.port}/health"
    # the health probe (every 200 ms here) takes the dead replica out
    wait_until(lambda: httpx.get(url, timeout=10).status_code == 503)
    r = httpx.get(url, timeout=10)
    assert (r.headers["retry-after"], r.json()) == ("1", {
        "object": "health", "status": "unavailable",
        "models": {MODEL: {"replicas": 1, "healthy_replicas": 0}},
        "error": {"message": f"No model has a ready replica ({MODEL}).",
                  "type": "server_error", "param": None, "code": "no_ready_replica"}})
    assert httpx.head(url, timeout=10).status_code == 503


def test_a_replica_that_accepts_connections_but_never_answers_is_not_ready(
        edge_variant_off_vllm: Callable[..., Edge], fast_upstream_url: str) -> None:
    # what a vLLM that is still loading its model looks like: its port is bound (the
    # kernel accepts), nothing answers /health
    loading = socket.create_server(("127.0.0.1", 0), backlog=64)
    try:
        e = _edge(edge_variant_off_vllm, "loading", fast_upstream_url,
                  upstream=f"127.0.0.1:{loading.getsockname()[1]}")
        url = f"http://127.0.0.1:{e.port}/readyz"
        for _ in range(5):  # from nginx's start, before and after the first probe ends
            r = httpx.get(url, timeout=10)
            assert (r.status_code, r.json()["models"][MODEL]) == \
                (503, {"replicas": 1, "healthy_replicas": 0}), r.text
            time.sleep(0.3)
    finally:
        loading.close()


def test_readyz_is_503_without_a_counter_or_a_healthy_replica(
        edge_variant_off_vllm: Callable[..., Edge], fast_upstream_url: str) -> None:
    from tokenstorm.process import free_port
    dead = free_port()
    e = _edge(edge_variant_off_vllm, "not-ready", fast_upstream_url,
              counter_socket=TEST_DIR / "no-counter.sock", upstream=f"127.0.0.1:{dead}")
    url = f"http://127.0.0.1:{e.port}/readyz"
    # the health probe (every 200 ms here) takes the dead replica out
    wait_until(lambda: httpx.get(url, timeout=10).json()["models"][MODEL][
        "healthy_replicas"] == 0)
    r = httpx.get(url, timeout=10)
    assert r.status_code == 503
    body = r.json()
    assert body["status"] == "not_ready"
    # unreachable, or not asked again within edge.counter_backoff_ms of that failure
    assert body["counter"].startswith((f"model {MODEL}: down (counter unreachable",
                                       f"model {MODEL}: backoff (counter skipped after"))
    assert body["error"] == {
        "message": f"Not ready: counter: {body['counter']}; model {MODEL}: no healthy replica.",
        "type": "server_error", "param": None, "code": "not_ready"}

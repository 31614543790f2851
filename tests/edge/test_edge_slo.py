"""Latency targets at the edge (routing.policy slo, tokengate.slo): the replica predicted
to meet the TTFT target is chosen once the edge has learned each replica's speed from its
answers; once a replica's fit has learned a few answers, a sheddable request that no
replica can serve in time is refused at once and an interactive one waits until its
target has passed (before, the prior's guess refuses and holds nothing); what was
decided and predicted is in a response header, the usage event and the
prediction-error metric; bad target headers are 400s in each API's shape.

Real nginx (2 workers: each learns from every answer, its own and the other's), the
session's counter and two of TokenStorm's fast upstreams, one answering its first token
after 400 ms, the other after 5 ms; last, one simulated GPU replica (``sim-replica
--gpu``).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from tokengate import config as tg_config
from tokenstorm.null_server import FastUpstream
from tokenstorm.upstream.sim import SimReplica, SimSettings

from tests.conftest import MODEL, key_digest
from tests.fixtures_edge import MAIN_KEY, Edge, at_once

SHED_KEY = "tg-test-slo-sheddable"
LEARNED = 8  # answers before a fit's predictions may hold or refuse (tokengate.slo)
BATCH_KEY = "tg-test-slo-batch"
SLO = "x-tokengate-slo"


def _edge(edge_variant_off_vllm: Callable[..., Edge], name: str,
          ups: list[FastUpstream], targets: dict[str, int] | None = None) -> Edge:
    def edit(raw: dict[str, Any]) -> None:
        m = raw["models"][MODEL]
        m["upstreams"] = [f"127.0.0.1:{u.port}" for u in ups]
        m["embedded"] = False
        m["routing"] = {**m.get("routing", {}), "policy": "slo", "kv_events": {}}
        m["slo"] = targets or {"ttft_ms": 200, "tpot_ms": 1000}
        raw["edge"]["admission"] = {"metrics_interval_ms": 0}
        for key, cls in ((SHED_KEY, "sheddable"), (BATCH_KEY, "batch")):
            raw["keys"][cls] = {"sha256": key_digest(key), "rpm": 100000,
                                "tpm": 100_000_000, "slo_class": cls}
    return edge_variant_off_vllm(name, edit)


def _chat(e: Edge, key: str = MAIN_KEY, headers: dict[str, str] | None = None,
          question: str = "What is 1 + 1?") -> httpx.Response:
    body = {"model": MODEL, "max_tokens": 3, "stream": True,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": question}]}
    return httpx.post(e.base_url + "/chat/completions", content=json.dumps(body),
                      headers={"Authorization": f"Bearer {key}",
                               "Content-Type": "application/json", **(headers or {})},
                      timeout=30)


def test_requests_go_to_the_replica_predicted_to_meet_the_ttft_target(
        edge_variant_off_vllm: Callable[..., Edge],
        replicas: Callable[..., FastUpstream]) -> None:
    slow, fast = replicas(ttft_ms=400), replicas(ttft_ms=5)
    e = _edge(edge_variant_off_vllm, "slo-route", [slow, fast])
    # bursts: the prefill each request queues on its replica sends the next one to the
    # other, so both answer and the workers learn how fast each is. When the first
    # answers come from the fast one, it stays predicted the faster and the slow one may
    # never be tried (its prior is no faster): up to three bursts, then either way the
    # next requests must go to the fast one
    answered: set[str] = set()
    sent = 0
    while len(answered) < 2 and sent < 24:
        burst = at_once(8, lambda: _chat(e))
        assert [r.status_code for r in burst] == [200] * 8
        answered |= {r.headers["x-tokengate-upstream"] for r in burst}
        sent += 8
    assert f"127.0.0.1:{fast.port}" in answered
    got = []
    for _ in range(6):
        r = _chat(e)
        assert r.status_code == 200, r.text
        got.append(r.headers["x-tokengate-upstream"])
    assert got == [f"127.0.0.1:{fast.port}"] * 6
    cls, decision, ttft, tpot = r.headers[SLO].split("; ")
    assert (cls, decision, tpot.split("/")[1]) == ("interactive", "met", "1000")
    assert ttft.startswith("ttft=") and ttft.endswith("/200")
    ev = e.event(r.headers["x-request-id"])
    slo = ev["slo"]
    assert (slo["class"], slo["decision"], slo["ttft_target_ms"], slo["tpot_target_ms"]) == \
        ("interactive", "met", 200, 1000)
    assert slo["predicted_ttft_ms"] < 200 and slo["observed_ttft_ms"] < 200
    assert isinstance(slo["decision_us"], int) and isinstance(slo["predict_us"], int)
    text = httpx.get(f"http://127.0.0.1:{e.status_port}/metrics", timeout=10).text
    series = [line for line in text.splitlines()
              if line.startswith("tokengate_slo_prediction_error_count")]
    assert {s.split('replica="')[1].split('"')[0] for s in series} == answered
    assert sum(float(s.rsplit(" ", 1)[1]) for s in series) == sent + 6


def _learn(e: Edge, n: int = LEARNED) -> None:
    """``n`` answers for the edge's fits of its one replica to learn from (every worker
    folds every answer): before LEARNED of them its predictions hold and refuse
    nothing."""
    for i in range(n):
        r = _chat(e, question=f"warm-up {i}")
        assert r.status_code == 200, r.text


def test_a_fresh_edge_refuses_nothing_on_its_prior(
        edge_variant_off_vllm: Callable[..., Edge],
        replicas: Callable[..., FastUpstream]) -> None:
    """Before a replica answered LEARNED requests its prediction is the prior's guess:
    a target of 1 ms is not met by it, yet the request is served, its answer learned."""
    e = _edge(edge_variant_off_vllm, "slo-fresh", [replicas()])
    r = _chat(e, SHED_KEY, {"X-Tokengate-SLO-TTFT-Ms": "1"})
    assert r.status_code == 200, r.text
    cls, decision, ttft, _ = r.headers[SLO].split("; ")
    assert (cls, decision) == ("sheddable", "met")
    assert int(ttft.removeprefix("ttft=").split("/")[0]) > 1


def test_a_target_set_nowhere_is_left_out_of_the_answer(
        edge_variant_off_vllm: Callable[..., Edge],
        replicas: Callable[..., FastUpstream]) -> None:
    """The model sets a TTFT target only: the answer shows the predicted TPOT without a
    target, the usage event's tpot_target_ms is null."""
    e = _edge(edge_variant_off_vllm, "slo-ttft-only", [replicas()], {"ttft_ms": 200})
    r = _chat(e)
    assert r.status_code == 200, r.text
    _, _, ttft, tpot = r.headers[SLO].split("; ")
    assert ttft.startswith("ttft=") and ttft.endswith("/200")
    assert tpot.startswith("tpot=") and "/" not in tpot
    ev = e.event(r.headers["x-request-id"])
    assert (ev["slo"]["ttft_target_ms"], ev["slo"]["tpot_target_ms"]) == (200, None)


def test_a_sheddable_or_batch_request_no_replica_can_serve_in_time_is_refused(
        edge_variant_off_vllm: Callable[..., Edge],
        replicas: Callable[..., FastUpstream]) -> None:
    e = _edge(edge_variant_off_vllm, "slo-shed", [replicas()])
    _learn(e)
    for key, cls in ((SHED_KEY, "sheddable"), (BATCH_KEY, "batch")):
        r = _chat(e, key, {"X-Tokengate-SLO-TTFT-Ms": "1"})
        assert r.status_code == 503, r.text
        err = r.json()["error"]
        assert (err["type"], err["code"]) == ("server_error", "slo_unattainable")
        assert f"{cls} requests are not queued" in err["message"]
        assert r.headers["retry-after"] == "1"
        assert r.headers[SLO].startswith(f"{cls}; refused; ttft=")
        ev = e.event(r.headers["x-request-id"])
        assert (ev["status"], ev["error"], ev["reserved"], ev["upstream"]) == \
            (503, "slo_unattainable", 0, None)
        assert (ev["slo"]["decision"], ev["slo"]["ttft_target_ms"]) == ("refused", 1)
    # within reach, the same keys are served
    assert _chat(e, SHED_KEY).status_code == 200


def test_an_interactive_request_waits_until_its_target_passed_then_goes(
        edge_variant_off_vllm: Callable[..., Edge],
        replicas: Callable[..., FastUpstream]) -> None:
    e = _edge(edge_variant_off_vllm, "slo-wait", [replicas()])
    _learn(e)
    r = _chat(e, headers={"X-Tokengate-SLO-TTFT-Ms": "1", "X-Tokengate-SLO-TPOT-Ms": "500"})
    assert r.status_code == 200, r.text
    cls, decision, ttft, tpot = r.headers[SLO].split("; ")
    assert (cls, decision) == ("interactive", "late")
    assert ttft.startswith("ttft=") and ttft.endswith("/1")
    assert tpot.startswith("tpot=") and tpot.endswith("/500")
    ev = e.event(r.headers["x-request-id"])
    assert (ev["slo"]["decision"], ev["slo"]["tpot_target_ms"]) == ("late", 500)
    assert ev["slo"]["observed_ttft_ms"] > 0


@pytest.mark.parametrize("value", ["0", "-3", "2.5", "600001", "fast", ""])
def test_bad_target_headers_are_400_in_each_apis_shape(
        edge_variant_off_vllm: Callable[..., Edge],
        replicas: Callable[..., FastUpstream], value: str) -> None:
    e = _edge(edge_variant_off_vllm, "slo-bad", [replicas()])
    r = _chat(e, headers={"X-Tokengate-SLO-TTFT-Ms": value})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["type"], err["code"], err["param"]) == \
        ("invalid_request_error", "invalid_slo", "X-Tokengate-SLO-TTFT-Ms")
    assert "from 1 to 600000" in err["message"]
    body = {"model": MODEL, "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]}
    r = httpx.post(e.base_url + "/messages", content=json.dumps(body),
                   headers={"x-api-key": MAIN_KEY, "Content-Type": "application/json",
                            "anthropic-version": "2023-06-01",
                            "X-Tokengate-SLO-TPOT-Ms": value}, timeout=30)
    assert r.status_code == 400, r.text
    got = r.json()
    assert (got["type"], got["error"]["type"]) == ("error", "invalid_request_error")
    assert got["error"]["message"].startswith("X-Tokengate-SLO-TPOT-Ms must be a whole")


def test_a_bad_target_header_behind_a_hundred_others_is_still_400(
        edge_variant_off_vllm: Callable[..., Edge],
        replicas: Callable[..., FastUpstream]) -> None:
    """ngx.req.get_headers() reads 100 headers: a bad target after 97 others was never
    seen and the request was forwarded."""
    up = replicas()
    e = _edge(edge_variant_off_vllm, "slo-many", [up])
    filler = {f"X-Filler-{i}": "1" for i in range(120)}
    r = _chat(e, headers={**filler, "X-Tokengate-SLO-TTFT-Ms": "abc"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "invalid_slo"


def test_the_backlog_gauge_grows_with_the_prefill_queued_on_the_replicas(
        edge_variant_off_vllm: Callable[..., Edge],
        replicas: Callable[..., FastUpstream]) -> None:
    up = replicas(ttft_ms=1500)
    e = _edge(edge_variant_off_vllm, "slo-backlog", [up])

    def backlog() -> float:
        text = httpx.get(f"http://127.0.0.1:{e.status_port}/metrics", timeout=10).text
        [line] = [x for x in text.splitlines()
                  if x.startswith("tokengate_slo_backlog_seconds{")]
        assert line.startswith(f'tokengate_slo_backlog_seconds{{model="{MODEL}"}} ')
        return float(line.rsplit(" ", 1)[1])

    idle = backlog()
    assert 0 < idle < 0.1          # the prior: 20 ms with nothing queued
    with ThreadPoolExecutor(1) as pool:
        long = pool.submit(_chat, e, MAIN_KEY, None, "word " * 3000)
        deadline = time.monotonic() + 10
        while backlog() <= idle + 0.1:    # 3,000 tokens queued: 150 ms more by the prior
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert long.result().status_code == 200


def test_on_a_gpu_timed_replica_the_edge_learns_that_a_long_prefill_takes_longer(
        edge_variant_off_vllm: Callable[..., Edge], cfg: tg_config.Config,
        tmp_path: Path) -> None:
    """One simulated H100 replica of Qwen3-8B (vLLM's steps, roofline-timed): after
    short and long prompts in turn, every event has its prediction beside what was
    observed, and the last long prompt is predicted slower than the last short one."""
    m = cfg.models[MODEL]
    s = SimSettings(model=m.name, model_dir=Path(m.dir), max_model_len=16384, gpu="h100",
                    model_config="qwen3-8b", num_gpu_blocks=0, tokenizer="counter").sized()
    with SimReplica(s, state_dir=tmp_path) as rep:
        def edit(raw: dict[str, Any]) -> None:
            mm = raw["models"][MODEL]
            mm["upstreams"] = [rep.address]
            mm["embedded"] = False
            mm["max_model_len"] = 16384
            mm["routing"] = {**mm.get("routing", {}), "policy": "slo", "kv_events": {}}
            mm["slo"] = {"ttft_ms": 5000, "tpot_ms": 1000}
            raw["edge"]["admission"] = {"metrics_interval_ms": 0}
        e = edge_variant_off_vllm("slo-sim", edit)
        last: dict[str, dict[str, Any]] = {}
        for i in range(12):
            kind = "long" if i % 2 else "short"
            words = 6000 if kind == "long" else 20
            r = _chat(e, question=f"{i} " + "word " * words)
            assert r.status_code == 200, r.text
            last[kind] = e.event(r.headers["x-request-id"])["slo"]
            assert last[kind]["observed_ttft_ms"] > 0 and last[kind]["decision"] == "met"
    assert last["long"]["predicted_ttft_ms"] > last["short"]["predicted_ttft_ms"]


def test_on_the_vllm_cpu_server_the_learned_prediction_is_sane_and_exported(
        edge_variant: Callable[..., Edge]) -> None:
    """The session's vLLM CPU server behind policy slo: after a few warm-up requests
    every answer carries its prediction beside what was observed, the learned
    prediction is within a loose factor of the observed TTFT (a fit that learned, not
    the 20 ms prior and not a runaway), and the prediction-error histogram counts every
    answer under the replica's name."""
    def edit(raw: dict[str, Any]) -> None:
        m = raw["models"][MODEL]
        m["routing"] = {**m.get("routing", {}), "policy": "slo", "kv_events": {}}
        m["slo"] = {"ttft_ms": 600000, "tpot_ms": 60000}
    e = edge_variant("slo-vllm", edit)
    slos = []
    for i in range(16):
        r = _chat(e, question=f"{i}: what is {i} + {i}? " + "Think. " * (i % 4 * 40))
        assert r.status_code == 200, r.text
        assert r.headers[SLO].startswith("interactive; met; ttft=")
        slos.append(e.event(r.headers["x-request-id"])["slo"])
    for s in slos:
        assert s["predicted_ttft_ms"] > 0 and s["observed_ttft_ms"] > 0
        assert s["predicted_tpot_ms"] > 0
    ratios = sorted(s["predicted_ttft_ms"] / s["observed_ttft_ms"] for s in slos[8:])
    assert 0.2 < ratios[len(ratios) // 2] < 5, ratios
    text = httpx.get(f"http://127.0.0.1:{e.status_port}/metrics", timeout=10).text
    [count] = [line for line in text.splitlines()
               if line.startswith("tokengate_slo_prediction_error_count{")]
    assert f'model="{MODEL}"' in count and 'replica="' in count
    assert float(count.rsplit(" ", 1)[1]) == 16

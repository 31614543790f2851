"""The whole stack's metrics, as ``make run`` starts it (``devstack run``, global limits
on, in front of TokenStorm's fast upstream): every endpoint the banner prints answers,
the sidecars' counts match a known workload exactly, and every metric that an
expression of the Grafana board (docs/grafana/tokengate.json) names is exported by one of
them, or is one of vLLM's own (``VLLM_METRICS``, read from a real vLLM server by
tests/storm/test_upstream_contract.py).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from tokengate import version
from tokenstorm.process import free_port

from tests.deploy.test_make_run import KEY, Stack, up, upstream_of
from tests.fixtures_ledger import wait_until

BOARD = Path(__file__).resolve().parents[2] / "docs" / "grafana" / "tokengate.json"
# vLLM's metrics that the board reads (vLLM 0.32's names)
VLLM_METRICS = {"vllm:time_to_first_token_seconds_bucket", "vllm:kv_cache_usage_perc",
                "vllm:num_requests_waiting", "vllm:num_requests_running"}
N = 4  # requests of the workload, each with another prompt (none answered from a cache)


def board_metrics() -> dict[str, set[str]]:
    """Each metric an expression of the board names -> the panels naming it."""
    names: dict[str, set[str]] = {}
    for panel in json.loads(BOARD.read_text())["panels"]:
        for target in panel["targets"]:
            found = re.findall(r"\b(?:tokengate_[a-z0-9_]+|vllm:[a-z0-9_:]+)", target["expr"])
            assert found, f"{panel['title']}: {target['expr']} names no metric"
            for name in found:
                names.setdefault(name, set()).add(panel["title"])
    return names


def scrape(url: str) -> str:
    r = httpx.get(url, timeout=10)
    assert r.status_code == 200, url
    return r.text


def exported(url: str) -> dict[str, float]:
    """Every sample of one /metrics, by its name and labels (``name{a="x"}``)."""
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(scrape(url)):
        for s in fam.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}"] = s.value
    return out


SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"),
            "gauge": ("",)}


def names(url: str) -> set[str]:
    """The sample names one /metrics exports, also of families without a sample yet
    (a counter no request has moved: its HELP and TYPE lines)."""
    out: set[str] = set()
    for fam in text_string_to_metric_families(scrape(url)):
        out.update(fam.name + suffix for suffix in SUFFIXES.get(fam.type, ("",)))
        out.update(s.name for s in fam.samples)
    return out


@pytest.fixture(scope="module")
def stack(fast_upstream_url: str) -> Iterator[Stack]:
    def edit(raw: dict[str, Any]) -> None:
        raw["global_limits"]["enabled"] = True
        raw["global_limits"]["listen"] = f"127.0.0.1:{free_port()}"

    with up(Stack("observability", upstream_of(fast_upstream_url), edit=edit)) as s:
        yield s


def endpoints(s: Stack) -> dict[str, str]:
    """The banner's health and metrics lines: what -> URL."""
    out = {}
    for line in s.lines:
        m = re.match(r"^  (edge \w+|\w+ metrics)\s*: (http://\S+)$", line)
        if m:
            out[m.group(1)] = m.group(2)
    return out


def test_make_run_prints_every_health_and_metrics_endpoint(stack: Stack) -> None:
    urls = endpoints(stack)
    assert sorted(urls) == ["counter metrics", "edge liveness", "edge metrics",
                            "edge readiness", "ledger metrics", "limits metrics"]
    assert urls["edge liveness"] == stack.url.removesuffix("/v1") + "/healthz"
    assert httpx.get(urls["edge liveness"], timeout=10).status_code == 200
    r = httpx.get(urls["edge readiness"], timeout=10)
    assert (r.status_code, r.json()["status"]) == (200, "ready"), r.text
    # what vLLM-aware tools probe before they start
    r = httpx.get(stack.url.removesuffix("/v1") + "/health", timeout=10)
    assert (r.status_code, r.json()["status"]) == (200, "ok"), r.text


def test_every_sidecar_exports_the_release_it_runs(stack: Stack) -> None:
    urls = endpoints(stack)
    want = {"version": version.version(), "commit": version.commit()}
    for part in ("counter", "limits", "ledger"):
        [(labels, value)] = [(s.labels, s.value)
                             for fam in text_string_to_metric_families(
                                 scrape(urls[f"{part} metrics"]))
                             for s in fam.samples if s.name == "tokengate_build_info"]
        assert (labels, value) == ({"service": part, **want}, 1.0)


def test_the_cli_says_its_version() -> None:
    r = subprocess.run([sys.executable, "-m", "tokengate.cli", "--version"],
                       capture_output=True, text=True, timeout=60, check=True)
    assert r.stdout == f"tokengate {version.describe()}\n"
    assert version.version() == metadata.version("tokengate") != "unknown"


def test_sidecar_metrics_count_a_known_workload_and_the_board_is_exported(
        stack: Stack) -> None:
    urls = endpoints(stack)
    before = {k: exported(urls[k]) for k in ("counter metrics", "limits metrics")}
    counts = []
    for i in range(N):
        body = {"model": "tiny-qwen3", "max_tokens": 3,
                "messages": [{"role": "user", "content": f"Question number {i}?"}]}
        r = httpx.post(f"{stack.url}/chat/completions", json=body, timeout=30,
                       headers={"Authorization": f"Bearer {KEY}"})
        assert r.status_code == 200, r.text
        assert r.headers["x-tokengate-limits"] == "global"
        counts.append(int(r.headers["x-token-count"]))

    def delta(part: str, sample: str) -> float:
        return exported(urls[part]).get(sample, 0.0) - before[part].get(sample, 0.0)

    ok = 'code="OK",model="tiny-qwen3"'
    assert delta("counter metrics", f"tokengate_counter_calls_total{{{ok}}}") == N
    assert delta("counter metrics",
                 'tokengate_counter_prompt_tokens_total{model="tiny-qwen3"}') == sum(counts)
    assert delta("counter metrics",
                 'tokengate_counter_call_duration_seconds_count{model="tiny-qwen3"}') == N
    # one shape (a user message): each worker renders it at most once, the rest is
    # assembled from its trace
    renders = {how: delta("counter metrics", "tokengate_counter_template_renders_total"
                                             f'{{how="{how}",model="tiny-qwen3"}}')
               for how in ("trace", "recorded", "plain")}
    assert (renders["trace"] + renders["recorded"], renders["plain"]) == (N, 0), renders
    assert renders["recorded"] <= 2
    assert delta("limits metrics",
                 'tokengate_limits_calls_total{code="OK",method="Reserve"}') == N
    assert delta("limits metrics",
                 'tokengate_limits_call_duration_seconds_count{method="Reserve"}') == N
    wait_until(lambda: exported(urls["ledger metrics"])
               .get("tokengate_ledger_events_applied_total{}", 0) >= N
               and exported(urls["ledger metrics"]).get("tokengate_ledger_lag_bytes{}") == 0)
    ledger = exported(urls["ledger metrics"])
    assert ledger["tokengate_ledger_redis_up{}"] == 1
    assert ledger["tokengate_ledger_duplicate_events_total{}"] == 0

    every = set().union(*(names(u) for what, u in urls.items() if what.endswith("metrics")))
    missing = {name: panels for name, panels in board_metrics().items()
               if name not in every and name not in VLLM_METRICS}
    assert not missing, f"metrics the board reads that nothing exports: {missing}"

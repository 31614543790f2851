"""Count drift through the real edge: when the upstream's usage.prompt_tokens differs from
the counter's count, the usage event carries count_drift, the status server counts it,
and nginx's error log warns once per minute per model and replica, not once per request.

The upstream is TokenStorm's fast upstream with ``prompt_tokens_delta``: it reports the
edge's X-Token-Count plus that many prompt tokens, standing in for a vLLM that counts
otherwise (another release or chat template). The counter is the session's real one.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from tokengate.ledger.event import parse_event
from tokenstorm.null_server import FastUpstream

from tests.conftest import MODEL
from tests.fixtures_edge import EDGE_DIR, MAIN_KEY, Edge

HEADERS = {"Authorization": f"Bearer {MAIN_KEY}", "Content-Type": "application/json"}
WARNING = "tokengate: count drift: model tiny-qwen3"


@pytest.fixture
def drifting(replicas: Callable[..., FastUpstream]) -> Callable[[int], FastUpstream]:
    """Factory: ``drifting(delta)`` starts a fast upstream whose usage.prompt_tokens is
    the edge's count + delta; all stop at the end."""
    return lambda delta: replicas(prompt_tokens_delta=delta)


def _edge(edge_variant_off_vllm: Callable[..., Edge], name: str, up: FastUpstream,
          counter_socket: Path | None = None) -> Edge:
    def edit(raw: dict[str, Any]) -> None:
        raw["models"][MODEL]["upstreams"] = [f"127.0.0.1:{up.port}"]
        raw["models"][MODEL]["embedded"] = False
    return edge_variant_off_vllm(name, edit, counter_socket=counter_socket)


def _post(e: Edge, path: str, body: dict[str, Any]) -> httpx.Response:
    r = httpx.post(e.base_url + path, content=json.dumps({"model": MODEL, **body}),
                   headers=HEADERS, timeout=60)
    assert r.status_code == 200, r.text
    return r


def _event(e: Edge, r: httpx.Response) -> dict[str, Any]:
    return e.event(r.headers["x-request-id"])


def _chat(**kw: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": "How far is the moon?"}],
            "max_tokens": 2, **kw}


def test_a_drifting_upstream_is_recorded_per_request_and_warned_once(
        edge_variant_off_vllm: Callable[..., Edge],
        drifting: Callable[[int], FastUpstream]) -> None:
    up = drifting(3)
    e = _edge(edge_variant_off_vllm, "drift-plus3", up)
    r = _post(e, "/chat/completions", _chat())
    counted = int(r.headers["x-token-count"])
    assert r.headers["x-token-count-source"] == "counter"
    assert r.json()["usage"]["prompt_tokens"] == counted + 3
    ev = _event(e, r)
    assert (ev["token_estimate"], ev["prompt_tokens"], ev["count_drift"]) == \
        (counted, counted + 3, 3)
    assert parse_event(json.dumps(ev)).count_drift == 3  # the ledger reads it
    # a stream: the usage of the final chunk
    r = _post(e, "/chat/completions",
              _chat(stream=True, stream_options={"include_usage": True}))
    assert _event(e, r)["count_drift"] == 3
    # completions, one prompt
    r = _post(e, "/completions", {"prompt": "The moon is", "max_tokens": 2})
    assert _event(e, r)["count_drift"] == 3
    # not compared: several prompts, n > 1 (vLLM's usage then is per prompt or choice)
    r = _post(e, "/completions", {"prompt": ["The moon is", "The sun is"], "max_tokens": 2})
    assert (_event(e, r)["usage_source"], _event(e, r)["count_drift"]) == ("final", 0)
    r = _post(e, "/chat/completions", _chat(n=2, temperature=1.0))
    assert _event(e, r)["count_drift"] == 0
    status = e.status()
    assert (status["count_drift_requests"], status["count_drift_tokens"]) == (3, 9)
    # three drifted requests within a minute: one warning, naming both counts
    warnings = [x for x in e.log_path.read_text().splitlines() if WARNING in x]
    assert len(warnings) == 1, warnings
    assert f"replica 127.0.0.1:{up.port} reported {counted + 3} prompt tokens where the " \
           f"counter counted {counted} (count_drift +3)" in warnings[0]


def test_a_negative_drift_has_its_sign(edge_variant_off_vllm: Callable[..., Edge],
                                       drifting: Callable[[int], FastUpstream]) -> None:
    e = _edge(edge_variant_off_vllm, "drift-minus2", drifting(-2))
    r = _post(e, "/chat/completions", _chat())
    ev = _event(e, r)
    assert (ev["prompt_tokens"] - ev["token_estimate"], ev["count_drift"]) == (-2, -2)
    assert (e.status()["count_drift_requests"], e.status()["count_drift_tokens"]) == (1, 2)
    assert "(count_drift -2)" in e.log_path.read_text()


def test_agreeing_counts_and_estimates_are_no_drift(
        edge_variant_off_vllm: Callable[..., Edge],
        drifting: Callable[[int], FastUpstream]) -> None:
    e = _edge(edge_variant_off_vllm, "drift-none", drifting(0))
    r = _post(e, "/chat/completions", _chat())
    assert _event(e, r)["count_drift"] == 0
    # the counter is down: the edge forwards its byte estimate, which vLLM's usage
    # contradicts by design (the upstream here reports estimate + 5)
    e = _edge(edge_variant_off_vllm, "drift-estimate", drifting(5),
              counter_socket=EDGE_DIR / "no-counter.sock")
    r = _post(e, "/chat/completions", _chat())
    ev = _event(e, r)
    assert (ev["count_source"], ev["prompt_tokens"] - ev["token_estimate"],
            ev["count_drift"]) == ("estimate", 5, 0)
    assert e.status()["count_drift_requests"] == 0
    assert WARNING not in e.log_path.read_text()

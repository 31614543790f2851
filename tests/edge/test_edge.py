"""The nginx edge with the official openai client: real nginx, counter and vLLM CPU.

Each test sends one request through the gateway and states what must come back: the
exact prompt tokens in X-Token-Count (== vLLM's usage.prompt_tokens), the rate-limit
headers, the usage chunks the client asked for (and no others), and the usage event.
"""

from __future__ import annotations

from typing import Any

import openai
import pytest

from tests.conftest import MODEL
from tests.fixtures_edge import MAIN_KEY, Edge, key_of

RATE_HEADERS = [f"x-ratelimit-{k}-{w}" for k in ("limit", "remaining", "reset")
                for w in ("requests", "tokens")]


def client(edge: Edge, key: str = MAIN_KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=edge.base_url, api_key=key, max_retries=0, timeout=120)


def chat_body(content: str = "Say hello.", **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}],
            "max_tokens": 5, **extra}


def test_chat_counts_exactly_and_reports_usage(edge: Edge) -> None:
    raw = client(edge).chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "system", "content": "You are terse."},
                               {"role": "user", "content": "Name three rivers."}],
        max_tokens=5, extra_body={"ignore_eos": True})
    resp = raw.parse()
    assert resp.usage is not None
    assert int(raw.headers["x-token-count"]) == resp.usage.prompt_tokens
    assert raw.headers["x-token-count-source"] == "counter"
    assert resp.usage.completion_tokens == 5
    for h in RATE_HEADERS:
        assert h in raw.headers
    ev = edge.event(raw.headers["x-request-id"])
    assert ev["request_id"] == raw.headers["x-request-id"]
    assert resp.id == f"chatcmpl-{ev['request_id']}"
    assert (ev["key_id"], ev["model"], ev["endpoint"], ev["status"], ev["stream"]) == \
        ("edge-main", MODEL, "chat", 200, False)
    assert (ev["token_estimate"], ev["prompt_tokens"], ev["completion_tokens"]) == \
        (resp.usage.prompt_tokens, resp.usage.prompt_tokens, 5)
    assert ev["count_source"] == "counter" and ev["usage_source"] == "final"
    assert ev["reserved"] == resp.usage.prompt_tokens + 5
    assert ev["system_tokens"] > 0
    assert ev["client_aborted"] is False and ev["error"] is None
    assert ev["upstream"].endswith(str(edge_upstream_port()))
    assert 0 <= ev["ttft_ms"] <= ev["total_ms"]


def edge_upstream_port() -> int:
    from tests.conftest import VLLM_PORT
    return VLLM_PORT


def test_chat_stream_without_include_usage_gets_no_usage_chunks(edge: Edge) -> None:
    raw = client(edge).chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "Count to ten."}], max_tokens=6,
        stream=True, extra_body={"ignore_eos": True})
    chunks = list(raw.parse())
    assert chunks, "no chunks"
    assert all(c.usage is None for c in chunks)
    assert all(c.choices for c in chunks), "the final usage chunk reached the client"
    ev = edge.event(raw.headers["x-request-id"])
    # the edge still read vLLM's usage (it asked for it): billed exactly
    assert (ev["stream"], ev["usage_source"], ev["completion_tokens"]) == (True, "final", 6)
    assert ev["prompt_tokens"] == int(raw.headers["x-token-count"])


def test_chat_stream_with_include_usage_gets_only_the_final_usage(edge: Edge) -> None:
    raw = client(edge).chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "Count to ten."}], max_tokens=6,
        stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = list(raw.parse())
    final = chunks[-1]
    assert final.choices == [] and final.usage is not None
    assert all(c.usage is None for c in chunks[:-1])
    assert final.usage.prompt_tokens == int(raw.headers["x-token-count"])
    assert final.usage.completion_tokens == 6
    ev = edge.event(raw.headers["x-request-id"])
    assert (ev["usage_source"], ev["prompt_tokens"], ev["completion_tokens"]) == \
        ("final", final.usage.prompt_tokens, 6)


def test_chat_stream_with_continuous_usage_keeps_running_totals(edge: Edge) -> None:
    raw = client(edge).chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "Count to ten."}], max_tokens=4,
        stream=True,
        extra_body={"ignore_eos": True,
                    "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    chunks = list(raw.parse())
    running = [c.usage.completion_tokens for c in chunks if c.usage is not None]
    assert running == sorted(running) and running[-1] == 4
    assert len(running) == len(chunks)


def test_completions_counts_exactly(edge: Edge) -> None:
    raw = client(edge).completions.with_raw_response.create(
        model=MODEL, prompt="The capital of France is", max_tokens=3,
        extra_body={"ignore_eos": True})
    resp = raw.parse()
    assert resp.usage is not None
    assert int(raw.headers["x-token-count"]) == resp.usage.prompt_tokens
    assert resp.usage.completion_tokens == 3
    ev = edge.event(raw.headers["x-request-id"])
    assert (ev["endpoint"], ev["prompt_tokens"], ev["completion_tokens"]) == \
        ("completions", resp.usage.prompt_tokens, 3)


@pytest.mark.parametrize("include_usage", [False, True])
def test_completions_stream(edge: Edge, include_usage: bool) -> None:
    opts = {"stream_options": {"include_usage": True}} if include_usage else {}
    raw = client(edge).completions.with_raw_response.create(
        model=MODEL, prompt="Once upon a time", max_tokens=4, stream=True,
        extra_body={"ignore_eos": True}, **opts)  # type: ignore[arg-type]
    chunks = list(raw.parse())
    with_usage = [c for c in chunks if c.usage is not None]
    if include_usage:
        assert len(with_usage) == 1 and chunks[-1].choices == []
        assert with_usage[0].usage is not None
        assert with_usage[0].usage.prompt_tokens == int(raw.headers["x-token-count"])
        assert with_usage[0].usage.completion_tokens == 4
    else:
        assert with_usage == [] and all(c.choices for c in chunks)
    ev = edge.event(raw.headers["x-request-id"])
    assert (ev["stream"], ev["usage_source"], ev["completion_tokens"]) == (True, "final", 4)


def test_rate_limit_headers_count_down(edge: Edge) -> None:
    c = client(edge, key_of("edge-countdown"))
    with edge.window_clock():
        seen = []
        for _ in range(3):
            raw = c.chat.completions.with_raw_response.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                extra_body={"ignore_eos": True})
            assert raw.headers["x-ratelimit-limit-requests"] == "50"
            assert raw.headers["x-ratelimit-limit-tokens"] == "100000"
            seen.append((int(raw.headers["x-ratelimit-remaining-requests"]),
                         int(raw.headers["x-ratelimit-remaining-tokens"])))
        cost = int(raw.headers["x-token-count"]) + 2  # reserved = used: prompt + 2 completion
        assert seen == [(49, 100000 - cost), (48, 100000 - 2 * cost), (47, 100000 - 3 * cost)]
        assert raw.headers["x-ratelimit-reset-requests"].endswith("s")


def test_per_model_override_limits(edge: Edge) -> None:
    c = client(edge, key_of("edge-override"))
    raw = c.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=1)
    assert raw.headers["x-ratelimit-limit-requests"] == "2"
    assert raw.headers["x-ratelimit-limit-tokens"] == "50000"


def test_models_list_needs_a_key(edge: Edge) -> None:
    models = client(edge).models.list()
    assert [m.id for m in models.data] == [MODEL]
    with pytest.raises(openai.AuthenticationError) as e:
        client(edge, "tg-wrong-key").models.list()
    assert e.value.status_code == 401
    assert e.value.code == "invalid_api_key"


@pytest.mark.parametrize("path,body", [
    ("chat/completions", chat_body(stream=True, thinking_token_budget=10)),
    ("completions", {"model": MODEL, "prompt": "a", "max_tokens": 3, "stream": True,
                     "allowed_token_ids": [99_999_999]}),
])
def test_a_stream_that_vllm_refuses_before_generating_is_billed_nothing(
        edge: Edge, path: str, body: dict[str, Any]) -> None:
    """vLLM 0.32 answers some refusals of a stream as a 200 whose first event is the
    error (a thinking budget without --reasoning-parser; allowed_token_ids past the
    vocabulary), and writes no engine record: the estimate the edge used to bill
    stayed billed. Such a stream is billed nothing, with vLLM's error in the event."""
    import httpx

    r = httpx.post(f"{edge.base_url}/{path}", json=body, timeout=120,
                   headers={"authorization": f"Bearer {MAIN_KEY}"})
    assert r.status_code == 200 and r.text.startswith('data: {"error"'), r.text
    ev = edge.event(r.headers["x-request-id"])
    assert (ev["usage_source"], ev["prompt_tokens"], ev["completion_tokens"], ev["error"]) \
        == ("none", 0, 0, "BadRequestError"), ev

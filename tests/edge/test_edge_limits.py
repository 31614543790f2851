"""RPM and TPM limits at the edge, with the official openai client: 429s that say which
limit and when to retry, bursts that never overshoot, and settlement that returns what a
request did not use.

Limits are per-minute sliding windows: used = prev * (1 - f) + cur, with f the elapsed
fraction of the current wall-clock minute. Each test owns a key (fixtures_edge.KEYS), so
prev = 0 and the expected numbers follow from the requests the test itself made.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import openai

from tests.conftest import MODEL
from tests.fixtures_edge import Edge, key_of

IM_END = 151645  # <|im_end|>: a logit bias on it makes the model stop after one token


class Answer:
    """Status, headers and JSON of one answer, from a success or an openai.APIStatusError."""

    def __init__(self, status: int, headers: httpx.Headers, data: dict[str, Any]) -> None:
        self.status_code, self.headers, self.data = status, headers, data

    def json(self) -> dict[str, Any]:
        return self.data


def post(edge: Edge, key: str, body: dict[str, Any]) -> Answer:
    client = openai.OpenAI(base_url=edge.base_url, api_key=key, max_retries=0, timeout=120)
    extra = {k: v for k, v in body.items() if k not in ("model", "messages", "max_tokens")}
    try:
        raw = client.chat.completions.with_raw_response.create(
            model=body["model"], messages=body["messages"], max_tokens=body["max_tokens"],
            extra_body=extra)
    except openai.APIStatusError as e:
        return Answer(e.status_code, e.response.headers, e.response.json())
    return Answer(raw.status_code, raw.headers, raw.parse().model_dump())


def body(content: str = "hi", max_tokens: int = 1, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens, "ignore_eos": True, **extra}


def expected_retry_after(limit: int, cur: float, cost: int, elapsed: float) -> int:
    """Seconds until prev * (1 - f) + cur + cost <= limit with prev = 0 now: only once
    this window has become the previous one and slid out far enough."""
    g = max(0.0, 1 - (limit - cost) / cur)
    return math.ceil((60 - elapsed) + 60 * g - 1e-9)  # as tokengate.local_limit rounds


def test_rpm_limit_answers_429_with_retry_after(edge: Edge,
                                                vllm_requests: Callable[[], int]) -> None:
    key = key_of("edge-rpm")  # 3 requests per minute
    with edge.window_clock() as clock:
        remaining = [int(post(edge, key, body()).headers["x-ratelimit-remaining-requests"])
                     for _ in range(3)]
        assert remaining == [2, 1, 0]
        before = vllm_requests()
        r = post(edge, key, body())
        assert r.status_code == 429, r.text
        err = r.json()["error"]
        assert (err["type"], err["code"], err["param"]) == ("requests", "rate_limit_exceeded", None)
        assert "requests per minute (RPM)" in err["message"] and "limit 3" in err["message"]
        retry = r.headers["retry-after"]
        assert retry.isdigit()
        # cur = 3, limit = 3, cost = 1: free once 1/3 of this window has slid out of view
        assert int(retry) == expected_retry_after(3, 3, 1, clock.elapsed)
        assert f"try again in {retry}s" in err["message"]
        assert r.headers["x-ratelimit-remaining-requests"] == "0"
        assert vllm_requests() == before
        ev = edge.event(r.headers["x-request-id"])
        assert (ev["status"], ev["error"], ev["reserved"], ev["usage_source"]) == \
            (429, "rate_limit_exceeded", 0, "none")


def test_a_refused_request_gets_in_exactly_at_its_retry_after(edge: Edge) -> None:
    key = key_of("edge-rpm")  # 3 requests per minute
    with edge.window_clock() as clock:
        assert [post(edge, key, body()).status_code for _ in range(4)] == [200] * 3 + [429]
        retry = int(post(edge, key, body()).headers["retry-after"])
        assert retry == expected_retry_after(3, 3, 1, clock.elapsed) == 79
        # the window rolls: its 3 requests become the previous window's, and slide out
        clock.move(retry - 1)
        r = post(edge, key, body())
        assert r.status_code == 429
        assert r.headers["retry-after"] == "1"
        clock.move(1)
        r = post(edge, key, body())
        assert r.status_code == 200, r.text
        # 3 x (1 - 20/60) + 1 = 3 requests in view: none left
        assert r.headers["x-ratelimit-remaining-requests"] == "0"
        clock.move(60)  # a window on: the one request in view, 2/3 of it
        r = post(edge, key, body())
        assert r.headers["x-ratelimit-remaining-requests"] == "1"  # floor(3 - 1 * 2/3 - 1)
        clock.move(120)  # two windows on: nothing left in view but this request
        r = post(edge, key, body())
        assert r.headers["x-ratelimit-remaining-requests"] == "2"


def test_tpm_limit_answers_429_with_retry_after(edge: Edge) -> None:
    key = key_of("edge-tpm")  # 120 tokens per minute
    with edge.window_clock() as clock:
        first = post(edge, key, body(max_tokens=40))
        assert first.status_code == 200, first.text
        cost = int(first.headers["x-token-count"]) + 40  # reserved = used (ignore_eos)
        assert first.json()["usage"]["completion_tokens"] == 40
        assert int(first.headers["x-ratelimit-remaining-tokens"]) == 120 - cost
        second = post(edge, key, body(max_tokens=40))
        assert second.status_code == 200
        assert int(second.headers["x-ratelimit-remaining-tokens"]) == 120 - 2 * cost
        r = post(edge, key, body(max_tokens=40))
        assert r.status_code == 429, r.text
        err = r.json()["error"]
        assert (err["type"], err["code"]) == ("tokens", "rate_limit_exceeded")
        assert f"limit 120, remaining {120 - 2 * cost}, requested {cost}" in err["message"]
        assert int(r.headers["retry-after"]) == \
            expected_retry_after(120, 2 * cost, cost, clock.elapsed)


def test_request_larger_than_tpm_is_told_retrying_cannot_help(edge: Edge) -> None:
    r = post(edge, key_of("edge-tpm"), body(max_tokens=200))
    assert r.status_code == 429
    err = r.json()["error"]
    assert err["type"] == "tokens"
    assert "retrying cannot help" in err["message"]
    prompt = int(r.headers["x-token-count"])
    assert f"it needs {prompt + 200} tokens ({prompt} prompt + 200 reserved" in err["message"]
    assert r.headers["retry-after"] == "60"
    assert r.headers["x-should-retry"] == "false"  # the openai clients then do not retry


def test_concurrent_burst_never_admits_more_than_tpm(edge: Edge) -> None:
    key = key_of("edge-burst")  # 1000 tokens per minute
    with edge.window_clock():
        text = "Summarize the following sentence in one word: " + "the river flows " * 12
        with ThreadPoolExecutor(64) as pool:
            results = list(pool.map(lambda _: post(edge, key, body(text)), range(64)))
        statuses = [r.status_code for r in results]
        admitted = [r for r in results if r.status_code == 200]
        assert set(statuses) <= {200, 429}
        cost = int(results[0].headers["x-token-count"]) + 1
        assert cost > 50
        assert 1 <= len(admitted) <= 1000 // cost
        assert all(r.json()["error"]["type"] == "tokens" for r in results if r.status_code == 429)
        assert sum(r.json()["usage"]["prompt_tokens"] + r.json()["usage"]["completion_tokens"]
                   for r in admitted) <= 1000
        events = [edge.event(r.headers["x-request-id"]) for r in results]
        assert sum(e["reserved"] for e in events) <= 1000
        assert sum(e["reserved"] for e in events if e["status"] == 200) == cost * len(admitted)


def test_settlement_returns_the_unused_reservation(edge: Edge) -> None:
    key = key_of("edge-settle")  # 100000 tokens per minute
    with edge.window_clock():
        stop_at_once = {"logit_bias": {str(IM_END): 100}, "ignore_eos": False}
        a = post(edge, key, body(max_tokens=50, **stop_at_once))
        assert a.status_code == 200, a.text
        prompt = int(a.headers["x-token-count"])
        assert a.json()["usage"]["completion_tokens"] == 1
        # at admission: prompt + 50 reserved
        assert int(a.headers["x-ratelimit-remaining-tokens"]) == 100000 - (prompt + 50)
        ev = edge.event(a.headers["x-request-id"])
        assert (ev["reserved"], ev["prompt_tokens"], ev["completion_tokens"]) == \
            (prompt + 50, prompt, 1)
        # settled: only prompt + 1 stays charged, so the next admission sees it
        b = post(edge, key, body(max_tokens=50, **stop_at_once))
        assert int(b.headers["x-ratelimit-remaining-tokens"]) == \
            100000 - (prompt + 1) - (prompt + 50)

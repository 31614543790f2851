"""The fast upstream answers like vLLM 0.32: the same requests go to the real vLLM CPU
server and to the fast upstream, and the answers must match in status, content type,
field sets and types (recursively), SSE framing (events in order, ``[DONE]``; vLLM may
merge token chunks under load), finish reasons and usage numbers (cumulative per chunk, final usage chunk). Only the
generated text and ids/timestamps differ. vLLM runs greedy (temperature 0) with
ignore_eos so its output length is exactly max_tokens.

The fast upstream takes prompt tokens from ``X-Token-Count``; each case sends it the
count vLLM reported for the same body (what the gateway does with its exact count).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

MODEL = "tiny-qwen3"
CHAT = "/chat/completions"
COMPL = "/completions"
RNG = random.Random()  # prompts differ between runs: no prefix-cache hits on vLLM


def shape(v: Any) -> Any:
    """The value with every scalar replaced by its JSON type name."""
    if isinstance(v, dict):
        return {k: shape(x) for k, x in v.items()}
    if isinstance(v, list):
        return [shape(x) for x in v]
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "bool"
    if isinstance(v, int):
        return "int"
    if isinstance(v, float):
        return "float"
    return "str"


def sse_events(text: str) -> list[str]:
    """The ``data:`` payloads of an SSE body; every event must be ``data: ...\\n\\n``."""
    assert text.endswith("\n\n"), text[-200:]
    events = text[:-2].split("\n\n")
    assert all(e.startswith("data: ") for e in events), events[:3]
    return [e[6:] for e in events]


def usage_numbers(u: dict[str, Any] | None) -> tuple[int, int, int] | None:
    if u is None:
        return None
    return (u["prompt_tokens"], u["completion_tokens"], u["total_tokens"])


@dataclass
class Answer:
    status: int
    content_type: str
    body: Any = None          # parsed JSON (non-streaming)
    events: list[Any] = field(default_factory=list)  # parsed SSE payloads, "[DONE]" kept


def call(base: str, method: str, path: str, body: Any = None, raw: bytes | None = None,
         headers: dict[str, str] | None = None) -> Answer:
    hdrs = {"content-type": "application/json", **(headers or {})}
    content = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    r = httpx.request(method, base + path, content=content, headers=hdrs, timeout=120)
    ctype = r.headers.get("content-type", "")
    a = Answer(r.status_code, ctype)
    if ctype.startswith("text/event-stream"):
        a.events = [p if p == "[DONE]" else json.loads(p) for p in sse_events(r.text)]
    elif r.content:
        a.body = r.json()
    return a


def prompt_tokens_of(a: Answer) -> int:
    if a.body is not None:
        return int(a.body["usage"]["prompt_tokens"])
    raise AssertionError("no usage to take the prompt count from")


def paired_events(real: list[Any], fast: list[Any]) -> list[tuple[Any, Any]]:
    """Each vLLM stream event with the fast-upstream event it must match.

    The fast upstream sends one chunk per token, as vLLM does while its API server keeps
    up. When it falls behind (a busy CPU), vLLM merges the deltas not yet sent into one
    chunk (``RequestOutputCollector`` in vllm/v1/engine/output_processor.py), so its stream
    can have fewer token chunks, never more. A merged chunk stands for the last of the
    chunks it merged: it pairs with the fast chunk of the same cumulative usage, or, in a
    stream without usage, by position counted from the end (a chat stream's first chunk,
    the role chunk, is never merged with what follows; a completions stream has none, and
    its first chunk can hold every token: seen in CI, one chunk of ten tokens)."""
    assert len(real) <= len(fast), (real, fast)
    if len(real) == len(fast):
        return list(zip(real, fast))
    if all(e.get("usage") for e in real):
        pairs, j = [], 0
        for r in real:
            want = usage_numbers(r["usage"])
            while usage_numbers(fast[j]["usage"]) != want:
                j += 1
                assert j < len(fast), (real, fast)
            pairs.append((r, fast[j]))
            j += 1
        return pairs
    skip = len(fast) - len(real)
    first = real[0]["choices"][:1] if real else []
    if first and "role" in (first[0].get("delta") or {}):
        return [(real[0], fast[0])] + list(zip(real[1:], fast[1 + skip:]))
    return list(zip(real, fast[skip:]))


def assert_same_answer(real: Answer, fast: Answer, exact_error: bool = True) -> None:
    """The contract between one vLLM answer and one fast-upstream answer."""
    assert fast.status == real.status, (real.body, fast.body)
    assert fast.content_type == real.content_type
    if real.events:
        assert fast.events[-1] == real.events[-1] == "[DONE]"
        for i, (r, f) in enumerate(paired_events(real.events[:-1], fast.events[:-1])):
            assert shape(f) == shape(r), f"event {i}:\nvLLM {r}\nfast {f}"
            for c_r, c_f in zip(r["choices"], f["choices"]):
                assert c_f["index"] == c_r["index"]
                assert c_f.get("finish_reason") == c_r.get("finish_reason")
            assert usage_numbers(f.get("usage")) == usage_numbers(r.get("usage")), i
            assert f.get("usage", {}).get("prompt_tokens_details") == \
                r.get("usage", {}).get("prompt_tokens_details"), i
            assert f["object"] == r["object"] and f["model"] == r["model"]
        return
    assert shape(fast.body) == shape(real.body), f"\nvLLM {real.body}\nfast {fast.body}"
    if real.status == 200 and "usage" in (real.body or {}):
        assert fast.body["usage"] == real.body["usage"]
        assert [c["finish_reason"] for c in fast.body["choices"]] == \
            [c["finish_reason"] for c in real.body["choices"]]
        assert fast.body["object"] == real.body["object"]
        assert fast.body["model"] == real.body["model"]
    elif real.body and "error" in real.body:
        e_r, e_f = real.body["error"], fast.body["error"]
        assert (e_f["type"], e_f["code"]) == (e_r["type"], e_r["code"])
        if exact_error:
            assert e_f == e_r


def words(n: int) -> str:
    return " ".join(RNG.choice(("storm", "gate", "token", "meter", "count", "ledger"))
                    for _ in range(n))


def chat(max_tokens: int | None = 5, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": MODEL, "temperature": 0, "ignore_eos": True,
                            "messages": [{"role": "user", "content": words(12)}]}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    body.update(extra)
    return body


def completion(max_tokens: float | None = 5, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": MODEL, "temperature": 0, "ignore_eos": True,
                            "prompt": words(12)}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    body.update(extra)
    return body


BOTH = {"include_usage": True, "continuous_usage_stats": True}
SUCCESS_CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "chat": (CHAT, chat()),
    "chat max_completion_tokens": (CHAT, chat(None, max_completion_tokens=4)),
    "chat n=2": (CHAT, chat(3, n=2, temperature=1.0, seed=7)),
    "chat stream": (CHAT, chat(stream=True)),
    "chat stream include_usage": (CHAT, chat(stream=True,
                                             stream_options={"include_usage": True})),
    "chat stream continuous_usage_stats only": (
        CHAT, chat(stream=True, stream_options={"continuous_usage_stats": True})),
    "chat stream cumulative usage": (CHAT, chat(stream=True, stream_options=BOTH)),
    "chat stream one token": (CHAT, chat(1, stream=True, stream_options=BOTH)),
    "completions": (COMPL, completion()),
    "completions default max_tokens": (COMPL, completion(None)),
    "completions stream": (COMPL, completion(stream=True)),
    "completions stream include_usage": (COMPL, completion(
        stream=True, stream_options={"include_usage": True})),
    "completions stream cumulative usage": (COMPL, completion(stream=True,
                                                              stream_options=BOTH)),
}


@pytest.mark.parametrize("case", list(SUCCESS_CASES))
def test_success_answers_match_vllm(case: str, vllm_url: str, fast_upstream_url: str) -> None:
    path, body = SUCCESS_CASES[case]
    real = call(vllm_url, "POST", path, body)
    assert real.status == 200
    if real.events:
        usage = [e["usage"] for e in real.events[:-1] if e.get("usage")]
        count = usage[-1]["prompt_tokens"] if usage else None
    else:
        count = prompt_tokens_of(real)
    if count is None:  # a stream without usage: ask vLLM for the count
        count = prompt_tokens_of(call(vllm_url, "POST", path,
                                      {**body, "stream": False, "stream_options": None,
                                       "max_tokens": 1, "max_completion_tokens": None}))
    fast = call(fast_upstream_url, "POST", path, body, headers={"X-Token-Count": str(count)})
    assert_same_answer(real, fast)


def test_cumulative_usage_arithmetic(fast_upstream_url: str) -> None:
    """Every chunk's usage is a running total: the role chunk has 0 completion tokens,
    each token chunk one more, total = prompt + completion, and the final
    ``"choices": []`` chunk repeats the last totals."""
    fast = call(fast_upstream_url, "POST", CHAT, chat(4, stream=True, stream_options=BOTH),
                headers={"X-Token-Count": "21"})
    nums = [usage_numbers(e["usage"]) for e in fast.events[:-1]]
    assert nums == [(21, 0, 21), (21, 1, 22), (21, 2, 23), (21, 3, 24), (21, 4, 25),
                    (21, 4, 25)]
    assert fast.events[-2]["choices"] == []
    assert fast.events[-1] == "[DONE]"


def test_clamped_max_tokens_matches_vllm(vllm_url: str, fast_upstream_url: str) -> None:
    """prompt + max_tokens above max_model_len is clamped (200), not refused; a prompt
    of token ids is counted exactly by the fast upstream (no header needed)."""
    ids = [RNG.randrange(1000, 100000) for _ in range(8180)]
    body = {"model": MODEL, "prompt": ids, "max_tokens": 50, "temperature": 0,
            "ignore_eos": True}
    real = call(vllm_url, "POST", COMPL, body)
    fast = call(fast_upstream_url, "POST", COMPL, body)
    assert real.status == fast.status == 200
    assert usage_numbers(real.body["usage"]) == usage_numbers(fast.body["usage"]) \
        == (8180, 12, 8192)
    assert shape(fast.body) == shape(real.body)


ERROR_CASES: dict[str, tuple[str, str, dict[str, Any] | None, bytes | None, dict[str, str],
                             bool]] = {
    # name: (method, path, body, raw body, headers, exact error object)
    "max_tokens 0": ("POST", CHAT, chat(0), None, {}, True),
    "max_tokens -1 stream": ("POST", CHAT, chat(-1, stream=True), None, {}, True),
    "max_tokens above max_model_len": ("POST", CHAT, chat(9000), None, {}, True),
    "max_completion_tokens 0": ("POST", CHAT, chat(None, max_completion_tokens=0), None, {},
                                True),
    "completions max_tokens 0": ("POST", COMPL, completion(0), None, {}, True),
    "unknown model": ("POST", CHAT, {**chat(), "model": "nope"}, None, {}, True),
    "n 0": ("POST", COMPL, completion(n=0), None, {}, True),
    "n 2 with greedy sampling": ("POST", CHAT, chat(n=2), None, {}, True),
    "temperature not a number": ("POST", CHAT, chat(temperature="hot"), None, {}, True),
    "max_tokens with a fraction": ("POST", COMPL, completion(2.5), None, {}, False),
    "stream_options without stream": ("POST", CHAT, chat(stream_options=BOTH), None, {},
                                      True),
    "prompt above max_model_len": ("POST", COMPL, {"model": MODEL, "prompt": [100] * 8193,
                                                   "max_tokens": 5}, None, {}, True),
    "prompt of exactly max_model_len": ("POST", COMPL, {"model": MODEL,
                                                        "prompt": [100] * 8192}, None, {},
                                        True),
    "invalid JSON": ("POST", CHAT, None, b'{"model":', {}, False),
    "messages missing": ("POST", CHAT, {"model": MODEL, "max_tokens": 2}, None, {}, True),
    "messages not a list": ("POST", CHAT, {"model": MODEL, "messages": "hi"}, None, {}, True),
    "messages an object": ("POST", CHAT, {"model": MODEL, "messages": {"a": 1}}, None, {},
                           True),
    "wrong content type": ("POST", CHAT, chat(), None, {"content-type": "text/plain"}, True),
    "GET on an endpoint": ("GET", CHAT, None, None, {}, True),
    "unknown path": ("POST", "/nothing", chat(), None, {}, True),
}


@pytest.mark.parametrize("case", list(ERROR_CASES))
def test_error_answers_match_vllm(case: str, vllm_url: str, fast_upstream_url: str) -> None:
    method, path, body, raw, headers, exact = ERROR_CASES[case]
    real = call(vllm_url, method, path, body, raw, headers)
    fast = call(fast_upstream_url, method, path, body, raw, headers)
    assert real.status in (400, 404, 405)
    assert_same_answer(real, fast, exact_error=exact)


def test_models_and_health_match_vllm(vllm_url: str, fast_upstream_url: str) -> None:
    real = call(vllm_url, "GET", "/models")
    fast = call(fast_upstream_url, "GET", "/models")
    assert real.status == fast.status == 200
    assert shape(fast.body) == shape(real.body)
    assert [m["id"] for m in fast.body["data"]] == [m["id"] for m in real.body["data"]]
    assert fast.body["data"][0]["max_model_len"] == real.body["data"][0]["max_model_len"]
    root = vllm_url.removesuffix("/v1")
    fast_root = fast_upstream_url.removesuffix("/v1")
    assert httpx.get(root + "/health").status_code == httpx.get(fast_root + "/health").status_code \
        == 200


def test_version_matches_vllm(vllm_url: str, fast_upstream_url: str) -> None:
    # what `tokengate doctor` reads to tell the vLLM release behind an upstream
    real = call(vllm_url.removesuffix("/v1"), "GET", "/version")
    fast = call(fast_upstream_url.removesuffix("/v1"), "GET", "/version")
    assert real.status == fast.status == 200
    assert (real.content_type, fast.body) == (fast.content_type, real.body)


def test_vllm_exports_the_metrics_the_grafana_board_reads(vllm_url: str) -> None:
    """docs/grafana/tokengate.json reads these of vLLM's own /metrics (after a request, so
    the TTFT histogram has a sample)."""
    from prometheus_client.parser import text_string_to_metric_families

    from tests.deploy.test_observability import VLLM_METRICS, board_metrics

    call(vllm_url, "POST", "/chat/completions",
         {"model": "tiny-qwen3", "max_tokens": 2,
          "messages": [{"role": "user", "content": "Hi"}]})
    text = httpx.get(vllm_url.removesuffix("/v1") + "/metrics", timeout=30).text
    exported = {s.name for fam in text_string_to_metric_families(text) for s in fam.samples}
    assert VLLM_METRICS <= exported, VLLM_METRICS - exported
    assert {n for n in board_metrics() if n.startswith("vllm:")} <= VLLM_METRICS

"""Completion limits through the edge the way vLLM 0.32 handles them, against the real
vLLM CPU server: a max_tokens that does not fit the room the prompt leaves is fitted into
it (200, as vLLM answers the same body sent to it directly); one above max_model_len is
refused in vLLM's words with the client's own numbers; the gateway's max_tokens_cap
(the model's, or a key's tighter one) lowers a limit without refusing and says so in
X-Tokengate-Max-Tokens-Capped and the usage event.

The context is read from the test configuration (models.<m>.max_model_len), never
assumed.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import anthropic
import httpx
import pytest
import yaml

from tests.conftest import MODEL, VLLM_PORT
from tests.fixtures_edge import MAIN_KEY, Edge

VLLM = f"http://127.0.0.1:{VLLM_PORT}/v1"
AUTH = {"Authorization": f"Bearer {MAIN_KEY}"}
CAPPED = "x-tokengate-max-tokens-capped"


def context_of(config: Path) -> int:
    return int(yaml.safe_load(config.read_text())["models"][MODEL]["max_model_len"])


def chat(words: int, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "word " * words}],
            **extra}


def vllm_prompt(body: dict[str, Any], path: str = "/chat/completions") -> int:
    """vLLM's prompt tokens for body sent straight to it (one completion token)."""
    limit = "max_output_tokens" if path == "/responses" else "max_tokens"
    r = httpx.post(VLLM + path, json={**body, limit: 1}, timeout=120)
    assert r.status_code == 200, r.text
    u = r.json()["usage"]
    if "prompt_tokens" in u:
        return int(u["prompt_tokens"])
    # Anthropic's input_tokens leave out prefix-cache reads (cache_read_input_tokens)
    return int(u["input_tokens"] + (u.get("cache_read_input_tokens") or 0)
               + (u.get("cache_creation_input_tokens") or 0))


def prompt_of(usage: Any) -> int:
    """vLLM's prompt tokens from an anthropic client's usage."""
    return int(usage.input_tokens + (usage.cache_read_input_tokens or 0)
               + (usage.cache_creation_input_tokens or 0))


def near_full(context: int, room: int, make: Callable[[int], dict[str, Any]],
              path: str = "/chat/completions") -> tuple[dict[str, Any], int]:
    """A body from make(words) whose prompt leaves about ``room`` tokens of the context,
    and the room it leaves exactly (vLLM's count; 1 to 3 x room)."""
    w0, w1 = context // 8, context // 4
    p0, p1 = vllm_prompt(make(w0), path), vllm_prompt(make(w1), path)
    per_word = (p1 - p0) / (w1 - w0)
    words = w1 + int((context - 2 * room - p1) / per_word)
    for _ in range(6):
        body = make(words)
        left = context - vllm_prompt(body, path)
        if room <= left <= 3 * room:
            return body, left
        words += int((left - 2 * room) / per_word)
    raise AssertionError(f"no body leaves {room} tokens")


def test_a_chat_max_tokens_past_the_context_is_fitted_into_the_room_as_vllm_does(
        edge: Edge, edge_config_path: Path) -> None:
    context = context_of(edge_config_path)
    body, room = near_full(context, 4, lambda w: chat(w, ignore_eos=True))
    body["max_tokens"] = room + 50
    direct = httpx.post(VLLM + "/chat/completions", json=body, timeout=120)
    assert direct.status_code == 200, direct.text
    assert direct.json()["usage"]["completion_tokens"] == room
    r = httpx.post(edge.base_url + "/chat/completions", json=body, headers=AUTH, timeout=120)
    assert r.status_code == 200, r.text
    u = r.json()["usage"]
    assert (u["prompt_tokens"], u["completion_tokens"]) == (context - room, room)
    assert int(r.headers["x-token-count"]) == context - room
    assert CAPPED not in r.headers
    ev = edge.event(r.headers["x-request-id"])
    assert (ev["max_tokens_requested"], ev["max_tokens_applied"]) == (room + 50, room)
    # output_reserve 256 > room; the prompt vLLM just saw is expected in its prefix cache,
    # and cache hits count cached_tokens_weight (0) in TPM
    assert ev["reserved"] == context - room - ev["expected_cached_tokens"] + room


def test_a_messages_max_tokens_past_the_context_is_answered_where_vllm_answers(
        edge: Edge, edge_config_path: Path) -> None:
    """Claude Code's case: its max_tokens does not fit beside a long history."""
    context = context_of(edge_config_path)

    def make(words: int) -> dict[str, Any]:
        return {"model": MODEL, "max_tokens": 1, "ignore_eos": True,
                "messages": [{"role": "user", "content": "word " * words}]}
    body, room = near_full(context, 4, make, "/messages")
    body["max_tokens"] = room + 50
    direct = httpx.post(VLLM + "/messages", json=body, timeout=120)
    assert direct.status_code == 200, direct.text
    assert direct.json()["usage"]["output_tokens"] == room
    raw = anthropic.Anthropic(base_url=edge.base_url.removesuffix("/v1"), api_key=MAIN_KEY,
                              max_retries=0, timeout=120).messages.with_raw_response.create(
        model=MODEL, max_tokens=room + 50, messages=body["messages"],
        extra_body={"ignore_eos": True})
    msg = raw.parse()
    assert (prompt_of(msg.usage), msg.usage.output_tokens, msg.stop_reason) == \
        (context - room, room, "max_tokens")
    ev = edge.event(raw.headers["x-request-id"])
    assert (ev["max_tokens_requested"], ev["max_tokens_applied"]) == (room + 50, room)


@pytest.mark.parametrize("path,field", [("/chat/completions", "max_tokens"),
                                        ("/chat/completions", "max_completion_tokens"),
                                        ("/completions", "max_tokens"),
                                        ("/responses", "max_output_tokens")])
def test_a_limit_above_the_context_is_refused_in_vllms_words(
        edge: Edge, edge_config_path: Path, vllm_requests: Callable[[], int], path: str,
        field: str) -> None:
    context = context_of(edge_config_path)
    body: dict[str, Any] = {"model": MODEL, field: context + 1}
    if path == "/chat/completions":
        body["messages"] = [{"role": "user", "content": "hi"}]
    elif path == "/completions":
        body["prompt"] = "hi"
    else:
        body["input"] = "hi"
    direct = httpx.post(VLLM + path, json=body, timeout=60)
    assert direct.status_code == 400, direct.text
    said = f"{field}={context + 1} cannot be greater than max_model_len={context}. " \
           "Please request fewer output tokens."
    assert direct.json()["error"]["message"].startswith(said)
    before = vllm_requests()
    r = httpx.post(edge.base_url + path, json=body, headers=AUTH, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"] == {"message": said, "type": "invalid_request_error",
                                 "param": field, "code": "invalid_value"}
    assert vllm_requests() == before


def test_a_huge_limit_is_quoted_as_sent_not_wrapped(edge: Edge, edge_config_path: Path
                                                    ) -> None:
    # a double above 2^63 printed with %d came out as -9223372036854775808
    context = context_of(edge_config_path)
    body = {"model": MODEL, "max_tokens": 10**30,
            "messages": [{"role": "user", "content": "hi"}]}
    r = httpx.post(edge.base_url + "/chat/completions", json=body, headers=AUTH, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"] == (
        f"max_tokens={10**30:.0f} cannot be greater than max_model_len={context}. "
        "Please request fewer output tokens.")


def test_a_messages_max_tokens_above_the_context_is_refused_in_anthropics_shape(
        edge: Edge, edge_config_path: Path) -> None:
    context = context_of(edge_config_path)
    with pytest.raises(anthropic.BadRequestError) as info:
        anthropic.Anthropic(base_url=edge.base_url.removesuffix("/v1"), api_key=MAIN_KEY,
                            max_retries=0, timeout=60).messages.create(
            model=MODEL, max_tokens=context + 1, messages=[{"role": "user", "content": "hi"}])
    assert info.value.body == {"type": "error", "error": {
        "type": "invalid_request_error",
        "message": f"max_tokens={context + 1} cannot be greater than max_model_len="
                   f"{context}. Please request fewer output tokens."}}


def _caps(model_cap: int, key_cap: int | None) -> Callable[[dict[str, Any]], None]:
    def edit(raw: dict[str, Any]) -> None:
        raw["models"][MODEL]["max_tokens_cap"] = model_cap
        raw["models"][MODEL].pop("default_max_tokens", None)
        if key_cap is not None:
            raw["keys"]["edge-main"]["max_tokens_cap"] = key_cap
    return edit


def test_the_model_cap_lowers_claude_codes_32000_and_says_so(
        edge_variant: Callable[..., Edge], edge_config_path: Path) -> None:
    context = context_of(edge_config_path)
    asked = min(32_000, context)
    e = edge_variant("cap-model", _caps(3, None))
    raw = anthropic.Anthropic(base_url=e.base_url.removesuffix("/v1"), api_key=MAIN_KEY,
                              max_retries=0, timeout=120).messages.with_raw_response.create(
        model=MODEL, max_tokens=asked, messages=[{"role": "user", "content": "hi"}],
        extra_body={"ignore_eos": True})
    msg = raw.parse()
    assert (msg.usage.output_tokens, msg.stop_reason) == (3, "max_tokens")
    assert raw.headers[CAPPED] == f"{asked} -> 3 (model cap)"
    ev = e.event(raw.headers["x-request-id"])
    assert (ev["max_tokens_requested"], ev["max_tokens_applied"]) == (asked, 3)
    assert ev["reserved"] == prompt_of(msg.usage) + 3


def test_a_keys_cap_applies_where_tighter_than_the_models(
        edge_variant: Callable[..., Edge]) -> None:
    e = edge_variant("cap-key", _caps(5, 2))
    body = chat(2, max_tokens=1000, ignore_eos=True)
    r = httpx.post(e.base_url + "/chat/completions", json=body, headers=AUTH, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 2
    assert r.headers[CAPPED] == "1000 -> 2 (key cap)"
    ev = e.event(r.headers["x-request-id"])
    assert (ev["max_tokens_requested"], ev["max_tokens_applied"]) == (1000, 2)
    # another key of the same edge keeps the model's cap
    other = httpx.post(e.base_url + "/responses", timeout=120,
                       headers={"Authorization": "Bearer tg-test-edge-other"},
                       json={"model": MODEL, "input": "hi", "max_output_tokens": 1000})
    assert other.status_code == 200, other.text
    assert other.headers[CAPPED] == "1000 -> 5 (model cap)"
    assert e.event(other.headers["x-request-id"])["max_tokens_applied"] == 5

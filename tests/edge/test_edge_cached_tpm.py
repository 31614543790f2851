"""Prefix-cache hits in TPM limits, against the real vLLM CPU server (prefix caching on,
--enable-prompt-tokens-details): a repeated long prompt is served mostly from the cache
on its second turn; its TPM reservation counts the tokens the edge expected cached at
cached_tokens_weight each, and the window settles with the cached_tokens vLLM reports
weighed the same way. The x-ratelimit-remaining-tokens of the next request show it.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

import httpx

from tests.conftest import MODEL
from tests.fixtures_edge import Edge, key_of


def turn(edge: Edge, key_id: str, text: str) -> tuple[httpx.Response, dict[str, Any]]:
    """One chat request of key_id: (answer, its usage event)."""
    r = httpx.post(edge.base_url + "/chat/completions", timeout=120,
                   headers={"Authorization": f"Bearer {key_of(key_id)}"},
                   json={"model": MODEL, "max_tokens": 1, "ignore_eos": True,
                         "messages": [{"role": "user", "content": text}]})
    assert r.status_code == 200, r.text
    return r, edge.event(r.headers["x-request-id"])


def long_prompt() -> str:
    """About 1,500 tokens no request has sent before (several 128-token blocks)."""
    return f"{uuid.uuid4()} " + "the river runs to the sea " * 250


def charged(ev: dict[str, Any], weight: float) -> int:
    cached = ev["cached_tokens"]
    return ev["prompt_tokens"] - cached + int(cached * weight + 0.5) + ev["completion_tokens"]


def three_turns(edge: Edge, key_id: str, weight: float) -> None:
    """A long prompt, then again until the edge expects its hit (mostly cached), then a
    short one: each reservation and the remaining tokens of the window, with hits at
    ``weight``."""
    text = long_prompt()
    with edge.window_clock():
        turns = [turn(edge, key_id, text)[1]]
        # the edge expects the hit once the replica's blocks reached the counter's index
        # (vLLM publishes a step's KV events with a later step): the same prompt again,
        # a bounded number of times, until it does
        for _ in range(20):
            turns.append(turn(edge, key_id, text)[1])
            if turns[-1]["expected_cached_tokens"] > 0:
                break
        r, third = turn(edge, key_id, "hi")
    second = turns[-1]
    prompt = second["prompt_tokens"]
    assert second["cached_tokens"] >= prompt // 2, second    # vLLM served it from cache
    expected = second["expected_cached_tokens"]
    assert expected > 0, second
    assert second["reserved"] == prompt - expected + int(expected * weight + 0.5) + 1
    assert third["reserved"] == third["prompt_tokens"] + 1
    tpm = int(r.headers["x-ratelimit-limit-tokens"])
    assert int(r.headers["x-ratelimit-remaining-tokens"]) == \
        tpm - sum(charged(t, weight) for t in turns) - third["reserved"]


def test_cache_hits_do_not_count_toward_tpm_by_default(edge: Edge) -> None:
    three_turns(edge, "edge-main", 0.0)


def _weights(model: float, key: float | None) -> Callable[[dict[str, Any]], None]:
    def edit(raw: dict[str, Any]) -> None:
        raw["models"][MODEL]["cached_tokens_weight"] = model
        if key is not None:
            raw["keys"]["edge-main"]["cached_tokens_weight"] = key
    return edit


def test_weight_one_counts_every_prompt_token_as_before(
        edge_variant: Callable[..., Edge]) -> None:
    three_turns(edge_variant("cached-weight-1", _weights(1.0, None)), "edge-main", 1.0)


def test_a_keys_weight_overrides_the_models(edge_variant: Callable[..., Edge]) -> None:
    e = edge_variant("cached-weight-key", _weights(1.0, 0.25))
    three_turns(e, "edge-main", 0.25)
    three_turns(e, "edge-other", 1.0)

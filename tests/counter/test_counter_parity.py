"""Contract §2.1: the counter's prompt_tokens equals the real vLLM server's usage.prompt_tokens."""

from __future__ import annotations

from typing import Any

import grpc
import httpx
import pytest
from tokengate.v1 import counter_pb2, counter_pb2_grpc

from tests.conftest import MODEL, count_body
from tests.counter_cases import CASES, REFUSED_TOOL_CALLS

CHAT, COMPLETIONS = counter_pb2.ENDPOINT_CHAT, counter_pb2.ENDPOINT_COMPLETIONS
ENDPOINTS = {"chat": CHAT, "completions": COMPLETIONS}
PATHS = {"chat": "chat/completions", "completions": "completions"}


@pytest.mark.parametrize("name,endpoint,body", CASES, ids=[c[0] for c in CASES])
def test_prompt_tokens_equal_vllm_usage(counter_stub: counter_pb2_grpc.TokenCounterStub,
                                        vllm_http: httpx.Client, name: str, endpoint: str,
                                        body: dict[str, Any]) -> None:
    body = {"model": MODEL, **body}
    response = vllm_http.post(PATHS[endpoint], json=body)
    assert response.status_code == 200, response.text
    expected = response.json()["usage"]["prompt_tokens"]
    reply = count_body(counter_stub, ENDPOINTS[endpoint], body)
    assert reply.prompt_tokens == expected
    b = reply.breakdown
    assert b.system + b.tools + b.messages + b.template_overhead == reply.prompt_tokens
    assert reply.tokenizer_backend == "tiktoken"


@pytest.mark.parametrize("name,body,message", REFUSED_TOOL_CALLS,
                         ids=[c[0] for c in REFUSED_TOOL_CALLS])
def test_tool_calls_vllm_refuses_the_counter_refuses(
        counter_stub: counter_pb2_grpc.TokenCounterStub, vllm_http: httpx.Client, name: str,
        body: dict[str, Any], message: str) -> None:
    """Refused by the counter, with a line that says what to fix, so the edge answers
    400 instead of forwarding the body for vLLM's pydantic dump."""
    body = {"model": MODEL, **body}
    response = vllm_http.post(PATHS["chat"], json=body)
    assert response.status_code == 400, response.text
    with pytest.raises(grpc.RpcError) as info:
        count_body(counter_stub, CHAT, body)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details() == message


def test_max_tokens_effective_is_what_vllm_generates_at_most(
        counter_stub: counter_pb2_grpc.TokenCounterStub) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hello!"}]}
    prompt = count_body(counter_stub, CHAT, body).prompt_tokens
    assert prompt == 10
    # No max_tokens: vLLM may generate up to the rest of the context window.
    assert count_body(counter_stub, CHAT, body).max_tokens_effective == 8192 - prompt
    # prompt + max_tokens > max_model_len: vLLM clamps silently.
    r = count_body(counter_stub, CHAT, {**body, "max_tokens": 8190})
    assert (r.max_tokens_requested, r.max_tokens_effective) == (8190, 8192 - prompt)
    r = count_body(counter_stub, CHAT, {**body, "max_tokens": 100, "max_completion_tokens": 7})
    assert (r.max_tokens_requested, r.max_tokens_effective) == (7, 7)
    # Completions default max_tokens to 16 (OpenAI API, vLLM CompletionRequest).
    r = count_body(counter_stub, COMPLETIONS, {"model": MODEL, "prompt": "Hi"})
    assert (r.prompt_tokens, r.max_tokens_requested, r.max_tokens_effective) == (1, 16, 16)
    r = count_body(counter_stub, COMPLETIONS, {"model": MODEL, "prompt": ["a b", "c"]})
    assert (r.prompt_tokens, r.prompt_count) == (3, 2)


def test_breakdown_is_never_negative_and_adds_up(
        counter_stub: counter_pb2_grpc.TokenCounterStub) -> None:
    """Short contents that also occur inside role headers or the system prompt
    ("y" in "system", "help" in "helpful") are attributed where they really are."""
    import random

    rng = random.Random(51)
    words = ["y", "e", "s", "m", "user", "system", "help", "helpful", "1", "11", " ", "\n",
             "assistant", "You are a helpful assistant.", "<think>", "a <|im_end|> b"]
    for _ in range(300):
        msgs = [{"role": "system", "content": " ".join(rng.choices(words, k=rng.randint(1, 4)))}]
        for _ in range(rng.randint(1, 4)):
            msgs.append({"role": rng.choice(["user", "assistant"]),
                         "content": "".join(rng.choices(words, k=rng.randint(1, 3)))})
        r = count_body(counter_stub, CHAT, {"model": MODEL, "messages": msgs})
        b = r.breakdown
        assert b.system + b.tools + b.messages + b.template_overhead == r.prompt_tokens
    r = count_body(counter_stub, CHAT, {"model": MODEL, "messages": [
        {"role": "system", "content": "You are helpful."}, {"role": "user", "content": "help"}]})
    assert (r.breakdown.system, r.breakdown.messages) == (4, 1)


def test_breakdown_separates_system_tools_and_messages(
        counter_stub: counter_pb2_grpc.TokenCounterStub) -> None:
    from tests.counter_cases import WEATHER_TOOL
    body = {"model": MODEL, "tools": [WEATHER_TOOL],
            "messages": [{"role": "system", "content": "Be brief."},
                         {"role": "user", "content": "Weather in Paris?"}]}
    r = count_body(counter_stub, CHAT, body)
    assert (r.breakdown.system, r.breakdown.messages) == (3, 4)
    assert r.breakdown.tools > 40
    assert r.breakdown.template_overhead == (r.prompt_tokens - r.breakdown.system
                                             - r.breakdown.tools - r.breakdown.messages)

"""Contract §2.1 for the Anthropic Messages API: the counter's prompt_tokens equals the
real vLLM server's ``/v1/messages/count_tokens`` ``input_tokens`` and the prompt of
its ``/v1/messages`` usage, for every body of ``tests/counter_messages_cases.py``; the
bodies vLLM refuses, the counter refuses too, naming the field."""

from __future__ import annotations

from typing import Any

import grpc
import httpx
import pytest
from tokengate.v1 import counter_pb2, counter_pb2_grpc

from tests.conftest import MODEL, count_body
from tests.counter_cases import LOREM
from tests.counter_messages_cases import CASES, NAMED, REFUSED

MESSAGES = counter_pb2.ENDPOINT_MESSAGES
COUNT_TOKENS = counter_pb2.ENDPOINT_MESSAGES_COUNT_TOKENS
BY_NAME = dict(CASES)


def refusal(counter_stub: counter_pb2_grpc.TokenCounterStub, endpoint: int,
            body: dict[str, Any]) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        count_body(counter_stub, endpoint, body)
    return info.value.code(), info.value.details()


@pytest.mark.parametrize("name,body", CASES, ids=[c[0] for c in CASES])
def test_count_tokens_equal_vllm_count_tokens(counter_stub: counter_pb2_grpc.TokenCounterStub,
                                              vllm_http: httpx.Client, name: str,
                                              body: dict[str, Any]) -> None:
    body = {"model": MODEL, **body}
    response = vllm_http.post("messages/count_tokens", json=body)
    assert response.status_code == 200, response.text
    reply = count_body(counter_stub, COUNT_TOKENS, body)
    assert reply.prompt_tokens == response.json()["input_tokens"]
    assert (reply.max_tokens_requested, reply.max_tokens_effective) == (0, 0)
    b = reply.breakdown
    assert b.system + b.tools + b.messages + b.template_overhead == reply.prompt_tokens


@pytest.mark.parametrize("name", NAMED)
def test_messages_usage_equals_the_count(counter_stub: counter_pb2_grpc.TokenCounterStub,
                                         vllm_http: httpx.Client, name: str) -> None:
    """/v1/messages reports the prompt as input_tokens plus the prefix-cache hits in
    cache_read_input_tokens (the server runs with --enable-prompt-tokens-details), and
    its count_tokens gives the same prompt."""
    body = {"model": MODEL, "max_tokens": 1, **BY_NAME[name]}
    response = vllm_http.post("messages", json=body)
    assert response.status_code == 200, response.text
    usage = response.json()["usage"]
    prompt = (usage["input_tokens"] + usage.get("cache_read_input_tokens", 0)
              + usage.get("cache_creation_input_tokens", 0))
    reply = count_body(counter_stub, MESSAGES, body)
    assert reply.prompt_tokens == prompt
    assert (reply.max_tokens_requested, reply.max_tokens_effective) == (1, 1)
    assert vllm_http.post("messages/count_tokens", json=body).json()["input_tokens"] == prompt


def test_input_tokens_leave_out_prefix_cache_hits(counter_stub: counter_pb2_grpc.TokenCounterStub,
                                                  vllm_http: httpx.Client) -> None:
    """The same long body twice: vLLM serves most of the second prompt from its prefix
    cache and reports only the rest as input_tokens. The counter's count (what the edge
    reserves and sends as X-Token-Count) is the whole prompt: input_tokens plus
    cache_read_input_tokens, which vLLM's count_tokens gives too."""
    body = {"model": MODEL, "max_tokens": 1, "system": "prefix cache probe. " + LOREM * 12,
            "messages": [{"role": "user", "content": "Summarize."}]}
    first = vllm_http.post("messages", json=body)
    second = vllm_http.post("messages", json=body)
    assert (first.status_code, second.status_code) == (200, 200), second.text
    usage = second.json()["usage"]
    reply = count_body(counter_stub, MESSAGES, body)
    assert usage["cache_read_input_tokens"] > 0
    assert usage["input_tokens"] + usage["cache_read_input_tokens"] == reply.prompt_tokens
    assert vllm_http.post("messages/count_tokens", json=body).json()["input_tokens"] \
        == reply.prompt_tokens


@pytest.mark.parametrize("name,body,message", REFUSED, ids=[c[0] for c in REFUSED])
def test_what_vllm_refuses_the_counter_refuses(counter_stub: counter_pb2_grpc.TokenCounterStub,
                                               vllm_http: httpx.Client, name: str,
                                               body: dict[str, Any], message: str) -> None:
    body = {"model": MODEL, **body}
    response = vllm_http.post("messages/count_tokens", json=body)
    assert 400 <= response.status_code < 500, response.text
    code, details = refusal(counter_stub, COUNT_TOKENS, body)
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert details.startswith(message), details


@pytest.mark.parametrize("extra,message", [
    ({}, "max_tokens: required integer"),
    ({"max_tokens": 0}, "max_tokens: must be positive, got 0"),
    ({"max_tokens": 1.5}, "max_tokens: expected an integer, got a number"),
    ({"max_tokens": 2048, "thinking": {"type": "enabled", "budget_tokens": 2048}},
     "thinking.budget_tokens: must be less than max_tokens (2048 >= 2048)"),
], ids=["missing", "zero", "fraction", "thinking_budget"])
def test_messages_needs_max_tokens_count_tokens_does_not(
        counter_stub: counter_pb2_grpc.TokenCounterStub, vllm_http: httpx.Client,
        extra: dict[str, Any], message: str) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], **extra}
    response = vllm_http.post("messages", json=body)
    assert 400 <= response.status_code < 500, response.text
    assert refusal(counter_stub, MESSAGES, body) == (grpc.StatusCode.INVALID_ARGUMENT, message)
    # count_tokens reads no max_tokens: the same body counts
    response = vllm_http.post("messages/count_tokens", json=body)
    assert response.status_code == 200, response.text
    assert count_body(counter_stub, COUNT_TOKENS, body).prompt_tokens == \
        response.json()["input_tokens"]

"""Contract §2.1 for the OpenAI Responses API: the counter's prompt_tokens equals the
real vLLM server's ``POST /v1/responses`` ``usage.input_tokens`` for every body of
``tests/counter_responses_cases.py`` (checked through the edge, with one vLLM call a
body: tests/edge/test_edge_responses.py ``test_parity_through_the_edge``); the bodies
vLLM refuses, the counter refuses too, naming the field."""

from __future__ import annotations

from typing import Any

import grpc
import httpx
import pytest
from tokengate.v1 import counter_pb2, counter_pb2_grpc

from tests.conftest import MODEL, count_body
from tests.counter_responses_cases import REFUSED

RESPONSES = counter_pb2.ENDPOINT_RESPONSES
MAX_OUTPUT_TOKENS = 16


@pytest.mark.parametrize("name,body,message", REFUSED, ids=[c[0] for c in REFUSED])
def test_what_vllm_refuses_the_counter_refuses(counter_stub: counter_pb2_grpc.TokenCounterStub,
                                               vllm_http: httpx.Client, name: str,
                                               body: dict[str, Any], message: str) -> None:
    body = {"model": MODEL, "max_output_tokens": MAX_OUTPUT_TOKENS, **body}
    response = vllm_http.post("responses", json=body)
    assert 400 <= response.status_code < 500, response.text
    with pytest.raises(grpc.RpcError) as info:
        count_body(counter_stub, RESPONSES, body)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith(message), info.value.details()

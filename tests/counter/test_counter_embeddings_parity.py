"""Contract §2.1 for /v1/embeddings: the counter's prompt_tokens (ENDPOINT_EMBEDDINGS)
equals a real pooling vLLM server's usage.prompt_tokens, body by body
(tests/counter_embeddings_cases.py), and what vLLM refuses the counter refuses.

The session's counter serves the embedded model as ``tiny-qwen3``; the pooling server
serves the same directory as ``tiny-qwen3-embed`` (``tests.fixtures_embeddings``). A
count depends only on the model's files and ``max_model_len``, not on its name or runner,
so each body is counted under ``tiny-qwen3``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import grpc
import httpx
import pytest
from tokengate.v1 import counter_pb2, counter_pb2_grpc

from tests.conftest import count_body
from tests.counter_embeddings_cases import CASES, REFUSED
from tests.fixtures_embeddings import EMBED_MODEL
from tests.fixtures_vllm import VllmServer


@pytest.fixture(scope="module")
def pooling_http(pooling_vllm: VllmServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=pooling_vllm.url + "/", timeout=300) as client:
        yield client


@pytest.mark.parametrize("name,body", CASES, ids=[c[0] for c in CASES])
def test_prompt_tokens_equal_vllm_usage(counter_stub: counter_pb2_grpc.TokenCounterStub,
                                        pooling_http: httpx.Client, name: str,
                                        body: dict[str, Any]) -> None:
    response = pooling_http.post("embeddings", json={"model": EMBED_MODEL, **body})
    assert response.status_code == 200, response.text
    answer = response.json()
    reply = count_body(counter_stub, counter_pb2.ENDPOINT_EMBEDDINGS, body)
    assert (reply.prompt_tokens, reply.prompt_count) == \
        (answer["usage"]["prompt_tokens"], len(answer["data"]))
    assert (reply.max_tokens_effective, reply.max_tokens_requested) == (0, 0)
    assert reply.tokenizer_backend == "tiktoken"


@pytest.mark.parametrize("name,body,param,code", REFUSED, ids=[c[0] for c in REFUSED])
def test_what_vllm_refuses_the_counter_refuses(counter_stub: counter_pb2_grpc.TokenCounterStub,
                                               pooling_http: httpx.Client, name: str,
                                               body: dict[str, Any], param: str,
                                               code: str) -> None:
    response = pooling_http.post("embeddings", json={"model": EMBED_MODEL, **body})
    assert response.status_code == 400, response.text
    with pytest.raises(grpc.RpcError) as info:
        count_body(counter_stub, counter_pb2.ENDPOINT_EMBEDDINGS, body)
    assert info.value.code() == grpc.StatusCode[code]
    assert info.value.details().startswith(f"{param}: ")

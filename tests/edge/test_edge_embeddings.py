"""POST /v1/embeddings through the edge, with the official openai client: real nginx, a
real counter and a real pooling vLLM CPU server (``--runner pooling``).

The edge of these tests serves two models: ``tiny-qwen3-embed`` (``runner: pooling``, the
session's pooling server) and ``tiny-qwen3`` (``runner: generate``), whose only replica
here is a fake that counts what reaches it (the refusals below must reach nothing). Its
counter is one of this module's own, on the same configuration (the session's counter
knows only the configuration of tests/conftest.py). Embeddings are counted before they
are forwarded (X-Token-Count equals vLLM's usage.prompt_tokens), reserve their prompt
tokens only (no completion), are billed from vLLM's usage and limited like chat; a model
serves only its runner's routes."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml
from tokengate_dev import devstack
from tokenstorm.process import free_port

from tests.conftest import MODEL, PORT_OFFSET, TEST_DIR
from tests.fixtures_edge import MAIN_KEY, Edge, FakeUpstream, key_of
from tests.fixtures_embeddings import EMBED_MODEL, add_embed_model, requests_to
from tests.fixtures_vllm import VllmServer

COUNTER_SOCKET = TEST_DIR / "embed-counter.sock"


@pytest.fixture(scope="module")
def generate_replica() -> Iterator[FakeUpstream]:
    """The generating model's replica in this module's edge: counts the POSTs that reach
    it (and answers none)."""
    fake = FakeUpstream("close")
    try:
        yield fake
    finally:
        fake.close()


def edit_for(pooling: VllmServer, generate: FakeUpstream) -> Callable[[dict[str, Any]], None]:
    """The configuration edit of this module's counter and edge: ``EMBED_MODEL`` on the
    pooling server, the generating model on the fake."""
    def edit(raw: dict[str, Any]) -> None:
        add_embed_model(raw, pooling.address)
        raw["models"][MODEL].update(upstreams=[f"127.0.0.1:{generate.port}"], embedded=False)
    return edit


@pytest.fixture(scope="module")
def embed_counter(config_path: Path, pooling_vllm: VllmServer,
                  generate_replica: FakeUpstream) -> Iterator[Path]:
    """A counter (two workers) on the configuration with ``EMBED_MODEL``; yields the
    edge's counter_socket (workers on ``<path>.0``, ``.1``)."""
    raw = yaml.safe_load(config_path.read_text())
    edit_for(pooling_vllm, generate_replica)(raw)
    path = TEST_DIR / "embed-counter.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    svc = devstack.counter_service(path, port=free_port(), unix_socket=COUNTER_SOCKET,
                                   workers=2,
                                   name=f"test-counter-embed{PORT_OFFSET or ''}").start()
    try:
        yield COUNTER_SOCKET
    finally:
        svc.stop()


@pytest.fixture
def embed_edge(edge_variant_off_vllm: Callable[..., Edge], embed_counter: Path,
               pooling_vllm: VllmServer, generate_replica: FakeUpstream) -> Edge:
    """An edge with both models (module docstring), fresh for each test."""
    return edge_variant_off_vllm("embeddings", edit_for(pooling_vllm, generate_replica),
                                 counter_socket=embed_counter)


def client(edge: Edge, key: str = MAIN_KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=edge.base_url, api_key=key, max_retries=0, timeout=120)


def post(edge: Edge, body: dict[str, Any], path: str = "embeddings",
         key: str = MAIN_KEY) -> httpx.Response:
    return httpx.post(f"{edge.base_url}/{path}", json=body, timeout=120,
                      headers={"Authorization": f"Bearer {key}"})


def assert_error(r: httpx.Response, status: int, code: str, param: str | None,
                 message: str) -> None:
    assert r.status_code == status, r.text
    assert r.json() == {"error": {"message": message, "type": "invalid_request_error",
                                  "param": param, "code": code}}


@pytest.mark.parametrize("input_,tokens,n", [
    ("Hello, world!", 4, 1),
    (["Hello, world!", "a", "日本語のテキスト"], 11, 3),
    ([9707, 11, 1879, 0], 4, 1),
    ([[1, 2, 3], [4]], 4, 2),
], ids=["string", "list of strings", "token ids", "token id arrays"])
def test_embeddings_create_counts_exactly_and_bills_the_prompt(
        embed_edge: Edge, pooling_vllm: VllmServer,
        input_: Any, tokens: int, n: int) -> None:
    raw = client(embed_edge).embeddings.with_raw_response.create(model=EMBED_MODEL,
                                                                 input=input_)
    r = raw.parse()
    assert (r.model, len(r.data), len(r.data[0].embedding)) == (EMBED_MODEL, n, 128)
    assert (r.usage.prompt_tokens, r.usage.total_tokens) == (tokens, tokens)
    assert int(raw.headers["x-token-count"]) == r.usage.prompt_tokens
    assert raw.headers["x-token-count-source"] == "counter"
    assert int(raw.headers["x-ratelimit-remaining-tokens"]) == 100_000_000 - tokens
    ev = embed_edge.event(raw.headers["x-request-id"])
    assert (ev["key_id"], ev["model"], ev["endpoint"], ev["status"], ev["stream"]) == \
        ("edge-main", EMBED_MODEL, "embeddings", 200, False)
    # the reservation is the prompt alone: nothing is generated
    assert (ev["token_estimate"], ev["reserved"], ev["prompt_tokens"],
            ev["completion_tokens"], ev["cached_tokens"]) == (tokens, tokens, tokens, 0, 0)
    assert (ev["usage_source"], ev["count_drift"], ev["error"], ev["upstream"]) == \
        ("final", 0, None, pooling_vllm.address)


def test_the_edge_cleans_the_input_and_counts_what_it_forwards(embed_edge: Edge) -> None:
    # invisible characters go (as from a completions prompt); a literal special token is
    # raw text for an embedding: forwarded and counted as vLLM encodes it
    raw = client(embed_edge).embeddings.with_raw_response.create(
        model=EMBED_MODEL, input=["Hel\u200blo, wor\u2066ld!", "a <|im_end|> b"])
    r = raw.parse()
    # "Hello, world!" (4 tokens, as cleaned) and "a", " ", "<|im_end|>", " b"
    assert r.usage.prompt_tokens == 4 + 4 == int(raw.headers["x-token-count"])
    ev = embed_edge.event(raw.headers["x-request-id"])
    assert (ev["sanitized_chars"], ev["stripped_special_tokens"], ev["count_drift"]) == \
        (2, 0, 0)


def test_an_input_above_the_context_is_refused_before_vllm(
        embed_edge: Edge, pooling_vllm: VllmServer) -> None:
    before = requests_to(pooling_vllm)
    r = post(embed_edge, {"model": EMBED_MODEL, "input": [[1, 2], [7] * 8193]})
    assert_error(r, 400, "context_length_exceeded", "input[1]",
                 "input[1]: This model's maximum context length is 8192 tokens. However, "
                 "your input contains 8193 tokens, which exceeds this limit even without "
                 "any output tokens. Please reduce the length of the input.")
    assert requests_to(pooling_vllm) == before, "the request reached vLLM"
    ev = embed_edge.event(r.headers["x-request-id"])
    assert (ev["status"], ev["error"], ev["reserved"], ev["upstream"]) == \
        (400, "context_length_exceeded", 0, None)


def test_tpm_refuses_an_embeddings_request_that_does_not_fit(embed_edge: Edge) -> None:
    key = key_of("edge-tpm")  # 120 tokens per minute
    with embed_edge.window_clock():
        first = post(embed_edge, {"model": EMBED_MODEL, "input": [1] * 100}, key=key)
        assert first.status_code == 200, first.text
        assert (first.json()["usage"]["prompt_tokens"], first.headers["x-token-count"]) == \
            (100, "100")
        assert first.headers["x-ratelimit-remaining-tokens"] == "20"
        # 21 tokens no longer fit: no output is reserved for an embedding, so 20 still do
        r = post(embed_edge, {"model": EMBED_MODEL, "input": [[1] * 11, [2] * 10]}, key=key)
        assert r.status_code == 429, r.text
        err = r.json()["error"]
        assert (err["type"], err["code"], err["param"]) == \
            ("tokens", "rate_limit_exceeded", None)
        assert "limit 120, remaining 20, requested 21 (21 prompt + 0 reserved for the " \
            "completion)" in err["message"]
        assert int(r.headers["retry-after"]) >= 1
        ev = embed_edge.event(r.headers["x-request-id"])
        assert (ev["status"], ev["error"], ev["endpoint"], ev["reserved"]) == \
            (429, "rate_limit_exceeded", "embeddings", 0)
        last = post(embed_edge, {"model": EMBED_MODEL, "input": [[1] * 10, [2] * 10]},
                    key=key)
        assert last.status_code == 200, last.text
        assert last.headers["x-ratelimit-remaining-tokens"] == "0"
    # the openai client is told the same (and retries nothing: max_retries=0)
    with embed_edge.window_clock():
        client(embed_edge, key).embeddings.create(model=EMBED_MODEL, input=[1] * 120)
        with pytest.raises(openai.RateLimitError) as info:
            client(embed_edge, key).embeddings.create(model=EMBED_MODEL, input="Hi")
    assert info.value.status_code == 429


def test_a_generating_model_is_refused_on_embeddings(
        embed_edge: Edge, generate_replica: FakeUpstream) -> None:
    before = generate_replica.requests
    r = post(embed_edge, {"model": MODEL, "input": "Hello"})
    assert_error(r, 400, "model_not_supported", "model",
                 "The model `tiny-qwen3` generates text (runner: generate) and does not "
                 "serve /v1/embeddings: use an embedding model (runner: pooling).")
    assert generate_replica.requests == before, "the request reached the replica"
    ev = embed_edge.event(r.headers["x-request-id"])
    assert (ev["model"], ev["endpoint"], ev["status"], ev["error"], ev["reserved"],
            ev["prompt_tokens"], ev["count_source"]) == \
        (MODEL, "embeddings", 400, "model_not_supported", 0, 0, "none")
    with pytest.raises(openai.BadRequestError) as info:
        client(embed_edge).embeddings.create(model=MODEL, input="Hello")
    assert info.value.code == "model_not_supported"


CHAT = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4}


@pytest.mark.parametrize("path,body", [
    ("chat/completions", CHAT),
    ("completions", {"prompt": "Hello", "max_tokens": 4}),
    ("responses", {"input": "Hello", "max_output_tokens": 4}),
    ("responses/input_tokens", {"input": "Hello"}),
], ids=["chat", "completions", "responses", "input_tokens"])
def test_the_embedding_model_is_refused_on_generating_routes(
        embed_edge: Edge, pooling_vllm: VllmServer,
        path: str, body: dict[str, Any]) -> None:
    before = requests_to(pooling_vllm)
    r = post(embed_edge, {"model": EMBED_MODEL, **body}, path)
    assert_error(r, 400, "model_not_supported", "model",
                 f"The model `tiny-qwen3-embed` is an embedding model (runner: pooling): it "
                 f"serves POST /v1/embeddings only, not /v1/{path}.")
    assert requests_to(pooling_vllm) == before, "the request reached vLLM"
    ev = embed_edge.event(r.headers["x-request-id"])
    assert (ev["model"], ev["status"], ev["error"], ev["reserved"]) == \
        (EMBED_MODEL, 400, "model_not_supported", 0)


def test_the_embedding_model_is_refused_on_messages_in_anthropics_shape(
        embed_edge: Edge, pooling_vllm: VllmServer) -> None:
    before = requests_to(pooling_vllm)
    r = post(embed_edge, {"model": EMBED_MODEL, **CHAT}, "messages")
    assert r.status_code == 400, r.text
    assert r.json() == {"type": "error", "error": {
        "type": "invalid_request_error",
        "message": "The model `tiny-qwen3-embed` is an embedding model (runner: pooling): "
                   "it serves POST /v1/embeddings only, not /v1/messages."}}
    assert requests_to(pooling_vllm) == before, "the request reached vLLM"


@pytest.mark.parametrize("body,code,param,message", [
    ({"model": EMBED_MODEL, "input": ""}, "invalid_value", "input",
     "input: must not be an empty string"),
    ({"model": EMBED_MODEL, "input": ["a", [1]]}, "invalid_type", "input[1]",
     ("input[1]: must be a string, as input[0] is (input is a string, an array of "
      "strings, an array of token ids or an array of token-id arrays; one kind of element "
      "per array)")),
    ({"model": EMBED_MODEL, "input": "x", "encoding_format": "bytes"}, "invalid_value",
     "encoding_format", "encoding_format: must be 'float' or 'base64'"),
    ({"model": EMBED_MODEL, "messages": [{"role": "user", "content": "x"}]},
     "unsupported_parameter", "messages",
     ("messages: chat-style embedding requests are not supported by this gateway; send "
      "input as a string, an array of strings, an array of token ids or an array of "
      "token-id arrays")),
    ({"model": EMBED_MODEL, "input": [1, 999999]}, "invalid_value", "input[1]",
     "input[1]: token id 999999 is out of vocabulary (0..151668)"),
    ({"model": EMBED_MODEL, "input": "x", "truncate_prompt_tokens": 9000}, "invalid_value",
     "truncate_prompt_tokens",
     "truncate_prompt_tokens: 9000 is greater than max_model_len 8192"),
], ids=["empty string", "mixed list", "bytes format", "chat input", "out of vocabulary",
        "truncation above the context"])
def test_bad_bodies_are_a_clear_400_never_forwarded(
        embed_edge: Edge, pooling_vllm: VllmServer,
        body: dict[str, Any], code: str, param: str, message: str) -> None:
    before = requests_to(pooling_vllm)
    r = post(embed_edge, body)
    assert_error(r, 400, code, param, message)
    assert requests_to(pooling_vllm) == before, "the request reached vLLM"


def test_metrics_count_embeddings_by_endpoint(embed_edge: Edge) -> None:
    raw = client(embed_edge).embeddings.with_raw_response.create(model=EMBED_MODEL,
                                                                  input="Hi")
    embed_edge.event(raw.headers["x-request-id"])  # the log phase (metrics, event) ran
    text = httpx.get(f"http://127.0.0.1:{embed_edge.status_port}/metrics", timeout=10).text
    lines = [x for x in text.splitlines() if x.startswith("tokengate_requests_total{")
             and 'endpoint="embeddings"' in x and 'status="2xx"' in x]
    assert len(lines) == 1 and lines[0].endswith(" 1"), lines


def test_the_client_sdk_paces_embeddings_on_the_prompt_alone(embed_edge: Edge) -> None:
    """tokengate_client's embeddings.create (here, beside the pooling edge it needs):
    its offline count is the edge's X-Token-Count and its reservation the prompt alone;
    the usage it bills is vLLM's prompt_tokens."""
    from tokengate_client import Client

    config = embed_edge.usage_file.parent / "tokengate.yaml"
    c = Client(base_url=embed_edge.base_url, api_key=MAIN_KEY, config=config)
    try:
        answer = c.embeddings.create(model=EMBED_MODEL, input=["Hello, world!", "a"])
    finally:
        c.close()
    est = answer.billing.estimate
    assert est is not None and answer.usage is not None
    assert (est.prompt_tokens, est.completion_budget, est.reservation) == (5, 0, 5)
    assert (answer.token_count, answer.usage.prompt_tokens) == (5, 5)
    assert len(answer.response.data) == 2

"""Requests that cost the backend far more than their tokens are bounded at the edge.

vLLM compiles a structured-output constraint into a token mask before it generates: a
``response_format`` schema of 2,000 optional properties took vLLM (CPU) 92 s and was billed
13 tokens (about n² in the properties: 200 took 0.9 s, 400 took 3 s here). The edge refuses
constraints above ``edge.structured_output`` (bytes, depth, named properties) and
top-level fields that vLLM does not define above ``edge.max_unknown_fields_bytes``, with
400 naming the field; nothing reaches vLLM.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest

from tests.conftest import MODEL, VLLM_IN_PROCESS
from tests.edge.test_edge_input import assert_error, chat, post
from tests.fixtures_edge import Edge, run_lua

pytestmark = VLLM_IN_PROCESS  # a test imports vLLM's classes (tests/conftest.py)


def schema(properties: int, depth: int = 0, described: bool = True) -> dict[str, Any]:
    """A JSON schema of ``properties`` optional string properties (each with a description
    when ``described``), wrapped in ``depth`` more object levels."""
    def prop(i: int) -> dict[str, Any]:
        return {"type": "string", **({"description": f"value {i}"} if described else {})}
    node: dict[str, Any] = {"type": "object", "properties": {
        f"field_{i}": prop(i) for i in range(properties)}}
    for _ in range(depth):
        node = {"type": "object", "properties": {"inner": node}}
    return node


def json_schema_format(s: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": s}}


def test_the_edge_knows_vllms_request_fields() -> None:
    from vllm.entrypoints.anthropic.protocol import (
        AnthropicCountTokensRequest,
        AnthropicMessagesRequest,
    )
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    from vllm.entrypoints.openai.responses.protocol import ResponsesRequest
    from vllm.entrypoints.pooling.embed.protocol import EmbeddingCompletionRequest

    def names(model: Any) -> list[str]:
        out = set(model.model_fields)
        out |= {f.alias for f in model.model_fields.values() if f.alias}
        return sorted(out)
    known = json.loads(run_lua("""
        local cjson = require "cjson"
        local out = {}
        for _, mod in ipairs(require("tokengate.apis").MODULES) do
            for route, set in pairs(mod.FIELDS) do
                local list = {}
                for k in pairs(set) do list[#list + 1] = k end
                table.sort(list)
                out[route] = list
            end
        end
        return cjson.encode(out)"""))
    assert known == {"chat": names(ChatCompletionRequest),
                     "completions": names(CompletionRequest),
                     "messages": names(AnthropicMessagesRequest),
                     "count_tokens": names(AnthropicCountTokensRequest),
                     # input_tokens takes a Responses body (OpenAI's input token count)
                     "responses": names(ResponsesRequest),
                     "input_tokens": names(ResponsesRequest),
                     # OpenAI's input shapes only: the edge refuses the chat-style
                     # requests (EmbeddingChatRequest and its kin)
                     "embeddings": names(EmbeddingCompletionRequest)}


def test_the_issues_2000_property_schema_is_refused(edge: Edge,
                                                    vllm_requests: Callable[[], int]) -> None:
    # about the issue's size: 2,000 properties in 60 KB, under the byte bound
    body = chat("Fill the form.",
                response_format=json_schema_format(schema(2000, described=False)))
    assert 55_000 < len(json.dumps(body["response_format"], separators=(",", ":"))) < 65_536
    before = vllm_requests()
    r = post(edge, json.dumps(body))
    assert_error(r, 400, "structured_output_too_complex", "response_format",
                 "'response_format' names 2000 properties; the limit is 256 (vLLM's grammar "
                 "grows with each one, whatever the prompt costs)")
    assert vllm_requests() == before, "the request reached vLLM"
    ev = edge.event(r.headers["x-request-id"])
    assert (ev["status"], ev["error"], ev["upstream"]) == \
        (400, "structured_output_too_complex", None)


BOUNDS: list[tuple[str, dict[str, Any], str, str]] = [
    ("too many properties", {"response_format": json_schema_format(schema(300))},
     "response_format", "'response_format' names 300 properties; the limit is 256"),
    ("properties spread over levels",
     {"response_format": json_schema_format(
         {"type": "object", "properties": {f"g{j}": schema(30) for j in range(9)}})},
     "response_format", "names 279 properties; the limit is 256"),
    ("too deep", {"response_format": json_schema_format(schema(1, depth=11))},
     "response_format", "'response_format' is nested 27 levels deep; the limit is 24 levels"),
    ("too many bytes", {"response_format": json_schema_format(
        {"type": "string", "description": "x" * 70_000})},
     "response_format", "the limit is 65536 bytes"),
    ("structured_outputs.json given as text",
     {"structured_outputs": {"json": json.dumps(schema(300))}},
     "structured_outputs", "'structured_outputs' names 300 properties"),
    ("structured_outputs.json that is not JSON", {"structured_outputs": {"json": "{'a': 1}"}},
     "structured_outputs.json", "'structured_outputs.json' must hold a JSON value"),
    ("a long structured_outputs regex", {"structured_outputs": {"regex": "(a|b)" * 20_000}},
     "structured_outputs", "'structured_outputs' is 100012 bytes of JSON"),
    ("legacy guided_json", {"guided_json": schema(300)}, "guided_json",
     "'guided_json' names 300 properties"),
    ("legacy guided_choice", {"guided_choice": [f"choice {i}" for i in range(8000)]},
     "guided_choice", "'guided_choice' is "),
]


@pytest.mark.parametrize("name,extra,param,message", BOUNDS, ids=[b[0] for b in BOUNDS])
def test_structured_output_above_a_bound_is_refused(edge: Edge,
                                                    vllm_requests: Callable[[], int],
                                                    name: str, extra: dict[str, Any],
                                                    param: str, message: str) -> None:
    before = vllm_requests()
    r = post(edge, json.dumps(chat("hi", **extra)))
    code = "invalid_json" if name.endswith("not JSON") else "structured_output_too_complex"
    assert_error(r, 400, code, param, message)
    assert vllm_requests() == before


def test_a_reasonable_schema_passes(edge: Edge) -> None:
    s = {**schema(20, depth=3), "required": ["inner"]}
    for extra in ({"response_format": json_schema_format(s)},
                  {"structured_outputs": {"json": json.dumps(s)}},
                  {"structured_outputs": {"choice": ["yes", "no"]}}):
        r = post(edge, json.dumps(chat("Fill the form.", max_tokens=2, **extra)))
        assert r.status_code == 200, (extra, r.text)
        assert r.json()["usage"]["completion_tokens"] >= 1
    r = post(edge, json.dumps({"model": MODEL, "prompt": "Answer:", "max_tokens": 2,
                               "response_format": json_schema_format(s)}), path="/completions")
    assert r.status_code == 200, r.text


def test_unknown_fields_are_bounded_in_bytes(edge: Edge,
                                             vllm_requests: Callable[[], int]) -> None:
    before = vllm_requests()
    body = chat("hi", metadata={"trace": "t" * 100}, x_padding="p" * 3_000_000,
                x_small="s" * 40_000)
    r = post(edge, json.dumps(body))
    assert_error(r, 400, "unknown_fields_too_large", "x_padding",
                 "The largest is 'x_padding' (3000014 bytes): remove it")
    assert "fields that vLLM does not read; the limit is 65536 bytes" in \
        r.json()["error"]["message"]
    # many small ones add up; a chat field is unknown to the completions endpoint
    r = post(edge, json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 1,
                               "messages": ["m" * 40_000], "x_small": "s" * 40_000}),
             path="/completions")
    assert_error(r, 400, "unknown_fields_too_large", "messages")
    assert vllm_requests() == before
    # OpenAI SDK fields that vLLM ignores, of ordinary size, pass
    r = post(edge, json.dumps(chat("hi", metadata={"trace": "t" * 100}, store=False,
                                   service_tier="auto")))
    assert r.status_code == 200, r.text


def test_the_bounds_are_configurable(edge_variant: Callable[..., Edge]) -> None:
    def edit(raw: dict[str, Any]) -> None:
        raw["edge"].update(structured_output={"max_properties": 10},
                           max_unknown_fields_bytes=0)
    e = edge_variant("costly-config", edit)
    r = post(e, json.dumps(chat("hi", response_format=json_schema_format(schema(11)))))
    assert_error(r, 400, "structured_output_too_complex", "response_format",
                 "names 11 properties; the limit is 10")
    r = post(e, json.dumps(chat("hi", store=False)))
    assert_error(r, 400, "unknown_fields_too_large", "store", "the limit is 0 bytes")
    r = post(e, json.dumps(chat("hi", response_format=json_schema_format(schema(10)))))
    assert r.status_code == 200, r.text

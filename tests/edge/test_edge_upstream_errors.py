"""The backend's own refusals through the edge: a request the edge forwards and vLLM
refuses comes back in OpenAI's error shape, not vLLM's ("type": "Bad Request" /
"BadRequestError", "code": 400). The status stays (vLLM's 422 becomes 400), the
message is vLLM's, param loses FastAPI's "body." prefix, and the usage event's error is
the OpenAI type. A stream refused before its first chunk (vLLM answers plain JSON) is
rewritten the same way; a 4xx body that is no JSON error object passes unchanged.

The fast upstream answers vLLM's error bodies byte for byte (tests/storm/test_upstream_contract.py
checks that against a live vLLM); one test goes through the real vLLM.
"""

from __future__ import annotations

import json
from typing import Any

import httpx

from tests.conftest import MODEL
from tests.fixtures_edge import MAIN_KEY, Edge, run_lua

HEADERS = {"Authorization": f"Bearer {MAIN_KEY}", "Content-Type": "application/json"}
# refusals of bodies the edge passes (it refuses wrong types and ranges itself)
STREAM_OPTIONS = {"message": "Stream options can only be defined when `stream=True`. "
                             "(parameter=stream_options)",
                  "type": "invalid_request_error", "param": "stream_options", "code": None}
GREEDY = {"message": "n must be 1 when using greedy sampling, got 2.",
          "type": "invalid_request_error", "param": None, "code": None}


def chat(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
            **extra}


def post(e: Edge, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(e.base_url + "/chat/completions", content=json.dumps(body),
                      headers=HEADERS, timeout=60)


def assert_refused(e: Edge, r: httpx.Response, error: dict[str, Any]) -> None:
    """r is a 400 whose body is exactly {"error": error}, its length right (httpx reads
    by Content-Length or chunks), and its usage event's error is error's code or type."""
    assert r.status_code == 400, r.text
    assert r.headers["content-type"] == "application/json"
    assert r.json() == {"error": error}
    assert e.event(r.headers["x-request-id"])["error"] == (error["code"] or error["type"])


def test_validation_error_is_openai_shaped(fast_edge: Edge) -> None:
    body = chat(stream_options={"include_usage": True})
    assert_refused(fast_edge, post(fast_edge, body), STREAM_OPTIONS)


def test_stream_refused_before_its_first_chunk_is_openai_shaped(fast_edge: Edge) -> None:
    body = chat(n=2, temperature=0, stream=True, stream_options={"include_usage": True})
    assert_refused(fast_edge, post(fast_edge, body), GREEDY)


def test_bad_request_error_is_openai_shaped(fast_edge: Edge) -> None:
    assert_refused(fast_edge, post(fast_edge, chat(n=2, temperature=0)), GREEDY)


def test_the_rule_on_backend_bodies() -> None:
    """errors.upstream on bodies the real edge cannot get from the fast upstream: a 422,
    a string code, the whole body as param, a long message, a 5xx, and bodies that are no JSON
    error object (nil: they pass unchanged)."""
    out = run_lua(r"""
        local errors = require "tokengate.errors"
        local cjson = require "cjson"
        local function shaped(status, text)
            local err = errors.upstream(status, text)
            if not err then
                return "unchanged"
            end
            return {err.status, cjson.decode(errors.body(err.message, err.type, err.param,
                err.code)).error}
        end
        return cjson.encode({
            shaped(422, '{"error":{"message":"bad image","type":"UnprocessableEntityError",'
                .. '"param":"image_url","code":422}}'),
            shaped(404, '{"error":{"message":"no such adapter","type":"NotFoundError",'
                .. '"param":null,"code":"model_not_found"}}'),
            shaped(400, '{"error":{"message":"x","type":"Bad Request","param":"body",'
                .. '"code":400}}'),
            #shaped(400, '{"error":{"message":"' .. string.rep("m", 5000) .. '",'
                .. '"type":"BadRequestError","code":400}}')[2].message,
            shaped(500, '{"error":{"message":"engine dead","type":"InternalServerError",'
                .. '"param":null,"code":500}}'),
            shaped(401, '{"error":"Unauthorized"}'),
            shaped(405, '{"detail":"Method Not Allowed"}'),
            shaped(400, 'Bad Request'),
        })""")
    inv = "invalid_request_error"
    assert json.loads(out) == [
        [400, {"message": "bad image", "type": inv, "param": "image_url", "code": None}],
        [404, {"message": "no such adapter", "type": inv, "param": None,
               "code": "model_not_found"}],
        [400, {"message": "x", "type": inv, "param": None, "code": None}],
        1024 + len("…".encode()),
        [500, {"message": "engine dead", "type": "server_error", "param": None, "code": None}],
        "unchanged", "unchanged", "unchanged",
    ]


def test_real_vllm_refusal_is_openai_shaped(edge: Edge) -> None:
    assert_refused(edge, post(edge, chat(stream_options={"include_usage": True})),
                   STREAM_OPTIONS)

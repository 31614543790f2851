"""The admission pipeline's edges: the path forwarded is the one the edge matched, the
body forwarded is the client's bytes when the edge changed nothing and one encoding of
the parsed body when it did, the vLLM priority the edge's, the model routes answer like OpenAI's, nginx's own error pages have the OpenAI shape, the
usage event has the ledger's schema (with the sanitizer's counts), and a failed counter
is skipped for its backoff period instead of costing every request its timeout.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from tokengate.ledger.event import UsageEvent, parse_event

from tests.conftest import MODEL, read_until_closed
from tests.fixtures_edge import MAIN_KEY, Edge, QuietUpstreamHandler, key_of

AUTH = f"Authorization: Bearer {MAIN_KEY}\r\n"


def raw_http(edge: Edge, request: bytes, timeout: float = 30) -> tuple[int, dict[str, str], bytes]:
    """Sends request bytes as they are (no client normalizes the path) and reads the
    answer: status, headers (lower-case names), body."""
    with socket.create_connection(("127.0.0.1", edge.port), timeout=timeout) as s:
        s.sendall(request)
        data = read_until_closed(s)
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ")[1])
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return status, headers, body


def post_raw(edge: Edge, path: str, body: dict[str, Any]) -> tuple[int, dict[str, str], bytes]:
    data = json.dumps(body).encode()
    return raw_http(edge, (f"POST {path} HTTP/1.1\r\nHost: x\r\n{AUTH}"
                           f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n"
                           "Connection: close\r\n\r\n").encode() + data)


def test_dot_segments_and_double_slashes_reach_vllm_as_the_matched_path(edge: Edge) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for path in ("/v1/./chat/completions", "//v1/chat/completions",
                 "/v1/x/../chat/completions"):
        status, headers, data = post_raw(edge, path, body)
        assert status == 200, (path, data)
        answer = json.loads(data)
        assert answer["object"] == "chat.completion"
        assert answer["usage"]["prompt_tokens"] == int(headers["x-token-count"])


class _Recorder(QuietUpstreamHandler):
    """An upstream that keeps the bytes of every body it is sent (server.bodies) and
    answers one chat completion, usage = the edge's count (X-Token-Count) + 1."""

    def do_POST(self) -> None:
        self.server.bodies.append(  # type: ignore[attr-defined]
            self.rfile.read(int(self.headers["Content-Length"])))
        p = int(self.headers.get("X-Token-Count", "0"))
        data = json.dumps({
            "id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": MODEL,
            "choices": [{"index": 0, "finish_reason": "stop",
                         "message": {"role": "assistant", "content": "ok"}}],
            "usage": {"prompt_tokens": p, "completion_tokens": 1,
                      "total_tokens": p + 1}}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@contextlib.contextmanager
def recording(edge_variant_off_vllm: Callable[..., Edge], name: str,
              more: Callable[[dict[str, Any]], None] | None = None
              ) -> Iterator[tuple[Edge, list[bytes]]]:
    """An edge whose model's one replica is a _Recorder, its YAML edited by ``more``
    too; the bodies the replica was sent."""
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    srv.bodies = []  # type: ignore[attr-defined]
    threading.Thread(target=srv.serve_forever, daemon=True).start()

    def edit(raw: dict[str, Any]) -> None:
        raw["models"][MODEL]["upstreams"] = [f"127.0.0.1:{srv.server_address[1]}"]
        raw["models"][MODEL]["embedded"] = False
        if more is not None:
            more(raw)
    try:
        yield edge_variant_off_vllm(name, edit), srv.bodies  # type: ignore[attr-defined]
    finally:
        srv.shutdown()
        srv.server_close()


@pytest.fixture
def recorded(edge_variant_off_vllm: Callable[..., Edge]) -> Iterator[tuple[Edge, list[bytes]]]:
    """An edge whose model's one replica is a _Recorder; the bodies it was sent."""
    with recording(edge_variant_off_vllm, "recorded") as got:
        yield got


def _send(edge: Edge, data: bytes, key_id: str = "edge-main") -> httpx.Response:
    r = httpx.post(edge.base_url + "/chat/completions", content=data, timeout=60,
                   headers={"Authorization": f"Bearer {key_of(key_id)}",
                            "Content-Type": "application/json"})
    assert r.status_code == 200, r.text
    return r


def test_a_body_the_edge_does_not_change_is_forwarded_as_the_client_sent_it(
        recorded: tuple[Edge, list[bytes]]) -> None:
    edge, bodies = recorded
    # spaces, a line break, escapes the edge's encoder would write otherwise; a
    # max_tokens under the cap that fits: nothing for the edge to change
    data = (b'{ "model" : "' + MODEL.encode() + b'",\n "messages": [{"role": "user", '
            b'"content": "h\\u00e9llo \\/ \\"x\\""}],  "max_tokens": 8 }')
    _send(edge, data)
    assert bodies == [data]


def test_a_body_the_edge_changes_is_forwarded_as_one_encoding_of_the_parsed_body(
        recorded: tuple[Edge, list[bytes]]) -> None:
    edge, bodies = recorded
    # a zero-width space the sanitizer removes, no max_tokens (the cap is written in),
    # a stream (the edge asks for the usage of every chunk)
    sent = {"model": MODEL, "messages": [{"role": "user", "content": "hi\u200b there"}]}
    r = _send(edge, json.dumps(sent, indent=2).encode())
    assert len(bodies) == 1
    got = json.loads(bodies[0])
    assert got["messages"] == [{"role": "user", "content": "hi there"}]
    assert got["max_tokens"] == edge.event(r.headers["x-request-id"])["max_tokens_applied"]
    # compact, in the client's key order with the edge's field last, UTF-8 as is
    assert bodies[0] == json.dumps(got, separators=(",", ":"), ensure_ascii=False).encode()
    assert list(got) == ["model", "messages", "max_tokens"]
    bodies.clear()
    streamed = {**sent, "stream": True, "max_tokens": 8}
    with httpx.stream("POST", edge.base_url + "/chat/completions", json=streamed, timeout=60,
                      headers={"Authorization": f"Bearer {key_of('edge-main')}"}) as s:
        assert s.status_code == 200
        s.read()
    got = json.loads(bodies[0])
    assert (got["stream_options"], got["messages"][0]["content"]) == (
        {"include_usage": True, "continuous_usage_stats": True}, "hi there")


def test_the_vllm_priority_forwarded_is_the_edges_never_the_clients(
        edge_variant_off_vllm: Callable[..., Edge]) -> None:
    """A client's priority -100 would go ahead of everything on a replica that runs
    vLLM's --scheduling-policy priority: the edge drops it, and on a model configured
    so (scheduling_policy) writes the vllm_priority of the key's admission priority
    instead (low: 1; normal: 0, vLLM's default, so none)."""
    sent = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 8, "priority": -100}

    def levels(raw: dict[str, Any]) -> None:
        raw["keys"]["edge-other"]["priority"] = "low"
        raw["edge"]["admission"] = {"priorities": {"low": {"vllm_priority": 1},
                                                   "normal": {}}}

    def policy(raw: dict[str, Any]) -> None:
        levels(raw)
        raw["models"][MODEL]["scheduling_policy"] = "priority"

    for name, edit, want in (("fcfs", levels, [None, None]),
                             ("priority", policy, [None, 1])):
        with recording(edge_variant_off_vllm, f"recorded-{name}", edit) as (edge, bodies):
            for key_id in ("edge-main", "edge-other"):
                _send(edge, json.dumps(sent).encode(), key_id)
            assert [json.loads(b).get("priority") for b in bodies] == want, name
            assert all(json.loads(b)["max_tokens"] == 8 for b in bodies)


def test_models_retrieve_answers_like_openai(edge: Edge) -> None:
    client = openai.OpenAI(base_url=edge.base_url, api_key=MAIN_KEY)
    m = client.models.retrieve(MODEL)
    assert (m.id, m.object, m.owned_by) == (MODEL, "model", "tokengate")
    assert [x.id for x in client.models.list()] == [MODEL]
    try:
        client.models.retrieve("no-such-model")
        raise AssertionError("an unknown model was found")
    except openai.NotFoundError as e:
        assert e.status_code == 404
        assert e.body["code"] == "model_not_found"
        assert e.body["message"] == ("The model `no-such-model` does not exist or you do not "
                                     "have access to it.")


def _openai_error(status: int, headers: dict[str, str], body: bytes) -> dict[str, Any]:
    assert headers["content-type"] == "application/json", (status, body)
    err: dict[str, Any] = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


def test_errors_nginx_makes_itself_have_the_openai_shape(edge: Edge) -> None:
    cases = [
        (b"GARBAGE\r\n\r\n", 400, "invalid_request"),
        (b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 20000 + b"\r\n\r\n",
         400, "request_too_large"),
        (b"GET /v1/" + b"a" * 20000 + b" HTTP/1.1\r\nHost: x\r\n\r\n", 414,
         "request_too_large"),
        (b"GET /elsewhere HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", 404,
         "unknown_url"),
        (b"TRACE /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", 405,
         "method_not_allowed"),
        (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n" + AUTH.encode()
         + b"Content-Type: application/json\r\nContent-Length: 70000000\r\n"
         b"Connection: close\r\n\r\n", 413, "request_too_large"),
    ]
    for request, status, code in cases:
        got, headers, body = raw_http(edge, request)
        assert got == status, (request[:40], body[:200])
        err = _openai_error(got, headers, body)
        assert (err["type"], err["code"]) == ("invalid_request_error", code)


def test_usage_events_have_the_ledgers_schema_with_the_sanitizers_counts(edge: Edge) -> None:
    # one invisible character, one repeated system message
    body = {"model": MODEL, "max_tokens": 2, "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "he\u200bllo"},
        {"role": "system", "content": "Be brief."},
    ]}
    status, headers, _ = post_raw(edge, "/v1/chat/completions", body)
    assert status == 200
    edge.event(headers["x-request-id"])  # written after the answer: wait for it
    line = next(x for x in edge.usage_file.read_text().splitlines()
                if headers["x-request-id"] in x)
    keys = list(json.loads(line))
    assert keys == [f.name for f in dataclasses.fields(UsageEvent)]
    ev = parse_event(line)
    assert (ev.sanitized_chars, ev.stripped_special_tokens, ev.dropped_system_messages) == \
        (1, 0, 1)


def test_a_failed_counter_is_skipped_for_its_backoff(edge_variant: Callable[..., Edge],
                                                     slow_counter: Path) -> None:
    def tight(raw: dict[str, Any]) -> None:
        raw["edge"]["count_timeout_ms"] = 300
        raw["edge"]["counter_backoff_ms"] = 60000
    e = edge_variant("counter-breaker", tight, counter_socket=slow_counter)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for i in range(4):
        status, headers, data = post_raw(e, "/v1/chat/completions", {**body, "seed": i})
        assert status == 200, data
        assert headers["x-token-count-source"] == "estimate"
    assert e.status()["counter_backing_off"] is True
    # only the first request waited for the counter and said why; the others skipped it
    deadline = time.monotonic() + 5
    while "counter unavailable" not in e.log_path.read_text() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert e.log_path.read_text().count("counter unavailable (timeout") == 1


def test_a_large_body_that_times_out_does_not_switch_the_counter_off(
        edge_variant: Callable[..., Edge], slow_counter: Path) -> None:
    def tight(raw: dict[str, Any]) -> None:
        raw["edge"]["count_timeout_ms"] = 300
        raw["edge"]["counter_backoff_ms"] = 60000
    e = edge_variant("counter-heavy", tight, counter_socket=slow_counter)
    heavy = {"model": MODEL, "max_tokens": 2,
             "messages": [{"role": "user", "content": "word " * 60000}]}
    status, headers, _ = post_raw(e, "/v1/chat/completions", heavy)
    assert headers["x-token-count-source"] == "estimate"
    # one slow body says nothing about the counter: the next request still asks it
    assert e.status()["counter_backing_off"] is False
    small = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    status, headers, _ = post_raw(e, "/v1/chat/completions", small)
    assert (status, headers["x-token-count-source"]) == (200, "estimate")
    assert e.status()["counter_backing_off"] is True

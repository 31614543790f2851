"""What nginx refuses itself (duplicate headers, request smuggling shapes, a body that
never arrives): each answer has OpenAI's shape and, when the request carries a valid
key, a usage event with the error's code; without a valid key it is counted
(``unauthenticated_refused``) and writes no event, like a 401. nginx stops reading the
headers at the line it refuses: the key counts when its header came before that line.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable
from typing import Any

import pytest

from tests.conftest import MODEL
from tests.edge.test_edge_pipeline import raw_http
from tests.fixtures_edge import MAIN_KEY, Edge, free_port

AUTH = f"Authorization: Bearer {MAIN_KEY}\r\n".encode()
BODY = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                   "max_tokens": 1}).encode()
POST = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
CLOSE = b"Connection: close\r\n"
CL = b"Content-Length: %d\r\n" % len(BODY)


def dead_upstream(raw: dict[str, Any]) -> None:
    # nothing here is forwarded: a dead port proves it
    raw["models"][MODEL]["upstreams"] = [f"127.0.0.1:{free_port()}"]


@pytest.fixture
def refusing_edge(edge_variant_off_vllm: Callable[..., Edge]) -> Edge:
    def edit(raw: dict[str, Any]) -> None:
        dead_upstream(raw)
        raw["edge"]["client_body_timeout_s"] = 1
    return edge_variant_off_vllm("nginx-refusals", edit)


# name, request (with a valid key), status, code
REFUSED = [
    ("duplicate Authorization", POST + AUTH + AUTH + CL + CLOSE + b"\r\n" + BODY,
     400, "invalid_request"),
    ("Content-Length with Transfer-Encoding",
     POST + AUTH + CL + b"Transfer-Encoding: chunked\r\n" + CLOSE + b"\r\n" + BODY,
     400, "invalid_request"),
    ("two Content-Lengths", POST + AUTH + CL + CL + CLOSE + b"\r\n" + BODY,
     400, "invalid_request"),
    ("two Hosts", POST + AUTH + b"Host: y\r\n" + CL + CLOSE + b"\r\n" + BODY,
     400, "invalid_request"),
    ("Transfer-Encoding other than chunked",
     POST + AUTH + b"Transfer-Encoding: gzip, chunked\r\n" + CLOSE + b"\r\n0\r\n\r\n",
     501, "invalid_request"),
    ("Transfer-Encoding with HTTP/1.0",
     POST.replace(b"HTTP/1.1", b"HTTP/1.0") + AUTH + b"Transfer-Encoding: chunked\r\n\r\n"
     b"0\r\n\r\n", 400, "invalid_request"),
    ("space before a header's colon",
     POST + AUTH + b"Content-Length : 5\r\n" + CLOSE + b"\r\nhello", 400, "invalid_request"),
    ("broken chunked body",
     POST + AUTH + b"Transfer-Encoding: chunked\r\n" + CLOSE + b"\r\nzz\r\nabc\r\n0\r\n\r\n",
     400, "invalid_request"),
]


@pytest.mark.parametrize("name,request_bytes,status,code", REFUSED,
                         ids=[c[0] for c in REFUSED])
def test_a_refused_request_with_a_valid_key_gets_its_event_and_code(
        refusing_edge: Edge, name: str, request_bytes: bytes, status: int,
        code: str) -> None:
    got, headers, body = raw_http(refusing_edge, request_bytes)
    assert got == status, body[:200]
    assert headers["content-type"] == "application/json"
    err = json.loads(body)["error"]
    assert (err["type"], err["code"]) == ("invalid_request_error", code)
    if status == 400:
        assert err["message"] == (
            "The request is not HTTP that the gateway accepts: a bad request line or header, "
            "a header that may appear once sent twice (Host, Authorization, Content-Length), "
            "Content-Length with Transfer-Encoding, or a broken chunked body.")
    ev = refusing_edge.event(headers["x-request-id"])
    assert (ev["status"], ev["error"], ev["key_id"], ev["endpoint"], ev["usage_source"],
            ev["prompt_tokens"], ev["upstream"]) == \
        (status, code, "edge-main", "chat", "none", 0, None)


def test_a_refused_request_without_a_valid_key_is_counted_not_billed(
        refusing_edge: Edge) -> None:
    smuggled = POST + b"Authorization: Bearer tg-nope\r\n" + CL + \
        b"Transfer-Encoding: chunked\r\n" + CLOSE + b"\r\n" + BODY
    got, headers, _ = raw_http(refusing_edge, smuggled)
    assert got == 400
    refusing_edge.assert_no_event(headers["x-request-id"])
    # an HTTP version nginx does not speak: the request line is all it read
    got, headers, body = raw_http(refusing_edge, b"GET /v1/models HTTP/2.0\r\nHost: x\r\n"
                                  + AUTH + b"\r\n")
    assert got == 505
    assert json.loads(body)["error"]["code"] == "invalid_request"
    refusing_edge.assert_no_event(headers["x-request-id"])
    m = refusing_edge.status()
    assert (m["unauthenticated_refused"], m["unauthenticated_invalid_key"],
            m["auth_blocks"]) == (2, 0, 0)


def test_a_body_that_never_arrives_is_a_408_event_with_its_error(
        refusing_edge: Edge) -> None:
    with socket.create_connection(("127.0.0.1", refusing_edge.port), timeout=10) as s:
        s.sendall(POST + AUTH + b"Content-Length: 100\r\n\r\n" + BODY[:10])
        t0 = time.monotonic()
        assert s.recv(65536) == b""  # nginx closes a timed-out client without an answer
        waited = time.monotonic() - t0
    assert 0.9 < waited < 5
    deadline = time.monotonic() + 5
    while not (evs := [ev for ev in refusing_edge.events() if ev["status"] == 408]):
        assert time.monotonic() < deadline, "no 408 event"
        time.sleep(0.05)
    assert [(ev["error"], ev["key_id"], ev["endpoint"], ev["usage_source"])
            for ev in evs] == [("request_timeout", "edge-main", "chat", "none")]


@pytest.mark.parametrize("path,shape", [
    ("/v1/chat/completions", {"error": {
        "message": "The request body did not arrive within 2 s (edge.body_deadline_s)",
        "type": "invalid_request_error", "param": None, "code": "request_timeout"}}),
    ("/v1/messages", {"type": "error", "error": {
        "type": "timeout_error",
        "message": "The request body did not arrive within 2 s (edge.body_deadline_s)"}}),
], ids=["openai", "anthropic"])
def test_a_body_sent_a_byte_at_a_time_ends_at_the_body_deadline_with_a_408(
        edge_variant_off_vllm: Callable[..., Edge], path: str, shape: dict[str, Any]) -> None:
    """nginx's client_body_timeout is per read: a byte before each read times out kept a
    request open for ever, and was logged as 400 invalid_request when the client left."""
    def edit(raw: dict[str, Any]) -> None:
        dead_upstream(raw)
        raw["edge"]["client_body_timeout_s"] = 60
        raw["edge"]["body_deadline_s"] = 2
    e = edge_variant_off_vllm("slow-body", edit)
    head = (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"anthropic-version: 2023-06-01\r\n").encode() + AUTH + CL + b"\r\n"
    with socket.create_connection(("127.0.0.1", e.port), timeout=30) as s:
        s.sendall(head + BODY[:1])
        s.settimeout(0.2)
        data, sent = b"", 1
        while not data.endswith(b"}"):
            try:
                chunk = s.recv(65536)
            except TimeoutError:
                # still reading: one more byte (never the whole body), one read at a time
                assert sent < len(BODY) - 1, "the whole body was read"
                s.sendall(BODY[sent:sent + 1])
                sent += 1
                continue
            assert chunk, f"closed without an answer after {sent} bytes: {data!r}"
            data += chunk
    head_text, _, body = data.partition(b"\r\n\r\n")
    lines = head_text.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in
               (line.partition(":") for line in lines[1:])}
    assert (lines[0], headers["content-type"], headers["connection"]) == \
        ("HTTP/1.1 408 Request Time-out", "application/json", "close")
    assert json.loads(body) == shape
    ev = e.event(headers["x-request-id"])
    assert (ev["status"], ev["error"], ev["key_id"], ev["usage_source"]) == \
        (408, "request_timeout", "edge-main", "none")

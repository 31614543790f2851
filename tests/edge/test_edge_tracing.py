"""One trace per request, from the edge to vLLM (tracing): the real edge with tracing on,
the real counter and vLLM CPU server (exporting its own spans with
--otlp-traces-endpoint), a real ``tokengate-ledger`` process exporting the edge's spans,
and one real OTLP receiver (the protocol's gRPC service) for both.

After a known workload (a non-streamed request that continues a client's trace, a
stream, a refusal, an aborted stream, a request whose trace is not sampled, one with an
invalid traceparent) every traced request has exactly one edge span whose counts equal
its usage event, and vLLM's span of the same request is in the same trace, a child of
the edge's upstream span."""

from __future__ import annotations

import json
import re
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from tokengate_dev import devstack
from tokengate_dev.otlp_receiver import OtlpReceiver, Span
from tokenstorm.process import free_port

from tests.conftest import MODEL, read_until_closed
from tests.fixtures_edge import MAIN_KEY, Edge, key_of, run_lua
from tests.fixtures_ledger import svc_name, wait_until
from tests.fixtures_vllm import OTLP_PORT, VllmServer
from tests.ledger.test_ledger_engine import status
from tests.ledger.test_tracing_export import scrape

CLIENT_TRACE = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN = "b7ad6b7169203331"


def tracing_on(raw: dict[str, Any]) -> None:
    raw["tracing"] = {"enabled": True, "endpoint": f"http://127.0.0.1:{OTLP_PORT}",
                      "schedule_delay_ms": 50, "service_name": "tokengate-test"}
    raw["keys"]["edge-rpm"]["rpm"] = 1


def chat(edge: Edge, key: str = MAIN_KEY, headers: dict[str, str] | None = None,
         **body: Any) -> httpx.Response:
    return httpx.post(f"{edge.base_url}/chat/completions", timeout=120,
                      headers={"Authorization": f"Bearer {key}", **(headers or {})},
                      json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
                            "max_tokens": 8, **body})


def edge_spans(spans: list[Span], rid: str) -> list[Span]:
    return [s for s in spans if s.kind == "SERVER"
            and s.attributes.get("tokengate.request_id") == rid]


def test_traceparent_parsing() -> None:
    """W3C Trace Context's rules (lua/tokengate/trace.lua, parse)."""
    ok = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"
    cases = {ok: f"{CLIENT_TRACE} {CLIENT_SPAN} true",
             ok[:-1] + "0": f"{CLIENT_TRACE} {CLIENT_SPAN} false",
             "01-" + ok[3:] + "-future": f"{CLIENT_TRACE} {CLIENT_SPAN} true",
             ok + "-x": "nil", "ff-" + ok[3:]: "nil", ok.upper(): "nil",
             f"00-{'0' * 32}-{CLIENT_SPAN}-01": "nil", f"00-{CLIENT_TRACE}-{'0' * 16}-01": "nil",
             ok[:-2]: "nil", "": "nil", "00-" + CLIENT_TRACE: "nil"}
    lines = "\n".join(f"out[#out + 1] = p({json.dumps(k)})" for k in cases)
    got = run_lua(f"""
        local trace = require "tokengate.trace"
        local function p(h)
            local a, b, c = trace.parse(h)
            if not a then return "nil" end
            return a .. " " .. b .. " " .. tostring(c)
        end
        local out = {{}}
        {lines}
        return table.concat(out, "\\n")""").split("\n")
    assert dict(zip(cases, got, strict=True)) == cases


def raw_chat(port: int, headers: bytes) -> tuple[int, bytes]:
    """One chat request over a plain socket (httpx refuses control bytes in a header):
    (status, the head of the answer)."""
    body = json.dumps({"model": MODEL, "max_tokens": 4,
                       "messages": [{"role": "user", "content": "Hi"}]}).encode()
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
            b"Authorization: Bearer " + MAIN_KEY.encode() + b"\r\n"
            b"Content-Type: application/json\r\nContent-Length: "
            + str(len(body)).encode() + b"\r\n" + headers + b"\r\n")
    with socket.create_connection(("127.0.0.1", port), timeout=120) as c:
        c.sendall(head + body)
        data = read_until_closed(c)
    status = int(data.split(b" ", 2)[1])
    return status, data.partition(b"\r\n\r\n")[0]


def test_hostile_trace_headers_never_fail_a_request(edge: Edge,
                                                    edge_variant: Callable[..., Edge]) -> None:
    """vLLM refuses a request whose tracestate holds control bytes: the edge forwards a
    client's trace headers only when they are valid, tracing on or off. A repeated
    traceparent is not valid (W3C); repeated tracestates are joined."""
    on = edge_variant("tracing-hostile", tracing_on)
    ok = f"traceparent: 00-{CLIENT_TRACE}-{CLIENT_SPAN}-01\r\n".encode()
    cases = [ok + b"tracestate: a=\x01\xff\x80\r\n", ok + b"tracestate: a=\x7f\r\n",
             b"tracestate: a=1\r\n", ok + b"tracestate: " + b"a" * 600 + b"\r\n",
             ok + f"traceparent: 00-{'3' * 32}-{CLIENT_SPAN}-01\r\n".encode(),
             b"traceparent: 00-\x01\r\n"]
    for e in (edge, on):
        for headers in cases:
            status, head = raw_chat(e.port, headers)
            assert status == 200, (e.port, headers, head)
    # traced: the repeated traceparent starts a trace of its own; joined tracestates
    status, head = raw_chat(on.port, ok * 2)
    rid = re.search(rb"X-Request-Id: (\w+)", head)[1].decode()
    assert on.event(rid)["trace"]["trace_id"] == rid
    status, head = raw_chat(on.port, ok + b"tracestate: a=1\r\ntracestate: b=2\r\n")
    rid = re.search(rb"X-Request-Id: (\w+)", head)[1].decode()
    tr = on.event(rid)["trace"]
    assert (tr["trace_id"], tr["tracestate"]) == (CLIENT_TRACE, "a=1,b=2")


def test_one_trace_per_request_from_edge_to_vllm(
        edge_variant: Callable[..., Edge], vllm_server: Callable[..., VllmServer],
        otlp_receiver: OtlpReceiver, redis_url: str) -> None:
    vllm_server()
    e = edge_variant("tracing", tracing_on)
    name = svc_name("test-ledger-tracing")
    ledger = devstack.ledger_service(Path(e.usage_file.parent / "tokengate.yaml"),
                                     e.usage_file, redis_url, ledger_id=name,
                                     name=name).start()
    try:
        rids: dict[str, str] = {}
        # continues the client's trace; the answer names the edge's span
        r = chat(e, headers={"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01",
                             "tracestate": "congo=t61rcWkgMzE"})
        assert r.status_code == 200
        rids["continued"] = r.headers["x-request-id"]
        tp = r.headers["traceparent"].split("-")
        assert tp[1] == CLIENT_TRACE and tp[2] == rids["continued"][:16] and tp[3] == "01"
        # a stream: the trace starts at the edge, its id the request id
        with httpx.stream("POST", f"{e.base_url}/chat/completions", timeout=120,
                          headers={"Authorization": f"Bearer {MAIN_KEY}"},
                          json={"model": MODEL, "stream": True, "max_tokens": 8,
                                "messages": [{"role": "user", "content": "Hello"}]}) as s:
            body = s.read().decode()
            rids["stream"] = s.headers["x-request-id"]
            assert s.headers["traceparent"] == \
                f"00-{rids['stream']}-{rids['stream'][:16]}-01"
        assert "[DONE]" in body
        # refused at the edge (rpm 1): traced, with an error status
        assert chat(e, key=key_of("edge-rpm")).status_code == 200
        r = chat(e, key=key_of("edge-rpm"))
        assert r.status_code == 429
        rids["refused"] = r.headers["x-request-id"]
        assert r.headers["traceparent"].split("-")[1] == rids["refused"]
        # a stream the client leaves after its first chunk
        with httpx.stream("POST", f"{e.base_url}/chat/completions", timeout=120,
                          headers={"Authorization": f"Bearer {MAIN_KEY}"},
                          json={"model": MODEL, "stream": True, "max_tokens": 200,
                                "messages": [{"role": "user", "content": "Go on"}]}) as s:
            rids["aborted"] = s.headers["x-request-id"]
            next(s.iter_bytes())
        # not sampled by its parent: no span anywhere, and vLLM is told so
        r = chat(e, headers={"traceparent": f"00-{'1' * 32}-{CLIENT_SPAN}-00"})
        assert r.status_code == 200 and r.headers["traceparent"].endswith("-00")
        unsampled = r.headers["x-request-id"]
        # an invalid traceparent (upper case) starts a new trace
        r = chat(e, headers={"traceparent": f"00-{CLIENT_TRACE.upper()}-{CLIENT_SPAN}-01"})
        rids["invalid"] = r.headers["x-request-id"]
        assert r.headers["traceparent"].split("-")[1] == rids["invalid"]

        events = {k: e.event(rid) for k, rid in rids.items()}
        assert events["aborted"]["client_aborted"] is True
        spans = otlp_receiver.wait_for(
            lambda got: all(edge_spans(got, rid) for rid in rids.values()), timeout_s=60)
        for kind, rid in rids.items():
            ev = events[kind]
            mine = edge_spans(spans, rid)
            assert len(mine) == 1, kind
            s = mine[0]
            trace_id = CLIENT_TRACE if kind == "continued" else rid
            assert s.trace_id == trace_id and s.span_id == rid[:16], kind
            assert s.service == "tokengate-test"
            a = s.attributes
            assert a["gen_ai.usage.input_tokens"] == ev["prompt_tokens"], kind
            assert a["gen_ai.usage.output_tokens"] == ev["completion_tokens"], kind
            assert a["gen_ai.usage.cache_read.input_tokens"] == ev["cached_tokens"], kind
            assert a["gen_ai.request.model"] == MODEL and a["gen_ai.operation.name"] == "chat"
            assert a["tokengate.key_id"] == ev["key_id"]
            assert a["tokengate.count_source"] == ev["count_source"]
            assert a["tokengate.reserved_tokens"] == ev["reserved"]
            assert a["gen_ai.request.stream"] is ev["stream"]
            assert a["http.response.status_code"] == ev["status"]
            children = {c.name: c for c in spans if c.parent_span_id == s.span_id}
            assert "tokengate.count" in s.events and "tokengate.limits" in s.events, kind
            if kind == "refused":
                assert s.status_code == "ERROR"
                assert a["error.type"] == a["tokengate.refusal_reason"] == ev["error"] \
                    == "rate_limit_exceeded"
                assert "tokengate.upstream" not in children
                continue
            assert s.status_code == "UNSET", kind
            assert a["gen_ai.response.model"] == MODEL
            assert a["tokengate.replica"] == ev["upstream"]
            up = children["tokengate.upstream"]
            assert up.span_id == rid[16:] and up.kind == "CLIENT"
            assert s.start_ns <= s.events["tokengate.count"][0] <= up.start_ns
            assert up.end_ns <= s.end_ns
            if kind == "aborted":
                assert a["tokengate.client_aborted"] is True
                continue
            assert a["gen_ai.response.finish_reasons"] == ["length"], kind
            if kind == "stream":
                assert a["gen_ai.response.time_to_first_chunk"] == \
                    pytest.approx(ev["ttft_ms"] / 1000)
            # vLLM's own span: same trace, a child of the upstream call's span
            theirs = otlp_receiver.wait_for(lambda got, t=trace_id, u=up.span_id: any(
                x.parent_span_id == u and x.trace_id == t for x in got))
            v = next(x for x in theirs if x.parent_span_id == up.span_id)
            assert v.name == "llm_request" and v.service != "tokengate-test"
            assert v.attributes["gen_ai.usage.completion_tokens"] == ev["completion_tokens"]
        assert not [x for x in spans if x.trace_id == "1" * 32], "an unsampled trace"
        assert e.event(unsampled)["trace"] is None

        # the same events, read by a second ledger whose collector is down: every event
        # is taken (the first ledger billed them: duplicates here), every span is lost
        # and counted
        mine = [x for x in otlp_receiver.spans() if x.service == "tokengate-test"]
        down = dead_collector_config(e.usage_file.parent, ports=(free_port(), free_port()))
        ledger2 = devstack.ledger_service(down, e.usage_file, redis_url,
                                          ledger_id=name + "-down", name=name + "-down").start()
        try:
            n = len(e.events())
            wait_until(lambda: status(name + "-down")["duplicates"] == n, timeout_s=30)
            wait_until(lambda: scrape_lost(down) == len(mine), timeout_s=30,
                       what=f"{len(mine)} spans counted lost")
        finally:
            ledger2.stop()
    finally:
        ledger.stop()


def dead_collector_config(folder: Path, ports: tuple[int, int]) -> Path:
    """The edge's configuration with a collector nothing listens on and the ledger's
    metrics on a port of its own."""
    raw = yaml.safe_load((folder / "tokengate.yaml").read_text())
    raw["tracing"].update(endpoint=f"http://127.0.0.1:{ports[0]}", timeout_s=1)
    raw["metrics"]["ledger_listen"] = f"127.0.0.1:{ports[1]}"
    out = folder / "tokengate-down.yaml"
    out.write_text(yaml.safe_dump(raw, sort_keys=False))
    return out


def scrape_lost(config: Path) -> float:
    """tokengate_trace_spans_lost_total of every reason, from the ledger's /metrics."""
    port = int(yaml.safe_load(config.read_text())["metrics"]["ledger_listen"].rpartition(":")[2])
    return sum(v for k, v in scrape(port).items()
               if k.startswith("tokengate_trace_spans_lost_total"))

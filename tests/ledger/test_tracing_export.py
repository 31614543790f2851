"""The ledger exports the spans that the edge wrote into usage events (``tokengate.ledger.tracing``):
a real ``tokengate-ledger`` process, the session's Redis, and a real OTLP receiver (the
protocol's gRPC service and OTLP/HTTP, ``tokengate_dev.otlp_receiver``). The edge's side,
with vLLM's spans in the same traces, is tests/edge/test_edge_tracing.py."""

from __future__ import annotations

import json
import random
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis
import yaml
from tokengate.ledger.event import Trace, parse_event
from tokengate_dev import devstack
from tokengate_dev.otlp_receiver import OtlpReceiver, Span

from tests.conftest import PORT_OFFSET
from tests.fixtures_ledger import (
    UsageWriter,
    free_port,
    make_event,
    svc_name,
    wait_until,
)
from tests.ledger.test_ledger_engine import status

PORTS = range(17400 + PORT_OFFSET, 17440 + PORT_OFFSET)


def trace_of(rid: str, **over: Any) -> Trace:
    raw: dict[str, Any] = {
        "trace_id": "4bf92f3577b34da6a3ce929d0e0e4736", "span_id": rid[:16],
        "parent_span_id": "00f067aa0ba902b7", "upstream_span_id": rid[16:],
        "sampled": True, "tracestate": "vendor=1", "start_ms": 1764900000123.0,
        "spans": [["count", 0.5, 1.25], ["limits", 2.0, 0.5]], "upstream": [3.0, 400.0],
        "finish_reasons": ["stop"]}
    raw.update(over)
    t = Trace.parse(raw)
    assert t is not None
    return t


def ledger_config(base: Path, out: Path, endpoint: str, protocol: str,
                  metrics_port: int) -> Path:
    raw = yaml.safe_load(base.read_text())
    raw["tracing"] = {"enabled": True, "endpoint": endpoint, "protocol": protocol,
                      "timeout_s": 1, "schedule_delay_ms": 50,
                      "resource_attributes": {"deployment.environment": "test"}}
    raw["metrics"]["ledger_listen"] = f"127.0.0.1:{metrics_port}"
    out.write_text(yaml.safe_dump(raw, sort_keys=False))
    return out


def scrape(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("tokengate_trace_"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def by_name(spans: list[Span], trace_id: str) -> dict[str, Span]:
    return {s.name: s for s in spans if s.trace_id == trace_id}


@pytest.mark.unit
def test_a_bad_trace_never_costs_the_event() -> None:
    """A trace that does not parse is read as null: the event is still billed."""
    ev = make_event()
    for bad in ({"trace_id": "x"}, [1], "t", {**json.loads(json.dumps(
            {"trace_id": "0" * 32, "span_id": "1" * 16, "sampled": True, "spans": [],
             "finish_reasons": [], "start_ms": 1}))}):
        line = json.loads(ev.to_json())
        line["trace"] = bad
        assert parse_event(json.dumps(line)).trace is None
    good = make_event(trace=trace_of(ev.request_id))
    assert parse_event(good.to_json()) == good


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_ledger_exports_the_events_spans(protocol: str, ledger_config_path: Path,
                                         redis_url: str, ledger_redis: redis.Redis,
                                         tmp_path: Path) -> None:
    """Every traced event becomes its spans: the edge's SERVER span with the GenAI and
    tokengate attributes, the edge's ids and an event per recorded stage, and the CLIENT
    upstream span whose id vLLM got; untraced events none. Then the receiver stops:
    the events are still applied and the spans that could not go are counted lost."""
    grpc_port = free_port(PORTS)
    http_port = free_port(range(grpc_port + 1, PORTS.stop))
    metrics_port = free_port(range(http_port + 1, PORTS.stop))
    rx = OtlpReceiver(grpc_port=grpc_port, http_port=http_port).start()
    endpoint = (f"http://127.0.0.1:{grpc_port}" if protocol == "grpc"
                else f"http://127.0.0.1:{http_port}")
    cfg = ledger_config(ledger_config_path, tmp_path / "tokengate.yaml", endpoint, protocol,
                        metrics_port)
    usage = tmp_path / "usage.jsonl"
    writer = UsageWriter(usage)
    rid = [f"{random.getrandbits(128):032x}" for _ in range(3)]
    ok = make_event(request_id=rid[0], stream=True, ttft_ms=12.5, cached_tokens=4,
                    trace=trace_of(rid[0]), session_id="agent-run-7")
    refused = make_event(request_id=rid[1], status=429, error="rate_limit_exceeded",
                         prompt_tokens=0, completion_tokens=0, usage_source="none",
                         upstream=None,
                         trace=trace_of(rid[1], parent_span_id=None, upstream_span_id=None,
                                        upstream=None, sampled=False, finish_reasons=[],
                                        tracestate=None, trace_id="a" * 32))
    untraced = make_event()
    for ev in (ok, refused, untraced):
        writer.write(ev)
    name = svc_name(f"test-ledger-trace-{protocol.replace('/', '-')}")
    svc = devstack.ledger_service(cfg, usage, redis_url, ledger_id=name, name=name).start()
    try:
        spans = rx.wait_for(lambda s: len(s) >= 3)
        got = by_name(spans, ok.trace.trace_id)
        edge = got["chat tiny-qwen3"]
        assert edge.kind == "SERVER" and edge.span_id == ok.request_id[:16]
        assert edge.parent_span_id == "00f067aa0ba902b7" and edge.status_code == "UNSET"
        a = edge.attributes
        assert a["gen_ai.operation.name"] == "chat"
        assert a["gen_ai.provider.name"] == "openai"
        assert a["gen_ai.request.model"] == a["gen_ai.response.model"] == "tiny-qwen3"
        assert a["gen_ai.usage.input_tokens"] == ok.prompt_tokens
        assert a["gen_ai.usage.output_tokens"] == ok.completion_tokens
        assert a["gen_ai.usage.cache_read.input_tokens"] == 4
        assert a["gen_ai.response.finish_reasons"] == ["stop"]
        assert a["gen_ai.request.stream"] is True
        assert a["gen_ai.response.time_to_first_chunk"] == pytest.approx(0.0125)
        assert a["tokengate.key_id"] == "demo" and a["tokengate.request_id"] == ok.request_id
        assert a["session.id"] == "agent-run-7"
        assert a["tokengate.reserved_tokens"] == ok.reserved
        assert "tokengate.refusal_reason" not in a and "error.type" not in a
        assert edge.resource["deployment.environment"] == "test"
        assert edge.service == "tokengate"
        start = 1764900000123 * 10**6
        assert edge.start_ns == start and edge.end_ns == start + round(ok.total_ms * 1e6)
        # the stages are events of the edge's span: at their start, with their duration
        assert edge.events == {"tokengate.count": (start + 500_000,
                                                   {"tokengate.duration_ms": 1.25}),
                               "tokengate.limits": (start + 2_000_000,
                                                    {"tokengate.duration_ms": 0.5})}
        up = got["tokengate.upstream"]
        assert up.kind == "CLIENT" and up.span_id == ok.request_id[16:]
        assert up.parent_span_id == edge.span_id
        assert up.attributes["server.address"] == "127.0.0.1"
        assert up.attributes["server.port"] == 18000
        bad = by_name(spans, "a" * 32)
        assert set(bad) == {"chat tiny-qwen3"}
        r = bad["chat tiny-qwen3"]
        assert set(r.events) == {"tokengate.count", "tokengate.limits"}
        assert r.status_code == "ERROR" and r.parent_span_id == ""
        assert r.attributes["error.type"] == r.attributes["tokengate.refusal_reason"] \
            == "rate_limit_exceeded"
        assert not [s for s in spans if s.trace_id == untraced.request_id]
        # counted once the exporter's call returned, which may be after the collector
        # already holds the spans
        wait_until(lambda: scrape(metrics_port)["tokengate_trace_spans_exported_total"]
                   == len(spans), what="the exported spans counted")

        # the collector goes away: events are applied, spans lost and counted
        rx.stop()
        late = make_event(request_id=rid[2], trace=trace_of(rid[2]))
        writer.write(late)
        wait_until(lambda: status(name)["applied"] == 4, timeout_s=20)
        wait_until(lambda: scrape(metrics_port).get(
            'tokengate_trace_spans_lost_total{reason="export_failed"}', 0) == 2,
            timeout_s=30)
    finally:
        svc.stop()
        rx.stop()


def test_spans_queued_when_the_ledger_is_killed_are_counted_lost_at_its_restart(
        ledger_config_path: Path, redis_url: str, ledger_redis: redis.Redis,
        tmp_path: Path) -> None:
    """A soak's ledger killed with spans queued lost them uncounted: exported + lost =
    42,708 against 42,774 traced. Here the collector takes the connection and never
    answers, so the spans of five applied events sit in an export when the ledger gets
    SIGKILL; it starts again with a collector that answers."""
    import os
    import signal
    import socket

    silent = socket.socket()
    silent.bind(("127.0.0.1", free_port(PORTS)))
    silent.listen(16)  # connections complete in the backlog; nothing is ever read
    grpc_port = free_port(range(silent.getsockname()[1] + 1, PORTS.stop))
    http_port = free_port(range(grpc_port + 1, PORTS.stop))
    metrics_port = free_port(range(http_port + 1, PORTS.stop))
    cfg = ledger_config(ledger_config_path, tmp_path / "tokengate.yaml",
                        f"http://127.0.0.1:{silent.getsockname()[1]}", "http/protobuf",
                        metrics_port)
    raw = yaml.safe_load(cfg.read_text())
    raw["tracing"]["timeout_s"] = 60  # the export waits on the silent collector
    cfg.write_text(yaml.safe_dump(raw, sort_keys=False))
    usage = tmp_path / "usage.jsonl"
    writer = UsageWriter(usage)
    for _ in range(5):
        rid = f"{random.getrandbits(128):032x}"
        writer.write(make_event(request_id=rid, trace=trace_of(rid)))  # 2 spans each
    name = svc_name("test-ledger-trace-killed")
    ledger_redis.delete(f"tg:{{ledger}}:spans:{name}")
    svc = devstack.ledger_service(cfg, usage, redis_url, ledger_id=name, name=name).start()
    rx = None
    try:
        wait_until(lambda: status(name)["applied"] == 5, timeout_s=20)
        wait_until(lambda: scrape(metrics_port).get("tokengate_trace_spans_queued", 0) == 0,
                   timeout_s=20, what="the batch taken by the export")
        assert svc.proc is not None
        os.kill(svc.proc.pid, signal.SIGKILL)
        svc.proc.wait(30)
        svc.stop()
        rx = OtlpReceiver(grpc_port=grpc_port, http_port=http_port).start()
        raw["tracing"]["endpoint"] = f"http://127.0.0.1:{http_port}"
        cfg.write_text(yaml.safe_dump(raw, sort_keys=False))
        rid = f"{random.getrandbits(128):032x}"
        writer.write(make_event(request_id=rid, trace=trace_of(rid)))
        svc = devstack.ledger_service(cfg, usage, redis_url, ledger_id=name,
                                      name=name).start()
        rx.wait_for(lambda s: len(s) >= 2)
        wait_until(lambda: scrape(metrics_port).get("tokengate_trace_spans_exported_total")
                   == 2, timeout_s=20, what="the new event's spans exported")
        m = scrape(metrics_port)
        traced = sum(2 for line in usage.read_text().splitlines()
                     if parse_event(line).trace is not None)
        lost = {k: v for k, v in m.items() if k.startswith("tokengate_trace_spans_lost_total")}
        assert (traced, m["tokengate_trace_spans_exported_total"],
                lost['tokengate_trace_spans_lost_total{reason="killed"}'],
                sum(lost.values())) == (12, 2, 10, 10)
    finally:
        svc.stop()
        silent.close()
        if rx is not None:
            rx.stop()


def test_span_counts_sent_while_redis_stalls_are_counted_once(
        ledger_config_path: Path, private_redis: Callable[..., Any],
        tmp_path: Path) -> None:
    """A soak's span counts broke by 2 (exported + lost above traced): an increment timed
    out while Redis was stopped (SIGSTOP), Redis ran it once it went on, and the ledger
    sent it again. Here the collector takes the connection and never answers, so the
    spans of five events are counted lost (export_failed) while Redis is stopped."""
    import os
    import signal
    import socket

    r = private_redis()
    silent = socket.socket()
    silent.bind(("127.0.0.1", free_port(PORTS)))
    silent.listen(16)  # connections complete in the backlog; nothing is ever read
    metrics_port = free_port(range(silent.getsockname()[1] + 1, PORTS.stop))
    cfg = ledger_config(ledger_config_path, tmp_path / "tokengate.yaml",
                        f"http://127.0.0.1:{silent.getsockname()[1]}", "http/protobuf",
                        metrics_port)
    raw = yaml.safe_load(cfg.read_text())
    raw["tracing"]["timeout_s"] = 3  # the export gives up on the silent collector
    cfg.write_text(yaml.safe_dump(raw, sort_keys=False))
    usage = tmp_path / "usage.jsonl"
    writer = UsageWriter(usage)

    def write(n: int) -> None:
        for _ in range(n):
            rid = f"{random.getrandbits(128):032x}"
            writer.write(make_event(request_id=rid, trace=trace_of(rid)))  # 2 spans each
    write(5)
    name = svc_name("test-ledger-trace-stall")
    svc = devstack.ledger_service(cfg, usage, r.url, ledger_id=name, name=name)
    svc.log_path.unlink(missing_ok=True)
    svc.start()
    counts = r.client()
    try:
        wait_until(lambda: status(name)["applied"] == 5, timeout_s=20)
        wait_until(lambda: scrape(metrics_port).get("tokengate_trace_spans_queued", 0) == 0,
                   timeout_s=20, what="the batch taken by the export")
        assert r.svc is not None and r.svc.proc is not None
        os.kill(r.svc.proc.pid, signal.SIGSTOP)
        try:
            wait_until(lambda: "span counts not stored yet" in svc.log_path.read_text(),
                       timeout_s=30, what="the lost spans' count timed out")
        finally:
            os.kill(r.svc.proc.pid, signal.SIGCONT)
        write(1)  # its spans' count sends the kept one again
        key = f"tg:{{ledger}}:spans:{name}"

        def accounted() -> bool:
            h = counts.hgetall(key)
            return int(h.get("traced", 0)) == 12 and int(h.get("lost:export_failed", 0)) >= 12
        wait_until(accounted, timeout_s=30, what="the spans of six events counted")
        h = counts.hgetall(key)
        assert (h["traced"], h["lost:export_failed"], h.get("exported")) == ("12", "12", None)
    finally:
        counts.close()
        svc.stop()
        silent.close()

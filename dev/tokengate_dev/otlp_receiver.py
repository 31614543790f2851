"""An OTLP trace receiver for tests and benchmarks: the protocol's own gRPC service
(``opentelemetry.proto.collector.trace.v1.TraceService/Export``, from the
opentelemetry-proto package) and OTLP/HTTP (``POST /v1/traces``, a protobuf
``ExportTraceServiceRequest``), keeping every span it receives in memory.

    rx = OtlpReceiver(grpc_port=4317, http_port=4318).start()
    ... rx.spans() -> [Span(trace_id, span_id, parent_span_id, name, kind, attributes,
                            status_code, status_message, start_ns, end_ns, service)]
    rx.stop()

``paused`` makes both endpoints answer UNAVAILABLE / 503 (a collector that is down but
listening); ``stop`` closes them (connection refused).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from concurrent import futures
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as pb
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc as pb_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue


@dataclass(frozen=True)
class Span:
    """One received span; ids in lower-case hex ('' for no parent), times in ns since the
    epoch, kind and status code as OTLP's enum names without prefix ("SERVER", "ERROR"),
    events by name: (time in ns, attributes)."""

    trace_id: str
    span_id: str
    parent_span_id: str
    name: str
    kind: str
    attributes: dict[str, Any]
    status_code: str
    status_message: str
    start_ns: int
    end_ns: int
    service: str
    resource: dict[str, Any] = field(default_factory=dict)
    events: dict[str, tuple[int, dict[str, Any]]] = field(default_factory=dict)


def _value(v: AnyValue) -> Any:
    which = v.WhichOneof("value")
    if which == "array_value":
        return [_value(x) for x in v.array_value.values]
    if which == "kvlist_value":
        return _attrs(v.kvlist_value.values)
    return getattr(v, which) if which else None


def _attrs(kvs: Iterable[KeyValue]) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in kvs}


class OtlpReceiver:
    """Both endpoints on 127.0.0.1 (a port of None: that endpoint is off); ``keep``:
    keep the spans (False: count them only, ``received``)."""

    def __init__(self, grpc_port: int | None = None, http_port: int | None = None,
                 keep: bool = True) -> None:
        self.grpc_port, self.http_port = grpc_port, http_port
        self.keep = keep
        self.paused = False
        self.requests = 0
        self.received = 0
        self._spans: list[Span] = []
        self._lock = threading.Lock()
        self._grpc: grpc.Server | None = None
        self._http: ThreadingHTTPServer | None = None

    def _take(self, req: pb.ExportTraceServiceRequest) -> None:
        if not self.keep:
            n = sum(len(ss.spans) for rs in req.resource_spans for ss in rs.scope_spans)
            with self._lock:
                self.received += n
                self.requests += 1
            return
        got = []
        for rs in req.resource_spans:
            res = _attrs(rs.resource.attributes)
            for ss in rs.scope_spans:
                for s in ss.spans:
                    got.append(Span(
                        s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex(), s.name,
                        s.SpanKind.Name(s.kind).removeprefix("SPAN_KIND_"),
                        _attrs(s.attributes),
                        s.status.StatusCode.Name(s.status.code).removeprefix("STATUS_CODE_"),
                        s.status.message, s.start_time_unix_nano, s.end_time_unix_nano,
                        str(res.get("service.name", "")), res,
                        {e.name: (e.time_unix_nano, _attrs(e.attributes)) for e in s.events}))
        with self._lock:
            self._spans.extend(got)
            self.received += len(got)
            self.requests += 1

    def start(self) -> OtlpReceiver:
        """Listen; returns self."""
        if self.grpc_port is not None:
            receiver = self

            class Service(pb_grpc.TraceServiceServicer):
                def Export(self, request: pb.ExportTraceServiceRequest,
                           context: grpc.ServicerContext) -> pb.ExportTraceServiceResponse:
                    if receiver.paused:
                        context.abort(grpc.StatusCode.UNAVAILABLE, "paused")
                    receiver._take(request)
                    return pb.ExportTraceServiceResponse()

            self._grpc = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
            pb_grpc.add_TraceServiceServicer_to_server(Service(), self._grpc)
            self._grpc.add_insecure_port(f"127.0.0.1:{self.grpc_port}")
            self._grpc.start()
        if self.http_port is not None:
            self._http = ThreadingHTTPServer(("127.0.0.1", self.http_port), self._handler())
            self._http.daemon_threads = True
            threading.Thread(target=self._http.serve_forever, daemon=True).start()
        return self

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if receiver.paused or self.path != "/v1/traces":
                    self.send_response(503 if receiver.paused else 404)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                req = pb.ExportTraceServiceRequest()
                req.ParseFromString(body)
                receiver._take(req)
                out = pb.ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, *args: Any) -> None:
                pass

        return Handler

    def spans(self) -> list[Span]:
        """Every span received so far."""
        with self._lock:
            return list(self._spans)

    def wait_for(self, done: Callable[[list[Span]], bool], timeout_s: float = 30.0
                 ) -> list[Span]:
        """Polls until ``done(spans())``; returns the spans, or raises TimeoutError."""
        deadline = time.monotonic() + timeout_s
        while True:
            spans = self.spans()
            if done(spans):
                return spans
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(spans)} spans after {timeout_s} s")
            time.sleep(0.05)

    def stop(self) -> None:
        """Close both endpoints."""
        if self._grpc is not None:
            self._grpc.stop(grace=None)
            self._grpc = None
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None


def main(argv: list[str] | None = None) -> None:
    """``python -m tokengate_dev.otlp_receiver --grpc-port N [--http-port M]``: a receiver
    in a process of its own (``make bench``), counting spans until SIGTERM or SIGINT;
    then prints ``spans <n> requests <n>``."""
    import argparse
    import signal

    p = argparse.ArgumentParser(prog="python -m tokengate_dev.otlp_receiver",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--grpc-port", type=int, default=None)
    p.add_argument("--http-port", type=int, default=None)
    a = p.parse_args(argv)
    rx = OtlpReceiver(a.grpc_port, a.http_port, keep=False).start()
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    signal.signal(signal.SIGINT, lambda *_: done.set())
    done.wait()
    rx.stop()
    print(f"spans {rx.received} requests {rx.requests}", flush=True)


if __name__ == "__main__":
    main()

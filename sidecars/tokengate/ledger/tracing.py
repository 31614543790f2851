"""OpenTelemetry spans of the edge's requests, exported over OTLP by the ledger.

The edge (``lua/tokengate/trace.lua``) starts or continues a W3C trace for every request
and writes the span data into the request's usage event (``UsageEvent.trace``). The
ledger, off the request path, hands every event of a batch it has committed to
``SpanExport.events``, which builds the spans (``spans_of``) and queues them; a thread of
its own exports them with the official OTLP exporter (gRPC or HTTP/protobuf). Nothing on
this path waits on the collector: a collector that is down or slow fills the queue, and
what does not fit or fails to export is lost and counted (``lost``), never a request or
an event. Spans are exported once: a batch is handed over after Redis committed it, so a
ledger killed in between loses that batch's spans instead of sending them twice. The
counts add up across restarts (``SpanStore``): a ledger killed with spans queued or in an
export leaves them traced in Redis and neither exported nor lost, and its next start
counts them lost (``killed``).

One trace per request (span kinds and names per the OpenTelemetry GenAI semantic
conventions, open-telemetry/semantic-conventions-genai docs/gen-ai/client-inference.md,
development status, read in December 2026):

    <operation> <model>      SERVER, the request at the edge, from its start to its
                             log phase; gen_ai.* and tokengate.* attributes (ATTRIBUTES)
                             and a span event per stage, at its start, with its
                             tokengate.duration_ms: tokengate.count (the counter call),
                             tokengate.queue (the wait in the key's queue, edge.queue),
                             tokengate.limits (the reservation in every limit tier and
                             budget)
      tokengate.upstream     CLIENT, the proxied call to the replica; its span id is the
                             parent in the `traceparent` vLLM got, so vLLM's own
                             llm_request span (--otlp-traces-endpoint) is its child

The stages are events rather than spans of their own: every exported span costs the
ledger's CPU (the SDK's protobuf encoding: about 15 µs a span without attributes on
this machine's cores), and on a host where the ledger shares cores with the edge that
is throughput; an event costs a third of that.

A refused or failed request's edge span has status ERROR with ``error.type`` (the
event's error code); the edge keeps it even when the trace was not sampled.
"""

from __future__ import annotations

import logging
import os
import queue
import random
import threading
import time
from collections.abc import Iterable, Sequence
from importlib.metadata import PackageNotFoundError, version
from typing import Any
from urllib.parse import urlsplit

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags, TraceState
from redis.exceptions import RedisError

from tokengate.config.sidecars import TracingConfig
from tokengate.ledger.event import Trace, UsageEvent
from tokengate.redis_client import SyncRedis
from tokengate.redis_keys import spans_key

log = logging.getLogger("tokengate.ledger.tracing")

# gen_ai.operation.name by the event's endpoint (GenAI conventions' well-known values;
# count_tokens and input_tokens are tokengate's own: the edge answers them itself)
OPERATIONS = {"chat": "chat", "completions": "text_completion", "embeddings": "embeddings",
              "messages": "chat", "responses": "chat", "count_tokens": "count_tokens",
              "input_tokens": "count_tokens"}
# gen_ai.provider.name: the API the client spoke. The conventions name the provider "as
# identified by the client or server instrumentation" and let OpenAI-compatible servers
# report "openai" (gen_ai.request.model and server.address tell the real system).
ANTHROPIC = ("messages", "count_tokens")

ATTRIBUTES = """\
gen_ai.operation.name                  chat | text_completion | embeddings | count_tokens
gen_ai.provider.name                   openai | anthropic (the API the client spoke)
gen_ai.request.model                   the body's model
gen_ai.response.model                  the served model, when the replica answered usage
gen_ai.request.stream                  the client asked for SSE
gen_ai.usage.input_tokens              prompt tokens billed (the usage event's)
gen_ai.usage.output_tokens             completion tokens billed
gen_ai.usage.cache_read.input_tokens   prompt tokens served from the prefix cache
gen_ai.response.finish_reasons         finish_reason / stop_reason values seen
gen_ai.response.time_to_first_chunk    s, streams: the edge's TTFT
http.response.status_code              the status the client got
error.type                             the event's error code (refused or failed)
session.id                             the agent session (the event's session_id;
                                       OpenTelemetry's session attribute)
tokengate.request_id                   X-Request-Id, the usage event's request_id
tokengate.key_id                       the API key's id (never the key)
tokengate.endpoint                     the event's endpoint
tokengate.count_source                 counter | history | estimate | none
tokengate.prompt_tokens_counted        the counter's prompt tokens at admission
tokengate.count_drift                  vLLM's prompt tokens - the count (when not 0)
tokengate.reserved_tokens              tokens reserved at admission
tokengate.refusal_reason               the error code when the edge refused (not forwarded)
tokengate.replica                      the replica that served it
tokengate.usage_source                 final | running | estimate | none
tokengate.client_aborted               true: the client left before the end
tokengate.queue_ms                     ms in the key's queue (when it queued)
tokengate.ttft_ms                      ms to the first byte of the response body
tokengate.expected_cached_tokens       the prefix-cache prediction (routing.policy prefix)
"""

def _tokengate_version() -> str:
    try:
        return version("tokengate")
    except PackageNotFoundError:
        return "0"


SCOPE = InstrumentationScope("tokengate.edge", _tokengate_version())


def resource_of(cfg: TracingConfig) -> Resource:
    """The spans' resource: ``service.name`` and the configured resource attributes
    (with the SDK's own telemetry.sdk.* attributes)."""
    return Resource.create({**cfg.resource_attributes, "service.name": cfg.service_name,
                            "service.version": _tokengate_version()})


def _ns(ms: float) -> int:
    """ms -> ns, exact to the ns for durations (an epoch in ms goes through µs: ms * 1e6
    exceeds the 53 bits of a float)."""
    return round(ms * 1e6)


def _attributes(ev: UsageEvent, tr: Trace, op: str) -> dict[str, Any]:
    a: dict[str, Any] = {
        "gen_ai.operation.name": op,
        "gen_ai.provider.name": "anthropic" if ev.endpoint in ANTHROPIC else "openai",
        "gen_ai.request.stream": ev.stream,
        "gen_ai.usage.input_tokens": ev.prompt_tokens,
        "gen_ai.usage.output_tokens": ev.completion_tokens,
        "gen_ai.usage.cache_read.input_tokens": ev.cached_tokens,
        "http.response.status_code": ev.status,
        "tokengate.request_id": ev.request_id,
        "tokengate.endpoint": ev.endpoint,
        "tokengate.count_source": ev.count_source,
        "tokengate.prompt_tokens_counted": ev.token_estimate,
        "tokengate.reserved_tokens": ev.reserved,
        "tokengate.usage_source": ev.usage_source,
    }
    # what is mostly 0 or false only when it is not (each attribute costs encoding)
    if ev.count_drift:
        a["tokengate.count_drift"] = ev.count_drift
    if ev.client_aborted:
        a["tokengate.client_aborted"] = True
    if ev.queue_ms:
        a["tokengate.queue_ms"] = ev.queue_ms
    if ev.model:
        a["gen_ai.request.model"] = ev.model
        if ev.usage_source in ("final", "running"):
            a["gen_ai.response.model"] = ev.model
    if tr.finish_reasons:
        a["gen_ai.response.finish_reasons"] = list(tr.finish_reasons)
    if ev.ttft_ms is not None:
        a["tokengate.ttft_ms"] = ev.ttft_ms
        if ev.stream:
            a["gen_ai.response.time_to_first_chunk"] = ev.ttft_ms / 1000
    if ev.key_id:
        a["tokengate.key_id"] = ev.key_id
    if ev.session_id is not None:
        a["session.id"] = ev.session_id
    if ev.upstream:
        a["tokengate.replica"] = ev.upstream
    if ev.expected_cached_source:
        a["tokengate.expected_cached_tokens"] = ev.expected_cached_tokens
    if ev.error:
        a["error.type"] = ev.error
        if tr.upstream is None and ev.status >= 400:
            a["tokengate.refusal_reason"] = ev.error
    return a


def spans_of(ev: UsageEvent, resource: Resource) -> list[ReadableSpan]:
    """The spans of one event's trace (the module docstring's tree), or [] for an event
    without one. Times: the edge's wall-clock start (``Trace.start_ms``) plus the
    monotonic offsets it recorded, in ns since the epoch."""
    tr = ev.trace
    if tr is None:
        return []
    trace_id = int(tr.trace_id, 16)
    flags = TraceFlags(TraceFlags.SAMPLED)
    state = TraceState.from_header([tr.tracestate]) if tr.tracestate else None
    edge = SpanContext(trace_id, int(tr.span_id, 16), is_remote=False, trace_flags=flags,
                       trace_state=state)
    parent = (SpanContext(trace_id, int(tr.parent_span_id, 16), is_remote=True,
                          trace_flags=flags, trace_state=state)
              if tr.parent_span_id else None)
    base = round(tr.start_ms * 1000) * 1000  # epoch ns, µs resolution
    ends = [ev.total_ms] + [off + dur for _, off, dur in tr.spans]
    if tr.upstream:
        ends.append(sum(tr.upstream))
    op = OPERATIONS.get(ev.endpoint, ev.endpoint)
    failed = ev.status >= 400 or (ev.error is not None and not ev.client_aborted)
    status = (Status(StatusCode.ERROR, ev.error or str(ev.status)) if failed
              else Status(StatusCode.UNSET))
    events = [Event(f"tokengate.{name}", {"tokengate.duration_ms": dur}, base + _ns(off))
              for name, off, dur in tr.spans]
    out = [ReadableSpan(f"{op} {ev.model}" if ev.model else op, context=edge, parent=parent,
                        resource=resource, attributes=_attributes(ev, tr, op), events=events,
                        kind=SpanKind.SERVER, status=status, start_time=base,
                        end_time=base + _ns(max(ends)), instrumentation_scope=SCOPE)]
    if tr.upstream and tr.upstream_span_id:
        off, dur = tr.upstream
        ctx = SpanContext(trace_id, int(tr.upstream_span_id, 16), is_remote=False,
                          trace_flags=flags, trace_state=state)
        attrs: dict[str, Any] = {"http.response.status_code": ev.status}
        if ev.upstream:
            host, _, port = ev.upstream.rpartition(":")
            attrs["server.address"] = host.strip("[]") or ev.upstream
            if port.isdigit():
                attrs["server.port"] = int(port)
        out.append(ReadableSpan("tokengate.upstream", context=ctx, parent=edge,
                                resource=resource, attributes=attrs, kind=SpanKind.CLIENT,
                                status=status if ev.status >= 500 else Status(StatusCode.UNSET),
                                start_time=base + _ns(off), end_time=base + _ns(off + dur),
                                instrumentation_scope=SCOPE))
    return out


def collector_url(cfg: TracingConfig) -> str:
    """The URL an exporter is given: ``endpoint``, with ``/v1/traces`` added for
    http/protobuf when it has no path (OTLP/HTTP's default path)."""
    url = cfg.endpoint
    if cfg.protocol != "grpc" and urlsplit(url).path in ("", "/"):
        url = url.rstrip("/") + "/v1/traces"
    return url


def otlp_exporter(cfg: TracingConfig) -> SpanExporter:
    """The official OTLP span exporter for ``cfg``: gRPC (``endpoint`` http:// plaintext,
    https:// TLS) or HTTP/protobuf (``/v1/traces`` added when the URL has no path), with
    ``headers`` and ``timeout_s`` (the exporter retries within it)."""
    headers = dict(cfg.headers) or None
    if cfg.protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
            OTLPSpanExporter as GrpcExporter,
        )
        return GrpcExporter(endpoint=cfg.endpoint,
                            insecure=urlsplit(cfg.endpoint).scheme == "http",
                            headers=headers, timeout=cfg.timeout_s)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
        OTLPSpanExporter as HttpExporter,
    )
    return HttpExporter(endpoint=collector_url(cfg), headers=headers, timeout=cfg.timeout_s)


EXPORT_NICE = 10  # the export thread's nice value (the billing thread's is the process's)


def span_count(ev: UsageEvent) -> int:
    """How many spans ``spans_of(ev)`` gives: the edge's, and the upstream call's when
    the request was forwarded."""
    tr = ev.trace
    if tr is None:
        return 0
    return 2 if tr.upstream and tr.upstream_span_id else 1


LOST_REASONS = ("queue_full", "export_failed", "shutdown", "killed")


# SpanStore's increments, applied once: KEYS[1] the spans hash; ARGV[1] the batch's id,
# then field, n pairs. A batch whose id is the hash's last ("batch") was applied already:
# its first sending timed out and Redis ran it anyway (a stall), or the client's own
# retry sent it twice. Returns 1 when applied, 0 when it had been.
ADD_LUA = """
if redis.call('HGET', KEYS[1], 'batch') == ARGV[1] then
  return 0
end
redis.call('HSET', KEYS[1], 'batch', ARGV[1])
for i = 2, #ARGV, 2 do
  redis.call('HINCRBY', KEYS[1], ARGV[i], ARGV[i + 1])
end
return 1
"""

# recover's count of the spans of earlier processes left unaccounted (lost:killed), in
# one step with its read: a retry after a timeout counts nothing twice. KEYS[1] the spans
# hash; ARGV: the lost reasons. Returns [exported, lost of each reason in ARGV's order].
RECOVER_LUA = """
local h = KEYS[1]
local exported = tonumber(redis.call('HGET', h, 'exported') or '0')
local counted = exported
local lost = {}
for i = 1, #ARGV do
  lost[i] = tonumber(redis.call('HGET', h, 'lost:' .. ARGV[i]) or '0')
  counted = counted + lost[i]
end
local killed = tonumber(redis.call('HGET', h, 'traced') or '0') - counted
if killed > 0 then
  redis.call('HINCRBY', h, 'lost:killed', killed)
end
return {exported, killed, unpack(lost)}
"""


class SpanStore:
    """The span counts of one ledger (``ledger_id``) in Redis (``redis_keys.spans_key``:
    ``traced``, ``exported``, ``lost:<reason>``), so that exported + lost == traced holds
    across its restarts. ``traced`` grows when the ledger hands the spans of a batch that
    Redis committed to the export; ``exported`` and ``lost:*`` when their fate is known. A
    ledger killed with spans queued or in an export leaves traced above exported + lost:
    ``recover()``, at the next start, counts the difference as ``lost:killed``. What
    remains uncounted is a batch whose process died between its commit and ``add`` (one
    Redis round trip). Increments are sent only after ``recover()`` (else the spans
    queued now would be counted killed) and kept while Redis does not take them.

    Each increment is sent as a batch with a random id (``ADD_LUA``), sent again with the
    same id until Redis answers, and applied once: a batch that timed out while Redis was
    stopped (SIGSTOP) ran once Redis went on, and sending its counts again counted them
    twice (exported + lost two above traced in a soak). The hash's ``batch`` field holds
    the last batch applied."""

    def __init__(self, client: SyncRedis, ledger_id: str) -> None:
        self.client = client
        self.key = spans_key(ledger_id)
        self.recovered = False
        self._pending: dict[str, int] = {}
        # (id, counts): the batch being sent, or sent without an answer (resent as it is)
        self._batch: tuple[int, dict[str, int]] | None = None
        self._lock = threading.Lock()
        self._sending = threading.Lock()
        self._add = client.register_script(ADD_LUA)
        self._recover = client.register_script(RECOVER_LUA)

    def recover(self) -> tuple[int, dict[str, int]]:
        """(exported, lost by reason) of this ledger's earlier processes, the spans they
        traced and left unaccounted added to ``lost["killed"]``; then increments flow.
        Raises ``RedisError`` (try again later)."""
        exported, killed, *counts = (int(x) for x in
                                     self._recover(keys=[self.key], args=LOST_REASONS))
        lost = dict(zip(LOST_REASONS, counts, strict=True))
        if killed > 0:
            lost["killed"] += killed
            log.warning("tracing: %d span(s) of events applied by the previous ledger process "
                        "were neither exported nor counted lost (it was killed): counted "
                        "lost", killed)
        self.recovered = True
        self.add({})
        return exported, lost

    def add(self, counts: dict[str, int]) -> None:
        """Add ``counts`` (field -> spans) in Redis, with what an earlier call could not
        send; never raises (kept for the next call when Redis fails). Of calls from
        several threads at once one sends, and also what the others added meanwhile."""
        with self._lock:
            for field, n in counts.items():
                if n:
                    self._pending[field] = self._pending.get(field, 0) + n
        while self.recovered and self._sending.acquire(blocking=False):
            try:
                sent = self._send()
            finally:
                self._sending.release()
            with self._lock:  # counts added while this call sent, by a call that left
                if not sent or not self._pending:
                    return

    def _send(self) -> bool:
        """Sends the batch under way, then the pending counts as new batches, until none
        is left (True) or Redis failed (False: the batch is kept, with its id)."""
        while True:
            with self._lock:
                if self._batch is None and self._pending:
                    self._batch = (random.getrandbits(62) + 1, self._pending)
                    self._pending = {}
                batch = self._batch
            if batch is None:
                return True
            batch_id, fields = batch
            try:
                self._add(keys=[self.key],
                          args=[batch_id, *(x for pair in fields.items() for x in pair)])
            except (RedisError, OSError) as e:
                log.info("tracing: span counts not stored yet (%s)", e)
                return False
            with self._lock:
                self._batch = None


class SpanExport:
    """Exports the spans of committed usage events from a thread of its own, below the
    ledger's billing thread in CPU priority (``EXPORT_NICE``; Linux nice values are per
    thread, and weigh only within the ledger's own scheduling group: against nginx and
    the counter, the ledger's unit or session decides): on busy cores the spans wait,
    up to ``max_queue_spans``. ``events`` never blocks. Counts, this process's since it started: ``exported``
    (spans the collector accepted), ``lost`` by reason: ``queue_full`` (more than
    ``max_queue_spans`` waiting), ``export_failed`` (the exporter gave up: collector
    down, refused, or slower than ``timeout_s`` with its retries), ``shutdown`` (still
    queued when the ledger stopped and the last export failed), ``killed`` (queued or in
    an export when an earlier process of this ledger was killed). With a ``store``
    (``SpanStore``) the counts are the ledger's since its first start: those of its
    earlier processes are added once the store recovered them."""

    def __init__(self, cfg: TracingConfig, exporter: SpanExporter | None = None,
                 store: SpanStore | None = None) -> None:
        self.cfg = cfg
        self.exporter = exporter or otlp_exporter(cfg)
        self.resource = resource_of(cfg)
        self.store = store
        self.exported = 0
        self.lost = dict.fromkeys(LOST_REASONS, 0)
        self._events: queue.SimpleQueue[UsageEvent] = queue.SimpleQueue()
        self._queued = 0          # spans of the events in _events
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="span-export", daemon=True)
        self._thread.start()

    @property
    def queued(self) -> int:
        """Spans waiting for export now."""
        return self._queued

    def events(self, events: Iterable[UsageEvent]) -> None:
        """Queue the spans of ``events`` (those with a trace); what does not fit is lost
        (``lost["queue_full"]``). Called by the ledger's thread after a commit."""
        traced = full = 0
        for ev in events:
            n = span_count(ev)
            if not n:
                continue
            traced += n
            with self._lock:
                fits = self._queued + n <= self.cfg.max_queue_spans
                if fits:
                    self._queued += n
                else:
                    self.lost["queue_full"] += n
                    full += n
            if fits:
                self._events.put(ev)
        if self.store is not None and traced:
            self.store.add({"traced": traced, "lost:queue_full": full})

    def _take(self, first_wait_s: float) -> list[ReadableSpan]:
        """The spans of the next events, up to about batch_spans: waits up to
        ``first_wait_s`` for the first, then up to schedule_delay_ms for the batch to
        fill."""
        try:
            got = [self._events.get(timeout=first_wait_s)]
        except queue.Empty:
            return []
        n = span_count(got[0])
        deadline = time.monotonic() + self.cfg.schedule_delay_ms / 1000
        while n < self.cfg.batch_spans and not self._stop.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                ev = self._events.get(timeout=left)
            except queue.Empty:
                break
            got.append(ev)
            n += span_count(ev)
        with self._lock:
            self._queued -= n
        return [span for ev in got for span in spans_of(ev, self.resource)]

    def _export(self, batch: Sequence[ReadableSpan], lost_as: str) -> None:
        try:
            ok = self.exporter.export(batch) is SpanExportResult.SUCCESS
        except Exception:  # an exporter bug must not end the thread: the spans are lost
            log.exception("span export failed")
            ok = False
        if ok:
            self.exported += len(batch)
        else:
            self.lost[lost_as] += len(batch)
        if self.store is not None:
            self.store.add({"exported" if ok else f"lost:{lost_as}": len(batch)})
        if not ok:
            log.warning("tracing: %d span(s) lost: the collector at %s did not take them "
                        "(%d lost so far)", len(batch), self.cfg.endpoint,
                        sum(self.lost.values()))

    def _run(self) -> None:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), EXPORT_NICE)
        except (OSError, AttributeError) as e:  # not Linux, or not allowed: same priority
            log.info("tracing: span export at the ledger's priority (%s)", e)
        while not self._stop.is_set():
            self._recover()
            batch = self._take(0.5)
            if batch:
                self._export(batch, "export_failed")

    def _recover(self) -> None:
        """The earlier processes' counts, once Redis gives them (store.recover)."""
        if self.store is None or self.store.recovered:
            return
        try:
            exported, lost = self.store.recover()
        except (RedisError, OSError) as e:
            log.info("tracing: earlier span counts not read yet (%s)", e)
            return
        with self._lock:
            self.exported += exported
            for reason, n in lost.items():
                self.lost[reason] += n

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the thread, try one last export of what waits, shut the exporter down."""
        self._stop.set()
        self._thread.join(timeout_s)
        while True:
            batch = self._take(0.0)
            if not batch:
                break
            self._export(batch, "shutdown")
        self.exporter.shutdown()

"""``tokengate.v1.TokenCounter`` (proto/tokengate/v1/counter.proto): the counting of one
call (``TokenCounterService.count``), served over gRPC (``CountTokens``, TCP: tools,
other clients) and over the counter frames of ``tokengate.counter.frames`` (the workers'
unix sockets: the nginx edge).
"""

from __future__ import annotations

import json
import logging
import sys
import threading
import time
from typing import Any, NoReturn

import grpc
from prometheus_client import Counter, Histogram

from tokengate.counter.counting import BadRequest, CountResult, ModelCounter
from tokengate.counter.errors import ContextLengthExceeded
from tokengate.v1 import counter_pb2, counter_pb2_grpc

log = logging.getLogger(__name__)

_MAX_DETAILS = 512  # characters of an error message sent back
UNKNOWN = "unknown"  # the model label of a model that is not configured

# Metrics (tokengate.metrics serves them, summed over the worker processes). The model
# label is a configured model name or UNKNOWN, never the client's string.
CALLS = Counter("tokengate_counter_calls_total",
                "CountTokens calls, by model and gRPC status code (OK, INVALID_ARGUMENT, "
                "OUT_OF_RANGE, NOT_FOUND, INTERNAL).", ["model", "code"])
CALL_SECONDS = Histogram("tokengate_counter_call_duration_seconds",
                         "Time to answer CountTokens inside the counter (parse, render, "
                         "tokenize), by model.", ["model"],
                         buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025,
                                  0.05, 0.1, 0.25, 0.5, 1.0, 2.5))
PROMPT_TOKENS = Counter("tokengate_counter_prompt_tokens_total",
                        "Prompt tokens counted (replies sent), by model.", ["model"])
CACHE_LOOKUPS = Counter("tokengate_counter_segment_cache_lookups_total",
                        "Piece cache lookups (a prompt's pieces between special tokens; for "
                        "a prefix-routed model, of their token ids), "
                        "by model and result (hit, miss).", ["model", "result"])
TEMPLATE_RENDERS = Counter("tokengate_counter_template_renders_total",
                           "Chat prompts rendered, by model and how: trace (assembled from "
                           "a conversation of the same shape, tokengate.counter."
                           "template_trace), recorded (rendered and traced), plain "
                           "(rendered; a conversation or template that is not traced).",
                           ["model", "how"])
# the proto's endpoints and ModelCounter.count's names for them
_ENDPOINTS = {counter_pb2.ENDPOINT_CHAT: "chat", counter_pb2.ENDPOINT_COMPLETIONS: "completions",
              counter_pb2.ENDPOINT_MESSAGES: "messages",
              counter_pb2.ENDPOINT_MESSAGES_COUNT_TOKENS: "count_tokens",
              counter_pb2.ENDPOINT_RESPONSES: "responses",
              counter_pb2.ENDPOINT_EMBEDDINGS: "embeddings"}
_ENDPOINT_NAMES = ", ".join(counter_pb2.Endpoint.Name(e) for e in _ENDPOINTS)


class CountFailure(Exception):
    """A call the counter answers with a gRPC status other than OK: ``code`` and a short,
    always-encodable ``message`` (at most 512 characters; a lone surrogate echoed from
    the body, a model named "\\ud800", is escaped: grpc sends no status at all for a
    message it cannot encode)."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        if len(message) > _MAX_DETAILS:
            message = message[:_MAX_DETAILS] + "..."
        self.code = code
        self.message = message.encode("utf-8", "backslashreplace").decode("utf-8")
        super().__init__(f"{code.name}: {self.message}")


def _fail(code: grpc.StatusCode, message: str) -> NoReturn:
    raise CountFailure(code, message)


class TokenCounterService(counter_pb2_grpc.TokenCounterServicer):
    """Counts prompt tokens for the configured models (one ``ModelCounter`` each)."""

    def __init__(self, counters: dict[str, ModelCounter]) -> None:
        self.counters = counters
        self._lock = threading.Lock()
        # each model's series of a successful call, made at its first (a reload may
        # add models)
        self._series: dict[str, _Series] = {}

    def count(self, request: counter_pb2.CountRequest) -> counter_pb2.CountReply:
        """Exact prompt tokens of ``request.body``, whatever the transport.

        Raises ``CountFailure``: INVALID_ARGUMENT "<field path>: <problem>" (bad JSON,
        bad field, unknown endpoint); OUT_OF_RANGE "<field path>: <problem>" for a
        prompt longer than the model's context (embeddings inputs);
        NOT_FOUND for a model that is not configured;
        INTERNAL for a bug (logged with a traceback; the worker keeps serving). Every
        call is counted by model and code, and timed.
        """
        t0 = time.perf_counter()
        # the edge always names the model in the request; a body-only one that fails
        # is counted as UNKNOWN
        label = request.model if request.model in self.counters else UNKNOWN
        try:
            reply, label, counter = self._count(request)
        except Exception as e:
            code = e.code.name if isinstance(e, CountFailure) else "INTERNAL"
            CALLS.labels(label, code).inc()
            CALL_SECONDS.labels(label).observe(time.perf_counter() - t0)
            raise
        series = self._series.get(label) or self._new_series(label)
        series.seconds.observe(time.perf_counter() - t0)
        series.calls.inc()
        series.prompt_tokens.inc(reply.prompt_tokens)
        series.export(counter, self._lock)
        return reply

    def CountTokens(self, request: counter_pb2.CountRequest,
                    context: grpc.ServicerContext) -> counter_pb2.CountReply:
        """The gRPC method: ``count``, its ``CountFailure`` as the call's status."""
        try:
            return self.count(request)
        except CountFailure as e:
            context.abort(e.code, e.message)
            raise AssertionError("context.abort returned") from None

    def _new_series(self, model: str) -> _Series:
        with self._lock:
            return self._series.setdefault(model, _Series(model))

    def _count(self, request: counter_pb2.CountRequest
               ) -> tuple[counter_pb2.CountReply, str, ModelCounter]:
        """``count``'s work: the reply, the model it counted for and its counter."""
        invalid = grpc.StatusCode.INVALID_ARGUMENT
        endpoint = _ENDPOINTS.get(request.endpoint)
        if endpoint is None:
            _fail(invalid, f"endpoint: expected one of {_ENDPOINT_NAMES}")
        try:
            body: Any = json.loads(request.body)
        except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
            if "integer string conversion" in str(e):  # Python's int digit limit
                _fail(invalid, f"body: a number has more than {sys.get_int_max_str_digits()} "
                               "digits")
            _fail(invalid, f"body: invalid JSON: {e}")
        if not isinstance(body, dict):
            _fail(invalid, "body: expected a JSON object")
        model = request.model or body.get("model")
        if not isinstance(model, str) or not model:
            _fail(invalid, "model: required string")
        counter = self.counters.get(model)
        if counter is None:
            _fail(grpc.StatusCode.NOT_FOUND, f"model: the model '{model}' does not exist")
        try:
            r = counter.count(endpoint, body)
        except ContextLengthExceeded as e:
            _fail(grpc.StatusCode.OUT_OF_RANGE, str(e))
        except BadRequest as e:
            _fail(invalid, str(e))
        except RecursionError:
            _fail(invalid, "body: nested too deeply")
        except Exception:  # a bug must cost one request, not the worker
            log.exception("CountTokens failed on a %d-byte body", len(request.body))
            _fail(grpc.StatusCode.INTERNAL, "counter failed on this body")
        try:
            return _reply(r, counter), model, counter
        except Exception:  # e.g. a field out of range: the worker keeps serving
            log.exception("CountTokens could not build a reply for %s", r)
            _fail(grpc.StatusCode.INTERNAL, "counter failed on this body")


class _Series:
    """One model's metric series that every successful call adds to, and what its
    caches had counted when they were last exported (``export``)."""

    def __init__(self, model: str) -> None:
        self.calls = CALLS.labels(model, "OK")
        self.seconds = CALL_SECONDS.labels(model)
        self.prompt_tokens = PROMPT_TOKENS.labels(model)
        self._lookups = (CACHE_LOOKUPS.labels(model, "hit"),
                         CACHE_LOOKUPS.labels(model, "miss"))
        self._renders = tuple(TEMPLATE_RENDERS.labels(model, how)
                              for how in ("trace", "recorded", "plain"))
        self._counter: ModelCounter | None = None
        self._exported = (0, 0, 0, 0, 0)

    def export(self, counter: ModelCounter, lock: threading.Lock) -> None:
        """Adds what ``counter``'s piece cache and template traces counted since the
        last call to CACHE_LOOKUPS and TEMPLATE_RENDERS (the threads of a worker share
        them: under ``lock``, the sum of the increments is exact; a reload's new
        counter starts from 0)."""
        template = counter.template
        with lock:
            if counter is not self._counter:
                self._counter, self._exported = counter, (0, 0, 0, 0, 0)
            traces = template.traces if template is not None else None
            now = (*counter.tokenizer.lookups,
                   *((traces.hits, traces.recorded, traces.plain)
                     if traces is not None else (0, 0, 0)))
            before, self._exported = self._exported, now
        for series, n, n0 in zip((*self._lookups, *self._renders), now, before, strict=True):
            if n > n0:
                series.inc(n - n0)


def _reply(r: CountResult, counter: ModelCounter) -> counter_pb2.CountReply:
    b = r.breakdown
    return counter_pb2.CountReply(
        prompt_tokens=r.prompt_tokens, max_model_len=r.max_model_len,
        max_tokens_effective=r.max_tokens_effective,
        max_tokens_requested=r.max_tokens_requested,
        breakdown=counter_pb2.Breakdown(system=b.system, tools=b.tools,
                                        messages=b.messages,
                                        template_overhead=b.template_overhead),
        tokenizer_fingerprint=counter.fingerprint,
        tokenizer_backend=counter.tokenizer.backend,
        prompt_count=r.prompt_count,
        block_hashes=r.block_hashes, block_size=r.block_size,
        prefix_hits=[counter_pb2.PrefixHit(upstream=u, cached_tokens=n)
                     for u, n in r.prefix_hits])

"""The engine usage record: one JSON line per finished engine request, written on the
vLLM host.

One record per request the engine finished (stop, length, error, abort, repetition),
and per child of an ``n > 1`` request (vLLM runs each child as its own engine request).
The ledger joins records with the edge's usage events by request id
(``tokengate.ledger.engine_record`` parses them; ``EngineRecord.edge_request_id`` is the
edge's id). Schema (every key is present, in this order; ``null`` only where shown)::

    request_id             vLLM's external request id, as its FinishedRequestStats
                           reports it: "chatcmpl-<X-Request-Id>" for chat,
                           "cmpl-<X-Request-Id>-<prompt index>" for completions
                           (vllm/entrypoints/openai/{chat_completion,completion}/
                           serving.py); every child of an n > 1 request has its
                           parent's id
    index                  the child's index among the parent's n (vLLM's
                           RequestState.request_index; the response's choice index
                           for chat), 0 when n = 1
    n                      the parent request's n (ParentRequest.n), 1 for none
    ts                     wall-clock time the frontend saw the request finish,
                           RFC 3339 UTC with ms, e.g. "2026-11-29T16:40:00.123Z"
    arrival_ts             wall-clock time vLLM received the request (RFC 3339 UTC)
    model                  served model name | null
    key_id                 the API key's id the edge forwarded the request for
                           (its X-Tokengate-Key header, ``edge``) | null (not
                           through the edge, or a vLLM without ``edge.EdgeHeaders``)
    endpoint               the edge's endpoint of the request ("chat",
                           "completions", "messages", "responses", ...: its
                           X-Tokengate-Endpoint header) | null, as key_id
    finish_reason          "stop" | "length" | "abort" | "error" | "repetition"
                           (vllm/v1/engine/__init__.py FinishReason)
    source                 "stats": vLLM's FinishedRequestStats, through the stat
                           logger; "abort": the frontend aborted it (client left,
                           generate() cancelled), for which vLLM 0.32 makes no
                           FinishedRequestStats (see hooks)
    num_prompt_tokens      prompt tokens of this engine request, cached ones included
    num_generation_tokens  tokens the engine generated for it (what
                           vllm:generation_tokens counted for it)
    num_cached_tokens      prompt tokens served from the prefix cache
    prefilled              the engine returned output for it, so vllm:prompt_tokens
                           counted its num_prompt_tokens (false only for a request
                           aborted before its first token)
    max_tokens             the request's max_tokens | null
    num_preemptions        times the scheduler preempted it
    e2e_ms                 arrival to finish, ms (vLLM's e2e_latency)
    queued_ms              queued to first scheduled, ms | null (never scheduled)
    prefill_ms             first scheduled to first token, ms | null
    decode_ms              first token to last token, ms | null

Counting rules, from vLLM 0.32's source (vllm/v1/metrics/stats.py, loggers.py,
vllm/v1/engine/output_processor.py): vllm:generation_tokens grows by
len(new_token_ids) of every engine output the frontend processes, and each request's
num_generation_tokens is the sum of the same numbers, so Σ num_generation_tokens over
records equals the counter's growth. vllm:prompt_tokens grows by the full prompt
(cached tokens included) at each engine request's first output, so Σ num_prompt_tokens
over records with ``prefilled`` equals its growth; an ``n = 2`` request counts its
prompt twice there (two engine requests), while its ``usage.prompt_tokens`` counts it
once. num_generation_tokens counts what the engine generated, including tokens past a
stop string that the detokenizer cut from the text (``usage.completion_tokens``
leaves those out).
"""

from __future__ import annotations

import json
import time
from typing import Any

FIELDS = ("request_id", "index", "n", "ts", "arrival_ts", "model", "key_id", "endpoint",
          "finish_reason", "source",
          "num_prompt_tokens", "num_generation_tokens", "num_cached_tokens", "prefilled",
          "max_tokens", "num_preemptions", "e2e_ms", "queued_ms", "prefill_ms", "decode_ms")


def rfc3339(t: float) -> str:
    """Wall-clock seconds since the epoch as RFC 3339 UTC with milliseconds and ``Z``
    (the edge's ``ts`` format, lua/tokengate/usage.lua)."""
    secs, frac = divmod(round(t * 1000), 1000)
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(secs)) + f".{frac:03d}Z"


def ms(seconds: float | None) -> float | None:
    """Seconds as ms rounded to µs; None for a phase that never happened (vLLM leaves
    its timestamps at 0.0, which makes a negative difference)."""
    if seconds is None or seconds < 0:
        return None
    return round(seconds * 1000.0, 3)


def to_line(record: dict[str, Any]) -> bytes:
    """One record as one line: compact ASCII JSON (a request id is never a reason for an
    encoding error), keys in ``FIELDS`` order, newline-terminated."""
    return (json.dumps({k: record[k] for k in FIELDS}, separators=(",", ":"),
                       ensure_ascii=True, allow_nan=False) + "\n").encode("ascii")


def from_finished(fin: Any, finished_at: float, model: str | None) -> dict[str, Any]:
    """The record of one ``FinishedRequestStats`` (vllm/v1/metrics/stats.py) seen in an
    ``IterationStats`` stamped ``finished_at`` (its ``iteration_timestamp``, wall clock).

    ``fin.tokengate_child`` (``(index, n)``, set by ``hooks``) tells children of one
    parent apart; FinishedRequestStats itself carries only the parent's external id.
    ``fin.tokengate_edge`` (``(key id, endpoint)``, set by ``hooks`` from the request's
    state) says whose request it was.
    """
    index, n = getattr(fin, "tokengate_child", (0, 1))
    key_id, endpoint = getattr(fin, "tokengate_edge", (None, None))
    e2e = max(0.0, float(fin.e2e_latency))
    return {
        "request_id": str(fin.request_id),
        "index": int(index),
        "n": int(n),
        "ts": rfc3339(finished_at),
        "arrival_ts": rfc3339(finished_at - e2e),
        "model": model,
        "key_id": key_id,
        "endpoint": endpoint,
        "finish_reason": str(fin.finish_reason),
        "source": "stats",
        "num_prompt_tokens": int(fin.num_prompt_tokens),
        "num_generation_tokens": int(fin.num_generation_tokens),
        "num_cached_tokens": int(fin.num_cached_tokens),
        "prefilled": True,
        "max_tokens": None if fin.max_tokens_param is None else int(fin.max_tokens_param),
        "num_preemptions": int(fin.num_preemptions),
        "e2e_ms": ms(e2e) or 0.0,
        # vLLM's own differences, as its histograms observe them.
        "queued_ms": ms(fin.queued_time),
        "prefill_ms": ms(fin.prefill_time),
        "decode_ms": ms(fin.decode_time),
    }


def from_aborted(state: Any, aborted_at: float, model: str | None) -> dict[str, Any]:
    """The record of one frontend ``RequestState`` (vllm/v1/engine/output_processor.py)
    that ``OutputProcessor.abort_requests`` dropped at wall-clock ``aborted_at``.

    Mirrors ``IterationStats.update_from_finished_request``: the same fields from the
    same ``RequestStateStats`` (``state.stats``), finish_reason ``abort``; the key and
    endpoint from ``state.tokengate_edge`` (set by ``hooks``).
    """
    key_id, endpoint = getattr(state, "tokengate_edge", (None, None))
    st = state.stats  # None only with log_stats off, which a stat logger plugin turns on
    parent = state.parent_req
    arrival = float(st.arrival_time) if st is not None and st.arrival_time else aborted_at
    scheduled = bool(st is not None and st.scheduled_ts)
    first = bool(st is not None and st.first_token_ts)
    return {
        "request_id": str(state.external_req_id),
        "index": int(state.request_index),
        "n": int(parent.n) if parent is not None else 1,
        "ts": rfc3339(aborted_at),
        "arrival_ts": rfc3339(arrival),
        "model": model,
        "key_id": key_id,
        "endpoint": endpoint,
        "finish_reason": "abort",
        "source": "abort",
        "num_prompt_tokens": int(state.prompt_len),
        "num_generation_tokens": int(st.num_generation_tokens) if st is not None else 0,
        "num_cached_tokens": int(state.num_cached_tokens),
        "prefilled": not state.is_prefilling,
        "max_tokens": None if state.max_tokens_param is None else int(state.max_tokens_param),
        "num_preemptions": int(st.num_preemptions) if st is not None else 0,
        "e2e_ms": ms(max(0.0, aborted_at - arrival)) or 0.0,
        "queued_ms": ms(st.scheduled_ts - st.queued_ts) if st is not None and scheduled
        and st.queued_ts else None,
        "prefill_ms": ms(st.first_token_ts - st.scheduled_ts) if st is not None and first
        and scheduled else None,
        "decode_ms": ms(st.last_token_ts - st.first_token_ts) if st is not None and first
        else None,
    }

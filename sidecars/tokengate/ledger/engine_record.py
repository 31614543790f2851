"""The engine usage record: one JSON line per finished engine request, written on the
vLLM host by tokengate's vLLM plugin (``vllm_patches/``, ``tokengate_vllm.record``).

The plugin appends one line per request vLLM finished, aborted ones included, and per
child of an ``n > 1`` request, to the engine usage file (default
``var/usage/engine.jsonl`` in vLLM's working directory, ``TOKENGATE_ENGINE_USAGE_FILE``).
The file follows the edge's usage file rules (one append per batch, whole lines,
rotation by rename), so ``tokengate.ledger.tail.UsageTail`` reads it as it is; the
ledger joins records with the edge's events (``tokengate.ledger.event``) by
``edge_request_id``.

Schema (every key is present; ``null`` only where shown)::

    request_id             vLLM's external request id: "chatcmpl-<X-Request-Id>"
                           (chat), "cmpl-<X-Request-Id>-<prompt index>" (completions);
                           the children of an n > 1 request share their parent's
    index                  the child's index among the parent's n (0 when n = 1)
    n                      the parent request's n
    ts                     wall-clock time it finished, RFC 3339 UTC
    arrival_ts             wall-clock time vLLM received it, RFC 3339 UTC
    model                  served model name | null
    key_id                 the API key's id the edge forwarded the request for (its
                           X-Tokengate-Key header) | null (not through the edge, or
                           a vLLM without the plugin's middleware); absent in files
                           of older plugins (read as null)
    endpoint               the edge's endpoint ("chat", "messages", ...: its
                           X-Tokengate-Endpoint header) | null, as key_id
    finish_reason          "stop" | "length" | "abort" | "error" | "repetition"
    source                 "stats" (vLLM's FinishedRequestStats) | "abort" (dropped by
                           the frontend's abort: the client left)
    num_prompt_tokens      prompt tokens, cached ones included, tokens
    num_generation_tokens  tokens the engine generated, tokens
    num_cached_tokens      prompt tokens served from the prefix cache, tokens
    prefilled              vllm:prompt_tokens counted this prompt (false only for a
                           request aborted before its first token)
    max_tokens             the request's max_tokens, tokens | null
    num_preemptions        times the scheduler preempted it
    e2e_ms                 arrival to finish, ms
    queued_ms              queued to first scheduled, ms | null
    prefill_ms             first scheduled to first token, ms | null
    decode_ms              first to last token, ms | null

What the numbers add up to (vLLM 0.32, see ``tokengate_vllm.record``):
Σ num_generation_tokens = growth of ``vllm:generation_tokens_total``; Σ
num_prompt_tokens over records with ``prefilled`` = growth of
``vllm:prompt_tokens_total``, which counts an ``n > 1`` request's prompt once per
child (``usage.prompt_tokens`` counts it once: bill the prompt of one child per
``request_id``).

The parser is strict about the keys it knows and ignores keys it does not know, as
``tokengate.ledger.event.parse_event`` is, and raises the same ``EventError``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from tokengate.ledger.event import (
    EventError,
    _bool,
    _enum,
    _get,
    _int,
    _ms,
    _str,
    json_object,
    parse_ts,
)

FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")
SOURCES = ("stats", "abort")

# "chatcmpl-<32 hex>", "chatcmpl-<32 hex>_<i>" (several engine inputs),
# "cmpl-<32 hex>-<i>" (prompt i): vllm/entrypoints/openai/*/serving.py put the
# X-Request-Id header the edge sends ($request_id, 32 hex) after the endpoint's prefix;
# "resp_<32 hex><24 hex>" (Responses: the body's request_id, which the edge writes:
# its request id, then the replica and owner tags of tokengate.responses).
# X-Request-Id of ``tokengate doctor``'s probe request (tokengate.doctor.engine_records,
# the engine_records check): sent to a replica directly, so its record is of no edge
# request; the ledger counts such records as engine_probes, without a warning.
DOCTOR_PROBE_PREFIX = "tokengate-doctor-"
_EDGE_ID = re.compile(r"[a-z]+-([0-9a-f]{32})(?:[-_]\d+)?"
                      r"|resp_([0-9a-f]{32})[0-9a-f]{24}(?:_\d+)?")


@dataclass(frozen=True, slots=True)
class EngineRecord:
    """One finished engine request, as the vLLM plugin reported it (module docstring)."""

    request_id: str
    index: int
    n: int
    ts: str
    arrival_ts: str
    model: str | None
    key_id: str | None
    endpoint: str | None
    finish_reason: str
    source: str
    num_prompt_tokens: int
    num_generation_tokens: int
    num_cached_tokens: int
    prefilled: bool
    max_tokens: int | None
    num_preemptions: int
    e2e_ms: float
    queued_ms: float | None
    prefill_ms: float | None
    decode_ms: float | None

    @property
    def edge_request_id(self) -> str | None:
        """The edge's request id (32 lowercase hex, the usage event's ``request_id``)
        inside ``request_id``; None for a request that did not come through the edge."""
        m = _EDGE_ID.fullmatch(self.request_id)
        return (m.group(1) or m.group(2)) if m else None

    @property
    def doctor_probe(self) -> bool:
        """True for the record of a ``tokengate doctor`` probe (``DOCTOR_PROBE_PREFIX``
        after vLLM's "chatcmpl-" or "cmpl-")."""
        return self.request_id.partition("-")[2].startswith(DOCTOR_PROBE_PREFIX)

    @property
    def key(self) -> str:
        """``<request_id>#<index>``: unique per record (the ledger's dedupe key)."""
        return f"{self.request_id}#{self.index}"


def _opt_int(obj: dict[str, Any], name: str) -> int | None:
    return None if _get(obj, name) is None else _int(obj, name)


def _added_str(obj: dict[str, Any], name: str) -> str | None:
    """A string or null of a field older plugins did not write (absent: null)."""
    return _str(obj, name, nullable=True) if name in obj else None


def parse_record(line: bytes | str) -> EngineRecord:
    """Parse one engine usage line (with or without its newline) into an
    ``EngineRecord``.

    Raises ``EventError`` naming the first offending field: invalid UTF-8 or JSON,
    duplicate keys, NaN/Infinity, a missing key, a wrong type, a value out of range,
    ``index >= n``, an abort record whose finish_reason is not ``abort``, generated
    tokens without ``prefilled``, or ``num_cached_tokens > num_prompt_tokens``.
    """
    obj = json_object(line)
    ts, arrival = _str(obj, "ts"), _str(obj, "arrival_ts")
    parse_ts(ts)
    parse_ts(arrival)
    rec = EngineRecord(
        request_id=_str(obj, "request_id"),
        index=_int(obj, "index"),
        n=_int(obj, "n", 1),
        ts=ts,
        arrival_ts=arrival,
        model=_str(obj, "model", nullable=True),
        key_id=_added_str(obj, "key_id"),
        endpoint=_added_str(obj, "endpoint"),
        finish_reason=_enum(obj, "finish_reason", FINISH_REASONS),
        source=_enum(obj, "source", SOURCES),
        num_prompt_tokens=_int(obj, "num_prompt_tokens"),
        num_generation_tokens=_int(obj, "num_generation_tokens"),
        num_cached_tokens=_int(obj, "num_cached_tokens"),
        prefilled=_bool(obj, "prefilled"),
        max_tokens=_opt_int(obj, "max_tokens"),
        num_preemptions=_int(obj, "num_preemptions"),
        e2e_ms=_ms(obj, "e2e_ms") or 0.0,
        queued_ms=_ms(obj, "queued_ms", nullable=True),
        prefill_ms=_ms(obj, "prefill_ms", nullable=True),
        decode_ms=_ms(obj, "decode_ms", nullable=True),
    )
    if rec.index >= rec.n:
        raise EventError(f"index: {rec.index} >= n {rec.n}")
    if rec.source == "abort" and rec.finish_reason != "abort":
        raise EventError(f"finish_reason: {rec.finish_reason!r} in an abort record")
    if not rec.prefilled and rec.num_generation_tokens:
        raise EventError(f"num_generation_tokens: {rec.num_generation_tokens} without "
                         "prefilled")
    if rec.num_cached_tokens > rec.num_prompt_tokens:
        raise EventError(f"num_cached_tokens: {rec.num_cached_tokens} > num_prompt_tokens "
                         f"{rec.num_prompt_tokens}")
    return rec

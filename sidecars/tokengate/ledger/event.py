"""The usage event: one JSON line per finished request, written by the edge.

The edge appends one line to the usage file (default ``var/usage/usage.jsonl``) for
every request it finished that presented a valid API key, rejected ones (400, 413, 429,
nginx's own refusals, a 408 body timeout ...) included, before the request's log phase
ends. Requests without a valid key write none: a 401 (no key, or one that is not
configured), a 429 of a client blocked for sending invalid keys
(``edge.auth_failures``), and what nginx refuses itself while no valid key is known (a
bad request line, an unsupported HTTP version, a request whose headers carry no valid
key); the edge counts those on its status server instead, so a flood of random keys
costs the ledger and Redis nothing. Files written by older edges may hold events with
``key_id: null``; they are applied like any other. The ledger (``tokengate-ledger``) is
the only reader.

Schema (every key is present; ``null`` only where shown)::

    request_id        32 hex digits, unique per request (the edge's $request_id)
    ts                wall-clock time of the event, RFC 3339 UTC, e.g.
                      "2026-11-29T16:40:00.123Z"
    key_id            the API key's id from tokengate.yaml (never the key); null only
                      in files of older edges
    model             served model name from the body | null
    endpoint          "chat" | "completions" | an API's route ("messages",
                      "count_tokens", "responses", "input_tokens", "response",
                      "response_cancel") | the request path
    status            HTTP status sent to the client (int)
    stream            the client asked for SSE (bool)
    token_estimate    prompt tokens counted at admission, tokens
    count_source      where token_estimate came from: "counter" | "history" (the
                      counter, for a body that continues a stored response: vLLM adds
                      the history, so the count is a lower bound) | "estimate" | "none"
    reserved          tokens reserved in the TPM window at admission, tokens
    prompt_tokens     vLLM usage.prompt_tokens (includes cached_tokens), tokens
    completion_tokens vLLM usage.completion_tokens, tokens
    cached_tokens     vLLM usage.prompt_tokens_details.cached_tokens, tokens
    system_tokens     system-message tokens of the prompt (counter breakdown), tokens
    usage_source      "final" (last usage chunk / JSON body) | "running" (last
                      cumulative chunk seen before a disconnect) | "estimate" (no
                      usage from vLLM, admission estimate) | "none" (not forwarded)
    client_aborted    the client went away before the response ended (bool)
    ttft_ms           time to first byte of the response body, ms, monotonic | null
    total_ms          request time, ms, monotonic clock
    upstream          vLLM address that served it | null
    error             short error code of a failed or rejected request | null
    sanitized_chars          invisible or control characters the edge removed from
                             what the model reads (0 when absent: events written before
                             these three fields existed)
    stripped_special_tokens  literal special tokens removed (edge.special_tokens: strip)
    escaped_special_tokens   literal special tokens escaped, a U+200B inserted in each
                             (edge.special_tokens: escape; 0 in events written before
                             the field existed)
    dropped_system_messages  system messages dropped as exact repeats of an earlier one
    count_drift       vLLM's usage.prompt_tokens - token_estimate, tokens, signed: not 0
                      when the counter and the upstream disagree on the prompt (the
                      upstream is not the vLLM the counter mirrors: `tokengate doctor`);
                      0 when they agree or are not compared (count_source "estimate",
                      no usage from vLLM, several completions prompts, n > 1) and in
                      events written before the field existed
    expected_cached_tokens  prompt tokens the chosen replica was expected to serve from
                      its prefix cache (routing.policy prefix), tokens; 0 when no
                      prediction was made and in events written before the field existed
    expected_cached_source  where that prediction came from: "events" (the counter's
                      index of the replica's KV events) | "approximate" (the edge's
                      record of what it sent where) | null (none made; older events)
    queue_ms          how long the request waited in its key's queue (edge.queue), ms;
                      0 when it did not queue and in events written before the field
    trace             the request's span data when tracing is on (``tracing``) and the
                      request was sampled, refused, failed or aborted, else null
                      (``lua/tokengate/trace.lua``, record): trace_id (32 hex),
                      span_id (16 hex: the edge's span), parent_span_id (16 hex | null:
                      the trace started at the edge), upstream_span_id (16 hex | null:
                      not forwarded; vLLM's span is its child), sampled (bool),
                      tracestate (string | null), start_ms (wall clock, epoch ms),
                      spans ([[name, offset_ms, duration_ms], ...]: "count", "queue",
                      "limits"; offsets from the start of the access phase), upstream
                      ([offset_ms, duration_ms] | null), finish_reasons ([string]).
                      Never a reason to skip an event: a trace that does not parse is
                      read as null (``Trace.parse``), and the event is billed.
    max_tokens_requested  the completion limit the client sent (max_tokens,
                      max_completion_tokens, max_output_tokens), tokens; null without one
                      and in events written before the field existed
    max_tokens_applied  the completion limit the request was forwarded and reserved with,
                      tokens: vLLM's fit into the room the prompt leaves
                      (``get_max_tokens`` in vllm/entrypoints/serve/utils/api_utils.py),
                      lowered by the gateway's ``max_tokens_cap`` (model's or key's);
                      null when none was worked out (refused before, count_tokens,
                      embeddings) and in older events
    session_id        the agent session of the request (``lua/tokengate/session.lua``:
                      X-Session-Id, X-Claude-Code-Session-Id, Codex's session_id, a
                      Responses chain, metadata.user_id, safety_identifier, user): 1-128
                      printable ASCII characters (a longer or non-printable value arrives
                      as "sha256:<32 hex>") | null (none, and events written before the
                      field existed). Never a reason to skip an event: a value that is
                      not such a string is read as null.
    slo               the latency targets' record (``lua/tokengate/slo.lua`` finish:
                      class, decision, targets, predicted and observed TTFT and TPOT in
                      ms, decision_us) | null (no targets, older events); an object is
                      kept as is, anything else read as null.
    batch_id          the batch of a line the batch service sent (``tokengate.batch``),
                      "batch_<hex>" | null (an online request; older events)
    custom_id         that line's custom_id, 1-512 characters | null

The edge's writer (``lua/tokengate/usage.lua``, ``FIELDS``) writes exactly these keys
in this order; ``tests/edge/test_edge_access_log.py`` checks a real edge's lines against
``UsageEvent``.

The parser is strict about the keys it knows (type, range, enumerations, duplicate
keys, NaN, empty strings: an absent value is ``null``) and ignores keys it does not
know, so a newer edge that adds a field does not make an older ledger skip billable
events.
"""

from __future__ import annotations

import json
import logging
import math
import re
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from typing import Any

COUNT_SOURCES = ("counter", "history", "estimate", "none")
USAGE_SOURCES = ("final", "running", "estimate", "none")
EXPECTED_CACHED_SOURCES = ("events", "approximate")

log = logging.getLogger("tokengate.ledger")

_REQUEST_ID = re.compile(r"[0-9a-fA-F]{32}")
_TS = re.compile(r"(\d{4})-(\d{2})-(\d{2})T(\d{2}):(\d{2}):(\d{2})(?:\.(\d{1,9}))?Z")


class EventError(ValueError):
    """A usage line that is not a valid event; the message names the field."""


@dataclass(frozen=True, slots=True)
class UsageEvent:
    """One finished request, as the edge reported it (see the module docstring)."""

    request_id: str
    ts: str
    key_id: str | None
    model: str | None
    endpoint: str
    status: int
    stream: bool
    token_estimate: int
    count_source: str
    reserved: int
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    system_tokens: int
    usage_source: str
    client_aborted: bool
    ttft_ms: float | None
    total_ms: float
    upstream: str | None
    error: str | None
    sanitized_chars: int = 0
    stripped_special_tokens: int = 0
    escaped_special_tokens: int = 0
    dropped_system_messages: int = 0
    count_drift: int = 0
    expected_cached_tokens: int = 0
    expected_cached_source: str | None = None
    queue_ms: int = 0
    trace: Trace | None = None
    max_tokens_requested: int | None = None
    max_tokens_applied: int | None = None
    session_id: str | None = None
    slo: dict[str, Any] | None = None
    batch_id: str | None = None
    custom_id: str | None = None

    @property
    def time(self) -> datetime:
        """``ts`` as an aware UTC datetime (microsecond precision)."""
        return parse_ts(self.ts)

    @property
    def usage_endpoint(self) -> str:
        """The endpoint the usage counters split the event under: "batch" for a batch
        line (its own price), else ``endpoint``."""
        return "batch" if self.batch_id is not None else self.endpoint

    @property
    def day(self) -> str:
        """The UTC day of ``ts``, ``YYYY-MM-DD``: the ledger's day bucket."""
        return self.ts[:10]

    def to_json(self) -> str:
        """The event as one JSON line (no newline), keys in schema order."""
        return json.dumps(asdict(self), separators=(",", ":"), ensure_ascii=False)


_HEX32 = re.compile(r"[0-9a-f]{32}")
_HEX16 = re.compile(r"[0-9a-f]{16}")
_SPAN_NAMES = ("count", "queue", "limits")


def _duration(v: Any, most: float = 1e10) -> float:
    """A non-negative finite number of ms below ``most``; raises EventError."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) \
            or not 0 <= v < most:
        raise EventError(f"not a duration in ms: {v!r}")
    return float(v)


@dataclass(frozen=True, slots=True)
class Trace:
    """A usage event's span data (the ``trace`` field above); durations in ms."""

    trace_id: str
    span_id: str
    parent_span_id: str | None
    upstream_span_id: str | None
    sampled: bool
    tracestate: str | None
    start_ms: float
    spans: tuple[tuple[str, float, float], ...]
    upstream: tuple[float, float] | None
    finish_reasons: tuple[str, ...]

    @classmethod
    def parse(cls, v: Any) -> Trace | None:
        """``v`` (the decoded ``trace`` value) as a Trace; None for null. Raises
        ``EventError`` naming what is wrong."""
        if v is None:
            return None
        if not isinstance(v, dict):
            raise EventError("not an object")

        def ident(name: str, pattern: re.Pattern[str], nullable: bool = False) -> str | None:
            x = v.get(name)
            if x is None and nullable:
                return None
            if not isinstance(x, str) or not pattern.fullmatch(x) or set(x) == {"0"}:
                raise EventError(f"{name}: {x!r}")
            return x

        spans = v.get("spans")
        if not isinstance(spans, list) or len(spans) > 16:
            raise EventError("spans: not a list of at most 16")
        parsed = []
        for s in spans:
            if not (isinstance(s, list) and len(s) == 3 and s[0] in _SPAN_NAMES):
                raise EventError(f"spans: {s!r}")
            parsed.append((str(s[0]), _duration(s[1]), _duration(s[2])))
        up = v.get("upstream")
        if up is not None and not (isinstance(up, list) and len(up) == 2):
            raise EventError(f"upstream: {up!r}")
        reasons = v.get("finish_reasons")
        if not isinstance(reasons, list) or len(reasons) > 16 \
                or not all(isinstance(r, str) and 0 < len(r) <= 64 for r in reasons):
            raise EventError(f"finish_reasons: {reasons!r}")
        state = v.get("tracestate")
        if state is not None and (not isinstance(state, str) or len(state) > 512):
            raise EventError("tracestate: not a string of at most 512 characters")
        if not isinstance(v.get("sampled"), bool):
            raise EventError("sampled: not a boolean")
        return cls(trace_id=str(ident("trace_id", _HEX32)),
                   span_id=str(ident("span_id", _HEX16)),
                   parent_span_id=ident("parent_span_id", _HEX16, nullable=True),
                   upstream_span_id=ident("upstream_span_id", _HEX16, nullable=True),
                   sampled=v["sampled"], tracestate=state,
                   start_ms=_duration(v.get("start_ms"), 1e15), spans=tuple(parsed),
                   upstream=(_duration(up[0]), _duration(up[1])) if up else None,
                   finish_reasons=tuple(reasons))


def parse_ts(ts: str) -> datetime:
    """Parse an RFC 3339 UTC timestamp with a ``Z`` suffix; raises ``EventError``."""
    m = _TS.fullmatch(ts)
    if m is None:
        raise EventError(f"ts: expected RFC 3339 UTC like 2026-11-29T16:40:00.123Z, got {ts!r}")
    y, mo, d, h, mi, s, frac = m.groups()
    try:
        return datetime(int(y), int(mo), int(d), int(h), int(mi), int(s),
                        int((frac or "0").ljust(6, "0")[:6]), tzinfo=UTC)
    except ValueError as e:
        raise EventError(f"ts: {e}: {ts!r}") from None


def _reject_constant(name: str) -> Any:
    raise EventError(f"{name} is not valid JSON")


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise EventError(f"{k}: duplicate key")
        out[k] = v
    return out


def json_object(line: bytes | str) -> dict[str, Any]:
    """One line as a strict JSON object: UTF-8, no duplicate keys, no NaN/Infinity.
    Raises ``EventError``. Shared by the edge's events and the engine's records."""
    try:
        text = line.decode("utf-8") if isinstance(line, bytes) else line
        obj = json.loads(text, object_pairs_hook=_no_duplicates,
                         parse_constant=_reject_constant)
    except UnicodeDecodeError as e:
        raise EventError(f"not UTF-8: {e}") from None
    except json.JSONDecodeError as e:
        raise EventError(f"not JSON: {e}") from None
    if not isinstance(obj, dict):
        raise EventError("not a JSON object")
    return obj


def _get(obj: dict[str, Any], name: str) -> Any:
    if name not in obj:
        raise EventError(f"{name}: missing")
    return obj[name]


def _str(obj: dict[str, Any], name: str, nullable: bool = False) -> Any:
    v = _get(obj, name)
    if v is None and nullable:
        return None
    if not isinstance(v, str) or v == "":
        raise EventError(f"{name}: expected a non-empty string{' or null' if nullable else ''}"
                         f", got {v!r}")
    return v


def _int(obj: dict[str, Any], name: str, lo: int = 0, hi: int = 2**53) -> int:
    v = _get(obj, name)
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise EventError(f"{name}: expected an integer in [{lo}, {hi}], got {v!r}")
    return v


def _count(obj: dict[str, Any], name: str) -> int:
    """An optional non-negative count: 0 when absent (older edges did not write it)."""
    return _int(obj, name) if name in obj else 0


def _optional_count(obj: dict[str, Any], name: str) -> int | None:
    """A count that may be null: None when absent or null (older edges did not write
    it)."""
    return _int(obj, name) if obj.get(name) is not None else None


def _signed(obj: dict[str, Any], name: str) -> int:
    """An optional signed count: 0 when absent (older edges did not write it)."""
    return _int(obj, name, -2**53, 2**53) if name in obj else 0


def _bool(obj: dict[str, Any], name: str) -> bool:
    v = _get(obj, name)
    if not isinstance(v, bool):
        raise EventError(f"{name}: expected true or false, got {v!r}")
    return v


def _ms(obj: dict[str, Any], name: str, nullable: bool = False) -> float | None:
    v = _get(obj, name)
    if v is None and nullable:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
        raise EventError(f"{name}: expected a duration in ms >= 0, got {v!r}")
    return float(v)


def _enum(obj: dict[str, Any], name: str, allowed: tuple[str, ...]) -> str:
    v = _get(obj, name)
    if v not in allowed:
        raise EventError(f"{name}: one of {', '.join(allowed)}, got {v!r}")
    return str(v)


def _trace(obj: dict[str, Any], rid: str) -> Trace | None:
    """The event's trace, or None: absent, null, or not valid (logged: a trace is never
    a reason to skip a billable event)."""
    try:
        return Trace.parse(obj.get("trace"))
    except EventError as e:
        log.warning("usage event %s: trace ignored (%s)", rid, e)
        return None


SESSION_MAX = 128  # bytes of a session id (lua/tokengate/session.lua, MAX_BYTES)
_SESSION = re.compile(rf"[\x20-\x7e]{{1,{SESSION_MAX}}}")


def _session(obj: dict[str, Any], rid: str) -> str | None:
    """The event's session id, or None: absent, null, or not 1-128 printable ASCII
    characters (logged: a session id is never a reason to skip a billable event)."""
    v = obj.get("session_id")
    if v is None:
        return None
    if not isinstance(v, str) or not _SESSION.fullmatch(v):
        log.warning("usage event %s: session_id ignored (not 1-%d printable ASCII "
                    "characters)", rid, SESSION_MAX)
        return None
    return v


CUSTOM_ID_MAX = 512  # bytes of a batch line's custom_id (tokengate.batch.lines)


def _batch_field(obj: dict[str, Any], name: str, rid: str) -> str | None:
    """A batch line's ``batch_id`` or ``custom_id``, or None: absent, null, or not a
    string of 1-512 characters (logged: never a reason to skip a billable event)."""
    v = obj.get(name)
    if v is None:
        return None
    if not isinstance(v, str) or not 0 < len(v) <= CUSTOM_ID_MAX:
        log.warning("usage event %s: %s ignored (not a string of 1-%d characters)", rid,
                    name, CUSTOM_ID_MAX)
        return None
    return v


def parse_event(line: bytes | str) -> UsageEvent:
    """Parse one usage line (with or without its newline) into a ``UsageEvent``.

    Raises ``EventError`` naming the first offending field: invalid UTF-8 or JSON,
    duplicate keys, NaN/Infinity, a missing key, a wrong type, a value out of range,
    or ``cached_tokens > prompt_tokens``.
    """
    obj = json_object(line)
    rid = _str(obj, "request_id")
    if not _REQUEST_ID.fullmatch(rid):
        raise EventError(f"request_id: expected 32 hex digits, got {rid!r}")
    ts = _str(obj, "ts")
    parse_ts(ts)
    ev = UsageEvent(
        request_id=rid.lower(),
        ts=ts,
        key_id=_str(obj, "key_id", nullable=True),
        model=_str(obj, "model", nullable=True),
        endpoint=_str(obj, "endpoint"),
        status=_int(obj, "status", 100, 999),
        stream=_bool(obj, "stream"),
        token_estimate=_int(obj, "token_estimate"),
        count_source=_enum(obj, "count_source", COUNT_SOURCES),
        reserved=_int(obj, "reserved"),
        prompt_tokens=_int(obj, "prompt_tokens"),
        completion_tokens=_int(obj, "completion_tokens"),
        cached_tokens=_int(obj, "cached_tokens"),
        system_tokens=_int(obj, "system_tokens"),
        usage_source=_enum(obj, "usage_source", USAGE_SOURCES),
        client_aborted=_bool(obj, "client_aborted"),
        ttft_ms=_ms(obj, "ttft_ms", nullable=True),
        total_ms=_ms(obj, "total_ms") or 0.0,
        upstream=_str(obj, "upstream", nullable=True),
        error=_str(obj, "error", nullable=True),
        sanitized_chars=_count(obj, "sanitized_chars"),
        stripped_special_tokens=_count(obj, "stripped_special_tokens"),
        escaped_special_tokens=_count(obj, "escaped_special_tokens"),
        dropped_system_messages=_count(obj, "dropped_system_messages"),
        count_drift=_signed(obj, "count_drift"),
        expected_cached_tokens=_count(obj, "expected_cached_tokens"),
        expected_cached_source=(_enum(obj, "expected_cached_source", EXPECTED_CACHED_SOURCES)
                                if obj.get("expected_cached_source") is not None else None),
        queue_ms=_count(obj, "queue_ms"),
        trace=_trace(obj, rid),
        max_tokens_requested=_optional_count(obj, "max_tokens_requested"),
        max_tokens_applied=_optional_count(obj, "max_tokens_applied"),
        session_id=_session(obj, rid),
        slo=obj["slo"] if isinstance(obj.get("slo"), dict) else None,
        batch_id=_batch_field(obj, "batch_id", rid),
        custom_id=_batch_field(obj, "custom_id", rid),
    )
    if ev.cached_tokens > ev.prompt_tokens:
        raise EventError(f"cached_tokens: {ev.cached_tokens} > prompt_tokens "
                         f"{ev.prompt_tokens}")
    return ev

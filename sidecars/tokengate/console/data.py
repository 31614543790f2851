"""What the console's pages show, read from where the rest of tokengate keeps it:

- keys: ``tokengate.ledger.admin.snapshot`` (what ``tokengate keys list`` prints: limits,
  models, budgets, spend of the period from the ledger's rows, the budget counters with
  the reservations of requests in flight) and, with global limits, each key's current
  minute from its Redis window (``tokengate.limits.window``'s layout);
- usage: ``tokengate.ledger.report.query``, the rows ``tokengate usage`` prints;
- replicas: each edge's status server (``/tokengate/status``: health, KV cache usage,
  waiting requests, outstanding reserved tokens per replica, and the counts of requests
  refused before a key was known);
- audit: the ledger's audit stream (``tokengate.redis_keys.AUDIT_KEY``), newest first.

The usage files' requests (the request log, the Live page's refusals and charts) are
``tokengate.console.requests``' and ``tokengate.console.traffic``'s.
"""

from __future__ import annotations

import csv
import io
import json
import urllib.request
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, date, datetime
from typing import Any

from redis.exceptions import RedisError

from tokengate import config as tg_config
from tokengate import redis_keys
from tokengate.ledger import admin, report
from tokengate.redis_client import SyncRedis

WINDOW_MS = 60_000           # the global limits' window (tokengate.limits.window)
STATUS_TIMEOUT_S = 2.0


@dataclass
class KeyMinute:
    """A key's requests and tokens (prompt + reserved completion, settled when done) in
    its current one-minute window, all edges together (global limits' Redis window)."""

    requests: int
    tokens: int


def key_minutes(cfg: tg_config.Config, client: SyncRedis) -> dict[str, KeyMinute] | None:
    """Key id -> its current minute from the Redis windows, or None without global limits
    (each edge's own windows live in its nginx's shared memory). Raises
    ``RedisError``."""
    if not cfg.global_limits.enabled or not cfg.keys:
        return None
    sec, usec = client.time()
    since_ms = int(sec) * 1000 + int(usec) // 1000 - WINDOW_MS
    pipe = client.pipeline(transaction=False)
    names = list(cfg.keys)
    for key_id in names:
        z, _h = redis_keys.window_keys(key_id)
        pipe.zrangebyscore(z, f"({since_ms}", "+inf")
    ids = pipe.execute()
    pipe = client.pipeline(transaction=False)
    for key_id, rids in zip(names, ids, strict=True):
        _z, h = redis_keys.window_keys(key_id)
        pipe.hmget(h, rids or ["#none"])
    tokens = pipe.execute()
    return {key_id: KeyMinute(len(rids), sum(int(t or 0) for t in toks) if rids else 0)
            for key_id, rids, toks in zip(names, ids, tokens, strict=True)}


def keys_view(cfg: tg_config.Config, client: SyncRedis, today: date
              ) -> tuple[list[dict[str, Any]], dict[str, KeyMinute] | None, str | None]:
    """(``admin.snapshot``'s entries, ``key_minutes``, a problem to show or None)."""
    entries = admin.snapshot(cfg, client, today)
    problem = None
    try:
        minutes = key_minutes(cfg, client)
    except (RedisError, OSError) as e:
        minutes, problem = None, f"Redis unavailable: {e}"
    if problem is None and any(b["spent"] is None for e in entries for b in e["budgets"]):
        problem = "Redis unavailable: the spend of the budgets is unknown"
    return entries, minutes, problem


@dataclass
class UsageQuery:
    """A range of UTC days and optional filters (None: every key / model)."""

    since: date
    until: date
    key: str | None = None
    model: str | None = None


def usage_rows(client: SyncRedis, q: UsageQuery) -> list[report.UsageRow]:
    """The ledger's rows per key / model / day of ``q`` (``tokengate usage``'s), sorted
    by day, key, model. Raises ``RedisError``."""
    return report.query(client, q.since, q.until, q.key, q.model)


def endpoint_rows(rows: Iterable[report.UsageRow]) -> list[dict[str, Any]]:
    """Requests, prompt and completion tokens and cost per endpoint, summed over
    ``rows``, the endpoint with most requests first."""
    out: dict[str, dict[str, float]] = {}
    for r in rows:
        for ep, counts in r.endpoints.items():
            mine = out.setdefault(ep, dict.fromkeys(report.ENDPOINT_FIELDS, 0))
            for f, v in counts.items():
                mine[f] += v
    return [{"endpoint": ep, **counts} for ep, counts in
            sorted(out.items(), key=lambda kv: (-kv[1]["requests"], kv[0]))]


CSV_COLUMNS = ("day", "key", "model", "requests", "errors", "prompt_tokens",
               "cached_tokens", "completion_tokens", "cost")
ENDPOINT_CSV_COLUMNS = ("endpoint", "requests", "prompt_tokens", "completion_tokens", "cost")


def _cell(value: Any) -> str:
    """A CSV cell: a text that a spreadsheet would run as a formula (=, +, -, @, tab,
    carriage return first) gets a leading apostrophe (OWASP's CSV injection advice);
    a cost keeps its 15 significant digits."""
    if isinstance(value, float):
        return f"{value:.15g}"
    text = "" if value is None else str(value)
    return "'" + text if text[:1] in ("=", "+", "-", "@", "\t", "\r") else text


def usage_csv(rows: Sequence[report.UsageRow]) -> str:
    """The usage table as CSV (``CSV_COLUMNS``, one line per key / model / day)."""
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\r\n")
    w.writerow(CSV_COLUMNS)
    for r in rows:
        w.writerow([_cell(v) for v in (r.day, r.key_id, r.model, r.requests, r.errors,
                                       r.prompt_tokens, r.cached_tokens,
                                       r.completion_tokens, r.cost)])
    return buf.getvalue()


def endpoints_csv(rows: Sequence[dict[str, Any]]) -> str:
    """``endpoint_rows`` as CSV (``ENDPOINT_CSV_COLUMNS``)."""
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\r\n")
    w.writerow(ENDPOINT_CSV_COLUMNS)
    for r in rows:
        w.writerow([_cell(r[c]) for c in ENDPOINT_CSV_COLUMNS])
    return buf.getvalue()


@dataclass
class Replica:
    """One replica of a model as an edge sees it."""

    edge: str
    model: str
    name: str
    healthy: bool
    asleep: bool
    kv_cache_usage: float | None      # 0..1, vLLM's kv_cache_usage_perc; None: unknown
    waiting: int | None               # vLLM's num_requests_waiting
    running: int | None
    outstanding_tokens: int           # reserved tokens of the requests it serves now


@dataclass
class EdgeLive:
    """An edge's status server: its replicas and its refusals of requests without a
    valid key (those write no usage event), since nginx started."""

    address: str
    error: str | None = None
    replicas: list[Replica] = field(default_factory=list)
    unauthenticated: dict[str, int] = field(default_factory=dict)
    budget_refused: int = 0


UNAUTHENTICATED = ("missing_key", "invalid_key", "blocked", "refused")


def edge_live(address: str) -> EdgeLive:
    """``GET http://<address>/tokengate/status``; an edge that does not answer gives
    an ``EdgeLive`` with its error."""
    live = EdgeLive(address)
    try:
        with urllib.request.urlopen(f"http://{address}/tokengate/status",
                                    timeout=STATUS_TIMEOUT_S) as r:
            doc = json.loads(r.read())
    except (OSError, ValueError) as e:
        live.error = f"no answer: {e}"
        return live
    for model, replicas in sorted((doc.get("upstreams") or {}).items()):
        for name, st in sorted(replicas.items()):
            live.replicas.append(Replica(
                address, model, name, healthy=not st.get("out"), asleep=bool(st.get("asleep")),
                kv_cache_usage=st.get("kv_cache_usage"), waiting=st.get("num_requests_waiting"),
                running=st.get("num_requests_running"),
                outstanding_tokens=int(st.get("outstanding_tokens") or 0)))
    live.unauthenticated = {r: int(doc.get(f"unauthenticated_{r}") or 0)
                            for r in UNAUTHENTICATED}
    live.budget_refused = int(doc.get("global_budget_refused") or 0)
    return live


def status_addresses(cfg: tg_config.Config) -> list[str]:
    """The edges' status servers the live page reads (``ledger.console.edge_status``,
    else ``edge.status_listen``)."""
    return list(cfg.ledger.console.edge_status) or [cfg.edge.status_listen]


def today() -> date:
    return datetime.now(UTC).date()


def keys_with_usage(client: SyncRedis, since: date, until: date) -> list[str]:
    """The key ids with usage on days ``since``..``until`` (the ledger's day index, the
    one ``report.query`` reads), revoked keys included, sorted. Raises ``RedisError``."""
    days = [str(d) for d in client.zrangebyscore(
        redis_keys.DAYS_KEY, redis_keys.day_score(since.isoformat()),
        redis_keys.day_score(until.isoformat()))]
    pipe = client.pipeline(transaction=False)
    for day in days:
        pipe.smembers(redis_keys.idx_key(day))
    found: set[str] = set()
    for members in pipe.execute() if days else []:
        for m in members:
            key_id = json.loads(m)[0]
            if key_id:
                found.add(key_id)
    return sorted(found)


@dataclass(frozen=True)
class AuditEntry:
    """One entry of the audit stream as the audit page shows it: ``id`` (the stream's,
    epoch ms-sequence), ``ts`` (UTC, ISO 8601), ``kind`` (console, cli; "request" for
    a billed usage event), who (``admin``), ``action``, ``key``, ``detail``,
    ``result`` and the client address."""

    id: str
    ts: str
    kind: str
    admin: str
    action: str
    key: str
    detail: str
    result: str
    client: str


AUDIT_PAGE = 500   # stream entries read per XREVRANGE


def audit_entries(client: SyncRedis, shown: int, scanned_max: int,
                  changes_only: bool = True) -> tuple[list[AuditEntry], int]:
    """The newest ``shown`` entries of the audit stream, newest first, reading at most
    ``scanned_max`` entries (the usage events' entries are most of the stream: with
    ``changes_only`` they are skipped); returns (entries, entries read). Raises
    ``RedisError``."""
    out: list[AuditEntry] = []
    scanned = 0
    upper = "+"
    while len(out) < shown and scanned < scanned_max:
        batch = client.xrevrange(redis_keys.AUDIT_KEY, upper, "-",
                                 count=min(AUDIT_PAGE, scanned_max - scanned))
        if not batch:
            break
        for sid, fields in batch:
            scanned += 1
            f = {str(k): str(v) for k, v in (fields or {}).items()}
            if "kind" not in f and changes_only:
                continue
            if "kind" in f:
                entry = AuditEntry(str(sid), f.get("ts", ""), f["kind"], f.get("admin", ""),
                                   f.get("action", ""), f.get("key", ""),
                                   f.get("detail", ""), f.get("result", ""),
                                   f.get("client", ""))
            else:  # a billed request (tokengate.ledger.join)
                detail = " ".join(f"{k}={v}" for k, v in f.items()
                                  if k not in ("rid", "ts", "key"))
                entry = AuditEntry(str(sid), f.get("ts", ""), "request", "", "billed",
                                   f.get("key", ""), f"rid={f.get('rid', '')} {detail}",
                                   "ok", "")
            out.append(entry)
            if len(out) >= shown:
                break
        # the next page ends just before the last entry read (an exclusive range)
        last = batch[-1][0]
        upper = "(" + (last.decode() if isinstance(last, bytes) else str(last))
        if len(batch) < AUDIT_PAGE:
            break
    return out, scanned

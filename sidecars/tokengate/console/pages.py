"""The console's pages that only read: usage (the ledger's rows per day), Live (the
replicas, the refusals and the traffic charts of the last hours, refreshed by the page
itself), the request log and one request's event, and the audit stream. A mixin of
``tokengate.console.app.Console``, whose ``page`` renders them."""

from __future__ import annotations

import argparse
import json
import re
import urllib.parse
from datetime import date, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from redis.exceptions import RedisError

from tokengate import config as tg_config
from tokengate.console import charts, data, requests
from tokengate.console.traffic import Bucket, Traffic
from tokengate.console.web import Request, Response
from tokengate.ledger import report, tail
from tokengate.redis_client import SyncRedis

MAX_DAYS = 366              # the longest usage range, days
AUDIT_SHOWN = 200           # entries on the audit page
AUDIT_SCANNED = 20_000      # stream entries read at most to find them
# Live's ranges: (span s, bucket s, what a bucket is)
RANGES = {"1h": (3600, 60, "minute"), "6h": (6 * 3600, 300, "5 minutes"),
          "24h": (24 * 3600, 3600, "hour")}
REFRESH_S = 15              # Live reloads itself this often by default (meta refresh)
MAX_REFRESH_S = 3600
LATEST_REFUSALS = 10        # the newest refusals Live lists
LATEST_SCAN_BYTES = 4 << 20  # ... found among this much of the newest events
REQUEST_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")
BATCHES_SHOWN = 100         # a key's newest batches on the batches page


class ReportPages:
    """The read-only pages (see the module docstring)."""

    client: SyncRedis
    usage_file: Path
    traffic: Traffic

    if TYPE_CHECKING:
        def page(self, status: int, template: str, req: Request | None,
                 headers: list[tuple[str, str]] | None = None, **ctx: Any) -> Response: ...

        def plain(self, status: int, message: str,
                  headers: list[tuple[str, str]] | None = None) -> Response: ...

    # --- usage ---------------------------------------------------------------------

    def _usage_query(self, req: Request, cfg: tg_config.Config
                     ) -> tuple[data.UsageQuery, dict[str, str], dict[str, str]]:
        """(the query, the form's values, a message per bad field); a bad field falls
        back to its default."""
        today = data.today()
        values = {"since": req.query.get("since", "")[:40] or (today - timedelta(days=6)).isoformat(),
                  "until": req.query.get("until", "")[:40] or today.isoformat(),
                  "key": req.query.get("key", "")[:64], "model": req.query.get("model", "")[:200]}
        errors: dict[str, str] = {}
        days: dict[str, date] = {}
        for f, default in (("since", today - timedelta(days=6)), ("until", today)):
            try:
                days[f] = report.parse_day(values[f], today)
            except (argparse.ArgumentTypeError, ValueError, OverflowError) as e:
                errors[f] = str(e) if str(e) else "not a day"
                days[f] = default
        if days["since"] > days["until"]:
            errors["since"] = f"{days['since']} is after {days['until']}"
            days["since"] = days["until"]
        if (days["until"] - days["since"]).days >= MAX_DAYS:
            errors["since"] = f"a range is at most {MAX_DAYS} days"
            days["since"] = days["until"] - timedelta(days=MAX_DAYS - 1)
        return data.UsageQuery(days["since"], days["until"], values["key"] or None,
                               values["model"] or None), values, errors

    def usage_page(self, req: Request, cfg: tg_config.Config) -> Response:
        q, values, errors = self._usage_query(req, cfg)
        problem = None
        try:
            rows = data.usage_rows(self.client, q)
        except (RedisError, OSError) as e:
            rows, problem = [], f"Redis unavailable: {e}"
        days = [(q.since + timedelta(days=i)).isoformat()
                for i in range((q.until - q.since).days + 1)]
        per_key_model = sorted(report.group(rows, ["key", "model"]),
                               key=lambda r: (-r.cost, r.key_id or "", r.model or ""))
        query = urllib.parse.urlencode({k: v for k, v in values.items() if v})
        return self.page(400 if errors else 200, "usage.html", req, title="Usage",
                         values=values, errors=errors, rows=rows, problem=problem,
                         total=report.total(rows), per_key_model=per_key_model,
                         endpoints=data.endpoint_rows(rows), query=query,
                         chart_days=charts.tokens_per_day(rows, days),
                         chart_keys=charts.top_keys(rows, cfg.currency),
                         chart_models=charts.spend_per_model(rows, cfg.currency),
                         keys=self._usage_keys(cfg, q), models=list(cfg.models),
                         page="usage",
                         since=q.since.isoformat(), until=q.until.isoformat())

    def usage_csv(self, req: Request, cfg: tg_config.Config) -> Response:
        q, _values, errors = self._usage_query(req, cfg)
        if errors:
            return self.plain(400, "; ".join(f"{k}: {v}" for k, v in errors.items()))
        try:
            rows = data.usage_rows(self.client, q)
        except (RedisError, OSError) as e:
            return self.plain(503, f"Redis unavailable: {e}")
        table = req.query.get("table", "usage")
        text = data.endpoints_csv(data.endpoint_rows(rows)) if table == "endpoints" \
            else data.usage_csv(rows)
        name = f"tokengate-{'endpoints' if table == 'endpoints' else 'usage'}-{q.since}-{q.until}.csv"
        return Response(200, text.encode(), "text/csv; charset=utf-8",
                        [("Content-Disposition", f'attachment; filename="{name}"')])

    # --- live ----------------------------------------------------------------------

    def live_page(self, req: Request, cfg: tg_config.Config) -> Response:
        """Each edge's replicas, the refusals by reason and the requests, tokens and
        latency of the last ``range`` (1h per minute, 6h per 5 minutes, 24h per hour)
        from the usage files; the page reloads itself every ``refresh`` seconds
        (``REFRESH_S``; "off": never) with a meta refresh, which the content security
        policy allows (it runs no script)."""
        span_name = req.query.get("range", "1h")
        if span_name not in RANGES:
            span_name = "1h"
        span_s, step_s, step = RANGES[span_name]
        given = req.query.get("refresh", "")
        refresh: int | None = REFRESH_S
        if given == "off":
            refresh = None
        elif given.isdigit() and given.isascii():
            refresh = min(max(int(given), 1), MAX_REFRESH_S)
        self.traffic.update()
        buckets = self.traffic.buckets(span_s, step_s)
        latest = requests.request_log(self.usage_file, requests.Filters(status="refused"),
                                      size=LATEST_REFUSALS, scan_bytes=LATEST_SCAN_BYTES)
        edges = [data.edge_live(a) for a in data.status_addresses(cfg)]
        # what the range links keep of the refresh asked for
        refresh_q = "" if not given else f"&refresh={'off' if refresh is None else refresh}"
        return self.page(200, "live.html", req, title="Live", edges=edges, page="live",
                         refusals=self.traffic.refusals(span_s), latest=latest,
                         span=span_name, ranges=list(RANGES), step=step,
                         refresh=refresh, refresh_q=refresh_q,
                         partial_before=self.traffic.partial_before,
                         totals=_totals(buckets),
                         chart_requests=charts.requests_per_step(buckets, step),
                         chart_tokens=charts.tokens_per_step(buckets, step),
                         chart_latency=charts.latency(buckets, step))

    # --- requests ------------------------------------------------------------------

    def requests_page(self, req: Request, cfg: tg_config.Config) -> Response:
        """The request log, newest first, ``requests.PAGE_SIZE`` a page: filters ``key``,
        ``model`` and ``status`` (answered, refused, 4xx, 429, ...); ``before``, a
        cursor of an earlier page, goes on with older requests."""
        values = {"key": req.query.get("key", "")[:64],
                  "model": req.query.get("model", "")[:200],
                  "status": req.query.get("status", "")[:16]}
        errors = {}
        if values["status"] and not requests.STATUS_FILTER.fullmatch(values["status"]):
            errors["status"] = (f"{values['status']!r}: answered, refused, a class such as "
                                "4xx or a code such as 429")
            values["status"] = ""
        before = None
        if req.query.get("before"):
            before = tail.Position.decode(req.query["before"][:80])
            if before is None or not re.fullmatch(r"[0-9a-f]{32}", before.file_id):
                errors["before"] = "not a page of this log: the newest requests instead"
                before = None
        filters = requests.Filters(values["key"] or None, values["model"] or None,
                                   values["status"] or None)
        page = requests.request_log(self.usage_file, filters, before)
        query = {k: v for k, v in values.items() if v}
        older = urllib.parse.urlencode({**query, "before": page.older}) if page.older \
            else None
        return self.page(400 if errors else 200, "requests.html", req, title="Requests",
                         values=values, errors=errors, log=page, page="requests",
                         older=older, newest=urllib.parse.urlencode(query),
                         paged=before is not None, keys=list(cfg.keys),
                         models=list(cfg.models), scan_mib=requests.SCAN_BYTES >> 20)

    def request_page(self, req: Request, cfg: tg_config.Config, request_id: str) -> Response:
        """One request's usage event, every field; ``at`` (a row's place) finds it
        without a search."""
        if not REQUEST_ID.fullmatch(request_id):
            return self.page(404, "error.html", req, title="No such request",
                             message="A request id is 1-64 letters, digits, '_' or '-'.")
        at = tail.Position.decode(req.query.get("at", "")[:80])
        ev = requests.find(self.usage_file, request_id, at)
        if ev is None:
            return self.page(404, "error.html", req, title="No such request",
                             message=f"No usage event of request {request_id} in the "
                                     "usage files (a request without a valid key writes "
                                     "none; a compressed file is not read).")
        return self.page(200, "request.html", req, title=f"Request {request_id}",
                         request_id=request_id, fields=_fields(ev), page="requests")

    def _usage_keys(self, cfg: tg_config.Config, q: data.UsageQuery) -> list[str]:
        """The Usage filter's keys: the file's, then those that have usage in the
        range and are no longer in it (revoked), and the one asked for."""
        try:
            seen = data.keys_with_usage(self.client, q.since, q.until)
        except (RedisError, OSError):
            seen = []
        gone = sorted(set(seen) - set(cfg.keys) | ({q.key} - set(cfg.keys) if q.key else set()))
        return [*cfg.keys, *gone]

    # --- audit ---------------------------------------------------------------------

    def batches_page(self, req: Request, cfg: tg_config.Config) -> Response:
        """The Batch API's batches of every key (or of ``?key=``), newest first, at most
        ``BATCHES_SHOWN`` a key: status, progress, tokens, cost at the batch price and
        the files (``tokengate.batch.store``)."""
        from tokengate.batch.store import Store
        from tokengate.ledger.calculator import charge

        only = req.query.get("key")
        keys = [k for k in cfg.keys if only in (None, "", k)]
        store = Store(self.client, cfg.batch.files_dir, cfg.batch.retention_days * 86_400,
                      create=False)
        rows, problem = [], None
        try:
            for key_id in keys:
                for b in store.batches(key_id, BATCHES_SHOWN, None).data:
                    u, n = b["usage"], b["request_counts"]
                    model = cfg.models.get(b["model"] or "")
                    cost = charge(u["input_tokens"], u["output_tokens"],
                                  u["input_tokens_details"]["cached_tokens"],
                                  weights=model.cost if model else None, batch=True).cost
                    files = [(kind, fid, _bytes(store, key_id, fid)) for kind, fid in (
                        ("input", b["input_file_id"]), ("output", b["output_file_id"]),
                        ("errors", b["error_file_id"])) if fid]
                    rows.append({"key": key_id, "b": b, "done": n["completed"] + n["failed"],
                                 "cost": cost, "files": files})
        except (RedisError, OSError) as e:
            problem = f"Redis unavailable: {e}"
        rows.sort(key=lambda r: -r["b"]["created_at"])
        return self.page(200, "batches.html", req, title="Batches", rows=rows, keys=keys,
                         only=only or "", problem=problem, page="batches",
                         enabled=cfg.batch.enabled,
                         shown_max=BATCHES_SHOWN)

    def audit_page(self, req: Request, cfg: tg_config.Config) -> Response:
        """The audit stream, newest first: the changes and logins (console and command
        line) by default, every entry (the billed requests too) with ``?all=1``; at most
        ``AUDIT_SHOWN`` entries, found among the newest ``AUDIT_SCANNED``."""
        every = req.query.get("all") == "1"
        problem = None
        try:
            entries, scanned = data.audit_entries(self.client, AUDIT_SHOWN, AUDIT_SCANNED,
                                                  changes_only=not every)
        except (RedisError, OSError) as e:
            entries, scanned, problem = [], 0, f"Redis unavailable: {e}"
        return self.page(200, "audit.html", req, title="Audit", entries=entries,
                         scanned=scanned, every=every, problem=problem, page="audit",
                         shown_max=AUDIT_SHOWN)


def _bytes(store: Any, key_id: str, file_id: str) -> int | None:
    """A batch file's size, or None when it is gone (deleted, or past its retention)."""
    try:
        return int(store.file(key_id, file_id)["bytes"])
    except LookupError:
        return None


def _totals(buckets: list[Bucket]) -> dict[str, Any]:
    """The sums of ``buckets`` (``traffic.Bucket``) that Live shows above its charts."""
    c = [b.counts for b in buckets]
    return {"requests": sum(x.requests for x in c), "refused": sum(x.refused for x in c),
            "prompt_tokens": sum(x.prompt_tokens for x in c),
            "completion_tokens": sum(x.completion_tokens for x in c)}


def _fields(ev: dict[str, Any]) -> list[tuple[str, str, bool]]:
    """An event's fields as (name, text, whether the text is JSON): a string as it is,
    anything else (numbers, lists, objects, null) as compact JSON."""
    return [(k, v, False) if isinstance(v, str)
            else (k, json.dumps(v, separators=(",", ":"), ensure_ascii=False), True)
            for k, v in ev.items()]

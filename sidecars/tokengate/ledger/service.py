"""``tokengate-ledger``: the usage ledger process (see ``tokengate.ledger.ledger``)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

from prometheus_client.core import REGISTRY, CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from redis.exceptions import RedisError

from tokengate import config as tg_config
from tokengate import entry, metrics, redis_client
from tokengate.ledger import admin
from tokengate.ledger.alerts import BudgetAlerts
from tokengate.ledger.ledger import Ledger, default_ledger_id

if TYPE_CHECKING:
    from tokengate.ledger.tracing import SpanExport

log = logging.getLogger("tokengate.ledger")

DESCRIPTION = """\
Apply the edge's usage events to Redis, each exactly once.

Tails the usage file (one JSON line per finished request, written by the edge), bills
every event with the model's weights from tokengate.yaml and adds it to per key /
model / UTC-day counters in Redis (prompt, completion, cached and system tokens,
cost, requests by status) and to a bounded audit stream. `tokengate usage` reports
from those counters.

EXACTLY ONCE
  A batch of events and the ledger's checkpoint (file and byte offset) are written
  by one atomic Redis script, and every request id is remembered for --dedupe-days
  (ledger.dedupe_days). kill -9 at any moment, then a restart: nothing is lost,
  nothing is applied twice.

BUDGET ALERTS
  A budget of a key, team or organization with `alerts` percentages is announced
  once per threshold per period when its bill crosses one: a log line, the metric
  tokengate_ledger_budget_alerts_total, and a signed JSON POST to each of
  alerts.webhooks, retried with backoff until it is acknowledged (2xx). Claimed in
  Redis, so several ledgers and restarts (kill -9 included) send each alert once
  (tokengate.ledger.alerts).

LOG ROTATION
  Rename the file and let the edge reopen a new one (nginx -s reopen). The ledger
  reads the renamed file to its end, waits ledger.rotate_wait_s seconds after its
  last write for late writers, then continues with the new file. Files are found
  by content (a hash of their first line), so renames are safe; compressed
  siblings (*.gz ...) are ignored: compress a rotated file only after the ledger
  has read it (its checkpoint has moved to a newer file), and keep rotated files in
  the usage file's directory with names that start with its name (usage.jsonl.1,
  usage.jsonl-20261129): a restarted ledger looks for unfinished files there.

REDIS DOWN
  The ledger retries (0.1 s doubling to 1 s); events wait in the usage file and
  requests are never blocked.

REDIS WITHOUT ITS DATA
  The ledger keeps a ready mark in Redis; when it is missing (Redis came back empty,
  or a first start) the ledger rebuilds: it holds the budgets of every key that has
  some (the limits sidecar refuses them, 503 budget_unavailable), reads every usage
  and engine file still on disk again, joins events and records as before (the same
  bill), then sets the mark and releases the hold. The status file says rebuilding.

BAD LINES
  A line that is not a valid event is logged with its file and offset, counted
  (bad_lines in the status file and in Redis) and skipped.

ENGINE RECORDS
  With engine usage files (ledger.engine_usage_files, or --engine-file), the vLLM
  plugin's records of each engine request are joined with the edge's events by
  request id, in any order and across restarts, and the engine's numbers are the
  bill: a client that left pays what the engine generated. An event waits up to
  ledger.engine_wait_s for its records, then is billed with its own numbers
  (engine_missing). Where the edge's final usage and the engine disagree, the
  engine's numbers are billed and the request is counted (disagreements) and
  logged. Records that come after their request was billed with the edge's numbers
  (or with some of its records) correct the bill: the difference is added to the
  counters and the key's budget counters, with a correction entry in the audit
  stream (corrections). Records whose event never came are billed to the key they
  name after ledger.engine_orphan_s (orphans; status 0), records of no edge request
  are counted (engine_unmatched), not billed. On a vLLM host, run a ledger with
  --engine-only against the same Redis.

METRICS
  --metrics-listen (metrics.ledger_listen) serves Prometheus /metrics: events applied,
  duplicates, bad lines, Redis errors, lag in bytes and seconds, Redis up, and with
  engine files the engine's reconciliation counts: the numbers of the status file.
  The same port serves the admin view to loopback clients only (403 otherwise):
  GET /keys (what `tokengate keys list --json` prints: every key's limits, models,
  budgets and their spend) and GET /keys/NAME (one key; 404 for no such key), from
  the configuration file as it is now (`tokengate keys` changes need no reload), and
  GET /status (STATUS below).

RELOAD
  SIGHUP (systemctl reload) reads the configuration again: events applied from then
  on are billed with its models' weights and billing options (and its
  ledger.dedupe_days, ledger.audit_maxlen). The files and Redis it reads need a
  restart. A file that does not load is logged and the old configuration kept.

TRACING
  With tracing.enabled, the spans the edge recorded in each event (tokengate.ledger.tracing)
  are exported over OTLP (tracing.endpoint, tracing.protocol) from a thread of their
  own once their batch is applied: a collector that is down or slow loses spans
  (tokengate_trace_spans_lost_total), never events. Spans wait while Redis is down,
  with their events. The span counts are kept in Redis per ledger id, so exported +
  lost equals the spans of the applied events across restarts: a ledger killed with
  spans queued has them counted lost (reason killed) when it starts again. Changing
  the tracing section needs a restart.

STATUS
  --status-file gets a JSON snapshot every second: applied, duplicates, bad_lines,
  conflicts, lag_bytes (bytes of the usage files written but not yet applied), lag_s
  (age of the oldest event not yet applied, seconds; 0 when none waits), redis_up,
  position, config_keys (the keys of the configuration it bills with) and
  config_reloads (how often it loaded the file again: SIGHUP, or the file changed, which
  it checks every second, so keys `tokengate keys` adds are known without a signal).
  Both lags keep growing while Redis is down; they are null until the
  ledger has read its checkpoint once (started while Redis was down). rebuilding
  (true while it rebuilds, budgets held), rebuilds, budgets_settled. With engine
  files also settled_engine, engine_missing, disagreements, engine_records,
  engine_duplicates, engine_bad_lines, engine_unmatched, engine_probes, engine_late,
  corrections, orphans, budget_fixes, engine_lag_bytes, waiting (events waiting for their records) and engine_files (the
  engine files it follows: a file that ledger.engine_usage_files adds is followed from
  the reload on). The counts are
  this process's; Redis keeps the ledger's own (tg:{ledger}:stats:<ledger id>). The
  metrics port (loopback clients) answers GET /status with the same document, which
  `tokengate doctor` reads.

EXIT STATUS
  0 after SIGTERM/SIGINT (or --once done), 1 when --once cannot reach Redis,
  2 on a usage error or an invalid configuration.

EXAMPLES
  tokengate-ledger                              # the configuration's file and Redis
  tokengate-ledger --usage-file /var/log/tokengate/usage.jsonl --once
  tokengate-ledger --engine-file var/usage/engine.jsonl       # bill the engine's numbers
  tokengate-ledger --engine-only                               # on a vLLM host
"""


# Prometheus counters read from the ledger's Totals at scrape time: name, help, field.
_COUNTERS = (
    ("tokengate_ledger_events_applied", "Usage events billed (applied to Redis).", "applied"),
    ("tokengate_ledger_duplicate_events",
     "Events skipped: their request id was billed already.", "duplicates"),
    ("tokengate_ledger_bad_lines",
     "Lines of the usage file that are not events (skipped).", "bad_lines"),
    ("tokengate_ledger_redis_errors",
     "Ledger steps that failed on Redis (retried; nothing is lost).", "redis_errors"),
    ("tokengate_ledger_engine_settled",
     "Events billed with the vLLM plugin's engine records (reconciled).", "settled_engine"),
    ("tokengate_ledger_engine_missing",
     "Events billed with their own numbers: no engine record came in time.",
     "engine_missing"),
    ("tokengate_ledger_engine_disagreements",
     "Events whose final usage differed from the engine's numbers (those were billed).",
     "disagreements"),
    ("tokengate_ledger_engine_records", "Engine records read.", "engine_records"),
    ("tokengate_ledger_engine_unmatched",
     "Engine records of no edge request (not billed).", "engine_unmatched"),
    ("tokengate_ledger_engine_probes",
     "Engine records of tokengate doctor's probes (not billed).", "engine_probes"),
    ("tokengate_ledger_budgets_settled",
     ("Budget reservations the edge could not settle (limits sidecar or Redis down), "
      "settled from their usage events."), "budgets_settled"),
    ("tokengate_ledger_corrections",
     "Bills corrected by engine records that came after them.", "corrections"),
    ("tokengate_ledger_orphans",
     "Requests billed from their engine records alone (no usage event came).", "orphans"),
    ("tokengate_ledger_budget_fixes",
     "Changes of budget counters to the ledger's bill (engine numbers, corrections).",
     "budget_fixes"),
    ("tokengate_ledger_rebuilds",
     ("Rebuilds begun: the ledger's ready mark was missing (Redis lost its data, or a "
     "first start)."), "rebuilds"),
)
_LAG_BYTES = ("Bytes of the usage files written but not yet applied (absent until the "
              "checkpoint was read).")
_LAG_S = ("Age of the oldest event not yet applied, s (0 when none waits; absent until "
          "the checkpoint was read).")


class LedgerCollector(Collector):
    """The ledger's own numbers (``Ledger.totals``, its lags) as Prometheus metrics, read
    at scrape time: the status file and /metrics show the same values. Counts are this
    process's, since it started; the span counts are the ledger id's, across restarts
    (``tracing.SpanStore``)."""

    def __init__(self, ledger: Ledger, spans: SpanExport | None = None) -> None:
        self.ledger = ledger
        self.spans = spans

    def collect(self) -> Iterator[Metric]:
        t = self.ledger.totals
        for name, doc, field in _COUNTERS:
            yield CounterMetricFamily(name, doc, value=getattr(t, field))
        if self.spans is not None:
            yield CounterMetricFamily("tokengate_trace_spans_exported",
                                      "Spans the OTLP collector accepted.",
                                      value=self.spans.exported)
            lost = CounterMetricFamily(
                "tokengate_trace_spans_lost", "Spans lost: queue_full (more waiting than "
                "tracing.max_queue_spans), export_failed (the collector was down, refused "
                "or too slow), shutdown (queued when the ledger stopped), killed (queued "
                "when an earlier process of this ledger was killed).",
                labels=["reason"])
            for reason, n in self.spans.lost.items():
                lost.add_metric([reason], n)
            yield lost
            g = GaugeMetricFamily("tokengate_trace_spans_queued", "Spans waiting for export.")
            g.add_metric([], self.spans.queued)
            yield g
        for name, doc, value in (
                ("tokengate_ledger_lag_bytes", _LAG_BYTES, self.ledger.lag_bytes),
                ("tokengate_ledger_lag_seconds", _LAG_S, self.ledger.lag_s),
                ("tokengate_ledger_redis_up", "1 while the ledger's Redis answers, else 0.",
                 int(self.ledger.redis_up)),
                ("tokengate_ledger_rebuilding",
                 ("1 while the ledger rebuilds after Redis lost its data (budgets refused), "
                 "else 0."), int(self.ledger.rebuilding is not None))):
            g = GaugeMetricFamily(name, doc)
            if value is not None:
                g.add_metric([], value)
            yield g


def _write_status(path: Path, data: dict[str, object]) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, sort_keys=True) + "\n")
    os.replace(tmp, path)


def _file_id(path: Path) -> tuple[int, int, int] | None:
    """(inode, mtime ns, size) of ``path``, None when it cannot be read: a change of
    any (an edit in place, or tokengate's atomic rename) reloads the configuration."""
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns, st.st_size


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="tokengate-ledger", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    tg_config.add_config_option(parser)
    parser.add_argument("--usage-file", type=Path, default=None,
                        help="the edge's usage file (default: ledger.usage_file)")
    parser.add_argument("--redis-url", default=None, type=tg_config.redis_url_arg,
                        help="Redis URL (default: redis.url), e.g. redis://127.0.0.1:6380/0")
    parser.add_argument("--ledger-id", default=None,
                        help="name of this ledger's checkpoint (default: <hostname>:<absolute "
                             "usage file path>); one per usage file")
    parser.add_argument("--engine-file", type=Path, action="append", default=None,
                        metavar="PATH", dest="engine_files",
                        help="an engine usage file of the vLLM plugin; repeat for several "
                             "(default: ledger.engine_usage_files)")
    parser.add_argument("--engine-only", action="store_true",
                        help="read the engine files only, no usage file (a ledger on a "
                             "vLLM host that shares the edge's Redis)")
    parser.add_argument("--batch", type=int, default=500, metavar="N",
                        help="events per Redis script call (default: 500)")
    parser.add_argument("--status-file", type=Path, default=None,
                        help="write a JSON status snapshot here every second")
    parser.add_argument("--once", action="store_true",
                        help="apply what the files hold now and exit (rotated files count "
                             "as finished at once)")
    parser.add_argument("--metrics-listen", default=None, metavar="HOST:PORT",
                        help="serve Prometheus /metrics there (default: "
                             "metrics.ledger_listen; 'none': off)")
    # --once prints its totals on stdout
    args, cfg = entry.start(parser, argv)
    usage_file = (args.usage_file or cfg.ledger.usage_file).resolve()
    client = redis_client.connect(cfg.redis, timeout_s=5.0, url=args.redis_url)
    ledger_id = args.ledger_id or default_ledger_id(usage_file)
    spans: SpanExport | None = None
    if cfg.tracing.enabled and not args.engine_only:
        # imported only then: the OpenTelemetry SDK and its exporters take a while
        from tokengate.ledger.tracing import SpanExport, SpanStore

        spans = SpanExport(cfg.tracing, store=SpanStore(client, ledger_id))
    try:
        ledger = Ledger(cfg, client, usage_file, ledger_id, max_lines=args.batch,
                        rotate_wait_s=0.0 if args.once else None,
                        engine_files=args.engine_files, engine_only=args.engine_only,
                        on_events=spans.events if spans else None)
    except ValueError as e:
        parser.exit(2, f"tokengate-ledger: {e}\n")
    if spans:
        log.info("tracing: exporting spans to %s (%s)", cfg.tracing.endpoint,
                 cfg.tracing.protocol)
    if args.once:
        try:
            t = ledger.drain()
        except RedisError as e:
            print(f"tokengate-ledger: Redis unavailable: {e}", file=sys.stderr)
            sys.exit(1)
        if spans:
            spans.close()
        print(f"applied {t.applied}, duplicates {t.duplicates}, bad lines {t.bad_lines}")
        if ledger.engine_mode:
            print(f"settled by the engine {t.settled_engine}, engine records missing "
                  f"{t.engine_missing}, disagreements {t.disagreements}, engine records "
                  f"{t.engine_records} (unmatched {t.engine_unmatched}, late "
                  f"{t.engine_late}), waiting {ledger.waiting or 0}")
        return

    stop = threading.Event()
    hup = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGHUP, lambda *_: hup.set())
    log.info("ledger %s: %s -> %s", ledger.ledger_id,
             " + ".join(str(src.path) for src in ledger.sources), args.redis_url or cfg.redis.url)

    watched, reloads = _file_id(cfg.path), 0

    def snapshot() -> dict[str, object]:
        snap = {**asdict(ledger.totals), "lag_bytes": ledger.lag_bytes,
                "rebuilding": ledger.rebuilding is not None,
                "config_keys": len(ledger.cfg.keys), "config_reloads": reloads,
                "lag_s": ledger.lag_s, "redis_up": ledger.redis_up, "position": ledger.position,
                "ledger_id": ledger.ledger_id, "pid": os.getpid()}
        if ledger.engine_mode:
            snap.update(engine_lag_bytes=ledger.engine_lag_bytes, waiting=ledger.waiting,
                        engine_files=[str(src.path) for src in ledger.engines])
        return snap

    REGISTRY.register(LedgerCollector(ledger, spans))
    metrics.serve(args.metrics_listen or cfg.metrics.ledger_listen, "ledger",
                  admin=admin.view(cfg.path, client, status=snapshot))
    # The first status file says the ledger is up (what devstack and the units wait for):
    # written once its listeners are bound, so nothing that waited on it is refused.
    if args.status_file:
        _write_status(args.status_file, snapshot())
    worker = threading.Thread(target=ledger.run, args=(stop,), name="ledger", daemon=True)
    worker.start()
    # budget alerts: claimed once across ledgers, delivered until acknowledged
    alerter = BudgetAlerts(lambda: ledger.cfg, client, ledger.ledger_id)
    threading.Thread(target=alerter.run, args=(stop,), name="alerts", daemon=True).start()
    last_log = time.monotonic()
    last_applied = 0
    while not stop.wait(1.0):
        if not worker.is_alive():
            log.error("ledger %s: worker died; exiting (the checkpoint is safe)",
                      ledger.ledger_id)
            sys.exit(1)
        # SIGHUP, or the file changed: `tokengate keys ...` and `config apply` reload
        # the edges only, and a key created since the start (its budgets, its prices)
        # must be known here too (its failed settlements are repaired for keys with
        # budgets: tokengate.ledger.budgets)
        seen = _file_id(cfg.path)
        if hup.is_set() or (seen is not None and seen != watched):
            hup.clear()
            watched = seen
            try:
                ledger.reconfigure(tg_config.load(cfg.path))
                reloads += 1
                log.info("ledger %s: configuration reloaded (%d keys)", ledger.ledger_id,
                         len(ledger.cfg.keys))
            except (tg_config.ConfigError, OSError) as e:
                log.error("reload failed, billing with the previous configuration: %s", e)
        if args.status_file:
            _write_status(args.status_file, snapshot())
        t = ledger.totals
        if time.monotonic() - last_log >= 10.0 and t.applied != last_applied:
            log.info("applied %d (duplicates %d, bad lines %d), %s bytes / %s s behind",
                     t.applied, t.duplicates, t.bad_lines, ledger.lag_bytes, ledger.lag_s)
            last_log, last_applied = time.monotonic(), t.applied
    worker.join(10.0)
    ledger.close()
    if spans:
        spans.close()
    if args.status_file:
        _write_status(args.status_file, snapshot())
    log.info("ledger %s stopped: applied %d", ledger.ledger_id, ledger.totals.applied)


if __name__ == "__main__":
    main()

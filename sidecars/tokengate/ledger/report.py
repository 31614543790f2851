"""``tokengate usage``: tokens, cost, requests and errors per key / model / UTC day, or
per agent session of a key (``--by session``).

Reads the ledger's counters in Redis (keys: ``tokengate.redis_keys``); nothing is computed
from the usage files, so the report shows exactly what the ledger applied. Days are UTC
days of the events' ``ts``.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, date, datetime, timedelta

from redis.exceptions import RedisError

from tokengate import config as tg_config
from tokengate import redis_keys
from tokengate.redis_client import SyncRedis, connect

GROUPS = ("key", "model", "day", "team", "org")
INT_FIELDS = ("requests", "errors", "aborted", "estimated", "prompt_tokens",
              "completion_tokens", "cached_tokens", "system_tokens", "settled_engine",
              "engine_missing", "disagreements", "corrections", "orphans")
ENDPOINT_FIELDS = ("requests", "prompt_tokens", "completion_tokens", "cost")


@dataclass
class UsageRow:
    """Totals of one key / model / day (or of a coarser group: the dropped dimensions
    are ``None`` and named in ``ReportDoc``). Tokens are vLLM's usage numbers:
    ``prompt_tokens`` includes ``cached_tokens``; ``cost`` is in the currency."""

    day: str | None
    key_id: str | None
    model: str | None
    team: str | None = None    # --by team / org: the key's team and its organization in
    org: str | None = None     # tokengate.yaml when the report is made
    requests: int = 0
    errors: int = 0            # status >= 400
    aborted: int = 0           # client went away before the end
    estimated: int = 0         # usage from the admission estimate (no usage from vLLM)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    system_tokens: int = 0
    settled_engine: int = 0    # billed with the engine's records (ledger.engine_usage_files)
    engine_missing: int = 0    # waited for engine records that never came: edge's numbers
    disagreements: int = 0     # the edge's final usage differed from the engine's numbers
    corrections: int = 0       # bill changes by engine records that came after the bill
    orphans: int = 0           # billed from engine records alone: no usage event came
    cost: float = 0.0
    statuses: dict[str, int] = field(default_factory=dict)
    # endpoint (chat, completions, messages, count_tokens, responses, ..., other) ->
    # {requests, prompt_tokens, completion_tokens, cost}
    endpoints: dict[str, dict[str, float]] = field(default_factory=dict)

    def add(self, other: UsageRow) -> None:
        for f in INT_FIELDS:
            setattr(self, f, getattr(self, f) + getattr(other, f))
        self.cost += other.cost
        for s, n in other.statuses.items():
            self.statuses[s] = self.statuses.get(s, 0) + n
        for ep, counts in other.endpoints.items():
            mine = self.endpoints.setdefault(ep, dict.fromkeys(ENDPOINT_FIELDS, 0))
            for f, v in counts.items():
                mine[f] += v


def _row(day: str, key_id: str | None, model: str | None, h: dict[str, str]) -> UsageRow:
    row = UsageRow(day, key_id, model, cost=float(h.get("cost", 0.0)))
    for f in INT_FIELDS:
        setattr(row, f, int(h.get(f, 0)))
    row.statuses = {k[7:]: int(v) for k, v in sorted(h.items()) if k.startswith("status:")}
    for k, v in sorted(h.items()):
        if k.startswith("endpoint:"):
            ep, _, name = k[9:].rpartition(":")
            if name in ENDPOINT_FIELDS:
                counts = row.endpoints.setdefault(ep, dict.fromkeys(ENDPOINT_FIELDS, 0))
                counts[name] = float(v) if name == "cost" else int(v)
    return row


def query(client: SyncRedis, since: date | None = None, until: date | None = None,
          key_id: str | None = None, model: str | None = None) -> list[UsageRow]:
    """Rows per key / model / day, days ``since``..``until`` inclusive (UTC), sorted by
    day, key, model; optionally one key and/or model only. Raises ``RedisError``."""
    lo = redis_keys.day_score(since.isoformat()) if since else "-inf"
    hi = redis_keys.day_score(until.isoformat()) if until else "+inf"
    days = [str(d) for d in client.zrangebyscore(redis_keys.DAYS_KEY, lo, hi)]
    rows: list[UsageRow] = []
    for day in days:
        pairs = sorted((tuple(json.loads(m)) for m in client.smembers(redis_keys.idx_key(day))),
                       key=lambda p: (p[0] or "", p[1] or ""))
        pairs = [p for p in pairs if (key_id is None or p[0] == key_id)
                 and (model is None or p[1] == model)]
        pipe = client.pipeline(transaction=False)
        for k, m in pairs:
            pipe.hgetall(redis_keys.usage_key(day, k, m))
        for (k, m), h in zip(pairs, pipe.execute(), strict=True):
            rows.append(_row(day, k, m, h))
    return rows


def query_levels(client: SyncRedis, level: str, since: date | None = None,
                 until: date | None = None) -> list[UsageRow]:
    """Rows per team (``level`` "team") or organization ("org") / model / day from the
    ledger's counters of the levels (a key's team and organization when the ledger
    applied its requests), with ``team`` or ``org`` set and no key. Raises
    ``RedisError``."""
    lo = redis_keys.day_score(since.isoformat()) if since else "-inf"
    hi = redis_keys.day_score(until.isoformat()) if until else "+inf"
    rows: list[UsageRow] = []
    for day in (str(d) for d in client.zrangebyscore(redis_keys.DAYS_KEY, lo, hi)):
        pairs = sorted((p for p in (tuple(json.loads(m)) for m in
                                    client.smembers(redis_keys.level_idx_key(day)))
                        if str(p[0]).startswith(level + ":")),
                       key=lambda p: (p[0], p[1] or ""))
        pipe = client.pipeline(transaction=False)
        for lv, m in pairs:
            pipe.hgetall(redis_keys.level_usage_key(day, lv, m))
        for (lv, m), h in zip(pairs, pipe.execute(), strict=True):
            row = _row(day, None, m, h)
            setattr(row, level, lv.split(":", 1)[1])
            rows.append(row)
    return rows


def levels(cfg: tg_config.Config, key_id: str | None) -> tuple[str | None, str | None]:
    """(team, organization) of ``key_id`` in ``cfg`` (None: none, or no such key)."""
    k = cfg.keys.get(key_id) if key_id is not None else None
    team = k.team if k is not None else None
    return team, cfg.teams[team].org if team is not None else None


def group(rows: Iterable[UsageRow], by: Sequence[str],
          cfg: tg_config.Config | None = None) -> list[UsageRow]:
    """Sum rows over the dimensions not in ``by`` (a subset of key, model, day, team,
    org; team and org: the rows' own (``query_levels``), else each key's in ``cfg``)."""
    out: dict[tuple[str | None, ...], UsageRow] = {}
    for r in rows:
        team, org = levels(cfg, r.key_id) if cfg is not None and r.key_id is not None \
            else (r.team, r.org)
        k = (r.day if "day" in by else None, r.key_id if "key" in by else None,
             r.model if "model" in by else None, team if "team" in by else None,
             org if "org" in by else None)
        if k not in out:
            out[k] = UsageRow(*k)
        out[k].add(r)
    return list(out.values())


def total(rows: Iterable[UsageRow]) -> UsageRow:
    """The sum of all rows."""
    t = UsageRow(None, None, None)
    for r in rows:
        t.add(r)
    return t


def parse_day(text: str, today: date | None = None) -> date:
    """``YYYY-MM-DD``, ``today``, ``yesterday`` or ``Nd`` (N days before today, UTC)."""
    today = today or datetime.now(UTC).date()
    if text == "today":
        return today
    if text == "yesterday":
        return today - timedelta(days=1)
    m = re.fullmatch(r"([0-9]{1,9})d", text)
    if m:
        try:
            return today - timedelta(days=int(m.group(1)))
        except OverflowError:
            raise argparse.ArgumentTypeError(f"{text!r} goes back before the year 1") from None
    try:
        return date.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected YYYY-MM-DD, today, yesterday or Nd, got {text!r}") from None


@dataclass
class SessionRow:
    """Totals of one agent session of a key (the ledger's session hash,
    ``tokengate.redis_keys.session_key``): tokens as in ``UsageRow``, ``cost`` in the
    currency, ``first`` / ``last`` the RFC 3339 UTC times of its first and last event."""

    key_id: str | None
    session_id: str
    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    cost: float = 0.0
    first: str = ""
    last: str = ""


def _ms_iso(ms: str | int | None) -> str:
    if ms is None:
        return ""
    t = datetime.fromtimestamp(int(ms) / 1000, UTC)
    return t.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def query_sessions(client: SyncRedis, key_ids: Iterable[str | None],
                   since: date | None = None, until: date | None = None,
                   limit: int | None = None) -> list[SessionRow]:
    """The sessions of ``key_ids`` the ledger keeps (``ledger.session_days``,
    ``ledger.sessions_per_key``), most recently seen first within each key; with
    ``since`` / ``until`` (UTC days, inclusive) only sessions active in that span (first
    event on or before ``until``, last on or after ``since``); ``limit``: at most that
    many per key. Raises ``RedisError``."""
    rows: list[SessionRow] = []
    for key_id in key_ids:
        lo = (round(datetime.combine(since, datetime.min.time(), UTC).timestamp() * 1000)
              if since else "-inf")
        ids = [str(x) for x in client.zrevrangebyscore(
            redis_keys.sessions_key(key_id), "+inf", lo,
            start=0 if limit else None, num=limit)]
        pipe = client.pipeline(transaction=False)
        for sid in ids:
            pipe.hgetall(redis_keys.session_key(key_id, sid))
        end = (round(datetime.combine(until + timedelta(days=1), datetime.min.time(),
                                      UTC).timestamp() * 1000) if until else None)
        for sid, h in zip(ids, pipe.execute(), strict=True):
            if not h:  # expired since the index was read
                continue
            if end is not None and int(h.get("first", 0)) >= end:
                continue
            rows.append(SessionRow(key_id, sid, requests=int(h.get("requests", 0)),
                                   prompt_tokens=int(h.get("prompt_tokens", 0)),
                                   cached_tokens=int(h.get("cached_tokens", 0)),
                                   completion_tokens=int(h.get("completion_tokens", 0)),
                                   cost=float(h.get("cost", 0.0)),
                                   first=_ms_iso(h.get("first")), last=_ms_iso(h.get("last"))))
    return rows


def render_sessions(rows: list[SessionRow], currency: str, title: str) -> None:
    """Print session rows and their total as a table (rich)."""
    from rich.console import Console
    from rich.table import Table

    console = Console()
    if not console.is_terminal:
        console = Console(width=200)
    table = Table(title=title, title_justify="left")
    for name in ("key", "session", "first", "last"):
        table.add_column(name)
    for name in ("requests", "prompt", "cached", "completion", f"cost {currency}"):
        table.add_column(name, justify="right")
    for r in rows:
        table.add_row(r.key_id or "(no key)", r.session_id, r.first, r.last,
                      f"{r.requests:,}", f"{r.prompt_tokens:,}", f"{r.cached_tokens:,}",
                      f"{r.completion_tokens:,}", _fmt_cost(r.cost))
    if rows:
        table.add_section()
        table.add_row("total", "", "", "", f"{sum(r.requests for r in rows):,}",
                      f"{sum(r.prompt_tokens for r in rows):,}",
                      f"{sum(r.cached_tokens for r in rows):,}",
                      f"{sum(r.completion_tokens for r in rows):,}",
                      _fmt_cost(sum(r.cost for r in rows)), style="bold")
    console.print(table)


def _fmt_cost(cost: float) -> str:
    return f"{cost:.6f}"


def span(since: date | None, until: date | None, days: Iterable[str | None]) -> str:
    """The days a report covers, for its title: ``since`` .. ``until`` where given, else
    the first / last of ``days`` (the UTC days of the rows shown, before grouping);
    ``all days`` with neither, ``from D`` / ``up to D`` with one end only (no rows)."""
    shown = sorted(d for d in days if d is not None)
    first = since.isoformat() if since else (shown[0] if shown else None)
    last = until.isoformat() if until else (shown[-1] if shown else None)
    if first and last:
        return f"{first} .. {last}"
    if first:
        return f"from {first}"
    return f"up to {last}" if last else "all days"


def render(rows: list[UsageRow], by: Sequence[str], currency: str, title: str) -> None:
    """Print rows and a total as a table (rich)."""
    from rich.console import Console
    from rich.table import Table

    console = Console()
    if not console.is_terminal:  # a pipe or a file: never squeeze the numbers
        console = Console(width=200)
    table = Table(title=title, title_justify="left")
    dims = [d for d in ("day", "org", "team", "key", "model") if d in by]
    for d in dims:
        table.add_column(d)
    for name in ("requests", "errors", "engine", "prompt", "cached", "completion",
                 f"cost {currency}", "batch", f"batch {currency}"):
        table.add_column(name, justify="right")

    def cells(r: UsageRow) -> list[str]:
        b = r.endpoints.get("batch", {})
        return [f"{r.requests:,}", f"{r.errors:,}", f"{r.settled_engine:,}",
                f"{r.prompt_tokens:,}", f"{r.cached_tokens:,}", f"{r.completion_tokens:,}",
                _fmt_cost(r.cost), f"{int(b.get('requests', 0)):,}",
                _fmt_cost(float(b.get("cost", 0.0)))]

    names = {"day": lambda r: r.day, "key": lambda r: r.key_id if r.key_id is not None
             else "(no key)", "model": lambda r: r.model if r.model is not None else "(none)",
             "team": lambda r: r.team if r.team is not None else "(no team)",
             "org": lambda r: r.org if r.org is not None else "(no organization)"}
    for r in rows:
        table.add_row(*[str(names[d](r)) for d in dims], *cells(r))
    if rows:
        t = total(rows)
        table.add_section()
        table.add_row(*(["total"] + [""] * (len(dims) - 1)), *cells(t), style="bold")
    console.print(table)


USAGE_HELP = """\
Report usage per API key / model / UTC day from the ledger's counters in Redis.

COLUMNS
  requests    finished requests, rejected ones included (status 401, 429, ...)
  errors      requests with status >= 400
  engine      requests billed with the engine's own records (the vLLM plugin's,
              ledger.engine_usage_files); 0 without engine files
  prompt      vLLM usage.prompt_tokens (cached tokens included); billed from the
              engine's records: each prompt once, if the engine computed it
  cached      prompt tokens served from vLLM's prefix cache
  completion  vLLM usage.completion_tokens; billed from the engine's records: what
              the engine generated, also for a client that disconnected (without
              them: the tokens up to the last chunk the edge saw)
  cost        the billing formula (docs/operators/billing.md) with the
              model's weights at the time the ledger applied the event
  batch       of the requests, lines of batches (the Batch API), billed at
              models.<name>.cost.batch times the price; batch <currency>: their
              cost, a part of cost

  --json adds aborted (client disconnects), estimated (usage from the admission
  estimate), system_tokens, settled_engine (the engine column), engine_missing
  (waited for engine records that never came: billed with the edge's numbers),
  disagreements (the edge's final usage and the engine's records differed: the
  engine's numbers were billed), the count per status, and per endpoint (chat,
  completions, messages, count_tokens, responses, input_tokens, response,
  response_cancel, models, model, other) the requests,
  prompt and completion tokens and cost.

SESSIONS
  --by session lists the agent sessions of each key (or of --key), most recently
  seen first: key, session (the usage event's session_id: docs/api/sessions.md),
  first and last (UTC times of its first and last request), requests, prompt,
  cached, completion and cost, summed over every model. The ledger keeps a
  session ledger.session_days after its last request, and a key's
  ledger.sessions_per_key most recent ones. --since / --until keep the sessions
  active in those days; --limit N the N most recent per key.

DAYS
  --since and --until take YYYY-MM-DD, today, yesterday or Nd (N days ago); both
  are inclusive UTC days of the events' timestamps.

EXIT STATUS
  0 ok, 1 Redis unavailable, 2 usage error.

EXAMPLES
  tokengate usage --since 7d
  tokengate usage --by key --since 2026-11-01 --until 2026-11-30 --json
  tokengate usage --by team,day      # the teams' own counters
  tokengate usage --by key,team      # each key under its team in tokengate.yaml now
  tokengate usage --by session --key alice --limit 20
"""


def _positive(text: str) -> int:
    """An argparse type: a whole number of at least 1."""
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number of at least 1, got {text!r}")
    return n


def add_parser(
        sub: argparse._SubParsersAction,  # type: ignore[type-arg]
) -> argparse.ArgumentParser:
    """Register ``usage`` on a ``tokengate`` subcommand parser."""
    p = sub.add_parser("usage", help="usage and cost per key / model / day",
                       description=USAGE_HELP,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    tg_config.add_config_option(p)
    p.add_argument("--redis-url", default=None, type=tg_config.redis_url_arg,
                   help="Redis URL (default: redis.url)")
    p.add_argument("--since", type=parse_day, default=None, metavar="DAY",
                   help="first UTC day (default: the first with usage)")
    p.add_argument("--until", type=parse_day, default=None, metavar="DAY",
                   help="last UTC day, inclusive (default: the last with usage)")
    p.add_argument("--key", default=None, help="only this key id")
    p.add_argument("--model", default=None, help="only this model")
    p.add_argument("--by", default="key,model,day", metavar="DIMS",
                   help="group by these of key, model, day, team, org, comma-separated "
                        "(default: key,model,day; team or org without key: their own "
                        "counters, else each key's in the configuration now); or session "
                        "alone: the keys' agent sessions")
    p.add_argument("--limit", type=_positive, default=None, metavar="N",
                   help="--by session: at most N sessions per key, most recent first")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    """Execute ``tokengate usage``; returns the exit status."""
    by = [d.strip() for d in args.by.split(",") if d.strip()]
    if by == ["session"]:
        return run_sessions(args)
    if not by or any(d not in GROUPS for d in by):
        print(f"tokengate usage: --by takes key, model, day, team and/or org, or session "
              f"alone, got "
              f"{args.by!r}",
              file=sys.stderr)
        return 2
    if args.since and args.until and args.since > args.until:
        print(f"tokengate usage: --since {args.since} is after --until {args.until}",
              file=sys.stderr)
        return 2
    cfg = tg_config.load_for_command(args.config, "tokengate usage")
    if cfg is None:
        return 2
    client = connect(cfg.redis, timeout_s=5.0, url=args.redis_url)
    # by team or organization alone: their own counters (the levels when the ledger
    # applied each request); with keys (or one key): each key's levels now
    level = next((d for d in ("team", "org") if d in by), None)
    recorded = level is not None and "key" not in by and args.key is None \
        and not ("team" in by and "org" in by)
    try:
        per_day = query_levels(client, level, args.since, args.until) if recorded and level \
            else query(client, args.since, args.until, args.key, args.model)
        if recorded and args.model is not None:
            per_day = [r for r in per_day if r.model == args.model]
    except RedisError as e:
        print(f"tokengate usage: Redis unavailable: {e}", file=sys.stderr)
        return 1
    rows = group(per_day, by, None if recorded else cfg)
    rows.sort(key=lambda r: (r.day or "", r.org or "", r.team or "", r.key_id or "",
                             r.model or ""))
    if args.json:
        doc = {"currency": cfg.currency, "by": by,
               "since": args.since.isoformat() if args.since else None,
               "until": args.until.isoformat() if args.until else None,
               "rows": [asdict(r) for r in rows], "total": asdict(total(rows))}
        json.dump(doc, sys.stdout, indent=1)
        print()
    else:
        days = span(args.since, args.until, (r.day for r in per_day))
        render(rows, by, cfg.currency, f"tokengate usage, {days} (UTC), by {', '.join(by)}")
    return 0


def run_sessions(args: argparse.Namespace) -> int:
    """``tokengate usage --by session``; returns the exit status."""
    cfg = tg_config.load_for_command(args.config, "tokengate usage")
    if cfg is None:
        return 2
    key_ids: list[str | None] = [args.key]
    if not args.key:
        key_ids = [*sorted(cfg.keys)]
    client = connect(cfg.redis, timeout_s=5.0, url=args.redis_url)
    try:
        rows = query_sessions(client, key_ids, args.since, args.until, args.limit)
    except RedisError as e:
        print(f"tokengate usage: Redis unavailable: {e}", file=sys.stderr)
        return 1
    if args.json:
        json.dump({"currency": cfg.currency, "by": ["session"],
                   "since": args.since.isoformat() if args.since else None,
                   "until": args.until.isoformat() if args.until else None,
                   "rows": [asdict(r) for r in rows]}, sys.stdout, indent=1)
        print()
    else:
        days = span(args.since, args.until, ())
        render_sessions(rows, cfg.currency, f"tokengate usage, {days} (UTC), by session")
    return 0

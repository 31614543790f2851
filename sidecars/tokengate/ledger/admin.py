"""The ledger's admin view: per API key its limits, models and budgets with what was spent,
as JSON on the ledger's metrics port (``GET /keys``, ``GET /keys/<name>``: ``view``) and
as ``tokengate keys list`` prints it.

The console's team page (``team_view``) shows a team the same way, its budgets' bill
summed over its members.

The spend comes from the ledger's Redis: its per key / model / day rows
(``tokengate.ledger.report.query``: what ``tokengate usage`` bills) and, with global
limits, the budget counters as admission compares them with the limits
(``tokengate.budget_store.committed``: billed plus reserved by requests in flight).
Amounts are in the configuration's currency, token counts in tokens.
"""

from __future__ import annotations

import sys
import urllib.parse
from collections.abc import Callable
from datetime import UTC, date, datetime
from pathlib import Path
from typing import Any

from redis.exceptions import RedisError

from tokengate import config as tg_config
from tokengate import redis_keys
from tokengate.budget_store import committed, counter_name
from tokengate.ledger import report
from tokengate.redis_client import SyncRedis


def period_start(period: str, today: date) -> date:
    """First UTC day of the budget period holding ``today``."""
    return today if period == "day" else today.replace(day=1)


def listing(cfg: tg_config.Config, rows: list[report.UsageRow] | None,
            today: date, live: dict[tuple[str, str], tuple[int, int]] | None = None
            ) -> list[dict[str, Any]]:
    """``keys list --json``'s entries: per key its limits, models and budgets. Each
    budget has ``spent`` (currency) and ``tokens_used`` of the current period from
    ``rows`` (the ledger's per key / model / day rows: what ``tokengate usage`` bills;
    None: Redis unavailable, unknown), and ``committed_spend`` / ``committed_tokens``
    from ``live`` ((key id, counter) -> the budget counter in Redis, nano-units and
    tokens: billed plus reserved by requests in flight, what admission compares with the
    limit; None: unknown)."""
    out = []
    for key_id, k in cfg.keys.items():
        budgets = budget_entries(k.budgets, {key_id}, key_id, rows, today, live)
        out.append({"name": key_id, "rpm": k.rpm, "tpm": k.tpm,
                    "allowed_models": k.allowed_models,
                    "models": {m: lim.model_dump() for m, lim in k.models.items()},
                    "priority": k.priority, "budgets": budgets, "team": k.team,
                    "owner": k.owner, "description": k.description,
                    "expires_at": k.expires_at and tg_config.rfc3339(k.expires_at),
                    "disabled": k.disabled,
                    # a rotated key's old secrets: when each stops (never the digest)
                    "previous_expires_at": [tg_config.rfc3339(p.expires_at)
                                            for p in k.previous]})
    return out


def budget_entries(budgets: list[tg_config.Budget], members: set[str], owner: str,
                   rows: list[report.UsageRow] | None, today: date,
                   live: dict[tuple[str, str], tuple[int, int]] | None
                   ) -> list[dict[str, Any]]:
    """One entry per budget (``listing``'s): ``spent`` and ``tokens_used`` the bill of
    ``members``' rows in the current period, ``committed_*`` the counter ``live`` holds
    for (``owner``, its counter): a key id, or a level id, whose counters are named
    ``<level id>/<counter>`` (``budget_counter``)."""
    out = []
    for b in budgets:
        start = period_start(b.period, today).isoformat()
        entry: dict[str, Any] = {"period": b.period, "model": b.model, "spend": b.spend,
                                 "tokens": b.tokens, "since": start,
                                 "spent": None, "tokens_used": None,
                                 "committed_spend": None, "committed_tokens": None}
        if rows is not None:
            mine = [r for r in rows if r.key_id in members and (r.day or "") >= start
                    and (b.model is None or r.model == b.model)]
            entry["spent"] = round(sum(r.cost for r in mine), 9)
            entry["tokens_used"] = sum(r.prompt_tokens + r.completion_tokens for r in mine)
        counter = budget_counter(owner, b, today)
        if live is not None and counter in live:
            nano, tokens = live[counter]
            entry["committed_spend"] = nano / 1e9
            entry["committed_tokens"] = tokens
        out.append(entry)
    return out


def budget_counter(owner: str, b: tg_config.Budget, today: date) -> tuple[str, str]:
    """(owner, counter) of budget ``b`` of a key (owner its id) or of a team or
    organization (owner its level id, the counter ``<level id>/<counter>`` as the edge
    names it: lua/tokengate/budget.lua) in the period holding ``today``."""
    name = counter_name(b.scope, b.period, today)
    return (owner, f"{owner}/{name}") if ":" in owner else (owner, name)


def team_view(cfg: tg_config.Config, client: SyncRedis, name: str, today: date
              ) -> tuple[dict[str, Any], str | None]:
    """(the console's team page, a problem to show or None): the team's limits, members,
    budgets with their pooled bill of this period (every member's rows) and what their
    counters hold in Redis, and the alerts claimed this period
    (``tokengate.ledger.alerts``' ids)."""
    t = cfg.teams[name]
    members = sorted(k for k, v in cfg.keys.items() if v.team == name)
    level = tg_config.level_id("team", name)
    rows: list[report.UsageRow] | None = None
    live: dict[tuple[str, str], tuple[int, int]] | None = None
    alerts: list[str] = []
    problem = None
    try:
        rows = report.query(client, since=today.replace(day=1))
        counters = [budget_counter(level, b, today) for b in t.budgets]
        if counters and cfg.global_limits.enabled:
            live = dict(zip(counters, committed(client, counters, list(cfg.models)),
                            strict=True))
        mark = redis_keys.alert_mark(f"{level}/")
        alerts = sorted(k.removeprefix(mark) for k in client.scan_iter(match=mark + "*"))
    except (RedisError, OSError) as e:
        problem = f"Redis unavailable: {e}"
    return {"name": name, "org": t.org, "rpm": t.rpm, "tpm": t.tpm,
            "allowed_models": t.allowed_models, "members": members,
            "budgets": budget_entries(t.budgets, set(members), level, rows, today, live),
            "alerts": [urllib.parse.unquote(a) for a in alerts]}, problem


def snapshot(cfg: tg_config.Config, client: SyncRedis | None,
             today: date) -> list[dict[str, Any]]:
    """``listing`` with what Redis holds now (``client``; None or a failing Redis: the
    spend is unknown, said on stderr): the ledger's rows of this month and, with global
    limits, the live budget counters. The admin view (``view``) serves the same
    entries."""
    rows: list[report.UsageRow] | None = None
    live: dict[tuple[str, str], tuple[int, int]] | None = None
    counters = [(key_id, counter_name(b.scope, b.period, today))
                for key_id, k in cfg.keys.items() for b in k.budgets]
    if counters and client is not None:
        try:
            rows = report.query(client, since=today.replace(day=1))
            if cfg.global_limits.enabled:
                live = dict(zip(counters, committed(client, counters, list(cfg.models)),
                                strict=True))
        except (RedisError, OSError) as e:
            print(f"tokengate keys: Redis unavailable, spend unknown: {e}", file=sys.stderr)
    return listing(cfg, rows, today, live)


def view(path: Path, client: SyncRedis,
         status: Callable[[], dict[str, Any]] | None = None
         ) -> Callable[[str], tuple[int, Any] | None]:
    """The admin view that the ledger serves on its metrics port (``metrics.serve``):
    ``GET /keys`` -> ``{"currency", "keys": [entry...]}``, ``keys list --json``'s
    document; ``GET /keys/<name>`` -> that key's entry, or 404 ``{"error"}``; ``GET
    /status`` -> ``status()``, what the ledger's status file holds (its counts, lags and
    ``engine_files``, the engine files it follows: what ``tokengate doctor`` asks the
    running ledger). ``path``: the configuration file, read again whenever it changed
    (``tokengate keys`` edits it; a file that does not load leaves the last one that
    did)."""
    loaded: dict[str, Any] = {"stamp": None, "cfg": tg_config.load(path)}

    def current() -> tg_config.Config:
        try:
            st = path.stat()
            stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
            if stamp != loaded["stamp"]:
                loaded["stamp"] = stamp
                loaded["cfg"] = tg_config.load(path)
        except (tg_config.ConfigError, OSError) as e:
            # once per change of the file
            print(f"tokengate admin view: {path} does not load, showing the last "
                  f"configuration that did: {' '.join(str(e).split())[:300]}",
                  file=sys.stderr, flush=True)
        cfg: tg_config.Config = loaded["cfg"]
        return cfg

    def answer(path_info: str) -> tuple[int, Any] | None:
        if status is not None and path_info.rstrip("/") == "/status":
            return 200, status()
        if path_info.rstrip("/") == "/keys":
            cfg = current()
            return 200, {"currency": cfg.currency,
                         "keys": snapshot(cfg, client, datetime.now(UTC).date())}
        if not path_info.startswith("/keys/"):
            return None
        name = path_info.removeprefix("/keys/")
        cfg = current()
        if name not in cfg.keys:
            return 404, {"error": f"no key named {name!r}"}
        entry = snapshot(cfg.model_copy(update={"keys": {name: cfg.keys[name]}}), client,
                         datetime.now(UTC).date())[0]
        return 200, {"currency": cfg.currency, **entry}
    return answer

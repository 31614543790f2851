"""Budget alerts: a budget (a key's, a team's, an organization's) whose bill crosses one of
its ``alerts`` percentages of ``spend`` or ``tokens`` is announced once per threshold per
period: a log line, a metric, and a signed JSON POST to every ``alerts.webhooks`` entry.

What is measured is the ledger's bill (``tokengate usage``: its per key / model / day
counters, ``budget_store.billed_sync``), summed over the members for a team or an
organization, in the budget's current UTC period; it is read about once a second, after
the events are applied.

Exactly once. Crossing a threshold is *claimed* in Redis (``alert_claim.lua``: a mark per
alert id, ``SET NX``, and in the same script one pending delivery per webhook), so
however many ledgers run and however often they restart, each threshold of each period
is claimed once. A pending delivery stays in Redis until its webhook answers 2xx: a
ledger killed (kill -9) before that leaves it there and the next one to run delivers it;
a ledger delivers it under a lease (``SET NX PX``) so two ledgers never send it at once.
A failure waits ``retry_initial_s``, doubled after each further failure up to
``retry_max_s``. Each delivery carries the alert's stable ``id`` (also in
``X-Tokengate-Alert-Id``): the one window left, a ledger killed between the receiver's
2xx and its deletion of the delivery, sends it again with the same id, which a receiver
drops.

Signature (``X-Tokengate-Signature: t=<unix s>,v1=<hex>``): HMAC-SHA256 with the
webhook's ``secret`` of ``"<t>.<body>"`` (the scheme Stripe's webhooks use), so a
receiver checks both the sender and the time (a replay of an old body fails its window).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime

from prometheus_client import Counter
from redis.exceptions import RedisError

from tokengate import redis_keys, redis_scripts
from tokengate.budget_store import PERIOD_TTL_S, billed_sync, counter_name
from tokengate.config import Budget, Config
from tokengate.redis_client import SyncRedis

log = logging.getLogger("tokengate.ledger")

# KEYS: the alert's mark, the pending deliveries. ARGV: the mark's ttl, then per webhook
# its field and delivery. Returns 1 when claimed now, 0 when claimed before.
CLAIM_LUA = redis_scripts.read("alert_claim")

ALERTS = Counter("tokengate_ledger_budget_alerts_total",
                 "Budget alerts claimed (once per threshold per period, across ledgers), "
                 "by level (key, team, org) and threshold (percent).",
                 ["level", "threshold"])
DELIVERIES = Counter("tokengate_ledger_alert_deliveries_total",
                     "Deliveries of budget alerts to webhooks, by result (ok: 2xx; failed: "
                     "anything else, retried with backoff).", ["result"])

LEVEL_NAMES = {"key": "key", "team": "team", "org": "organization"}
PERIOD_NAMES = {"day": "daily", "month": "monthly"}


@dataclass(frozen=True, slots=True)
class Scope:
    """What one set of budgets counts: a key, or a team's or organization's members."""

    level: str                    # "key" | "team" | "org"
    name: str
    members: tuple[str, ...]      # key ids
    budgets: tuple[Budget, ...]


def scopes(cfg: Config) -> list[Scope]:
    """Every key, team and organization with a budget that has alerts."""
    def alerting(budgets: list[Budget]) -> bool:
        return any(b.alerts for b in budgets)

    out = [Scope("key", k, (k,), tuple(v.budgets)) for k, v in cfg.keys.items()
           if alerting(v.budgets)]
    for name, t in cfg.teams.items():
        if alerting(t.budgets):
            out.append(Scope("team", name, tuple(k for k, v in cfg.keys.items()
                                                 if v.team == name), tuple(t.budgets)))
    for name, o in cfg.orgs.items():
        if alerting(o.budgets):
            teams = {t for t, tc in cfg.teams.items() if tc.org == name}
            out.append(Scope("org", name, tuple(k for k, v in cfg.keys.items()
                                                if v.team in teams), tuple(o.budgets)))
    return out


def sign(secret: str, t: int, body: bytes) -> str:
    """``X-Tokengate-Signature``'s value for ``body`` sent at ``t`` (unix s)."""
    mac = hmac.new(secret.encode(), f"{t}.".encode() + body, hashlib.sha256).hexdigest()
    return f"t={t},v1={mac}"


class BudgetAlerts:
    """Claims and delivers budget alerts (module docstring) for the configuration
    ``config()`` returns (the ledger's, reloaded) on ``client`` (the ledger's Redis)."""

    def __init__(self, config: Callable[[], Config], client: SyncRedis, ledger_id: str,
                 now: Callable[[], float] = time.time) -> None:
        self.config = config
        self.client = client
        self.ledger_id = ledger_id
        self.now = now
        self._claim = client.register_script(CLAIM_LUA)

    def check(self) -> int:
        """Claim every threshold crossed now; returns how many this call claimed. Raises
        ``RedisError``."""
        cfg = self.config()
        today = datetime.fromtimestamp(self.now(), UTC).date()
        claimed = 0
        for sc in scopes(cfg):
            for b in sc.budgets:
                if not b.alerts or not sc.members:
                    continue
                counter = counter_name(b.scope, b.period, today)
                bills = billed_sync(self.client, [(m, counter) for m in sc.members],
                                    list(cfg.models))
                spent = sum(s for s, _t in bills)
                used = sum(t for _s, t in bills)
                for kind, value, limit in (("spend", spent, b.spend and b.spend * 1e9),
                                           ("tokens", used, b.tokens)):
                    if not limit:
                        continue
                    for pct in sorted(set(b.alerts)):
                        if value >= limit * pct / 100:
                            claimed += self._crossed(cfg, sc, b, counter, kind, pct, value)
        return claimed

    def _crossed(self, cfg: Config, sc: Scope, b: Budget, counter: str, kind: str,
                 pct: int, value: float) -> int:
        """Claim one crossed threshold; 1 when this call claimed it."""
        alert_id = f"{sc.level}:{sc.name}/{counter}/{kind}/{pct}"
        limit = b.spend if kind == "spend" else b.tokens
        used = round(value / 1e9, 9) if kind == "spend" else int(value)
        alert = {"id": alert_id, "type": "budget.threshold", "level": sc.level,
                 "name": sc.name, "period": b.period, "model": b.model, "kind": kind,
                 "threshold": pct, "limit": limit, "used": used,
                 "currency": cfg.currency if kind == "spend" else None,
                 "period_id": counter.rsplit(":", 1)[1],
                 "ts": datetime.fromtimestamp(self.now(), UTC).isoformat()}
        delivery = json.dumps({"alert": alert, "attempts": 0, "next_at": 0.0})
        args: list[str | int] = [PERIOD_TTL_S[b.period]]
        for w in cfg.alerts.webhooks:
            args += [f"{alert_id}|{w.url}", delivery]
        if not self._claim(keys=[redis_keys.alert_mark(alert_id), redis_keys.ALERTS_KEY],
                           args=args):
            return 0
        ALERTS.labels(sc.level, str(pct)).inc()
        what = f"{limit} {cfg.currency}" if kind == "spend" else f"{limit} tokens"
        log.warning("budget alert: %s %s's %s %s budget (%s) reached %d%%: %s of %s",
                    LEVEL_NAMES[sc.level], sc.name, PERIOD_NAMES[b.period], kind,
                    b.model or "every model", pct, used, what)
        return 1

    def deliver(self) -> int:
        """Send every pending delivery that is due; returns how many were acknowledged.
        Raises ``RedisError``."""
        cfg = self.config()
        secrets = {w.url: w.secret for w in cfg.alerts.webhooks}
        pending = self.client.hgetall(redis_keys.ALERTS_KEY)
        done = 0
        for field, value in pending.items():
            # the client decodes (redis_client: decode_responses)
            assert isinstance(field, str) and isinstance(value, str)
            url = field.rpartition("|")[2]
            d = json.loads(value)
            if d["next_at"] > self.now():
                continue
            if url not in secrets:
                log.warning("budget alert %s: webhook %s is no longer configured; dropped",
                            d["alert"]["id"], url)
                self.client.hdel(redis_keys.ALERTS_KEY, field)
                continue
            lease = redis_keys.alert_lease(field)
            hold_ms = int((cfg.alerts.timeout_s * 2 + 5) * 1000)
            if not self.client.set(lease, self.ledger_id, nx=True, px=hold_ms):
                continue  # another ledger is delivering it
            try:
                error = self._post(url, secrets[url], d["alert"], cfg.alerts.timeout_s)
                if error is None:
                    DELIVERIES.labels("ok").inc()
                    self.client.hdel(redis_keys.ALERTS_KEY, field)
                    done += 1
                    continue
                DELIVERIES.labels("failed").inc()
                d["attempts"] += 1
                wait = min(cfg.alerts.retry_max_s,
                           cfg.alerts.retry_initial_s * 2 ** (d["attempts"] - 1))
                d["next_at"] = self.now() + wait
                log.warning("budget alert %s to %s failed (%s): try %d again in %.1f s",
                            d["alert"]["id"], url, error, d["attempts"] + 1, wait)
                # only while it is still pending (a copy acknowledged meanwhile stays done)
                if self.client.hexists(redis_keys.ALERTS_KEY, field):
                    self.client.hset(redis_keys.ALERTS_KEY, field, json.dumps(d))
            finally:
                self.client.delete(lease)
        return done

    def _post(self, url: str, secret: str, alert: dict[str, object], timeout_s: float
              ) -> str | None:
        """POST ``alert`` (JSON, signed) to ``url``; None on a 2xx, else why not."""
        body = json.dumps(alert, separators=(",", ":")).encode()
        req = urllib.request.Request(url, data=body, method="POST", headers={
            "Content-Type": "application/json", "User-Agent": "tokengate-ledger",
            "X-Tokengate-Alert-Id": str(alert["id"]),
            "X-Tokengate-Signature": sign(secret, int(self.now()), body)})
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as r:
                return None if 200 <= r.status < 300 else f"status {r.status}"
        except urllib.error.HTTPError as e:
            return f"status {e.code}"
        except (urllib.error.URLError, OSError) as e:
            return str(getattr(e, "reason", e))

    def run(self, stop: threading.Event, every_s: float = 1.0) -> None:
        """Check and deliver every ``every_s`` until ``stop``; Redis failures are logged
        and tried again on the next round."""
        failing = False
        while not stop.wait(every_s):
            try:
                self.check()
                self.deliver()
                failing = False
            except (RedisError, OSError) as e:
                if not failing:
                    log.warning("budget alerts: Redis unavailable (%s); trying again", e)
                failing = True

"""The budgets' Redis layout and the script that settles one request's reservation,
shared by ``tokengate.limits.budget`` (which reserves and settles for the edges) and
``tokengate.ledger`` (which settles, from the request's usage event, a reservation the
edge's own settlement never reached: the limits sidecar or Redis was down when the
request ended).

The keys (``tg:bg:{<key_id>}:...``, one Redis Cluster slot per API key) are
``tokengate.redis_keys``'s.

A reservation record is ``"<cost_nano> <tokens> <h>"`` then, per counter the
reservation was put on, ``" <ttl_s> <counter>"`` (the counter encoded as in its keys,
``redis_keys.encode_counter``): what a settlement needs besides the real cost, so
whoever settles by request id needs nothing of the configuration (records of older
sidecars end after ``<h>``).

``budget_settle.lua`` (``tokengate.redis_scripts``; ``SETTLE_LUA`` here) settles a
request exactly once, whoever sends it first: the edge (its ``SettleBudget``), or the
ledger when it applies the request's usage event, which asks for the record it read
(``expected``) and changes nothing when that is gone or changed.

``budget_fix.lua`` (``FIX_LUA``) moves a key's settled counters by a signed amount once
per fix id: the ledger's correction of what the edge settled with its own numbers to
what the ledger billed (the engine's numbers, ``tokengate.ledger.budgets``).

The readers (``counter_name``, ``committed``, ``billed_sync``) say what a budget counter
holds for its limits: what the edges' admission compares (``tokengate.limits.budget``)
and what ``tokengate keys list`` and the ledger's admin view (``tokengate.ledger.admin``)
show.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import date, timedelta
from typing import Any
from urllib.parse import unquote

from tokengate import redis_scripts
from tokengate.config import Budget
from tokengate.redis_client import SyncRedis
from tokengate.redis_keys import (
    budget_fix_mark,
    budget_keys,
    encode_counter,
    level_counter,
    level_usage_key,
    ready_mark_key,
    rebuild_key,
    reservation_key,
    usage_key,
)

__all__ = ["BILL_FIELDS", "FIX_LUA", "FIX_MARK_TTL_S", "HOUR_S", "IN_FLIGHT_TTL_S",
           "PERIOD_TTL_S", "SETTLED", "SETTLED_TTL_S", "SETTLE_LUA", "Reservation",
           "bill_fields", "bill_sums", "billed_sync", "budget_keys", "committed",
           "counter_name", "fix_args", "fix_keys", "nano", "parse_record", "period_days",
           "queue_bills", "record_tail", "request_counters", "reservation_key",
           "reserve_keys", "settle_args", "settle_keys", "this_hour"]

HOUR_S = 3600
# an hour's bucket is read in that hour and the next; a reservation is kept as long
IN_FLIGHT_TTL_S = 2 * HOUR_S
SETTLED_TTL_S = 600  # a settlement's other sender comes within the ledger's lag
SETTLED = "settled"

# KEYS: reservation, then per counter its settled spend and tokens, then the in-flight
# spend and tokens of hour h and of hour h - 1 (``settle_keys``). ARGV: real cost_nano,
# real tokens, settled ttl, h, expected record ("": any, or none: a request admitted
# without a reservation is charged its real cost), then per counter its ttl. Returns
# {applied, reserved}.
SETTLE_LUA = redis_scripts.read("budget_settle")

# KEYS: the fix's mark (``redis_keys.budget_fix_mark``), then per counter its settled
# spend and tokens. ARGV: cost_nano and tokens to add (signed), the mark's ttl, then per
# counter its ttl (set on a counter that has none). Returns 1 (made) or 0 (made before).
FIX_LUA = redis_scripts.read("budget_fix")
# a fix is taken off the ledger's list right after it is made: its mark only has to
# outlive a ledger that stopped in between
FIX_MARK_TTL_S = 86400
# how long a period's counters are kept after their last change (TTL in
# lua/tokengate/budget.lua: a period's counters outlive it)
PERIOD_TTL_S = {"day": 2 * 86400, "month": 33 * 86400}


def this_hour() -> int:
    """The UTC hour now, in hours since the epoch (the in-flight buckets' id)."""
    return int(time.time() // HOUR_S)


def nano(cost: float) -> int:
    """A cost in currency units as whole nano-units, rounded up: the edge's rounding
    (``nano`` in lua/tokengate/budget.lua)."""
    return math.ceil(cost * 1e9 - 1e-6)


def settle_keys(key_id: str, request_id: str, counters: Sequence[str], hour: int
                ) -> list[str]:
    """KEYS of ``budget_settle.lua`` (and the first of ``budget_reserve.lua``'s): the
    reservation, then each counter's ``budget_keys``."""
    keys = [reservation_key(key_id, request_id)]
    for name in counters:
        keys.extend(budget_keys(key_id, name, hour))
    return keys


def settle_args(cost_nano: int, tokens: int, hour: int, ttls: Sequence[int],
                expected: str = "") -> list[Any]:
    """ARGV of ``budget_settle.lua``: the real cost (nano-units) and tokens, the hour, the
    record that must still be there (``""``: none required) and each counter's ttl (s)."""
    return [cost_nano, tokens, SETTLED_TTL_S, hour, expected, *ttls]


def request_counters(budgets: Sequence[Budget], model: str | None, day: date,
                     level: str | None = None) -> list[tuple[str, int]]:
    """(counter, ttl_s) of every budget of ``budgets`` (a key's, or of the level whose id
    is ``level``: its counters are ``<level id>/<counter>``) that a request of ``model``
    on UTC ``day`` is charged to: the counters the edge names for it (``add_items`` in
    lua/tokengate/budget.lua)."""
    prefix = f"{level}/" if level is not None else ""
    return [(prefix + counter_name(b.scope, b.period, day), PERIOD_TTL_S[b.period])
            for b in budgets if b.model is None or b.model == model]


def reserve_keys(key_id: str, request_id: str, counters: Sequence[str], hour: int
                 ) -> list[str]:
    """KEYS of ``budget_reserve.lua``: ``settle_keys``, then the key's ready mark and its
    rebuild holds (``redis_keys.ready_mark_key``, ``rebuild_key``)."""
    return [*settle_keys(key_id, request_id, counters, hour), ready_mark_key(key_id),
            rebuild_key(key_id)]


def fix_keys(key_id: str, fix_id: str, counters: Sequence[str]) -> list[str]:
    """KEYS of ``budget_fix.lua``: the mark, then each counter's settled spend and
    tokens."""
    keys = [budget_fix_mark(key_id, fix_id)]
    for name in counters:
        keys += budget_keys(key_id, name, 0)[:2]
    return keys


def fix_args(cost_nano: int, tokens: int, ttls: Sequence[int]) -> list[Any]:
    """ARGV of ``budget_fix.lua``: the signed change of spend (nano-units) and tokens,
    the mark's ttl and each counter's ttl (s)."""
    return [cost_nano, tokens, FIX_MARK_TTL_S, *ttls]


def record_tail(counters: Sequence[tuple[str, int]]) -> str:
    """What a reservation record holds after ``"<cost> <tokens> <h>"``: per
    ``(counter, ttl_s)`` ``" <ttl_s> <counter>"``."""
    return "".join(f" {ttl} {encode_counter(name)}" for name, ttl in counters)


@dataclass(frozen=True, slots=True)
class Reservation:
    """A reservation record as read from Redis."""

    cost_nano: int
    tokens: int
    hour: int                        # UTC hour of the admission, hours since the epoch
    counters: list[tuple[str, int]]  # (counter, ttl_s); empty in older sidecars' records


def parse_record(value: str | None) -> Reservation | None:
    """A reservation record -> ``Reservation``; None for no record, a settled one or
    one that is not a record."""
    if value is None or value == SETTLED:
        return None
    parts = value.split(" ")
    if len(parts) < 3 or len(parts) % 2 == 0 or not all(p.isdigit() for p in parts[:3]):
        return None
    pairs = parts[3:]
    if not all(t.isdigit() for t in pairs[0::2]):
        return None
    return Reservation(int(parts[0]), int(parts[1]), int(parts[2]),
                       [(unquote(n), int(t)) for t, n in zip(pairs[0::2], pairs[1::2],
                                                             strict=True)])


# --- reading the budgets


def period_days(counter: str) -> tuple[str, list[date]]:
    """``counter`` -> (its scope: ``*`` or a model, the UTC days of its period)."""
    scope, period, pid = counter.rsplit(":", 2)
    if period == "day":
        return scope, [date(1970, 1, 1) + timedelta(days=int(pid))]
    first = date(1970 + int(pid) // 12, int(pid) % 12 + 1, 1)
    following = date(first.year + first.month // 12, first.month % 12 + 1, 1)
    return scope, [first + timedelta(days=i) for i in range((following - first).days)]


def counter_name(scope: str, period: str, day: date) -> str:
    """The counter the edge names for a budget of ``scope`` (``*`` or a model) and
    ``period`` (day | month) in the UTC period holding ``day``: its id is the days since
    1970-01-01, or the months since 1970-01 (``period`` in lua/tokengate/budget.lua)."""
    pid = (day - date(1970, 1, 1)).days if period == "day" \
        else (day.year - 1970) * 12 + day.month - 1
    return f"{scope}:{period}:{pid}"


def committed(client: SyncRedis, counters: Sequence[tuple[str, str]],
              models: Sequence[str]) -> list[tuple[int, int]]:
    """(spend nano-units, tokens) each ``(key_id, counter)`` holds now for its limits
    (``tokengate.limits.budget``'s docstring: what was settled, or the ledger's bill,
    plus the reservations of requests still in flight; 0 for a counter nothing was
    charged to). ``models``: the configured models (the scope ``*``). Raises
    ``RedisError``."""
    hour = this_hour()
    pipe = client.pipeline(transaction=False)
    for key_id, counter in counters:
        for k in budget_keys(key_id, counter, hour):
            pipe.get(k)
    v = [int(x or 0) for x in pipe.execute()]
    bills = billed_sync(client, counters, models)
    return [(max(v[6 * i], bills[i][0]) + v[6 * i + 2] + v[6 * i + 4],
             max(v[6 * i + 1], bills[i][1]) + v[6 * i + 3] + v[6 * i + 5])
            for i in range(len(counters))]


BILL_FIELDS = ("cost", "prompt_tokens", "completion_tokens")  # of a ledger usage hash


def bill_fields(counters: Sequence[tuple[str, str]], models: Sequence[str]
                ) -> list[list[str]]:
    """Per ``(key_id, counter)`` the ledger's usage hashes its bill sums: the key's per
    key / model / day hashes, or for a team's or organization's counter
    (``level_counter``) the level's (``redis_keys.level_usage_key``: its members'
    requests, each under the levels its key had in the configuration the ledger applied
    it with). Both are rebuilt from the usage files when Redis loses its data, which
    the settled counters are not."""
    out: list[list[str]] = []
    for key_id, counter in counters:
        level = level_counter(counter)
        scope, days = period_days(counter if level is None else level[1])
        names = list(models) if scope == "*" else [scope]
        out.append([usage_key(d.isoformat(), key_id, m) if level is None
                    else level_usage_key(d.isoformat(), level[0], m)
                    for d in days for m in names])
    return out


def queue_bills(pipe: Any, fields: Sequence[Sequence[str]]) -> None:
    """HMGET the ``BILL_FIELDS`` of every hash of ``fields`` (``bill_fields``) on
    ``pipe`` (a sync or asyncio pipeline)."""
    for keys in fields:
        for k in keys:
            pipe.hmget(k, *BILL_FIELDS)


def bill_sums(fields: Sequence[Sequence[str]], rows: Sequence[Sequence[Any]]
              ) -> list[tuple[int, int]]:
    """Per entry of ``fields``, (spend nano-units, rounded down, tokens) of its rows of
    the pipeline ``queue_bills`` filled."""
    out, at = [], 0
    for keys in fields:
        mine = rows[at:at + len(keys)]
        at += len(keys)
        cost = sum(float(r[0] or 0) for r in mine)
        tokens = sum(int(r[1] or 0) + int(r[2] or 0) for r in mine)
        out.append((math.floor(cost * 1e9 + 1e-6), tokens))
    return out


def billed_sync(client: SyncRedis, counters: Sequence[tuple[str, str]],
                models: Sequence[str]) -> list[tuple[int, int]]:
    """(spend nano-units, tokens) the ledger billed each ``(key_id, counter)``: its
    key / model / day counters summed over the counter's days and scope (``*``: every
    model of ``models``). Raises ``RedisError``."""
    fields = bill_fields(counters, models)
    pipe = client.pipeline(transaction=False)
    queue_bills(pipe, fields)
    return bill_sums(fields, pipe.execute())

"""Global budgets: a key's spend and tokens per UTC day or month in Redis, shared by
every edge node and kept across restarts (``keys.<id>.budgets``).

The edge computes each request's cost (``lua/tokengate/budget.lua``, the formula of
``tokengate.ledger.calculator``, in whole nano-units of the currency, 1e-9, rounded up)
and names the counters of its period; here the counters are only added to, atomically.
Keys, all with the hash tag ``{<key_id>}`` (one Redis Cluster slot per key)::

    tg:bg:{<key_id>}:<counter>:s   string  spend of the period, nano-units
    tg:bg:{<key_id>}:<counter>:t   string  tokens of the period (prompt + completion)
    tg:bg:{<key_id>}:<counter>:rs  string  of that spend, what reservations still in
    tg:bg:{<key_id>}:<counter>:rt  string    flight hold (settled: taken out again)
    tg:bg:{<key_id>}:r:<request>   string  "<cost_nano> <tokens>": a reservation not yet
                                           settled; "settled" for 10 minutes after
    counter = "<model or *>:<day|month>:<period id>"

What a counter holds for a limit is the larger of its spend and what the ledger billed
the key in that period and scope (``billed``: its per key / model / day counters, the
bill ``tokengate usage`` reports) plus the reservations in flight. The counters alone
miss spend that never reached them: requests an edge admitted on its own counters while
Redis or this sidecar was unreachable and whose settlement could not reach Redis either
(an nginx restarted in between), a Redis that lost its data (the ledger rebuilds its
counters from the usage files), a bill the engine's records raised above the edge's
numbers. The ledger's bill lags its usage files by about a second; in that time the
counters decide, and they are never below the bill of what they admitted.

``RESERVE_LUA`` (one script, so concurrent reservations from any number of edges never
pass a limit: no get-then-set) checks every counter that has a limit against
``used + cost``, then charges all of them or none, and records the reservation.
``SETTLE_LUA`` corrects the counters by ``real - reserved``, takes the reservation out of
what is in flight and marks the request settled; a request the edge admitted without a
reservation (Redis was unreachable at admission) is charged its real cost then, so spend
admitted during an outage still reaches Redis when the settlement does.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import date, timedelta
from urllib.parse import quote

from tokengate import redis_client
from tokengate.ledger import store

RESERVATION_TTL_S = 86_400   # a reservation outlives any request
SETTLED_TTL_S = 600          # a settlement's retries come within seconds

# KEYS: reservation, then per counter its spend, tokens, in-flight spend and in-flight
# tokens keys. ARGV: cost_nano, tokens, reservation ttl, then per counter spend_limit
# (0: none), token_limit (0: none), ttl, billed spend (nano-units), billed tokens.
# Returns {admitted, refused (1-based counter index), limited_by (1 spend, 2 tokens),
#          then per counter what it holds for its limits, spend and tokens: after this
#          reservation when admitted, before it when refused}.
RESERVE_LUA = """
local cost, tokens, rttl = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local n = (#KEYS - 1) / 4
local used = {}
for i = 1, n do
  local k = 4 * i - 2
  local a = 5 * i - 1
  local s = tonumber(redis.call('GET', KEYS[k]) or '0')
  local t = tonumber(redis.call('GET', KEYS[k + 1]) or '0')
  local rs = tonumber(redis.call('GET', KEYS[k + 2]) or '0')
  local rt = tonumber(redis.call('GET', KEYS[k + 3]) or '0')
  used[2 * i - 1] = math.max(s, tonumber(ARGV[a + 3]) + rs)
  used[2 * i] = math.max(t, tonumber(ARGV[a + 4]) + rt)
end
local function reply(admitted, refused, limited)
  local r = {admitted, refused, limited}
  for i = 1, 2 * n do r[3 + i] = used[i] end
  return r
end
if redis.call('EXISTS', KEYS[1]) == 1 then
  return reply(1, 0, 0)
end
for i = 1, n do
  local a = 5 * i - 1
  local ls, lt = tonumber(ARGV[a]), tonumber(ARGV[a + 1])
  if ls > 0 and used[2 * i - 1] + cost > ls then return reply(0, i, 1) end
  if lt > 0 and used[2 * i] + tokens > lt then return reply(0, i, 2) end
end
for i = 1, n do
  local k = 4 * i - 2
  local ttl = tonumber(ARGV[5 * i + 1])
  used[2 * i - 1] = used[2 * i - 1] + cost
  used[2 * i] = used[2 * i] + tokens
  for j, delta in ipairs({cost, tokens, cost, tokens}) do
    redis.call('INCRBY', KEYS[k + j - 1], delta)
    redis.call('EXPIRE', KEYS[k + j - 1], ttl)
  end
end
redis.call('SET', KEYS[1], ARGV[1] .. ' ' .. ARGV[2], 'EX', rttl)
return reply(1, 0, 0)
"""

# KEYS as for RESERVE_LUA. ARGV: real cost_nano, real tokens, settled ttl, then per
# counter its ttl. Returns {applied, reserved}.
SETTLE_LUA = """
local cost, tokens, sttl = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local r = redis.call('GET', KEYS[1])
if r == 'settled' then return {0, 0} end
local dc, dt, rc, rt, reserved = cost, tokens, 0, 0, 0
if r then
  local c, t = string.match(r, '^(%d+) (%d+)$')
  rc, rt, reserved = tonumber(c), tonumber(t), 1
  dc, dt = cost - rc, tokens - rt
end
redis.call('SET', KEYS[1], 'settled', 'EX', sttl)
for i = 1, (#KEYS - 1) / 4 do
  local k = 4 * i - 2
  local ttl = tonumber(ARGV[3 + i])
  for j, delta in ipairs({dc, dt, -rc, -rt}) do
    if delta ~= 0 then redis.call('INCRBY', KEYS[k + j - 1], delta) end
    redis.call('EXPIRE', KEYS[k + j - 1], ttl)
  end
end
return {1, reserved}
"""

BILLED_CACHE_S = 1.0  # how long one read of the ledger's bill serves a key's reservations


@dataclass(frozen=True, slots=True)
class BudgetCounter:
    """One budget counter of a request (``BudgetCounter`` in limits.proto)."""

    name: str                  # "<model or *>:<day|month>:<period id>"
    spend_limit_nano: int      # nano-units of the currency; 0: none
    token_limit: int           # tokens; 0: none
    ttl_s: int                 # kept this long after its last change, s


@dataclass(frozen=True, slots=True)
class BudgetReservation:
    """ReserveBudget's answer: ``usage`` holds (spend nano-units, tokens) per counter,
    what it holds for its limits (module docstring), after this reservation when
    admitted, before it when refused."""

    admitted: bool
    refused: int               # 1-based index of the counter that refused; 0: admitted
    limited_by: str | None     # "spend" | "tokens" | None
    usage: list[tuple[int, int]]


def budget_keys(key_id: str, counter: str) -> tuple[str, str, str, str]:
    """The (spend, tokens, in-flight spend, in-flight tokens) Redis keys of one counter
    of ``key_id``."""
    base = f"tg:bg:{{{quote(key_id, safe='')}}}:{quote(counter, safe='*:')}"
    return base + ":s", base + ":t", base + ":rs", base + ":rt"


def period_days(counter: str) -> tuple[str, list[date]]:
    """``counter`` -> (its scope: ``*`` or a model, the UTC days of its period)."""
    scope, period, pid = counter.rsplit(":", 2)
    if period == "day":
        return scope, [date(1970, 1, 1) + timedelta(days=int(pid))]
    first = date(1970 + int(pid) // 12, int(pid) % 12 + 1, 1)
    following = date(first.year + first.month // 12, first.month % 12 + 1, 1)
    return scope, [first + timedelta(days=i) for i in range((following - first).days)]


def reservation_key(key_id: str, request_id: str) -> str:
    """The Redis key of one request's reservation."""
    return f"tg:bg:{{{quote(key_id, safe='')}}}:r:{quote(request_id, safe='')}"


def counter_name(scope: str, period: str, day: date) -> str:
    """The counter the edge names for a budget of ``scope`` (``*`` or a model) and
    ``period`` (day | month) in the UTC period holding ``day``: its id is the days since
    1970-01-01, or the months since 1970-01 (``period`` in lua/tokengate/budget.lua)."""
    pid = (day - date(1970, 1, 1)).days if period == "day" \
        else (day.year - 1970) * 12 + day.month - 1
    return f"{scope}:{period}:{pid}"


def committed(client: redis_client.SyncRedis, counters: Sequence[tuple[str, str]],
              models: Sequence[str]) -> list[tuple[int, int]]:
    """(spend nano-units, tokens) each ``(key_id, counter)`` holds now for its limits
    (module docstring: what was settled, or the ledger's bill, plus the reservations
    of requests still in flight; 0 for a counter nothing was charged to). ``models``:
    the configured models (the scope ``*``). Raises ``RedisError``."""
    pipe = client.pipeline(transaction=False)
    for key_id, counter in counters:
        for k in budget_keys(key_id, counter):
            pipe.get(k)
    vals = [int(v or 0) for v in pipe.execute()]
    bills = billed_sync(client, counters, models)
    return [(max(vals[4 * i], bills[i][0] + vals[4 * i + 2]),
             max(vals[4 * i + 1], bills[i][1] + vals[4 * i + 3]))
            for i in range(len(counters))]


def _bill_fields(counters: Sequence[tuple[str, str]], models: Sequence[str]
                 ) -> list[list[str]]:
    """Per ``(key_id, counter)`` the ledger's usage hashes its bill sums."""
    out = []
    for key_id, counter in counters:
        scope, days = period_days(counter)
        names = list(models) if scope == "*" else [scope]
        out.append([store.usage_key(d.isoformat(), key_id, m) for d in days for m in names])
    return out


def _bill_sum(rows: Sequence[Sequence[str | bytes | None]]) -> tuple[int, int]:
    """(spend nano-units, rounded down, tokens) of HMGET cost, prompt_tokens,
    completion_tokens rows."""
    cost = sum(float(r[0] or 0) for r in rows)
    tokens = sum(int(r[1] or 0) + int(r[2] or 0) for r in rows)
    return math.floor(cost * 1e9 + 1e-6), tokens


def billed_sync(client: redis_client.SyncRedis, counters: Sequence[tuple[str, str]],
                models: Sequence[str]) -> list[tuple[int, int]]:
    """(spend nano-units, tokens) the ledger billed each ``(key_id, counter)``: its
    key / model / day counters summed over the counter's days and scope (``*``: every
    model of ``models``). Raises ``RedisError``."""
    fields = _bill_fields(counters, models)
    pipe = client.pipeline(transaction=False)
    for keys in fields:
        for k in keys:
            pipe.hmget(k, "cost", "prompt_tokens", "completion_tokens")
    rows = pipe.execute()
    out, at = [], 0
    for keys in fields:
        out.append(_bill_sum(rows[at:at + len(keys)]))
        at += len(keys)
    return out


def _keys(key_id: str, request_id: str, counters: Sequence[BudgetCounter]) -> list[str]:
    keys = [reservation_key(key_id, request_id)]
    for c in counters:
        keys.extend(budget_keys(key_id, c.name))
    return keys


class GlobalBudgets:
    """Reserve and settle budgets in Redis (asyncio client: ``redis_client.connect_async``).
    ``models`` gives the configured models (the scope ``*`` of the ledger's bill).

    Raises ``redis.exceptions.RedisError`` (and ``asyncio.TimeoutError``) when Redis
    fails; the edge then decides on its own budget counters.
    """

    def __init__(self, client: redis_client.AsyncRedis,
                 models: Callable[[], Sequence[str]]) -> None:
        self.client = client
        self.models = models
        self._reserve = client.register_script(RESERVE_LUA)
        self._settle = client.register_script(SETTLE_LUA)
        self._bills: dict[tuple[str, str], tuple[float, tuple[int, int]]] = {}

    async def billed(self, key_id: str, counters: Sequence[BudgetCounter]
                     ) -> list[tuple[int, int]]:
        """``billed_sync`` over this client, each (key, counter) read at most once per
        ``BILLED_CACHE_S``."""
        now = time.monotonic()
        want = [(key_id, c.name) for c in counters
                if now - self._bills.get((key_id, c.name), (-1e9, (0, 0)))[0] > BILLED_CACHE_S]
        if want:
            fields = _bill_fields(want, self.models())
            pipe = self.client.pipeline(transaction=False)
            for keys in fields:
                for k in keys:
                    pipe.hmget(k, "cost", "prompt_tokens", "completion_tokens")
            rows = await pipe.execute()
            at = 0
            for kc, keys in zip(want, fields, strict=True):
                self._bills[kc] = (now, _bill_sum(rows[at:at + len(keys)]))
                at += len(keys)
            if len(self._bills) > 100_000:  # periods end: forget the old ones
                self._bills = {k: v for k, v in self._bills.items()
                               if now - v[0] <= BILLED_CACHE_S}
        return [self._bills[(key_id, c.name)][1] for c in counters]

    async def reserve(self, key_id: str, request_id: str, counters: Sequence[BudgetCounter],
                      cost_nano: int, tokens: int) -> BudgetReservation:
        """Charge ``cost_nano`` and ``tokens`` to every counter, or to none when one
        would pass its limit; see the module docstring."""
        bills = await self.billed(key_id, counters)
        args: list[int] = [cost_nano, tokens, RESERVATION_TTL_S]
        for c, (bs, bt) in zip(counters, bills, strict=True):
            args.extend((c.spend_limit_nano, c.token_limit, c.ttl_s, bs, bt))
        r = [int(x) for x in await self._reserve(
            keys=_keys(key_id, request_id, counters), args=args)]
        usage = [(r[3 + 2 * i], r[4 + 2 * i]) for i in range(len(counters))]
        return BudgetReservation(bool(r[0]), r[1], {1: "spend", 2: "tokens"}.get(r[2]), usage)

    async def settle(self, key_id: str, request_id: str, counters: Sequence[BudgetCounter],
                     cost_nano: int, tokens: int) -> tuple[bool, bool]:
        """Settle the request's real cost and tokens; returns (applied, reserved)."""
        r = await self._settle(keys=_keys(key_id, request_id, counters),
                               args=[cost_nano, tokens, SETTLED_TTL_S,
                                     *(c.ttl_s for c in counters)])
        return bool(int(r[0])), bool(int(r[1]))

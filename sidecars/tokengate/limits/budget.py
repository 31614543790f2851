"""Global budgets: a key's spend and tokens per UTC day or month in Redis, shared by
every edge node and kept across restarts (``keys.<id>.budgets``).

The edge computes each request's cost (``lua/tokengate/budget.lua``, the formula of
``tokengate.ledger.calculator``, in whole nano-units of the currency, 1e-9, rounded up)
and names the counters of its period; here the counters are only added to, atomically.
Keys, all with the hash tag ``{<key_id>}`` (one Redis Cluster slot per key)::

    tg:bg:{<key_id>}:<counter>:s   string  spend of the period, nano-units
    tg:bg:{<key_id>}:<counter>:t   string  tokens of the period (prompt + completion)
    tg:bg:{<key_id>}:r:<request>   string  "<cost_nano> <tokens>": a reservation not yet
                                           settled; "settled" for 10 minutes after
    counter = "<model or *>:<day|month>:<period id>"

``RESERVE_LUA`` (one script, so concurrent reservations from any number of edges never
pass a limit: no get-then-set) checks every counter that has a limit against
``value + cost``, then charges all of them or none, and records the reservation.
``SETTLE_LUA`` corrects the counters by ``real - reserved`` and marks the request
settled; a request the edge admitted without a reservation (Redis was unreachable at
admission) is charged its real cost then, so spend admitted during an outage still
reaches Redis when the settlement does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import date
from urllib.parse import quote

from tokengate import redis_client

RESERVATION_TTL_S = 86_400   # a reservation outlives any request
SETTLED_TTL_S = 600          # a settlement's retries come within seconds

# KEYS: reservation, then per counter its spend and tokens keys. ARGV: cost_nano, tokens,
# reservation ttl, then per counter spend_limit (0: none), token_limit (0: none), ttl.
# Returns {admitted, refused (1-based counter index), limited_by (1 spend, 2 tokens),
#          then per counter its spend and tokens}.
RESERVE_LUA = """
local cost, tokens, rttl = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local n = (#KEYS - 1) / 2
local vals = {}
for i = 1, n do
  vals[2 * i - 1] = tonumber(redis.call('GET', KEYS[2 * i]) or '0')
  vals[2 * i] = tonumber(redis.call('GET', KEYS[2 * i + 1]) or '0')
end
local function reply(admitted, refused, limited)
  local r = {admitted, refused, limited}
  for i = 1, 2 * n do r[3 + i] = vals[i] end
  return r
end
if redis.call('EXISTS', KEYS[1]) == 1 then
  return reply(1, 0, 0)
end
for i = 1, n do
  local ls, lt = tonumber(ARGV[1 + 3 * i]), tonumber(ARGV[2 + 3 * i])
  if ls > 0 and vals[2 * i - 1] + cost > ls then return reply(0, i, 1) end
  if lt > 0 and vals[2 * i] + tokens > lt then return reply(0, i, 2) end
end
for i = 1, n do
  local ttl = tonumber(ARGV[3 + 3 * i])
  vals[2 * i - 1] = redis.call('INCRBY', KEYS[2 * i], cost)
  vals[2 * i] = redis.call('INCRBY', KEYS[2 * i + 1], tokens)
  redis.call('EXPIRE', KEYS[2 * i], ttl)
  redis.call('EXPIRE', KEYS[2 * i + 1], ttl)
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
local dc, dt, reserved = cost, tokens, 0
if r then
  local rc, rt = string.match(r, '^(%d+) (%d+)$')
  dc, dt, reserved = cost - tonumber(rc), tokens - tonumber(rt), 1
end
redis.call('SET', KEYS[1], 'settled', 'EX', sttl)
for i = 1, (#KEYS - 1) / 2 do
  local ttl = tonumber(ARGV[3 + i])
  if dc ~= 0 then redis.call('INCRBY', KEYS[2 * i], dc) end
  if dt ~= 0 then redis.call('INCRBY', KEYS[2 * i + 1], dt) end
  redis.call('EXPIRE', KEYS[2 * i], ttl)
  redis.call('EXPIRE', KEYS[2 * i + 1], ttl)
end
return {1, reserved}
"""


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
    after this reservation when admitted, before it when refused."""

    admitted: bool
    refused: int               # 1-based index of the counter that refused; 0: admitted
    limited_by: str | None     # "spend" | "tokens" | None
    usage: list[tuple[int, int]]


def budget_keys(key_id: str, counter: str) -> tuple[str, str]:
    """The (spend, tokens) Redis keys of one counter of ``key_id``."""
    base = f"tg:bg:{{{quote(key_id, safe='')}}}:{quote(counter, safe='*:')}"
    return base + ":s", base + ":t"


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


def committed(client: redis_client.SyncRedis, counters: Sequence[tuple[str, str]]
              ) -> list[tuple[int, int]]:
    """(spend nano-units, tokens) each ``(key_id, counter)`` holds now: what was settled
    plus the reservations of requests still in flight, the totals admission compares with
    a limit (0 for a counter nothing was charged to). Raises ``RedisError``."""
    pipe = client.pipeline(transaction=False)
    for key_id, counter in counters:
        for k in budget_keys(key_id, counter):
            pipe.get(k)
    vals = [int(v or 0) for v in pipe.execute()]
    return [(vals[2 * i], vals[2 * i + 1]) for i in range(len(counters))]


def _keys(key_id: str, request_id: str, counters: Sequence[BudgetCounter]) -> list[str]:
    keys = [reservation_key(key_id, request_id)]
    for c in counters:
        keys.extend(budget_keys(key_id, c.name))
    return keys


class GlobalBudgets:
    """Reserve and settle budgets in Redis (asyncio client: ``redis_client.connect_async``).

    Raises ``redis.exceptions.RedisError`` (and ``asyncio.TimeoutError``) when Redis
    fails; the edge then decides on its own budget counters.
    """

    def __init__(self, client: redis_client.AsyncRedis) -> None:
        self._reserve = client.register_script(RESERVE_LUA)
        self._settle = client.register_script(SETTLE_LUA)

    async def reserve(self, key_id: str, request_id: str, counters: Sequence[BudgetCounter],
                      cost_nano: int, tokens: int) -> BudgetReservation:
        """Charge ``cost_nano`` and ``tokens`` to every counter, or to none when one
        would pass its limit; see the module docstring."""
        args: list[int] = [cost_nano, tokens, RESERVATION_TTL_S]
        for c in counters:
            args.extend((c.spend_limit_nano, c.token_limit, c.ttl_s))
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

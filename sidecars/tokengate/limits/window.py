"""Global limits: one sliding-window RPM/TPM reservation per API key in Redis.

Every edge node reserves in the same window, so N nodes share one limit. Algorithm: a
sliding log over the last ``window_ms`` (60 000 ms) on Redis's own clock (``TIME``,
so the edges' clocks do not matter), kept in two keys that share the hash tag
``{<key_id>}`` (one Redis Cluster slot per key, keys spread over the cluster;
``tokengate.redis_keys.window_keys``)::

    tg:gl:{<key_id>}:<scope>:z   zset  request_id -> admission time, ms
    tg:gl:{<key_id>}:<scope>:h   hash  request_id -> tokens reserved (settled);
                                       field "#sum" = tokens in the window
    scope = "all" (the key's own limits) | "m:<model>" (a per-model override)

``RESERVE_LUA`` runs atomically (one script): drop entries older than the window
(subtracting their tokens from ``#sum``), then admit only if both
``count + 1 <= rpm`` and ``#sum + tokens <= tpm``, recording the entry; so concurrent
reservations from any number of edges can never overshoot (no get-then-set). A retry
with the same request id is answered from the recorded entry (idempotent).
``SETTLE_LUA`` corrects an entry still in the window by ``actual - reserved``
(reserve at admission, settle with real usage). Both keys expire ``window_ms + 1000`` ms after the last admission.
Memory: one zset and hash entry per request admitted in the last minute (so at most
the RPM limit per key).
"""

from __future__ import annotations

from dataclasses import dataclass

from tokengate import redis_client
from tokengate.redis_keys import window_keys

__all__ = ["WINDOW_MS", "GlobalLimiter", "Reservation", "Settlement", "window_keys"]

WINDOW_MS = 60_000

# KEYS[1] zset, KEYS[2] hash. ARGV: request_id, rpm, tpm, tokens, window_ms.
# Returns {admitted, limited_by (0 none, 1 requests, 2 tokens), never_fits,
#          remaining_requests, remaining_tokens, reset_requests_ms, reset_tokens_ms,
#          retry_after_ms}.
RESERVE_LUA = """
local z, h, rid = KEYS[1], KEYS[2], ARGV[1]
local rpm, tpm, tokens, window = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4]),
  tonumber(ARGV[5])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local cutoff = now - window

local sum = tonumber(redis.call('HGET', h, '#sum') or '0')
local old = redis.call('ZRANGEBYSCORE', z, '-inf', cutoff)
if #old > 0 then
  for i = 1, #old, 1000 do
    local part = {}
    for j = i, math.min(i + 999, #old) do part[#part + 1] = old[j] end
    local vals = redis.call('HMGET', h, unpack(part))
    for j = 1, #vals do sum = sum - (tonumber(vals[j]) or 0) end
    redis.call('HDEL', h, unpack(part))
  end
  redis.call('ZREMRANGEBYSCORE', z, '-inf', cutoff)
  if sum < 0 then sum = 0 end
  redis.call('HSET', h, '#sum', sum)
end

local count = redis.call('ZCARD', z)
local function reset_ms()
  if count == 0 then return 0 end
  local newest = redis.call('ZRANGE', z, -1, -1, 'WITHSCORES')
  return math.max(0, tonumber(newest[2]) + window - now)
end
local function reply(admitted, limited, never, retry)
  local r = reset_ms()
  local rt = r
  if sum <= 0 then rt = 0 end
  return {admitted, limited, never, math.max(0, rpm - count), math.max(0, tpm - sum),
          r, rt, retry}
end

if redis.call('HEXISTS', h, rid) == 1 then
  return reply(1, 0, 0, 0)
end
if tokens > tpm then
  return reply(0, 2, 1, 0)
end
if count + 1 > rpm then
  local oldest = redis.call('ZRANGE', z, 0, 0, 'WITHSCORES')
  return reply(0, 1, 0, math.max(1, tonumber(oldest[2]) + window - now))
end
if sum + tokens > tpm then
  -- walk from the oldest entry until enough tokens would have left the window
  local need, freed, start = sum + tokens - tpm, 0, 0
  while true do
    local part = redis.call('ZRANGE', z, start, start + 99, 'WITHSCORES')
    if #part == 0 then break end
    local ids = {}
    for j = 1, #part, 2 do ids[#ids + 1] = part[j] end
    local vals = redis.call('HMGET', h, unpack(ids))
    for j = 1, #ids do
      freed = freed + (tonumber(vals[j]) or 0)
      if freed >= need then
        return reply(0, 2, 0, math.max(1, tonumber(part[2 * j]) + window - now))
      end
    end
    start = start + 100
  end
  return reply(0, 2, 0, window)
end

redis.call('ZADD', z, now, rid)
sum = sum + tokens
redis.call('HSET', h, rid, tokens, '#sum', sum)
redis.call('PEXPIRE', z, window + 1000)
redis.call('PEXPIRE', h, window + 1000)
count = count + 1
return reply(1, 0, 0, 0)
"""

# KEYS[1] zset, KEYS[2] hash. ARGV: request_id, actual tokens, window_ms.
# Returns {found, delta, window_tokens}.
SETTLE_LUA = """
local z, h, rid = KEYS[1], KEYS[2], ARGV[1]
local actual, window = tonumber(ARGV[2]), tonumber(ARGV[3])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local prev = redis.call('HGET', h, rid)
local score = redis.call('ZSCORE', z, rid)
if not prev or not score or tonumber(score) <= now - window then
  return {0, 0, tonumber(redis.call('HGET', h, '#sum') or '0')}
end
local delta = actual - tonumber(prev)
redis.call('HSET', h, rid, actual)
local sum = redis.call('HINCRBY', h, '#sum', delta)
return {1, delta, sum}
"""

LIMITS = {0: None, 1: "requests", 2: "tokens"}


@dataclass(frozen=True, slots=True)
class Reservation:
    """Reserve's answer; times in ms, tokens in tokens."""

    admitted: bool
    limited_by: str | None     # "requests" | "tokens" | None
    never_fits: bool           # tokens > tpm: can never be admitted
    remaining_requests: int
    remaining_tokens: int
    reset_requests_ms: int     # until the window is back to its full limit
    reset_tokens_ms: int
    retry_after_ms: int        # until this request would fit (0 when admitted)


@dataclass(frozen=True, slots=True)
class Settlement:
    """Settle's answer."""

    found: bool                # the reservation was still in the window
    delta: int                 # actual - reserved, tokens
    window_tokens: int         # tokens in the window afterwards


class GlobalLimiter:
    """Reserve and settle in the Redis windows (asyncio client: ``redis_client.connect_async``).

    Raises ``redis.exceptions.RedisError`` (and ``asyncio.TimeoutError`` from the
    client's timeouts) when Redis fails; callers fall back to local limits.
    """

    def __init__(self, client: redis_client.AsyncRedis, window_ms: int = WINDOW_MS) -> None:
        self.client = client
        self.window_ms = window_ms
        self._reserve = client.register_script(RESERVE_LUA)
        self._settle = client.register_script(SETTLE_LUA)

    async def reserve(self, key_id: str, model: str | None, rpm: int, tpm: int, tokens: int,
                      request_id: str) -> Reservation:
        """Reserve 1 request and ``tokens`` in the key's window (per model when ``model``
        is not None); see the module docstring."""
        r = await self._reserve(keys=list(window_keys(key_id, model)),
                                args=[request_id, rpm, tpm, tokens, self.window_ms])
        v = [int(x) for x in r]
        return Reservation(bool(v[0]), LIMITS.get(v[1]), bool(v[2]), v[3], v[4], v[5], v[6],
                           v[7])

    async def settle(self, key_id: str, model: str | None, request_id: str,
                     actual_tokens: int) -> Settlement:
        """Correct the reservation of ``request_id`` to ``actual_tokens``."""
        r = await self._settle(keys=list(window_keys(key_id, model)),
                               args=[request_id, actual_tokens, self.window_ms])
        return Settlement(bool(int(r[0])), int(r[1]), int(r[2]))

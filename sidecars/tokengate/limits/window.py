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

``window_reserve.lua`` (``tokengate.redis_scripts``) runs atomically (one script): drop
entries older than the window (subtracting their tokens from ``#sum``), then admit only
if both ``count + 1 <= rpm`` and ``#sum + tokens <= tpm``, recording the entry; so
concurrent reservations from any number of edges can never overshoot (no get-then-set).
A key of a team (``tokengate.config.teams``) is reserved in the same script in its own
window and in its team's and organization's (``tg:gl:{team:<name>}:all:*``, shared by
every member; the level id is the hash tag, so pooled windows need one Redis, not a
Cluster): every window admits and records the entry, or none does.
A retry with the same request id is answered from the recorded entry (idempotent).
``window_settle.lua`` corrects an entry still in the window by ``actual - reserved``
(reserve at admission, settle with real usage). Both keys expire ``window_ms + 1000`` ms
after the last admission.
Memory: one zset and hash entry per request admitted in the last minute (so at most
the RPM limit per key).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tokengate import redis_client, redis_scripts
from tokengate.redis_keys import window_keys

__all__ = ["WINDOW_MS", "GlobalLimiter", "LevelWindow", "Reservation", "Settlement",
           "window_keys"]

WINDOW_MS = 60_000

# KEYS: per window (the key's, then each level's) its zset and hash. ARGV: request_id,
# tokens, window_ms, then per window rpm, tpm. Returns {admitted, limited_by (0 none,
# 1 requests, 2 tokens), never_fits, remaining_requests, remaining_tokens,
# reset_requests_ms, reset_tokens_ms, retry_after_ms, window (0-based: whose numbers
# these are, the one that refused or, admitted, the one with the fewest tokens left)}.
RESERVE_LUA = redis_scripts.read("window_reserve")

# KEYS: per window its zset and hash, as for reserve. ARGV: request_id, actual tokens,
# window_ms. Returns {found, delta, window_tokens} of the key's window; every window
# holding the reservation is corrected.
SETTLE_LUA = redis_scripts.read("window_settle")

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
    level: int = 0             # whose numbers: 0 the key's window, i levels[i - 1]


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
                      request_id: str, levels: Sequence[LevelWindow] = ()) -> Reservation:
        """Reserve 1 request and ``tokens`` in the key's window (per model when ``model``
        is not None) and in each of ``levels`` (its team's, its organization's), all or
        none; see the module docstring."""
        args: list[int | str] = [request_id, tokens, self.window_ms, rpm, tpm]
        for lv in levels:
            args.extend((lv.rpm, lv.tpm))
        r = await self._reserve(keys=_keys(key_id, model, levels), args=args)
        v = [int(x) for x in r]
        return Reservation(bool(v[0]), LIMITS.get(v[1]), bool(v[2]), v[3], v[4], v[5], v[6],
                           v[7], v[8])

    async def settle(self, key_id: str, model: str | None, request_id: str,
                     actual_tokens: int, levels: Sequence[str] = ()) -> Settlement:
        """Correct the reservation of ``request_id`` to ``actual_tokens`` in the key's
        window and in the windows of ``levels`` (their ids)."""
        keys = list(window_keys(key_id, model))
        for lv in levels:
            keys.extend(window_keys(lv))
        r = await self._settle(keys=keys, args=[request_id, actual_tokens, self.window_ms])
        return Settlement(bool(int(r[0])), int(r[1]), int(r[2]))


    async def usage(self, key_id: str, levels: Sequence[str]) -> list[tuple[int, int, int]]:
        """(requests, tokens, reset ms) of the key's own window and of each level's (by
        id) on Redis's clock: the entries of the last ``window_ms`` (what the next
        reservation would count); nothing is changed."""
        sec, usec = await self.client.time()
        now = int(sec) * 1000 + int(usec) // 1000
        pairs = [window_keys(key_id)] + [window_keys(lv) for lv in levels]
        pipe = self.client.pipeline(transaction=False)
        for z, _h in pairs:
            pipe.zrangebyscore(z, f"({now - self.window_ms}", "+inf", withscores=True)
        entries = await pipe.execute()
        pipe = self.client.pipeline(transaction=False)
        for (_z, h), rows in zip(pairs, entries, strict=True):
            pipe.hmget(h, [rid for rid, _t in rows] or ["#sum"])
        values = await pipe.execute()
        out = []
        for rows, vals in zip(entries, values, strict=True):
            tokens = sum(int(v or 0) for v in vals) if rows else 0
            reset = int(max(t for _r, t in rows)) + self.window_ms - now if rows else 0
            out.append((len(rows), tokens, max(0, reset)))
        return out


@dataclass(frozen=True, slots=True)
class LevelWindow:
    """A team's or organization's window (``LevelWindow`` in limits.proto)."""

    id: str                    # "team:<name>" | "org:<name>"
    rpm: int
    tpm: int


def _keys(key_id: str, model: str | None, levels: Sequence[LevelWindow]) -> list[str]:
    """KEYS of window_reserve.lua: the key's window, then each level's."""
    keys = list(window_keys(key_id, model))
    for lv in levels:
        keys.extend(window_keys(lv.id))
    return keys

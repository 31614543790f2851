"""Tiered access-log sampling: which requests get an access-log line (the reference).

Usage events are written for every request (100 %); this rule only thins the access
log. The edge implements it in Lua (``lua/tokengate/sampling.lua``); nothing in
production runs this module: it is the independent statement of the rule that the Lua
is checked against, here and through a real edge, and ``sampling_vectors.json`` (next
to it) holds the test vectors both sides check.

The rule (``access_log:`` in tokengate.yaml, defaults shown)::

    keep = status >= error_status                          (400: every error)
        or bucket(request_id) < threshold(rate_for(total_ms))
    rate_for(total_ms) = slow_rate (0.10) if total_ms > slow_ms (5000 ms) else rate (0.01)
    bucket(request_id) = int(request_id[0:8], 16) % 10000  (first 8 hex digits)
    threshold(r)       = floor(r * 10000 + 0.5)            (rate in 1/10000 steps)

A request id that is not at least 8 hex digits is always kept (it cannot be bucketed,
and a malformed id is itself worth a look). In Lua (LuaJIT numbers are doubles, exact
for 32-bit integers)::

    local b = tonumber(rid:sub(1, 8), 16)          -- nil when not hex
    if not b or #rid < 8 then keep = true
    else keep = b % 10000 < math.floor(rate * 10000 + 0.5) end

Because the decision depends only on the request id, status and time, it is
reproducible: the same request is kept or dropped on every edge and on every replay.
"""

from __future__ import annotations

import math
import string

from tokengate.config import AccessLogConfig

BUCKETS = 10_000
_HEX = frozenset(string.hexdigits)


def bucket(request_id: str) -> int | None:
    """``int(request_id[:8], 16) % 10000``; None when the id does not start with
    8 hex digits."""
    head = request_id[:8]
    if len(head) < 8 or not _HEX.issuperset(head):
        return None
    return int(head, 16) % BUCKETS


def threshold(rate: float) -> int:
    """A rate in [0, 1] as a number of buckets out of 10000 (rounded half up)."""
    return math.floor(rate * BUCKETS + 0.5)


def keep(request_id: str, status: int, total_ms: float,
         rules: AccessLogConfig | None = None) -> bool:
    """Whether the request's access-log line is written (see the module docstring).

    ``status``: HTTP status sent; ``total_ms``: request time in ms (monotonic).
    """
    r = rules or AccessLogConfig()
    if status >= r.error_status:
        return True
    b = bucket(request_id)
    if b is None:
        return True
    rate = r.slow_rate if total_ms > r.slow_ms else r.rate
    return b < threshold(rate)

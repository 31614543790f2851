"""Global budgets: a key's spend and tokens per UTC day or month in Redis, shared by
every edge node and kept across restarts (``keys.<id>.budgets``).

The edge computes each request's cost (``lua/tokengate/budget.lua``, the formula of
``tokengate.ledger.calculator``, in whole nano-units of the currency, 1e-9, rounded up)
and names the counters of its period; here the counters are only added to, atomically.
The Redis keys (the hash tag ``{<key_id>}``: one Redis Cluster slot per key) are
``tokengate.redis_keys``'s and the reservation record ``tokengate.budget_store``'s, both
shared with the ledger.

What a counter holds for a limit (``used``) is the larger of its settled spend and what
the ledger billed the key in that period and scope (``billed``: its per key / model /
day counters, the bill ``tokengate usage`` reports; for a team's or organization's
counter, the level's counters of its members' requests: ``budget_store.bill_fields``),
plus what the requests of this hour
and the last hold in flight. The settled counters alone miss spend that never reached
them: requests an edge admitted on its own counters while Redis or this sidecar was
unreachable and whose settlement could not reach Redis either (an nginx restarted in
between), a Redis that lost its data (the ledger rebuilds its counters from the usage
files), a bill the engine's records raised above the edge's numbers. The ledger's bill
lags its usage files by about a second; in that time the settled counters decide. A
reservation whose settlement never comes (its edge died) leaves what is in flight when
its hour's bucket expires, at most two hours later, instead of holding the budget until
the period ends; the ledger bills what such a request generated, if an event of it was
written.

``budget_reserve.lua`` (``tokengate.redis_scripts``; one script, so concurrent
reservations from any number of edges never pass a limit: no get-then-set) checks every
counter that has a limit against ``used + cost``, then puts the cost in flight on all of
them or none, and records the reservation with the counters it was put on. While a
ledger rebuilds its bill after Redis lost its data (``tokengate.ledger.ledger``: it
holds the key's budgets, ``redis_keys.rebuild_key``) the script admits nothing and says
so (``limited_by`` "rebuilding"): neither the budget's counters nor the ledger's bill
are whole until it is done. The ledger also marks each budgeted key once its bill is
whole (``redis_keys.ready_mark_key``); a sidecar that saw a key's mark asks the script
to refuse while it is gone, which covers the moments between Redis coming back empty
and a ledger noticing. The ledger's bill that a reservation compares is read with the
key's hold and mark: one read while a ledger held the key is not used (the answer is
"rebuilding"), so a bill read before a rebuild ended never admits after it.
``budget_settle.lua`` adds the real cost to the settled counters, takes the reservation
out of flight and marks the request settled; a request the edge admitted without a
reservation (Redis was unreachable at admission, or its reservation expired) is charged
its real cost the same way, so spend admitted during an outage still reaches Redis when
the settlement does. A settlement that never reaches Redis (the sidecar or Redis was down
when the request ended) is made by the ledger when it applies the request's usage event
(``tokengate.ledger.budgets``), once: whichever comes first settles, the other finds the
request settled.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tokengate import redis_client, redis_scripts
from tokengate.budget_store import (
    IN_FLIGHT_TTL_S,
    SETTLE_LUA,
    bill_fields,
    bill_sums,
    billed_sync,
    committed,
    counter_name,
    period_days,
    queue_bills,
    record_tail,
    reserve_keys,
    settle_args,
    settle_keys,
    this_hour,
)
from tokengate.redis_keys import budget_keys, ready_mark_key, rebuild_key, reservation_key

__all__ = ["BudgetCounter", "BudgetReservation", "GlobalBudgets", "billed_sync",
           "budget_keys", "committed", "counter_name", "period_days", "reservation_key",
           "this_hour"]

# KEYS: reservation, then per counter its settled spend and tokens, then the in-flight
# spend and tokens of hour h and of hour h - 1, and last the key's ready mark and its
# rebuild holds (budget_store.reserve_keys). ARGV: cost_nano, tokens, in-flight ttl (of
# the buckets and the reservation), h, then per counter spend_limit (0: none),
# token_limit (0: none), billed spend (nano-units), billed tokens, then "1" when the
# ready mark must be there (this sidecar saw it), and last the record's counters
# (budget_store.record_tail). Returns {admitted, refused (1-based counter index, 0 for
# a hold), limited_by (1 spend, 2 tokens, 3 rebuilding: a ledger's hold, or the mark
# gone), then per counter its used spend and tokens: after this reservation when
# admitted, before it when refused; last 1 when the ready mark is there}.
RESERVE_LUA = redis_scripts.read("budget_reserve")

# budget_reserve.lua's limited_by
LIMITED_BY = {1: "spend", 2: "tokens", 3: "rebuilding"}

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
                               # or held
    limited_by: str | None     # "spend" | "tokens" | "rebuilding" (a ledger's hold) |
                               # None
    usage: list[tuple[int, int]]


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
        self._marked: set[str] = set()  # keys whose ready mark this sidecar saw

    async def billed(self, key_id: str, counters: Sequence[BudgetCounter]
                     ) -> list[tuple[int, int]] | None:
        """``billed_sync`` over this client, each (key, counter) read at most once per
        ``BILLED_CACHE_S``; None when a ledger held the key as the bill was read (or its
        ready mark, seen before, was gone): a bill read during a rebuild is not whole,
        and is neither used nor kept."""
        now = time.monotonic()
        want = [(key_id, c.name) for c in counters
                if now - self._bills.get((key_id, c.name), (-1e9, (0, 0)))[0] > BILLED_CACHE_S]
        if want:
            fields = bill_fields(want, self.models())
            pipe = self.client.pipeline(transaction=False)
            queue_bills(pipe, fields)
            pipe.hlen(rebuild_key(key_id))
            pipe.exists(ready_mark_key(key_id))
            *rows, held, marked = await pipe.execute()
            if held or (not marked and key_id in self._marked):
                return None
            for kc, bill in zip(want, bill_sums(fields, rows), strict=True):
                self._bills[kc] = (now, bill)
            if len(self._bills) > 100_000:  # periods end: forget the old ones
                self._bills = {k: v for k, v in self._bills.items()
                               if now - v[0] <= BILLED_CACHE_S}
        return [self._bills[(key_id, c.name)][1] for c in counters]

    async def reserve(self, key_id: str, request_id: str, counters: Sequence[BudgetCounter],
                      cost_nano: int, tokens: int) -> BudgetReservation:
        """Charge ``cost_nano`` and ``tokens`` to every counter, or to none when one
        would pass its limit; see the module docstring."""
        bills = await self.billed(key_id, counters)
        if bills is None:
            return BudgetReservation(False, 0, "rebuilding", [(0, 0)] * len(counters))
        hour = this_hour()
        args: list[int | str] = [cost_nano, tokens, IN_FLIGHT_TTL_S, hour]
        for c, (bs, bt) in zip(counters, bills, strict=True):
            args.extend((c.spend_limit_nano, c.token_limit, bs, bt))
        args.append("1" if key_id in self._marked else "0")
        args.append(record_tail([(c.name, c.ttl_s) for c in counters]))
        r = [int(x) for x in await self._reserve(
            keys=reserve_keys(key_id, request_id, [c.name for c in counters], hour),
            args=args)]
        if r[-1] and len(self._marked) < 1_000_000:
            self._marked.add(key_id)
        limited_by = LIMITED_BY.get(r[2])
        if limited_by == "rebuilding":  # the bill read before may be one being rebuilt
            for c in counters:
                self._bills.pop((key_id, c.name), None)
        usage = [(r[3 + 2 * i], r[4 + 2 * i]) for i in range(len(counters))]
        return BudgetReservation(bool(r[0]), r[1], limited_by, usage)

    async def settle(self, key_id: str, request_id: str, counters: Sequence[BudgetCounter],
                     cost_nano: int, tokens: int) -> tuple[bool, bool]:
        """Settle the request's real cost and tokens; returns (applied, reserved)."""
        hour = this_hour()
        r = await self._settle(
            keys=settle_keys(key_id, request_id, [c.name for c in counters], hour),
            args=settle_args(cost_nano, tokens, hour, [c.ttl_s for c in counters]))
        return bool(int(r[0])), bool(int(r[1]))

    async def usage(self, key_id: str, counters: Sequence[str]
                    ) -> list[tuple[int, int, int, int]]:
        """(spent nano-units, tokens, reserved spend, reserved tokens) of each counter (a
        level's by its ``<level id>/`` name), as admission counts them: what ended (the
        settled counters, the ledger's corrections included, or the ledger's bill of the
        period where that is more, e.g. for requests before the budget was set) and
        what requests in flight hold (this hour's and the last's buckets); nothing is
        changed. While a ledger rebuilds the bill, the settled counters alone."""
        hour = this_hour()
        pipe = self.client.pipeline(transaction=False)
        for name in counters:
            for k in budget_keys(key_id, name, hour):
                pipe.get(k)
        v = [int(x or 0) for x in await pipe.execute()]
        bills = await self.billed(key_id, [BudgetCounter(n, 0, 0, 0) for n in counters]) \
            or [(0, 0)] * len(counters)
        return [(max(v[6 * i], bills[i][0]), max(v[6 * i + 1], bills[i][1]),
                 max(0, v[6 * i + 2] + v[6 * i + 4]), max(0, v[6 * i + 3] + v[6 * i + 5]))
                for i in range(len(counters))]

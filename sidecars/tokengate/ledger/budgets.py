"""The budgets' side of billing: reservations the edge could not settle, settled by the
ledger, and the settled counters moved to what the ledger billed.

Reservations. The edge settles a request's budget reservation in Redis when the request
ends (``SettleBudget`` through the limits sidecar). When that fails (the sidecar or
Redis was down or stalled at that moment: ``global_settle_failed`` on the edge's status
server) or never happens (the nginx worker serving it was killed: no settlement and no
usage event) the reservation would keep its worst case in flight until its hour's bucket
expires, up to two hours, refusing the key's requests against spend that never
happened. The usage event has what the settlement needs: the request id, the key, the
real usage; an orphan engine record (``tokengate.ledger.join``) has the same; the
reservation record in Redis has the rest (its counters, ``tokengate.budget_store``).
So the ledger, before it applies a batch of events or bills orphan records, settles
each one's reservation that is still open, with the edge's formula and rounding
(``Calculator``, ``budget_store.nano``): the same amounts the edge would have sent.

Exactly once: ``budget_settle.lua`` (``budget_store.SETTLE_LUA``) marks the request
settled and is given the record the ledger read, so an edge settlement that came first
(the usual case: it is sent milliseconds after the event is written) or a replay of the
batch (the ledger restarted, Redis failed after the settlement and before the batch)
changes nothing. A batch is settled before it is applied, so a ledger killed in between
settles it on the replay, never not at all. Only keys with budgets while
``global_limits.enabled`` are looked at (``budgeted_keys``): one pipelined GET per batch
for their events, and one script call per reservation still open.

Fixes. The edge settles with its own numbers (the usage event's); the ledger may bill
others: the engine's records (a client that left, a disagreement), or a correction
when records come after the bill. Each such bill queues a fix in the ledger's Redis,
in the same script as the bill (``redis_keys.BUDGET_FIX_KEY``: the key, its counters,
the change of spend in nano-units and of tokens), and ``BudgetFixes.drain`` makes
them: ``budget_fix.lua`` moves the key's settled counters once per fix id (a mark in
the key's own slot), then the fix leaves the queue. A ledger killed in between finds
the fix queued and its mark made: nothing is moved twice. So a key's settled counters
end equal to its bill (each request rounded up to the nano-unit, as the edge rounds).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence

from tokengate import budget_store, redis_keys
from tokengate.config import Config
from tokengate.ledger.calculator import Calculator
from tokengate.ledger.event import UsageEvent
from tokengate.redis_client import SyncRedis

log = logging.getLogger("tokengate.ledger")

# (key id, request id, cost in currency units, tokens): what settles one reservation
Charge = tuple[str, str, float, int]


def budgeted_keys(cfg: Config) -> frozenset[str]:
    """The keys whose budgets Redis keeps: keys with budgets, or of a team or
    organization with budgets, while ``global_limits.enabled`` (without it a budget is
    refused by the schema). Their reservation records name every level's counters."""
    if not cfg.global_limits.enabled:
        return frozenset()

    def pooled(team: str | None) -> bool:
        t = cfg.teams.get(team) if team is not None else None
        return t is not None and bool(t.budgets or (t.org is not None
                                                    and cfg.orgs[t.org].budgets))

    return frozenset(k for k, v in cfg.keys.items() if v.budgets or pooled(v.team))


class Reservations:
    """Settles the open budget reservations of usage events and orphan engine records
    (module docstring) on ``client`` (the ledger's Redis, which the limits sidecar
    shares)."""

    def __init__(self, cfg: Config, client: SyncRedis) -> None:
        self.client = client
        self._settle = client.register_script(budget_store.SETTLE_LUA)
        self.reconfigure(cfg)

    def reconfigure(self, cfg: Config) -> None:
        """Use ``cfg``'s keys and prices from now on (one reference swap each)."""
        self.calc = Calculator(cfg)
        self.keys = budgeted_keys(cfg)

    def settle(self, events: Sequence[UsageEvent]) -> int:
        """Settle the reservations of ``events`` still open in Redis; returns how many
        this call settled. Raises ``RedisError`` (the batch is then tried again)."""
        return self.settle_charges([
            (ev.key_id, ev.request_id, self.calc.charge_event(ev).cost,
             ev.prompt_tokens + ev.completion_tokens)
            for ev in events if ev.key_id is not None])

    def settle_charges(self, charges: Sequence[Charge]) -> int:
        """Settle the reservation of each (key id, request id) still open in Redis with
        its cost (currency units) and tokens; returns how many this call settled.
        Raises ``RedisError``."""
        keys = self.keys
        mine = [c for c in charges if c[0] in keys]
        if not mine:
            return 0
        pipe = self.client.pipeline(transaction=False)
        for key_id, rid, _cost, _tokens in mine:
            pipe.get(redis_keys.reservation_key(key_id, rid))
        open_ = [(c, v) for c, v in zip(mine, pipe.execute(), strict=True)
                 if v is not None and v != budget_store.SETTLED]
        settled = 0
        hour = budget_store.this_hour()
        for (key_id, rid, cost, tokens), value in open_:
            rec = budget_store.parse_record(value)
            if rec is None or not rec.counters:  # an older sidecar's record: its ttl ends it
                continue
            names = [name for name, _ttl in rec.counters]
            applied, _reserved = self._settle(
                keys=budget_store.settle_keys(key_id, rid, names, hour),
                args=budget_store.settle_args(budget_store.nano(cost), tokens, hour,
                                              [ttl for _name, ttl in rec.counters],
                                              expected=str(value)))
            settled += int(applied)
        return settled


class BudgetFixes:
    """Makes the budget fixes the ledger's bills queued (module docstring)."""

    def __init__(self, client: SyncRedis) -> None:
        self.client = client
        self._fix = client.register_script(budget_store.FIX_LUA)

    def drain(self, most: int = 500) -> int:
        """Make up to ``most`` queued fixes and take them off the queue; returns how
        many were taken off. Raises ``RedisError`` (what is left stays queued)."""
        _cursor, queued = self.client.hscan(redis_keys.BUDGET_FIX_KEY, 0, count=most)
        assert isinstance(queued, dict)  # HSCAN without NOVALUES: field -> value
        done = []
        for fix_id, value in list(queued.items())[:most]:
            try:
                key_id, counters, cost_nano, tokens = json.loads(value)
            except (ValueError, TypeError):
                log.warning("budget fix %s: not a fix (%.200r); dropped", fix_id, value)
                done.append(fix_id)
                continue
            names = [str(name) for name, _ttl in counters]
            self._fix(keys=budget_store.fix_keys(key_id, str(fix_id), names),
                      args=budget_store.fix_args(int(cost_nano), int(tokens),
                                                 [int(ttl) for _name, ttl in counters]))
            done.append(fix_id)
        if done:
            self.client.hdel(redis_keys.BUDGET_FIX_KEY, *done)
        return len(done)

"""Budget reservations the edge could not settle, settled from the usage events.

The edge settles a request's budget reservation in Redis when the request ends
(``SettleBudget`` through the limits sidecar). When that fails (the sidecar or Redis was
down or stalled at that moment: ``global_settle_failed`` on the edge's status server)
the reservation would keep its worst case in flight until its hour's bucket expires, up
to two hours, refusing the key's requests against spend that never happened. The usage
event has what the settlement needs: the request id, the key, the real usage; the
reservation record in Redis has the rest (its counters, ``tokengate.budget_store``). So
the ledger, before it applies a batch of events, settles each one's reservation that is
still open, with the edge's formula and rounding (``Calculator``, ``budget_store.nano``):
the same amounts the edge would have sent.

Exactly once: ``budget_settle.lua`` (``budget_store.SETTLE_LUA``) marks the request
settled and is given the record the ledger read, so an edge settlement that came first
(the usual case: it is sent milliseconds after the event is written) or a replay of the
batch (the ledger restarted, Redis failed after the settlement and before the batch)
changes nothing. A batch is settled before it is applied, so a ledger killed in between
settles it on the replay, never not at all. Only keys with budgets while
``global_limits.enabled`` are looked at: one pipelined GET per batch for their events,
and one script call per reservation still open.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokengate import budget_store, redis_keys
from tokengate.config import Config
from tokengate.ledger.calculator import Calculator
from tokengate.ledger.event import UsageEvent
from tokengate.redis_client import SyncRedis


class Reservations:
    """Settles the open budget reservations of usage events (module docstring) on
    ``client`` (the ledger's Redis, which the limits sidecar shares)."""

    def __init__(self, cfg: Config, client: SyncRedis) -> None:
        self.client = client
        self._settle = client.register_script(budget_store.SETTLE_LUA)
        self.reconfigure(cfg)

    def reconfigure(self, cfg: Config) -> None:
        """Use ``cfg``'s keys and prices from now on (one reference swap each)."""
        self.calc = Calculator(cfg)
        self.keys = frozenset(k for k, v in cfg.keys.items() if v.budgets) \
            if cfg.global_limits.enabled else frozenset()

    def settle(self, events: Sequence[UsageEvent]) -> int:
        """Settle the reservations of ``events`` still open in Redis; returns how many
        this call settled. Raises ``RedisError`` (the batch is then tried again)."""
        keys = self.keys
        mine = [ev for ev in events if ev.key_id in keys]
        if not mine:
            return 0
        pipe = self.client.pipeline(transaction=False)
        for ev in mine:
            assert ev.key_id is not None
            pipe.get(redis_keys.reservation_key(ev.key_id, ev.request_id))
        open_ = [(ev, v) for ev, v in zip(mine, pipe.execute(), strict=True)
                 if v is not None and v != budget_store.SETTLED]
        settled = 0
        hour = budget_store.this_hour()
        for ev, value in open_:
            rec = budget_store.parse_record(value)
            if rec is None or not rec.counters:  # an older sidecar's record: its ttl ends it
                continue
            assert ev.key_id is not None
            cost = budget_store.nano(self.calc.charge_event(ev).cost)
            names = [name for name, _ttl in rec.counters]
            applied, _reserved = self._settle(
                keys=budget_store.settle_keys(ev.key_id, ev.request_id, names, hour),
                args=budget_store.settle_args(cost, ev.prompt_tokens + ev.completion_tokens,
                                              hour, [ttl for _name, ttl in rec.counters],
                                              expected=str(value)))
            settled += int(applied)
        return settled

"""The items the ledger's script applies (``ledger_apply.lua``,
``tokengate.ledger.ledger.APPLY_LUA``), decided from what Redis holds: the bill of an edge
event, an event parked until its engine records arrive, engine records kept until their
event arrives, the correction of a bill by records that came after it, the bill of
records whose event never came (orphans), records that bill nothing.

(Long for one thing: ``Join``'s decisions read the same Redis snapshot and each case
checks against the others, so they stay in one class.)

Corrections. A bill that engine records can still change (made with the edge's numbers
after the wait, or with some of the request's records) stays open in Redis
(``redis_keys.open_key``: the event, what it was billed, the records it used) for
``ledger.dedupe_days``. A record of that request that comes later (a replica's engine
file the ledger followed late, a ledger restarted in between) bills the request again
with every record it has: the difference from what it was billed is added to the key /
model / day counters and the session's totals, written to the audit stream as a
``kind: correction`` entry, and queued for the key's budget counters
(``tokengate.ledger.budgets``), in the record's batch: once, whichever ledger reads it.
A bill with every record of its request is closed.

Orphans. A record that names its API key (``key_id``: the vLLM plugin's middleware
writes what the edge sent) and whose edge event has not come ``engine_orphan_s`` after
it was written (an nginx worker killed mid-stream writes no event) is billed to that key
with the engine's numbers, as an event would have been (status 0: nothing was logged;
``orphans`` in the counters, ``orphan: 1`` in the audit stream); its reservation is
settled first. An event of that request that comes later is a duplicate. A record
without a key is dropped and counted as unmatched, as before.

Each item carries what its decision was read from (the request's number of kept
records, whether its event waits, whether it was billed, whether a record was read
before); the script checks all of it before it writes anything, so two ledgers that
decide on the same request at once never both act (``tokengate.ledger.ledger``). The
rules themselves (complete or not, what is billed) are ``tokengate.ledger.reconcile``'s.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, date, datetime, timedelta
from pathlib import Path
from typing import Any

from tokengate import redis_keys
from tokengate.budget_store import nano, request_counters
from tokengate.config import Config, key_levels, level_id
from tokengate.ledger.budgets import Charge, budgeted_keys
from tokengate.ledger.calculator import Calculator
from tokengate.ledger.engine_record import EngineRecord, parse_record
from tokengate.ledger.event import UsageEvent, parse_event, parse_ts
from tokengate.ledger.reconcile import (
    ENGINE,
    Settlement,
    is_complete,
    settle_edge,
    settle_engine,
    waits_for_engine,
)
from tokengate.redis_client import SyncRedis

# vLLM receives a request right after the edge started it; the event's day (its ts)
# is looked for on both sides of the record's arrival, clocks of two hosts apart.
CLOCK_MARGIN = timedelta(hours=1)
OPEN_BILL = "#bill"  # the field of an open bill's hash that holds the bill


class Keys:
    """KEYS of one script call: the fixed ones, then every other key once; calling it
    with a key name gives its index (from 1, as Lua counts)."""

    def __init__(self, fixed: list[str]) -> None:
        self.names = list(fixed)
        self._index = {k: i + 1 for i, k in enumerate(fixed)}

    def __call__(self, name: str) -> int:
        if name not in self._index:
            self.names.append(name)
            self._index[name] = len(self.names)
        return self._index[name]


@dataclass
class Item:
    """One script item and what it means once applied: increments of the process's
    ``Totals`` (field name -> n) and the lines to log (level, message)."""

    lua: dict[str, Any]
    totals: dict[str, int] = field(default_factory=dict)
    logs: list[tuple[int, str]] = field(default_factory=list)
    edge: bool = False  # an edge event of the batch: a '0' in the reply is a duplicate
    charge: Charge | None = None  # an orphan's bill: its reservation is settled first


@dataclass(frozen=True, slots=True)
class Billed:
    """What a request is billed: what its bill added to the usage hash (tokens as
    billed, counts), its ``cost`` as added there (``"0"`` or %.15g, currency units) and
    ``cost_nano`` as the budget counters hold it (rounded up, ``budget_store.nano``)."""

    by: str          # "engine" | "edge"
    prompt: int
    completion: int
    cached: int
    system: int
    cost: str
    cost_nano: int
    missing: int     # 1: the edge's numbers after the wait (engine_missing)
    disagree: int    # 1: counted in disagreements
    estimated: int   # 1: counted in estimated


def _seconds(ts: str) -> int:
    """An RFC 3339 time as whole epoch seconds (a kept record's eng_wait score)."""
    return int(parse_ts(ts).timestamp())


def orphan_event(rid: str, records: Sequence[EngineRecord], named: EngineRecord
                 ) -> UsageEvent:
    """The event an orphan's records stand for: its key, model and endpoint from
    ``named`` (a record that names its key), its start from the first arrival, status 0
    (nothing was logged), no usage of the edge's (``usage_source`` "none")."""
    return UsageEvent(
        request_id=rid, ts=min(r.arrival_ts for r in records), key_id=named.key_id,
        model=named.model, endpoint=named.endpoint or "-", status=0, stream=False,
        token_estimate=0, count_source="none", reserved=0, prompt_tokens=0,
        completion_tokens=0, cached_tokens=0, system_tokens=0, usage_source="none",
        client_aborted=any(r.finish_reason == "abort" for r in records), ttft_ms=None,
        total_ms=max(r.e2e_ms for r in records), upstream=None, error=None)


def _days_around(records: Sequence[EngineRecord]) -> list[str]:
    """The UTC days an edge event of these records can carry (its ts is the request's
    start at the edge, just before vLLM's arrival)."""
    days: set[str] = set()
    for r in records:
        t = parse_ts(r.arrival_ts)
        days.add((t - CLOCK_MARGIN).date().isoformat())
        days.add((t + CLOCK_MARGIN).date().isoformat())
    return sorted(days)


def kept_records(raw: dict[str, str]) -> list[EngineRecord]:
    """The records of one request kept in Redis (``eng:<request id>``: record key ->
    line, stored by the ledger, so valid)."""
    return [parse_record(line) for _key, line in sorted(raw.items())]


def _line(r: EngineRecord) -> str:
    """A record as the ledger keeps it (the plugin's JSON, ``tokengate_vllm.record``)."""
    return json.dumps(asdict(r), separators=(",", ":"), ensure_ascii=False)


def _flat(keys: Keys, recs: Sequence[tuple[str, str, str]]) -> list[Any]:
    """(eseen key, record key, line) triples as the script's ``rec``."""
    return [x for k, key, line in recs for x in (keys(k), key, line)]


def _pairs(records: Sequence[EngineRecord]) -> list[str]:
    """Records as an open bill's hash holds them: [record key, line, ...]."""
    return [x for r in records for x in (r.key, _line(r))]


def _fields(counts: dict[str, int]) -> list[str]:
    """The non-zero counts as the script's ``n`` / ``sn``: [field, n, ...]."""
    out: list[str] = []
    for f, v in counts.items():
        if v:
            out += [f, str(v)]
    return out


class Join:
    """Builds the items of one ledger (``ledger_id``: the id of its usage file, the owner
    of the events it parks). ``engine_mode``: engine files are configured (without
    them no item looks at engine records); ``engine_wait_s``, ``engine_orphan_s``: the
    configuration's waits (for the log lines)."""

    def __init__(self, cfg: Config, client: SyncRedis, ledger_id: str, engine_mode: bool,
                 engine_wait_s: float, engine_orphan_s: float) -> None:
        self.client = client
        self.calc = Calculator(cfg)
        self.session_days = cfg.ledger.session_days
        self.sessions_per_key = cfg.ledger.sessions_per_key
        self.ledger_id = ledger_id
        self.wait_key = redis_keys.wait_key(ledger_id)
        self.engine_mode = engine_mode
        self.engine_wait_s = engine_wait_s
        self.engine_orphan_s = engine_orphan_s
        self.cfg = cfg
        self.budgeted = budgeted_keys(cfg)

    def reconfigure(self, cfg: Config) -> None:
        """Bill with ``cfg``'s prices, sessions and budgets from now on."""
        self.calc = Calculator(cfg)
        self.session_days = cfg.ledger.session_days
        self.sessions_per_key = cfg.ledger.sessions_per_key
        self.cfg = cfg
        self.budgeted = budgeted_keys(cfg)

    # -- bills -------------------------------------------------------------------------

    def _billed(self, ev: UsageEvent, st: Settlement, missing: bool) -> Billed:
        """What ``ev`` is billed with ``st`` (system tokens never above the prompt)."""
        prompt = st.prompt_tokens
        system = min(ev.system_tokens, prompt)
        ch = self.calc.charge(prompt, st.completion_tokens, st.cached_tokens, system,
                              ev.model, ev.batch_id is not None)
        # 15 significant digits, the decimal precision of a double: the formula's
        # last-bit noise (0.00023610000000000002) stays out of the audit stream and the
        # counters
        cost = f"{ch.cost:.15g}" if ch.cost else "0"
        return Billed(st.by, prompt, st.completion_tokens, st.cached_tokens, system, cost,
                      nano(ch.cost), int(missing), int(st.disagreement is not None),
                      int(ev.usage_source == "estimate" and st.by != ENGINE))

    def _budget_fix(self, keys: Keys, lua: dict[str, Any], ev: UsageEvent, fix_id: str,
                    cost_nano: int, tokens: int) -> None:
        """Queue, with the item, the change of ``ev``'s key's settled budget counters, and
        its team's and organization's, by ``cost_nano`` and ``tokens``
        (``tokengate.ledger.budgets``), when the key has budgets (or its levels do) and
        the change is not nothing."""
        if not (cost_nano or tokens) or ev.key_id not in self.budgeted:
            return
        key = self.cfg.keys.get(ev.key_id)
        day = date.fromisoformat(ev.day)
        counters = request_counters(key.budgets if key else (), ev.model, day)
        # its team's and organization's too: the edge settled them with the same numbers
        for level, name, g in key_levels(key.team if key else None, self.cfg.teams,
                                         self.cfg.orgs):
            counters += request_counters(g.budgets, ev.model, day,
                                         level_id(level, name))
        if counters:
            lua["bq"] = keys(redis_keys.BUDGET_FIX_KEY)
            lua["bf"] = [fix_id, json.dumps([ev.key_id, counters, cost_nano, tokens],
                                            separators=(",", ":"), ensure_ascii=False)]

    def _usage_item(self, keys: Keys, ev: UsageEvent, kind: str, counts: dict[str, int],
                    cost: str, audit: list[str]) -> dict[str, Any]:
        """The script item's part that adds to ``ev``'s key / model / day counters:
        ``counts`` and ``cost`` (a signed decimal) into its usage hash, and into those of
        the key's team and organization (in the configuration the ledger runs with),
        ``audit`` to the audit stream."""
        item = {"t": kind, "u": keys(redis_keys.usage_key(ev.day, ev.key_id, ev.model)),
                "x": keys(redis_keys.idx_key(ev.day)), "r": ev.request_id,
                "m": json.dumps([ev.key_id, ev.model]), "d": ev.day,
                "ds": redis_keys.day_score(ev.day), "n": _fields(counts), "c": cost,
                "ce": redis_keys.endpoint_field(ev.usage_endpoint, "cost"), "a": audit}
        # the same into the day's counters of the key's team and organization
        key = self.cfg.keys.get(ev.key_id) if ev.key_id is not None else None
        levels = [level_id(lv, name) for lv, name, _g in
                  key_levels(key.team if key else None, self.cfg.teams, self.cfg.orgs)]
        if levels:
            item.update(lu=[keys(redis_keys.level_usage_key(ev.day, lv, ev.model))
                            for lv in levels],
                        lx=keys(redis_keys.level_idx_key(ev.day)),
                        lm=[json.dumps([lv, ev.model]) for lv in levels])
        return item

    def bill(self, keys: Keys, ev: UsageEvent, st: Settlement, owner: str, *,
             edge: bool, kept: int, wait_key: str | None = None,
             new_records: Sequence[tuple[str, str, str]] = (), missing: bool = False,
             late: int = 0, records: Sequence[EngineRecord] = (),
             orphan: bool = False) -> Item:
        """The item that bills ``ev`` with ``st``. ``owner``: the ledger id of the
        event's usage file (its stats get the counts); ``kept``: the request's records
        kept in Redis as read (checked, then dropped); ``wait_key``: the zset the event
        waits in (checked, removed); ``new_records``: records of this batch that the
        bill uses (eseen key, record key, line); ``missing``: billed with its own
        numbers after the wait; ``late``: kept records that bill nothing (a request
        billed without them); ``records``: the records ``st`` was made of (kept in the
        open bill when later ones can still correct it); ``orphan``: ``ev`` stands for
        records whose event never came (``orphan_event``)."""
        b = self._billed(ev, st, missing)
        by_engine = int(b.by == ENGINE)
        counts = {"requests": 1, "errors": int(ev.status >= 400),
                  "aborted": int(ev.client_aborted), "estimated": b.estimated,
                  "prompt_tokens": b.prompt, "completion_tokens": b.completion,
                  "cached_tokens": b.cached, "system_tokens": b.system,
                  "settled_engine": by_engine, "engine_missing": b.missing,
                  "disagreements": b.disagree, "orphans": int(orphan),
                  redis_keys.endpoint_field(ev.usage_endpoint, "requests"): 1,
                  redis_keys.endpoint_field(ev.usage_endpoint, "prompt_tokens"): b.prompt,
                  redis_keys.endpoint_field(ev.usage_endpoint, "completion_tokens"):
                      b.completion}
        if ev.status:  # an orphan's is 0: no answer was logged
            counts[f"status:{ev.status}"] = 1
        audit = ["rid", ev.request_id, "ts", ev.ts, "key", ev.key_id or "",
                 "model", ev.model or "", "endpoint", ev.endpoint, "status", str(ev.status),
                 "prompt", str(b.prompt), "completion", str(b.completion),
                 "cached", str(b.cached), "system", str(b.system),
                 "cost", b.cost, "usage", ev.usage_source,
                 "aborted", str(int(ev.client_aborted)), "ledger", owner, "settled", st.by]
        if ev.session_id is not None:
            audit += ["session", ev.session_id]
        if by_engine:
            audit += ["records", str(st.records), "complete", str(int(st.complete)),
                      "edge_prompt", str(ev.prompt_tokens),
                      "edge_completion", str(ev.completion_tokens)]
        if orphan:
            audit += ["orphan", "1"]
        sk = keys(redis_keys.stats_key(owner))
        totals = {"applied": 1, "settled_engine": by_engine, "engine_missing": b.missing,
                  "disagreements": b.disagree, "engine_late": late, "orphans": int(orphan)}
        stats: list[Any] = []
        for name, v in totals.items():
            if v:
                stats += [sk, name, v]
        lua = self._usage_item(keys, ev, "b", counts, b.cost, audit)
        lua.update({"s": keys(redis_keys.seen_key(ev.day)), "st": stats})
        if ev.session_id is not None:
            self._session(keys, lua, ev, _fields({
                "requests": 1, "prompt_tokens": b.prompt, "cached_tokens": b.cached,
                "completion_tokens": b.completion}))
        if self.engine_mode:
            lua["e"], lua["h"] = keys(redis_keys.eng_key(ev.request_id)), kept
        if edge:
            lua["ed"] = True
        if wait_key is not None:
            lua["w"], lua["pp"] = keys(wait_key), 1
        if new_records:
            lua["rec"] = _flat(keys, new_records)
        if self.engine_mode and waits_for_engine(ev) and not orphan \
                and not (by_engine and st.complete):
            # records that come later correct this bill (module docstring)
            lua["ob"] = keys(redis_keys.open_key(ev.request_id))
            lua["obv"] = json.dumps({"o": owner, "ev": ev.to_json(), "bill": asdict(b)},
                                    separators=(",", ":"), ensure_ascii=False)
            lua["obr"] = _pairs(records)
        charge = None
        if orphan:
            assert ev.key_id is not None
            charge = (ev.key_id, ev.request_id, float(b.cost), b.prompt + b.completion)
        elif by_engine:
            # the edge settled the event's own numbers: its budget counters move to these
            self._budget_fix(keys, lua, ev, ev.request_id,
                             b.cost_nano - nano(self.calc.charge_event(ev).cost),
                             b.prompt + b.completion - ev.prompt_tokens
                             - ev.completion_tokens)
        logs: list[tuple[int, str]] = []
        if st.disagreement:
            logs.append((logging.WARNING,
                         (f"request {ev.request_id} ({ev.key_id}, {ev.model}): the edge and "
                          f"the engine disagree: {st.disagreement}; billed the engine's")))
        if missing:
            logs.append((logging.INFO,
                         (f"request {ev.request_id}: no engine record within "
                          f"{self.engine_wait_s:g} s; billed the edge's numbers "
                          f"({ev.usage_source}: prompt {ev.prompt_tokens}, completion "
                          f"{ev.completion_tokens})")))
        if late:
            logs.append((logging.WARNING,
                         (f"request {ev.request_id}: {late} engine record(s) of a request "
                          f"billed without them (usage {ev.usage_source}); not billed")))
        if orphan:
            logs.append((logging.WARNING,
                         (f"request {ev.request_id}: no usage event within "
                          f"{self.engine_orphan_s:g} s of its {st.records} engine "
                          f"record(s); billed to key {ev.key_id} with the engine's numbers "
                          f"(prompt {b.prompt}, completion {b.completion})")))
        return Item(lua, {k: v for k, v in totals.items() if v}, logs, edge, charge)

    def correction(self, keys: Keys, stats_key: str, raw_open: dict[str, str],
                   fresh: list[EngineRecord], new_records: list[tuple[str, str, str]]
                   ) -> Item:
        """The item that bills a request again with the records of its open bill
        (``raw_open``, as read) and ``fresh`` ones of this batch (``new_records``: their
        eseen key, record key and line; counted in ``stats_key``), adding the
        difference (module docstring)."""
        head = json.loads(raw_open[OPEN_BILL])
        ev = parse_event(head["ev"])
        owner = str(head["o"])
        old = Billed(**head["bill"])
        every = kept_records({k: v for k, v in raw_open.items() if k != OPEN_BILL}) + fresh
        complete = is_complete(ev, every)
        st = settle_engine(ev, every, complete=complete)
        new = self._billed(ev, st, missing=False)
        d_prompt, d_completion = new.prompt - old.prompt, new.completion - old.completion
        d_cached, d_system = new.cached - old.cached, new.system - old.system
        counts = {"prompt_tokens": d_prompt, "completion_tokens": d_completion,
                  "cached_tokens": d_cached, "system_tokens": d_system,
                  "settled_engine": int(old.by != ENGINE), "engine_missing": -old.missing,
                  "disagreements": new.disagree - old.disagree,
                  "estimated": new.estimated - old.estimated, "corrections": 1,
                  redis_keys.endpoint_field(ev.usage_endpoint, "prompt_tokens"): d_prompt,
                  redis_keys.endpoint_field(ev.usage_endpoint, "completion_tokens"):
                      d_completion}
        d_cost = float(new.cost) - float(old.cost)
        cost = f"{d_cost:.15g}" if d_cost else "0"
        detail = (f"{len(fresh)} engine record(s) after the bill ({old.by}'s numbers): "
                  f"prompt {old.prompt} -> {new.prompt}, completion {old.completion} -> "
                  f"{new.completion}, cost {old.cost} -> {new.cost}")
        now = datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
        audit = ["kind", "correction", "ts", now, "rid", ev.request_id,
                 "key", ev.key_id or "", "model", ev.model or "", "endpoint", ev.endpoint,
                 "day", ev.day, "action", "bill_corrected", "detail", detail,
                 "prompt", str(d_prompt), "completion", str(d_completion),
                 "cached", str(d_cached), "system", str(d_system), "cost", cost,
                 "settled", ENGINE, "records", str(len(every)),
                 "complete", str(int(complete)), "ledger", owner, "result", "ok"]
        sk, so = keys(stats_key), keys(redis_keys.stats_key(owner))
        lua = self._usage_item(keys, ev, "c", counts, cost, audit)
        ob = keys(redis_keys.open_key(ev.request_id))
        lua.update({"e": ob, "h": len(raw_open), "ob": ob, "rec": _flat(keys, new_records),
                    "st": [sk, "engine_records", len(fresh), so, "corrections", 1]})
        if complete:
            lua["od"] = 1
        else:
            lua["obv"] = json.dumps({"o": owner, "ev": ev.to_json(), "bill": asdict(new)},
                                    separators=(",", ":"), ensure_ascii=False)
            lua["obr"] = _pairs(fresh)
        if ev.session_id is not None:
            self._session(keys, lua, ev, _fields({
                "prompt_tokens": d_prompt, "cached_tokens": d_cached,
                "completion_tokens": d_completion}))
        self._budget_fix(keys, lua, ev, f"{ev.request_id}#{len(every)}",
                         new.cost_nano - old.cost_nano,
                         new.prompt + new.completion - old.prompt - old.completion)
        log_line = (logging.INFO, f"request {ev.request_id}: {detail}; corrected")
        return Item(lua, {"engine_records": len(fresh), "corrections": 1}, [log_line])

    def _session(self, keys: Keys, lua: dict[str, Any], ev: UsageEvent,
                 sn: list[str]) -> None:
        """Adds to a bill (or correction) item the totals of the event's session (``ss``
        its hash, ``si`` its key's index, ``sid`` the session id, ``sn`` [field, n, ...],
        ``sm`` the event's time in epoch ms, ``sttl`` the expiry in s, ``smax`` the
        index's bound): applied by the script with the bill, so exactly once. The cost is
        the item's (``c``)."""
        assert ev.session_id is not None
        lua.update({"ss": keys(redis_keys.session_key(ev.key_id, ev.session_id)),
                    "si": keys(redis_keys.sessions_key(ev.key_id)), "sid": ev.session_id,
                    "sn": sn, "sm": round(parse_ts(ev.ts).timestamp() * 1000),
                    "sttl": self.session_days * 86400, "smax": self.sessions_per_key})

    # -- a batch of the usage file -----------------------------------------------------

    def edge_items(self, keys: Keys, events: list[UsageEvent]) -> list[Item]:
        """Items of a batch of edge events: billed now (without engine files, without
        engine usage, or with every record there) or parked. Raises ``RedisError``."""
        if not self.engine_mode:
            return [self.bill(keys, ev, settle_edge(ev), self.ledger_id, edge=True, kept=0)
                    for ev in events]
        rids = list(dict.fromkeys(ev.request_id for ev in events))
        pipe = self.client.pipeline(transaction=False)
        for rid in rids:
            pipe.hgetall(redis_keys.eng_key(rid))
        kept: dict[str, dict[str, str]] = dict(zip(rids, pipe.execute(), strict=True))
        items = []
        for ev in events:
            raw = kept[ev.request_id]
            records = kept_records(raw)
            if not waits_for_engine(ev):
                items.append(self.bill(keys, ev, settle_edge(ev), self.ledger_id, edge=True,
                                       kept=len(raw), late=len(raw)))
            elif records and is_complete(ev, records):
                items.append(self.bill(keys, ev, settle_engine(ev, records), self.ledger_id,
                                       edge=True, kept=len(raw)))
            else:
                value = json.dumps({"o": self.ledger_id, "ev": ev.to_json()},
                                   separators=(",", ":"), ensure_ascii=False)
                items.append(Item({"t": "p", "ed": True, "s": keys(redis_keys.seen_key(ev.day)),
                                   "r": ev.request_id, "v": value, "w": keys(self.wait_key),
                                   "e": keys(redis_keys.eng_key(ev.request_id)), "h": len(raw)},
                                  {"parked": 1}, [], True))
        return items

    # -- a batch of an engine file -----------------------------------------------------

    def engine_items(self, keys: Keys, stats_key: str, path: Path,
                     records: list[EngineRecord], by_written: bool = False
                     ) -> tuple[list[Item], int]:
        """Items of a batch of engine records read from ``path`` (whose counts go to
        ``stats_key``), and how many of the records were read before. Records kept for
        their event wait ``engine_orphan_s`` from now, or, ``by_written``, from when
        they were written (a rebuild after Redis lost its data reads records whose wait
        was over before). Raises ``RedisError``."""
        rids: dict[str, list[EngineRecord]] = {}
        unmatched: list[EngineRecord] = []
        probes: list[EngineRecord] = []
        for r in records:
            rid = r.edge_request_id
            if rid is None:
                (probes if r.doctor_probe else unmatched).append(r)
            else:
                rids.setdefault(rid, []).append(r)
        pipe = self.client.pipeline(transaction=False)
        for r in records:
            pipe.sismember(redis_keys.eseen_key(r.ts[:10]), r.key)
        days = {rid: _days_around(rs) for rid, rs in rids.items()}
        for rid in rids:
            pipe.hget(redis_keys.PENDING_KEY, rid)
            pipe.hgetall(redis_keys.eng_key(rid))
            pipe.hgetall(redis_keys.open_key(rid))
            for d in days[rid]:
                pipe.sismember(redis_keys.seen_key(d), rid)
        replies = iter(pipe.execute())
        read_before = {r.key for r in records if next(replies)}
        fresh: set[str] = set()
        dups = 0

        def new(rs: list[EngineRecord]) -> list[EngineRecord]:
            nonlocal dups
            out = []
            for r in rs:
                if r.key in read_before or r.key in fresh:
                    dups += 1
                else:
                    fresh.add(r.key)
                    out.append(r)
            return out

        def triples(rs: list[EngineRecord]) -> list[tuple[str, str, str]]:
            return [(redis_keys.eseen_key(r.ts[:10]), r.key, _line(r)) for r in rs]

        sk = keys(stats_key)

        def not_billed(rs: list[EngineRecord], stat: str, logs: list[tuple[int, str]]) -> Item:
            """Records of no edge request: kept as read, counted under ``stat``."""
            n = len(rs)
            return Item({"t": "l", "rec": _flat(keys, triples(rs)),
                         "st": [sk, "engine_records", n, sk, stat, n]},
                        {"engine_records": n, stat: n}, logs)

        items: list[Item] = []
        lost = new(unmatched)
        if lost:
            sample = ", ".join(r.request_id for r in lost[:3])
            items.append(not_billed(lost, "engine_unmatched", [(logging.WARNING, (
                f"{path}: {len(lost)} engine record(s) of requests that did not come "
                f"through the edge ({sample}); not billed"))]))
        doctor = new(probes)
        if doctor:  # tokengate doctor's probes, sent to the replica directly: expected
            items.append(not_billed(doctor, "engine_probes", []))
        for rid, rs in rids.items():
            pend, raw, raw_open = next(replies), next(replies), next(replies)
            billed_on = [next(replies) for _d in days[rid]]
            fresh_rs = new(rs)
            if not fresh_rs:
                continue
            eng = keys(redis_keys.eng_key(rid))
            recs = triples(fresh_rs)
            # eng_wait's score (the script's clock when absent)
            written = {"sc": min(_seconds(r.ts) for r in fresh_rs)} if by_written else {}
            counts = [sk, "engine_records", len(fresh_rs)]
            if pend is not None:
                obj = json.loads(pend)
                ev = parse_event(obj["ev"])
                owner = str(obj["o"])
                every = kept_records(raw) + fresh_rs
                if is_complete(ev, every):
                    item = self.bill(keys, ev, settle_engine(ev, every), owner, edge=False,
                                     kept=len(raw), wait_key=redis_keys.wait_key(owner),
                                     new_records=recs)
                    item.lua["st"] += counts
                    item.totals["engine_records"] = len(fresh_rs)
                    items.append(item)
                    continue
                items.append(Item({"t": "s", "r": rid, "e": eng, "h": len(raw), "pp": 1,
                                   **written, "rec": _flat(keys, recs), "st": counts},
                                  {"engine_records": len(fresh_rs)}))
            elif OPEN_BILL in raw_open:
                items.append(self.correction(keys, stats_key, raw_open, fresh_rs, recs))
            elif any(billed_on):
                items.append(Item(
                    {"t": "l", "r": rid, "pp": 0, "rec": _flat(keys, recs),
                     "st": counts + [sk, "engine_late", len(fresh_rs)]},
                    {"engine_records": len(fresh_rs), "engine_late": len(fresh_rs)},
                    [(logging.WARNING, (f"request {rid}: {len(fresh_rs)} engine record(s) "
                                        "came after it was billed; not billed"))]))
            else:
                items.append(Item({"t": "s", "r": rid, "e": eng, "h": len(raw), "pp": 0,
                                   **written,
                                   "ns": [keys(redis_keys.seen_key(d)) for d in days[rid]],
                                   "rec": _flat(keys, recs), "st": counts},
                                  {"engine_records": len(fresh_rs)}))
        return items, dups

    # -- sweeps --------------------------------------------------------------------------

    def waiting_items(self, keys: Keys, rids: list[str]) -> list[Item]:
        """Bills of this ledger's parked events ``rids`` whose wait is over: with the
        records that arrived, or with their own numbers when none did. Raises
        ``RedisError``."""
        pipe = self.client.pipeline(transaction=False)
        for rid in rids:
            pipe.hget(redis_keys.PENDING_KEY, rid)
            pipe.hgetall(redis_keys.eng_key(rid))
        replies = iter(pipe.execute())
        items = []
        for rid in rids:
            pend, raw = next(replies), next(replies)
            if pend is None:  # billed meanwhile by another ledger's batch
                self.client.zrem(self.wait_key, rid)
                continue
            ev = parse_event(json.loads(pend)["ev"])
            records = kept_records(raw)
            if records:
                st = settle_engine(ev, records, complete=is_complete(ev, records))
            else:
                st = settle_edge(ev)
            items.append(self.bill(keys, ev, st, self.ledger_id, edge=False, kept=len(raw),
                                   wait_key=self.wait_key, missing=not records,
                                   records=records))
        return items

    def orphan_items(self, keys: Keys, stats_key: str, rids: list[str],
                     bill_named: bool) -> list[Item]:
        """Items of the kept records of ``rids`` (written longer than engine_orphan_s
        ago) whose event never came: with ``bill_named``, the bill of those that name
        their key (module docstring; ``Item.charge`` says what settles the request's
        reservation); the others are dropped and counted as unmatched in
        ``stats_key``. Raises ``RedisError``."""
        pipe = self.client.pipeline(transaction=False)
        for rid in rids:
            pipe.hexists(redis_keys.PENDING_KEY, rid)
            pipe.hgetall(redis_keys.eng_key(rid))
        replies = iter(pipe.execute())
        sk = keys(stats_key)
        items = []
        for rid in rids:
            waits, raw = next(replies), next(replies)
            if waits:  # its event came and waits: the sweep of its owner bills it
                continue
            records = kept_records(raw)
            named = next((r for r in records if r.key_id is not None), None)
            if named is not None:
                if bill_named:
                    items.append(self._orphan(keys, rid, records, named, len(raw)))
                continue  # left for a ledger that reads a usage file
            items.append(Item(
                {"t": "o", "r": rid, "e": keys(redis_keys.eng_key(rid)), "h": len(raw), "pp": 0,
                 "st": [sk, "engine_unmatched", len(raw)]},
                {"engine_unmatched": len(raw)},
                [(logging.WARNING, (f"request {rid}: no edge event within "
                                    f"{self.engine_orphan_s:g} s of its {len(raw)} engine "
                                    f"record(s) ({', '.join(sorted(raw))}); not billed"))]))
        return items

    def _orphan(self, keys: Keys, rid: str, records: list[EngineRecord],
                named: EngineRecord, kept: int) -> Item:
        """The bill of orphan records (module docstring): under the day of its first
        arrival, its id also remembered on the days around, so that an event of it that
        comes after all, whatever its day, is a duplicate."""
        ev = orphan_event(rid, records, named)
        item = self.bill(keys, ev, settle_engine(ev, records,
                                                 complete=is_complete(ev, records)),
                         self.ledger_id, edge=False, kept=kept, orphan=True)
        item.lua["pp"] = 0
        item.lua["sx"] = [keys(redis_keys.seen_key(d)) for d in _days_around(records)
                          if d != ev.day]
        return item

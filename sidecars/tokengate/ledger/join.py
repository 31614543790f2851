"""The items the ledger's script applies (``ledger_apply.lua``,
``tokengate.ledger.ledger.APPLY_LUA``), decided from what Redis holds: the bill of an edge
event, an event parked until its engine records arrive, engine records kept until their
event arrives, records that bill nothing.

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
from datetime import timedelta
from pathlib import Path
from typing import Any

from tokengate import redis_keys
from tokengate.config import Config
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

    # -- bills -------------------------------------------------------------------------

    def bill(self, keys: Keys, ev: UsageEvent, st: Settlement, owner: str, *,
             edge: bool, kept: int, wait_key: str | None = None,
             new_records: Sequence[tuple[str, str, str]] = (), missing: bool = False,
             late: int = 0) -> Item:
        """The item that bills ``ev`` with ``st``. ``owner``: the ledger id of the
        event's usage file (its stats get the counts); ``kept``: the request's records
        kept in Redis as read (checked, then dropped); ``wait_key``: the zset the event
        waits in (checked, removed); ``new_records``: records of this batch that the
        bill uses (eseen key, record key, line); ``missing``: billed with its own
        numbers after the wait; ``late``: kept records that bill nothing (a request
        billed without them)."""
        day = ev.day
        prompt = st.prompt_tokens
        system = min(ev.system_tokens, prompt)
        ch = self.calc.charge(prompt, st.completion_tokens, st.cached_tokens, system,
                              ev.model)
        disagree = int(st.disagreement is not None)
        by_engine = int(st.by == ENGINE)
        counts = {"requests": 1, f"status:{ev.status}": 1,
                  "errors": int(ev.status >= 400), "aborted": int(ev.client_aborted),
                  "estimated": int(ev.usage_source == "estimate" and not by_engine),
                  "prompt_tokens": prompt, "completion_tokens": st.completion_tokens,
                  "cached_tokens": st.cached_tokens, "system_tokens": system,
                  "settled_engine": by_engine, "engine_missing": int(missing),
                  "disagreements": disagree,
                  redis_keys.endpoint_field(ev.endpoint, "requests"): 1,
                  redis_keys.endpoint_field(ev.endpoint, "prompt_tokens"): prompt,
                  redis_keys.endpoint_field(ev.endpoint, "completion_tokens"):
                      st.completion_tokens}
        n: list[str] = []
        for f, v in counts.items():
            if v:
                n += [f, str(v)]
        # 15 significant digits, the decimal precision of a double: the formula's last-bit
        # noise (0.00023610000000000002) stays out of the audit stream and the counters
        cost = f"{ch.cost:.15g}" if ch.cost else "0"
        audit = ["rid", ev.request_id, "ts", ev.ts, "key", ev.key_id or "",
                 "model", ev.model or "", "endpoint", ev.endpoint, "status", str(ev.status),
                 "prompt", str(prompt), "completion", str(st.completion_tokens),
                 "cached", str(st.cached_tokens), "system", str(system),
                 "cost", cost, "usage", ev.usage_source,
                 "aborted", str(int(ev.client_aborted)), "ledger", owner, "settled", st.by]
        if ev.session_id is not None:
            audit += ["session", ev.session_id]
        if by_engine:
            audit += ["records", str(st.records), "complete", str(int(st.complete)),
                      "edge_prompt", str(ev.prompt_tokens),
                      "edge_completion", str(ev.completion_tokens)]
        sk = keys(redis_keys.stats_key(owner))
        totals = {"applied": 1, "settled_engine": by_engine, "engine_missing": int(missing),
                  "disagreements": disagree, "engine_late": late}
        stats: list[Any] = []
        for name, v in totals.items():
            if v:
                stats += [sk, name, v]
        lua: dict[str, Any] = {"t": "b", "s": keys(redis_keys.seen_key(day)),
                               "u": keys(redis_keys.usage_key(day, ev.key_id, ev.model)),
                               "x": keys(redis_keys.idx_key(day)), "r": ev.request_id,
                               "m": json.dumps([ev.key_id, ev.model]), "d": day,
                               "ds": redis_keys.day_score(day), "n": n, "c": cost,
                               "ce": redis_keys.endpoint_field(ev.endpoint, "cost"),
                               "a": audit, "st": stats}
        if ev.session_id is not None:
            self._session(keys, lua, ev, prompt, st)
        if self.engine_mode:
            lua["e"], lua["h"] = keys(redis_keys.eng_key(ev.request_id)), kept
        if edge:
            lua["ed"] = True
        if wait_key is not None:
            lua["w"], lua["pp"] = keys(wait_key), 1
        if new_records:
            lua["rec"] = _flat(keys, new_records)
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
        return Item(lua, {k: v for k, v in totals.items() if v}, logs, edge)

    def _session(self, keys: Keys, lua: dict[str, Any], ev: UsageEvent, prompt: int,
                 st: Settlement) -> None:
        """Adds to a bill item the totals of the event's session (``ss`` its hash,
        ``si`` its key's index, ``sid`` the session id, ``sn`` [field, n, ...], ``sm``
        the event's time in epoch ms, ``sttl`` the expiry in s, ``smax`` the index's
        bound): applied by the script with the bill, so exactly once. The cost is the
        bill's (``c``)."""
        sn: list[str] = ["requests", "1"]
        for f, v in (("prompt_tokens", prompt), ("cached_tokens", st.cached_tokens),
                     ("completion_tokens", st.completion_tokens)):
            if v:
                sn += [f, str(v)]
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
                     records: list[EngineRecord]) -> tuple[list[Item], int]:
        """Items of a batch of engine records read from ``path`` (whose counts go to
        ``stats_key``), and how many of the records were read before. Raises
        ``RedisError``."""
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
            pend, raw = next(replies), next(replies)
            billed_on = [next(replies) for _d in days[rid]]
            fresh_rs = new(rs)
            if not fresh_rs:
                continue
            eng = keys(redis_keys.eng_key(rid))
            recs = triples(fresh_rs)
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
                                   "rec": _flat(keys, recs), "st": counts},
                                  {"engine_records": len(fresh_rs)}))
            elif any(billed_on):
                items.append(Item(
                    {"t": "l", "r": rid, "pp": 0, "rec": _flat(keys, recs),
                     "st": counts + [sk, "engine_late", len(fresh_rs)]},
                    {"engine_records": len(fresh_rs), "engine_late": len(fresh_rs)},
                    [(logging.WARNING, (f"request {rid}: {len(fresh_rs)} engine record(s) "
                                        "came after it was billed; not billed"))]))
            else:
                items.append(Item({"t": "s", "r": rid, "e": eng, "h": len(raw), "pp": 0,
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
                                   wait_key=self.wait_key, missing=not records))
        return items

    def orphan_items(self, keys: Keys, stats_key: str, rids: list[str]) -> list[Item]:
        """Items that drop the kept records of ``rids`` (kept longer than
        engine_orphan_s) whose event never came, counted as unmatched in
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
            items.append(Item(
                {"t": "o", "r": rid, "e": keys(redis_keys.eng_key(rid)), "h": len(raw), "pp": 0,
                 "st": [sk, "engine_unmatched", len(raw)]},
                {"engine_unmatched": len(raw)},
                [(logging.WARNING, (f"request {rid}: no edge event within "
                                    f"{self.engine_orphan_s:g} s of its {len(raw)} engine "
                                    f"record(s) ({', '.join(sorted(raw))}); not billed"))]))
        return items

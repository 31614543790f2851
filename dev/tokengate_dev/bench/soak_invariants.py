"""The invariants ``make soak`` checks once its faults are over and the stack has settled:
what must hold whatever was killed, stalled or reloaded meanwhile.
(Over 600 lines: eleven short checks over one ``SoakData`` and its fault timeline,
proven together by tests/storm/test_soak_invariants.py.)

Everything here is a pure function of what the soak collected (``SoakData``): TokenStorm's
per-request records, the edge's usage events, the ledger's bills (its audit stream), the
replicas' engine usage records and their own counters, the span counts, the state the
stack was left in, nginx's error log and the fault timeline. Times are the machine's
monotonic clock in seconds (the events' wall-clock times are moved onto it with one
offset). Each check returns a ``Check``: held or not, its figures, and a few examples of
what broke it.

The checks, in the order ``check_all`` runs them:

- ``events_once``: every answered request (an answer head with the edge's
  ``X-Request-Id``) is in the usage events exactly once; the one exception is a request
  whose nginx worker was killed while it was in flight (its log phase never ran). No
  event is written for a request no client got an answer head for, outside the kills of
  nginx and the reloads (those: ``reload_resets``).
- ``ledger_once``: every usage event is billed exactly once in the ledger's audit stream
  (its ``kind: correction`` entries, engine records that came after a bill, change that
  bill, they are no bill of their own), and nothing else is billed but engine records of
  requests without an event (orphans).
- ``tokens_whole``: every request answered whole (status 200, the whole body, final
  usage) has the same prompt and completion tokens at the client, in its event and in
  its bill.
- ``tokens_engine``: every edge request with engine records is billed exactly what its
  records say (a stream cut by a kill too, with or without its usage event), once, its
  corrections included.
- ``tokens_replicas``: each replica's own counters (``vllm:prompt_tokens``,
  ``vllm:generation_tokens`` since it last started) equal the sums of the engine records
  it wrote meanwhile (the counting rules of ``tokengate_vllm.record``).
- ``reservations``: no budget reservation left open after settling, no tokens or spend
  left in flight in the budgets' hourly counters.
- ``idle``: the edge's queues empty, no outstanding tokens and no replica out; every
  replica without running or waiting requests; the ledger with nothing left to read,
  nothing waiting for engine records.
- ``spans``: exported + lost == traced, in the ledger's span counts.
- ``errors_explained``: every 5xx answer and every request that failed without a whole
  answer (connection refused or reset, a stream cut short, a timeout) was in flight on a
  part that a fault took away: an nginx process, the replica that served it (as its event
  says), the limits sidecar or Redis for a 503 ``budget_unavailable``, any replica for
  the queue's 503s (capacity lost).
- ``reload_resets``: during reloads (SIGHUP, ``config apply``, key commands) no request
  the edge read got a reset: a reset there is only a request sent on a connection opened
  before it, before any byte of an answer, which the edge never read (and so never
  billed: no event without an answer there).
- ``error_log``: no ``[alert]``, ``[crit]`` or ``[emerg]`` line in nginx's error log but
  nginx's own ``[alert]`` for a worker the soak killed with SIGKILL.
"""

from __future__ import annotations

import re
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from tokengate.ledger.engine_record import EngineRecord
from tokengate.ledger.event import UsageEvent, parse_ts
from tokengate.ledger.reconcile import engine_requests
from tokengate.ledger.tracing import LOST_REASONS, span_count

# Fault kinds. A kill takes a part away until it is up again; a reload replaces nginx's
# workers; a Redis fault takes the global limits' store away.
NGINX_KILLS = ("nginx_worker", "nginx_master")
REPLICA_KILL = "replica"
RELOADS = ("sighup", "config_apply", "keys")
GLOBAL_TIER = ("limits", "redis_down", "redis_stall", "redis_restart")
KINDS = (*NGINX_KILLS, REPLICA_KILL, "counter", "ledger", *GLOBAL_TIER, *RELOADS)

# A request overlapping a fault's window by less than this after its end still counts as
# caught by it: the edge sees a replica back only at its next health probe (2 s), a
# client sees a killed nginx's refusal a moment after the supervisor restarted it.
GRACE_S = 2.0
# nginx writes a request's usage event in its log phase, after the answer's last byte:
# a worker killed within this long after a client read a whole answer may have died
# before writing it (seen once in 11,000 soak requests: an nginx_master kill 0-1 s after
# an answer). The engine records bill such a request; the checks accept it only then.
LOG_PHASE_S = 1.0
SAMPLES = 5  # examples kept per check

# The 503s of a lost capacity (tokengate.queue, tokengate.admission): all replicas full
QUEUE_ERRORS = ("overloaded", "queue_timeout")

_KILLED_WORKER = re.compile(r"\[alert\] \d+#\d+: worker process (\d+) exited on signal 9$")
_BAD_LEVEL = re.compile(r"\[(alert|crit|emerg)\]")


@dataclass(frozen=True)
class ClientRequest:
    """One TokenStorm request: ``sent`` and ``end`` (monotonic s); ``status`` (0: no
    answer head came); ``error``: TokenStorm's error name ("none", "connect",
    "disconnected", "timeout", "stream without [DONE]", ...); ``request_id``: the
    answer's X-Request-Id ("" without one); ``reused``: sent on a connection opened
    before it; ``prompt_tokens``, ``completion_tokens``: the last usage it carried (-1:
    none)."""

    sent: float
    end: float
    status: int
    error: str
    request_id: str
    reused: bool
    prompt_tokens: int
    completion_tokens: int

    @property
    def whole(self) -> bool:
        """Answered 200 with its whole body and a final usage."""
        return self.status == 200 and self.error == "none" and self.completion_tokens >= 0

    @property
    def failed(self) -> bool:
        """A 5xx answer, or no whole answer at all."""
        return self.status >= 500 or self.error != "none"


@dataclass(frozen=True)
class Fault:
    """One fault the soak made: ``kind`` (``KINDS``), ``target`` (the replica's
    host:port for a replica, else the part's name), from ``start`` until the part was
    back (``end``, monotonic s); ``pids``: the processes it killed or signalled."""

    kind: str
    target: str
    start: float
    end: float
    pids: tuple[int, ...] = ()

    def overlaps(self, t0: float, t1: float) -> bool:
        return t0 <= self.end + GRACE_S and t1 >= self.start


@dataclass(frozen=True)
class ReplicaLife:
    """A replica's last lifetime: since ``since`` (monotonic s of the kill before it, 0
    for one never killed), its ``/metrics`` at the end: ``prompt_tokens`` and
    ``generation_tokens`` (vLLM's counters), ``running`` and ``waiting`` requests.
    ``killed``: earlier lifetimes that ended in a kill (their counters died with them)."""

    replica: str
    since: float
    prompt_tokens: int
    generation_tokens: int
    running: int
    waiting: int
    killed: int = 0


@dataclass
class SoakData:
    """What the soak collected (see the module docstring). ``wall_to_mono``: add it to
    a wall-clock time (epoch s) to get the monotonic clock's. ``bills``: the audit
    stream's usage entries (field -> value, as the ledger wrote them). ``records``: each
    replica's engine records, with the monotonic time each was written (its ``ts``).
    ``spans``: the ledger's span counts (traced, exported, lost:<reason>);
    ``spans_received``: spans the collector got. ``open_reservations``: budget
    reservation records not settled; ``budget_in_flight``: the budgets' hourly in-flight
    counters that are not 0 (key -> value). ``edge``: queue_requests, queue_tokens,
    outstanding_tokens and out (per replica); ``ledger``: lag_bytes, engine_lag_bytes,
    waiting, pending, eng_wait. ``error_log``: nginx's error-log lines."""

    clients: list[ClientRequest] = field(default_factory=list)
    events: list[UsageEvent] = field(default_factory=list)
    wall_to_mono: float = 0.0
    bills: list[dict[str, str]] = field(default_factory=list)
    records: dict[str, list[EngineRecord]] = field(default_factory=dict)
    lives: list[ReplicaLife] = field(default_factory=list)
    spans: dict[str, int] = field(default_factory=dict)
    spans_received: int = 0
    open_reservations: list[str] = field(default_factory=list)
    budget_in_flight: dict[str, int] = field(default_factory=dict)
    edge: dict[str, Any] = field(default_factory=dict)
    ledger: dict[str, Any] = field(default_factory=dict)
    error_log: list[str] = field(default_factory=list)
    faults: list[Fault] = field(default_factory=list)

    def event_window(self, ev: UsageEvent) -> tuple[float, float]:
        """(start, end) of the request an event describes, monotonic s."""
        t0 = parse_ts(ev.ts).timestamp() + self.wall_to_mono
        return t0, t0 + ev.total_ms / 1000.0

    def records_by_request(self) -> dict[str, list[EngineRecord]]:
        """Every replica's engine records by the edge request they name (records of no
        edge request left out)."""
        out: dict[str, list[EngineRecord]] = defaultdict(list)
        for recs in self.records.values():
            for r in recs:
                if r.edge_request_id is not None:
                    out[r.edge_request_id].append(r)
        return out

    def record_time(self, rec: EngineRecord) -> float:
        """When a replica wrote ``rec`` (its ``ts``), monotonic s."""
        return parse_ts(rec.ts).timestamp() + self.wall_to_mono


@dataclass
class Check:
    """One invariant's verdict: ``name``, what it says (``title``), ``held``, its
    figures and up to ``SAMPLES`` examples of what broke it."""

    name: str
    title: str
    held: bool
    figures: dict[str, Any]
    samples: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "title": self.title, "held": self.held,
                "figures": self.figures, "samples": self.samples}


def _faults(data: SoakData, kinds: Sequence[str], t0: float, t1: float,
            target: str | None = None) -> list[Fault]:
    return [f for f in data.faults if f.kind in kinds and f.overlaps(t0, t1)
            and (target is None or f.target == target)]


def _event_lost_to_nginx(data: SoakData, c: ClientRequest) -> bool:
    """An nginx kill while ``c`` ran or within ``LOG_PHASE_S`` after its answer: its
    usage event may have died with the worker."""
    return bool(_faults(data, NGINX_KILLS, c.sent, c.end + LOG_PHASE_S))


def _by_id(events: Iterable[UsageEvent]) -> dict[str, list[UsageEvent]]:
    out: dict[str, list[UsageEvent]] = defaultdict(list)
    for ev in events:
        out[ev.request_id].append(ev)
    return out


@dataclass
class Billed:
    """What the ledger billed one request: ``bills`` (its bill entries: 1 when billed
    once), the tokens with every correction added, how the bill was ``settled`` (edge
    or engine), ``corrections`` (later engine records that changed it) and whether it
    billed records whose event never came (``orphan``)."""

    bills: int = 0
    prompt: int = 0
    completion: int = 0
    settled: str = ""
    corrections: int = 0
    orphan: bool = False

    @property
    def tokens(self) -> tuple[int, int]:
        return self.prompt, self.completion


def _bills(data: SoakData) -> dict[str, Billed]:
    """The audit stream by request: a bill entry, then any ``kind: correction`` entries
    that add their differences to it (``tokengate.ledger.join``); entries of other kinds
    (key commands) are not the ledger's bills."""
    out: dict[str, Billed] = defaultdict(Billed)
    for e in data.bills:
        kind = e.get("kind")
        if kind not in (None, "correction"):
            continue
        b = out[e["rid"]]
        b.prompt += int(e["prompt"])
        b.completion += int(e["completion"])
        if kind == "correction":
            b.corrections += 1
        else:
            b.bills += 1
            b.settled = e.get("settled", "")
            b.orphan = e.get("orphan") == "1"
    return out


def _sample(samples: list[str], text: str) -> None:
    if len(samples) < SAMPLES:
        samples.append(text)


# -- the checks ----------------------------------------------------------------------


def events_once(data: SoakData) -> Check:
    events = _by_id(data.events)
    seen: set[str] = set()
    samples: list[str] = []
    bills = _bills(data)
    answered = once = killed = missing = 0
    for c in data.clients:
        if not c.request_id:
            continue
        answered += 1
        seen.add(c.request_id)
        n = len(events.get(c.request_id, []))
        if n == 1:
            once += 1
        elif n == 0 and c.failed and _faults(data, NGINX_KILLS, c.sent, c.end):
            killed += 1
        elif n == 0 and _event_lost_to_nginx(data, c) and c.request_id in bills:
            killed += 1  # answered, then killed before its log phase; the engine billed it
        elif n == 0:
            missing += 1
            _sample(samples, f"{c.request_id}: answered {c.status} ({c.error}), no event")
    dups = {rid: len(evs) for rid, evs in events.items() if len(evs) > 1}
    for rid, n in list(dups.items())[:SAMPLES - len(samples)]:
        _sample(samples, f"{rid}: {n} events")
    unseen = stray = 0
    for rid, evs in events.items():
        if rid in seen:
            continue
        unseen += 1
        t0, t1 = data.event_window(evs[0])
        if not _faults(data, (*NGINX_KILLS, *RELOADS), t0, t1):
            stray += 1
            _sample(samples, f"{rid}: event (status {evs[0].status}) of a request no client "
                             "got an answer head for, outside kills and reloads")
    return Check("events_once", "each answered request once in the usage events",
                 missing == 0 and not dups and stray == 0,
                 {"answered": answered, "with_one_event": once,
                  "no_event_nginx_killed": killed, "no_event": missing,
                  "duplicate_event_ids": len(dups), "events": len(data.events),
                  "events_without_answer": unseen, "events_without_answer_unexplained": stray},
                 samples)


def ledger_once(data: SoakData) -> Check:
    bills = _bills(data)
    events = _by_id(data.events)
    with_records = data.records_by_request()
    samples: list[str] = []
    once = none = twice = 0
    for rid in events:
        n = bills[rid].bills if rid in bills else 0
        if n == 1:
            once += 1
        elif n == 0:
            none += 1
            _sample(samples, f"{rid}: event not billed")
        else:
            twice += 1
            _sample(samples, f"{rid}: billed {n} times")
    orphans = stray = 0
    for rid, b in bills.items():
        if rid in events:
            continue
        if rid in with_records and b.bills == 1:
            orphans += 1
        else:
            stray += 1
            _sample(samples, f"{rid}: billed {b.bills} time(s) without an event "
                             f"or engine records")
    return Check("ledger_once", "each usage event billed once in the ledger",
                 none == 0 and twice == 0 and stray == 0,
                 {"events": len(events), "billed_once": once, "not_billed": none,
                  "billed_more_than_once": twice,
                  "bills": sum(b.bills for b in bills.values()),
                  "corrections": sum(b.corrections for b in bills.values()),
                  "bills_of_engine_records_without_event": orphans,
                  "bills_unexplained": stray}, samples)


def tokens_whole(data: SoakData) -> Check:
    events = _by_id(data.events)
    bills = _bills(data)
    samples: list[str] = []
    n = bad = 0
    sums = Counter[str]()
    for c in data.clients:
        if not (c.whole and c.request_id):
            continue
        n += 1
        evs, billed = events.get(c.request_id, []), bills.get(c.request_id)
        ev = evs[0] if len(evs) == 1 else None
        b = billed if billed is not None and billed.bills == 1 else None
        sums["client_prompt"] += c.prompt_tokens
        sums["client_completion"] += c.completion_tokens
        if ev is not None:
            sums["event_prompt"] += ev.prompt_tokens
            sums["event_completion"] += ev.completion_tokens
        if b is not None:
            sums["ledger_prompt"] += b.prompt
            sums["ledger_completion"] += b.completion
        got = {"client": (c.prompt_tokens, c.completion_tokens),
               "event": None if ev is None else (ev.prompt_tokens, ev.completion_tokens),
               "ledger": None if b is None else b.tokens}
        if ev is None and got["client"] == got["ledger"] and _event_lost_to_nginx(data, c):
            sums["event_lost_to_an_nginx_kill"] += 1  # billed from its engine records
        elif len(set(got.values())) != 1:
            bad += 1
            _sample(samples, f"{c.request_id}: (prompt, completion) "
                             + ", ".join(f"{k} {v}" for k, v in got.items()))
    return Check("tokens_whole", "tokens of whole answers: clients = events = ledger",
                 bad == 0, {"whole_answers": n, "mismatched": bad, **sums}, samples)


def _engine_tokens(records: Iterable[EngineRecord]) -> tuple[int, int]:
    """(prompt, completion) tokens a request's engine records bill
    (``tokengate.ledger.reconcile``: a prompt once per engine request, when one of its
    choices was prefilled; every generated token)."""
    prompt = completion = 0
    for children in engine_requests(records).values():
        pre = [children[i] for i in sorted(children) if children[i].prefilled]
        prompt += pre[0].num_prompt_tokens if pre else 0
        completion += sum(r.num_generation_tokens for r in children.values())
    return prompt, completion


def tokens_engine(data: SoakData) -> Check:
    by_rid = data.records_by_request()
    bills = _bills(data)
    events = _by_id(data.events)
    samples: list[str] = []
    exact = unbilled = orphans = billed_orphans = wrong = cut = 0
    sums = Counter[str]()
    for rid, recs in by_rid.items():
        prompt, completion = _engine_tokens(recs)
        sums["engine_prompt"] += prompt
        sums["engine_completion"] += completion
        aborted = any(r.finish_reason == "abort" for r in recs)
        cut += aborted
        b = bills.get(rid, Billed())
        if b.bills != 1:
            unbilled += 1
            orphans += rid not in events
            where = "with an event" if rid in events else "without an event"
            _sample(samples, f"{rid}: engine records ({prompt} prompt, {completion} "
                             f"completion{', aborted' if aborted else ''}) {where}, "
                             f"billed {b.bills} times")
            continue
        sums["ledger_prompt"] += b.prompt
        sums["ledger_completion"] += b.completion
        billed_orphans += b.orphan
        if b.tokens == (prompt, completion):
            exact += 1
        else:
            wrong += 1
            _sample(samples, f"{rid}: billed {b.tokens} (settled {b.settled}, "
                             f"{b.corrections} corrections), engine records say "
                             f"{(prompt, completion)}")
    return Check("tokens_engine", "engine records billed exactly, once (cut streams too)",
                 unbilled == 0 and wrong == 0,
                 {"requests_with_records": len(by_rid), "with_an_abort_record": cut,
                  "billed_exactly": exact, "of_which_without_an_event": billed_orphans,
                  "billed_otherwise": wrong,
                  "not_billed_once": unbilled, "not_billed_once_without_an_event": orphans,
                  **sums},
                 samples)


def tokens_replicas(data: SoakData) -> Check:
    samples: list[str] = []
    per: dict[str, Any] = {}
    bad = killed = 0
    for life in data.lives:
        recs = [r for r in data.records.get(life.replica, [])
                if data.record_time(r) > life.since]
        generated = sum(r.num_generation_tokens for r in recs)
        prompt = sum(r.num_prompt_tokens for r in recs if r.prefilled)
        killed += life.killed
        per[life.replica] = {"records": len(recs), "records_prompt": prompt,
                             "records_generation": generated,
                             "vllm_prompt_tokens": life.prompt_tokens,
                             "vllm_generation_tokens": life.generation_tokens,
                             "earlier_lifetimes_killed": life.killed}
        if (prompt, generated) != (life.prompt_tokens, life.generation_tokens):
            bad += 1
            _sample(samples, f"{life.replica}: records (prompt {prompt}, generated "
                             f"{generated}) != its counters ({life.prompt_tokens}, "
                             f"{life.generation_tokens})")
    return Check("tokens_replicas", "replicas' own counters = their engine records",
                 bad == 0 and bool(data.lives),
                 {"replicas": per, "mismatched": bad,
                  "lifetimes_ended_by_a_kill_not_comparable": killed}, samples)


def reservations(data: SoakData) -> Check:
    """Open reservations are counted by what could have settled them: the request's
    usage event (the edge, or the ledger from the event), its engine records only (an
    nginx that died after forwarding it), or nothing (one that died before)."""
    events = {ev.request_id for ev in data.events}
    with_records = data.records_by_request()
    classes = ("with_event", "with_engine_records_only", "with_neither")
    by: dict[str, list[str]] = {c: [] for c in classes}
    for k in data.open_reservations:
        rid = k.rpartition(":r:")[2]
        by[classes[0] if rid in events else classes[1] if rid in with_records
           else classes[2]].append(k)
    samples: list[str] = []
    for what in classes:  # the ones someone should have settled first
        for k in by[what]:
            _sample(samples, f"open ({what.replace('_', ' ')}): {k}")
    for k, v in list(data.budget_in_flight.items())[:SAMPLES - len(samples)]:
        samples.append(f"in flight: {k} = {v}")
    return Check("reservations", "no reservation open after settling",
                 not data.open_reservations and not data.budget_in_flight,
                 {"open_budget_reservations": len(data.open_reservations),
                  **{f"open_{k}": len(v) for k, v in by.items()},
                  "budget_in_flight_counters": len(data.budget_in_flight)}, samples)


def idle(data: SoakData) -> Check:
    samples: list[str] = []
    edge, ledger = data.edge, data.ledger
    for name in ("queue_requests", "queue_tokens"):
        if edge.get(name):
            _sample(samples, f"edge {name} {edge[name]}")
    for r, v in (edge.get("outstanding_tokens") or {}).items():
        if v:
            _sample(samples, f"edge: {v} outstanding tokens on {r}")
    out = [r for r, v in (edge.get("out") or {}).items() if v]
    for r in out:
        _sample(samples, f"edge: replica {r} left out")
    for life in data.lives:
        if life.running or life.waiting:
            _sample(samples, f"{life.replica}: {life.running} running, {life.waiting} waiting")
    for name in ("lag_bytes", "engine_lag_bytes", "waiting", "pending", "eng_wait"):
        if ledger.get(name):
            _sample(samples, f"ledger {name} {ledger[name]}")
    busy = sum(bool(life.running or life.waiting) for life in data.lives)
    held = (not samples and bool(edge) and bool(ledger) and bool(data.lives))
    return Check("idle", "queues and in-flight counts back at 0", held,
                 {"edge": edge, "replicas_busy": busy, "ledger": ledger}, samples)


def spans(data: SoakData) -> Check:
    s = data.spans
    traced, exported = s.get("traced", 0), s.get("exported", 0)
    lost = {r: s.get(f"lost:{r}", 0) for r in LOST_REASONS}
    in_events = sum(span_count(ev) for ev in data.events)
    held = exported + sum(lost.values()) == traced and traced > 0
    lost_n = sum(lost.values())
    samples = [] if held else [f"exported {exported} + lost {lost_n} != traced {traced}"]
    return Check("spans", "spans exported + lost = traced", held,
                 {"traced": traced, "exported": exported, "lost": lost,
                  "spans_of_the_events": in_events, "received_by_the_collector":
                  data.spans_received}, samples)


def _explained(data: SoakData, c: ClientRequest, ev: UsageEvent | None) -> str | None:
    """The fault that explains a failed request, or None."""
    t0, t1 = c.sent, c.end
    if _faults(data, NGINX_KILLS, t0, t1):
        return "nginx killed"
    if ev is None:  # no event says where it went: any replica killed meanwhile
        return "a replica killed" if _faults(data, (REPLICA_KILL,), t0, t1) else None
    if ev.upstream and _faults(data, (REPLICA_KILL,), t0, t1, target=ev.upstream):
        return "its replica killed"
    if ev.error == "budget_unavailable" and _faults(data, GLOBAL_TIER, t0, t1):
        return "global limits down"
    if ev.error in QUEUE_ERRORS and _faults(data, (REPLICA_KILL,), t0, t1):
        return "capacity of a killed replica"
    return None


def _is_reload_reset(data: SoakData, c: ClientRequest) -> bool:
    return (c.error == "disconnected" and c.status == 0
            and bool(_faults(data, RELOADS, c.sent, c.end))
            and not _faults(data, (*NGINX_KILLS, REPLICA_KILL), c.sent, c.end))


def errors_explained(data: SoakData) -> Check:
    events = _by_id(data.events)
    samples: list[str] = []
    why = Counter[str]()
    kinds = Counter[str]()
    failed = bad = 0
    for c in data.clients:
        if not c.failed or _is_reload_reset(data, c):
            continue
        failed += 1
        kinds[str(c.status) if c.error == "none" else c.error] += 1
        evs = events.get(c.request_id, []) if c.request_id else []
        ev = evs[0] if evs else None
        reason = _explained(data, c, ev)
        if reason is None:
            bad += 1
            _sample(samples, f"{c.request_id or '(no answer head)'}: status {c.status}, "
                             f"{c.error}, error {ev.error if ev else None}, upstream "
                             f"{ev.upstream if ev else None}, {c.end - c.sent:.2f} s")
        else:
            why[reason] += 1
    return Check("errors_explained", "5xx only for requests in flight on a killed part",
                 bad == 0, {"requests": len(data.clients), "failed": failed,
                            "by_kind": dict(kinds), "explained": dict(why),
                            "unexplained": bad}, samples)


def reload_resets(data: SoakData) -> Check:
    samples: list[str] = []
    reloads = sum(f.kind in RELOADS for f in data.faults)
    resets = unread = 0
    for c in data.clients:
        if not _is_reload_reset(data, c):
            continue
        resets += 1
        if c.reused:
            unread += 1
        else:
            _sample(samples, f"reset of a new connection at {c.sent:.2f} s")
    seen = {c.request_id for c in data.clients if c.request_id}
    billed = 0
    for ev in data.events:
        if ev.request_id in seen:
            continue
        t0, t1 = data.event_window(ev)
        if _faults(data, RELOADS, t0, t1) and not _faults(data, NGINX_KILLS, t0, t1):
            billed += 1
            _sample(samples, f"{ev.request_id}: read and answered {ev.status} during a "
                             "reload, the client got no answer")
    return Check("reload_resets", "no connection reset on reload",
                 resets == unread and billed == 0,
                 {"reloads": reloads, "resets": resets,
                  "resets_of_unread_requests_on_open_connections": unread,
                  "events_of_reset_requests": billed}, samples)


def error_log(data: SoakData) -> Check:
    killed = {p for f in data.faults if f.kind == "nginx_worker" for p in f.pids}
    samples: list[str] = []
    allowed = bad = 0
    levels = Counter[str]()
    for line in data.error_log:
        m = _BAD_LEVEL.search(line)
        if m is None:
            continue
        levels[m.group(1)] += 1
        k = _KILLED_WORKER.search(line.rstrip())
        if k is not None and int(k.group(1)) in killed:
            allowed += 1
            continue
        bad += 1
        _sample(samples, line.strip()[:300])
    return Check("error_log", "no [alert]/[crit] in nginx's error log except for the kills",
                 bad == 0, {"lines": dict(levels), "workers_killed": len(killed),
                            "of_killed_workers": allowed, "others": bad}, samples)


CHECKS = (events_once, ledger_once, tokens_whole, tokens_engine, tokens_replicas,
          reservations, idle, spans, errors_explained, reload_resets, error_log)


def check_all(data: SoakData) -> list[Check]:
    """Every invariant of the module docstring, in its order."""
    return [check(data) for check in CHECKS]

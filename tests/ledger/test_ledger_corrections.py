"""Bills that engine records correct after the fact, and engine records billed on their
own: real ledger processes (killed with SIGKILL and started again, two sharing one
Redis), the real limits sidecar keeping a budgeted key's counters as the edge drives it
(``EdgeBudget``: ReserveBudget at admission, SettleBudget with the usage event's numbers),
usage events and engine records written the way the edge and the vLLM plugin write them.

- A replica's engine file that the ledger follows only after its requests were billed
  with the edge's numbers (the configuration lists it later, once while the ledger runs
  and once across a restart): its records correct those bills, once each, and the key's
  totals, spend and budget counters end at the engine's numbers.
- A stream cut by a killed nginx worker leaves no usage event: its record, which names the
  key, is billed to that key after ``ledger.engine_orphan_s``, its open reservation
  settled, once; an event of it that comes after all is a duplicate.
"""

from __future__ import annotations

import math
import os
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, date, datetime
from pathlib import Path
from typing import Any

import pytest
import redis
import yaml
from tokengate import budget_store
from tokengate import config as tg_config
from tokengate import redis_keys as store
from tokengate.ledger.calculator import Calculator
from tokengate.ledger.event import UsageEvent
from tokengate.ledger.report import query
from tokengate.v1 import limits_pb2 as pb
from tokengate.v1 import limits_pb2_grpc as pb_grpc
from tokengate_dev import devstack

from tests.conftest import MODEL, key_digest
from tests.fixtures_ledger import UsageWriter, make_event, svc_name, wait_until
from tests.ledger.test_ledger_engine import (
    EngineWriter,
    audit,
    record,
    start_ledger,
    stats,
    status,
    the_row,
)
from tests.limits.test_limits import limits_stub

KEY = "team"
TEAM = "billing"  # the key's team, with a budget of its own


def today_utc() -> date:
    return datetime.now(UTC).date()


def now_ts(shift_s: float = 0.0) -> str:
    """Wall-clock time as the edge and the plugin write it (RFC 3339 UTC, ms)."""
    t = datetime.fromtimestamp(time.time() + shift_s, UTC)
    return t.strftime("%Y-%m-%dT%H:%M:%S.") + f"{t.microsecond // 1000:03d}Z"


def bill_config(base: Path, out: Path, budgets: list[dict[str, Any]] | None = None,
                **ledger: Any) -> Path:
    """The test configuration with key ``KEY`` and its budgets (a day's spend of 1.0 by
    default), global limits on (budgets need them) and ``ledger`` settings."""
    raw = yaml.safe_load(base.read_text())
    raw["keys"][KEY] = {"sha256": key_digest("tg-test-team"), "rpm": 10_000,
                        "tpm": 10_000_000,
                        "budgets": budgets or [{"period": "day", "spend": 1.0}],
                        "team": TEAM}
    # the key's team pools a budget too: the edge reserves and settles both, and the
    # ledger's corrections move both
    raw["teams"] = {TEAM: {"budgets": [{"period": "day", "spend": 5.0}]}}
    raw["global_limits"] = {"enabled": True, "listen": "127.0.0.1:1"}
    raw.setdefault("ledger", {}).update(ledger)
    out.write_text(yaml.safe_dump(raw, sort_keys=False))
    return out


def list_engine_files(config: Path, files: list[Path]) -> None:
    """Edit ``ledger.engine_usage_files`` the way `tokengate config apply` writes a file:
    a new file renamed into place (the ledger notices the change within a second)."""
    raw = yaml.safe_load(config.read_text())
    raw["ledger"]["engine_usage_files"] = [str(f) for f in files]
    tmp = config.with_suffix(".tmp")
    tmp.write_text(yaml.safe_dump(raw, sort_keys=False))
    os.replace(tmp, config)


@contextmanager
def budgeted(base: Path, tmp: Path, redis_url: str, **ledger: Any
             ) -> Iterator[tuple[Path, EdgeBudget, list[devstack.Service]]]:
    """(the test's configuration with ``ledger`` settings, the edge's budget calls
    through a real limits sidecar on ``redis_url``, the list of the ledgers the test
    starts, stopped when the block ends)."""
    config = bill_config(base, tmp / "tokengate.yaml", **ledger)
    svcs: list[devstack.Service] = []
    with limits_stub(config, redis_url, "test-limits-billing") as stub:
        try:
            yield config, EdgeBudget(stub, tg_config.load(config)), svcs
        finally:
            for svc in svcs:
                svc.stop()


class EdgeBudget:
    """What the edge does for a request of a budgeted key (lua/tokengate/budget.lua,
    global_limit.lua): ``ReserveBudget`` of the worst case at admission on the counters
    of the key's budgets, and when the response ends ``SettleBudget`` with the cost of
    the numbers it writes in the usage event (the ledger's formula, rounded up to the
    nano-unit)."""

    def __init__(self, stub: pb_grpc.GlobalLimitsStub, cfg: tg_config.Config,
                 key_id: str = KEY) -> None:
        self.stub, self.cfg, self.key_id = stub, cfg, key_id
        self.calc = Calculator(cfg)

    def counters(self) -> list[pb.BudgetCounter]:
        """The key's budget counters, then its team's (named as the edge names them)."""
        key = self.cfg.keys[self.key_id]
        today = today_utc()
        owned = [(key.budgets, None)] + [
            (g.budgets, tg_config.level_id(level, name))
            for level, name, g in tg_config.key_levels(key.team, self.cfg.teams,
                                                       self.cfg.orgs)]
        out = []
        for budgets, level in owned:
            for b, (name, ttl) in zip(budgets, budget_store.request_counters(
                    budgets, MODEL, today, level), strict=True):
                out.append(pb.BudgetCounter(name=name, ttl_s=ttl, token_limit=b.tokens or 0,
                                            spend_limit_nano=round((b.spend or 0) * 1e9)))
        return out

    def reserve(self, rid: str, prompt: int = 12, max_tokens: int = 256
                ) -> pb.BudgetReserveReply:
        cost = budget_store.nano(self.calc.charge(prompt, max_tokens, 0, 0, MODEL).cost)
        return self.stub.ReserveBudget(pb.BudgetReserveRequest(
            key_id=self.key_id, request_id=rid, counters=self.counters(), cost_nano=cost,
            tokens=prompt + max_tokens), timeout=5)

    def settle(self, ev: UsageEvent) -> None:
        cost = budget_store.nano(self.calc.charge_event(ev).cost)
        self.stub.SettleBudget(pb.BudgetSettleRequest(
            key_id=self.key_id, request_id=ev.request_id, counters=self.counters(),
            cost_nano=cost, tokens=ev.prompt_tokens + ev.completion_tokens), timeout=5)

    def counter(self) -> str:
        """The name of the key's one budget counter today."""
        (name, _team) = [c.name for c in self.counters()]
        return name

    def team_counter(self) -> str:
        """The name of the key's team's budget counter today."""
        return self.counters()[1].name


# The edge's numbers and the engine's of three requests that the edge billed alone:
# (usage event fields, tokens the engine generated)
REQUESTS: list[tuple[dict[str, Any], int]] = [
    # non-streaming, the client left: the edge bills the whole reservation (244)
    ({"usage_source": "estimate", "client_aborted": True, "completion_tokens": 244,
      "reserved": 256}, 40),
    # a stream whose client left after 3 tokens
    ({"stream": True, "usage_source": "running", "client_aborted": True,
      "completion_tokens": 3}, 17),
    # a whole answer: the same numbers on both sides
    ({"usage_source": "final", "completion_tokens": 30}, 30),
]


def request(edge: EdgeBudget, usage: UsageWriter, engine: EngineWriter,
            fields: dict[str, Any], generated: int) -> UsageEvent:
    """One request through the edge to a replica whose records go to ``engine``:
    reserved, its usage event written and its reservation settled by the edge, its
    record written by the plugin."""
    ev = make_event(key_id=KEY, ts=now_ts(), prompt_tokens=12, token_estimate=12, **fields)
    assert edge.reserve(ev.request_id).admitted
    usage.write(ev)
    edge.settle(ev)
    finish, source = ("abort", "abort") if ev.client_aborted else ("length", "stats")
    engine.record(record(ev.request_id, gen=generated, finish=finish, source=source,
                         arrival=now_ts(), ts=now_ts(), key_id=KEY, endpoint="chat"))
    return ev


def kill(svc: devstack.Service) -> None:
    assert svc.proc is not None
    os.kill(svc.proc.pid, signal.SIGKILL)
    svc.proc.wait(10)


def engine_bill(calc: Calculator, generated: list[int]) -> tuple[int, int, float]:
    """(settled spend in nano-units, tokens, cost) of requests with a 12-token prompt
    that generated ``generated``: each rounded up to the nano-unit, as the edge does."""
    costs = [calc.charge(12, g, 0, 0, MODEL).cost for g in generated]
    return (sum(budget_store.nano(c) for c in costs), sum(12 + g for g in generated),
            math.fsum(costs))


def test_a_replicas_engine_file_followed_late_corrects_its_requests_bills_once(
        ledger_config_path: Path, ledger_redis: redis.Redis, redis_url: str,
        usage_writer: UsageWriter, tmp_path: Path) -> None:
    """Replica 2 and replica 3 are added to the fleet, their engine files are not yet
    listed: their requests wait ``engine_wait_s`` and are billed with the edge's numbers.
    Replica 2's file is then listed while the ledger runs; replica 3's while the ledger
    is down (killed), before it starts again. Each late record corrects its request's
    bill once; a second ledger reading both files, and another restart, correct
    nothing twice."""
    engines = {n: EngineWriter(tmp_path / f"replica-{n}" / "engine.jsonl") for n in (1, 2, 3)}
    name, other = svc_name("test-ledger-late-replica"), svc_name("test-ledger-late-other")
    with budgeted(ledger_config_path, tmp_path, redis_url,
                  engine_usage_files=[str(engines[1].path)],
                  engine_wait_s=0.3) as (config, edge, svcs):
        led = start_ledger(config, redis_url, name, usage_file=usage_writer.path,
                           engine_files=[])
        svcs.append(led)
        # a first start reads the files up to date (no ready mark in the flushed Redis)
        # holding the budgets: a reservation meanwhile is refused BUDGET_REBUILDING
        wait_until(lambda: ledger_redis.exists(store.ready_key(name)) and
                   not ledger_redis.exists(store.rebuild_key(KEY)), 30,
                   what="the ledger's first rebuild to end, its hold released")
        second = [request(edge, usage_writer, engines[2], f, g) for f, g in REQUESTS]
        wait_until(lambda: status(name)["engine_missing"] == 3, 30,
                   what="replica 2's requests billed with the edge's numbers")
        assert the_row(ledger_redis).completion_tokens == 244 + 3 + 30
        list_engine_files(config, [engines[1].path, engines[2].path])
        wait_until(lambda: status(name)["corrections"] == 3, 30,
                   what="replica 2's records correcting its bills")

        third = [request(edge, usage_writer, engines[3], f, g) for f, g in REQUESTS]
        wait_until(lambda: status(name)["engine_missing"] == 6, 30,
                   what="replica 3's requests billed with the edge's numbers")
        kill(led)
        list_engine_files(config, [engines[n].path for n in (1, 2, 3)])
        led = start_ledger(config, redis_url, name, usage_file=usage_writer.path,
                           engine_files=[])
        svcs.append(led)
        wait_until(lambda: stats(ledger_redis, name).get("corrections") == 6, 30,
                   what="replica 3's records correcting its bills after the restart")
        # another ledger over both late files, and one more restart: all read before
        svcs.append(start_ledger(config, redis_url, other, usage_file=None,
                                 engine_files=[engines[2].path, engines[3].path]))
        wait_until(lambda: status(other)["engine_duplicates"] == 6, 30,
                   what="the second ledger finding every record read")
        kill(led)
        led = start_ledger(config, redis_url, name, usage_file=usage_writer.path,
                           engine_files=[])
        svcs.append(led)
        wait_until(lambda: status(name)["engine_lag_bytes"] == 0 and
                   not status(name)["rebuilding"], 30, what="the ledger caught up")
        wait_until(lambda: not ledger_redis.hlen(store.BUDGET_FIX_KEY), 30,
                   what="the budget fixes made")
    generated = [g for _f, g in REQUESTS] * 2
    spend, tokens, cost = engine_bill(edge.calc, generated)
    row = the_row(ledger_redis)
    assert (row.requests, row.prompt_tokens, row.completion_tokens, row.settled_engine,
            row.engine_missing, row.corrections, row.estimated) == \
        (6, 72, sum(generated), 6, 0, 6, 0)
    assert row.cost == pytest.approx(cost, rel=1e-12)
    assert stats(ledger_redis, name)["corrections"] == 6
    corrections = [f for _id, f in ledger_redis.xrange(store.AUDIT_KEY)
                   if f.get("kind") == "correction"]
    assert sorted(f["rid"] for f in corrections) == \
        sorted(ev.request_id for ev in second + third)
    left = next(f for f in corrections if f["rid"] == second[0].request_id)
    assert (left["key"], left["completion"], left["prompt"], left["settled"],
            left["complete"], left["action"]) == (KEY, "-204", "0", "engine", "1",
                                                  "bill_corrected")
    assert "completion 244 -> 40" in left["detail"]
    bills = audit(ledger_redis)
    assert [bills[ev.request_id]["settled"] for ev in second + third] == ["edge"] * 6
    # the key's budget counters hold the engine's numbers too: nothing is in flight
    s, t, *_ = budget_store.budget_keys(KEY, edge.counter(), budget_store.this_hour())
    assert (int(ledger_redis.get(s)), int(ledger_redis.get(t))) == (spend, tokens)
    assert budget_store.committed(ledger_redis, [(KEY, edge.counter())], [MODEL]) == \
        [(spend, tokens)]
    # and the team's, which the same fixes moved
    s, t, *_ = budget_store.budget_keys(KEY, edge.team_counter(), budget_store.this_hour())
    assert s.startswith("tg:bg:{team%3A")
    assert (int(ledger_redis.get(s)), int(ledger_redis.get(t))) == (spend, tokens)
    assert not list(ledger_redis.scan_iter(store.open_key("*")))


def test_a_record_whose_usage_event_never_came_is_billed_to_its_key_once(
        ledger_config_path: Path, ledger_redis: redis.Redis, redis_url: str,
        usage_writer: UsageWriter, tmp_path: Path) -> None:
    """A stream cut by a killed nginx worker: admitted (its budget reserved), no usage
    event, no settlement; the replica's record names the key and endpoint. An edge
    host's ledger and a vLLM host's ledger read the replica's file; after
    ``engine_orphan_s`` the record is billed to the key with the engine's numbers and
    its reservation settled, once, across a SIGKILL and restart. A record that names no
    key (an older plugin) is only counted; the cut stream's event, written after all,
    is a duplicate."""
    engine = EngineWriter(tmp_path / "replica" / "engine.jsonl")
    name, vllm_host = svc_name("test-ledger-orphans"), svc_name("test-ledger-orphans-vllm")
    with budgeted(ledger_config_path, tmp_path, redis_url,
                  engine_usage_files=[str(engine.path)], engine_wait_s=0.3,
                  engine_orphan_s=1.0) as (config, edge, svcs):
        request(edge, usage_writer, engine, *REQUESTS[2])
        cut = make_event(key_id=KEY, ts=now_ts(), stream=True, usage_source="running",
                         client_aborted=True, completion_tokens=9, status=200)
        assert edge.reserve(cut.request_id).admitted
        engine.record(record(cut.request_id, gen=57, finish="abort", source="abort",
                             arrival=now_ts(-0.5), ts=now_ts(), key_id=KEY,
                             endpoint="chat"))
        keyless = f"{int(time.time() * 1e6):032x}"
        engine.record(record(keyless, gen=5, arrival=now_ts(), ts=now_ts()))
        led = start_ledger(config, redis_url, name, usage_file=usage_writer.path,
                           engine_files=[])
        svcs += [led, start_ledger(config, redis_url, vllm_host, usage_file=None,
                                   engine_files=[engine.path])]
        wait_until(lambda: len(query(ledger_redis)) == 1 and
                   the_row(ledger_redis).requests == 2, 30, what="the orphan billed")
        kill(led)
        svcs.append(start_ledger(config, redis_url, name, usage_file=usage_writer.path,
                                 engine_files=[]))
        # the cut stream's event comes after all (an edge that wrote it late)
        usage_writer.write(cut)
        wait_until(lambda: stats(ledger_redis, name).get("duplicates") == 1, 30,
                   what="the late event skipped")
        unmatched = sum(int(ledger_redis.hget(k, "engine_unmatched") or 0)
                        for k in ledger_redis.scan_iter(store.stats_key("") + "*"))
        assert unmatched == 1
        wait_until(lambda: not ledger_redis.hlen(store.BUDGET_FIX_KEY), 30,
                   what="the budget fixes made")
    row = the_row(ledger_redis)
    assert (row.requests, row.completion_tokens, row.orphans, row.settled_engine,
            row.aborted) == (2, 30 + 57, 1, 2, 1)
    assert row.statuses == {"200": 1}  # the orphan's answer was never logged
    bill = audit(ledger_redis)[cut.request_id]
    assert (bill["key"], bill["completion"], bill["prompt"], bill["settled"], bill["orphan"],
            bill["status"], bill["endpoint"]) == (KEY, "57", "12", "engine", "1", "0", "chat")
    assert stats(ledger_redis, name)["orphans"] == 1
    assert ledger_redis.get(store.reservation_key(KEY, cut.request_id)) == "settled"
    spend, tokens, _cost = engine_bill(edge.calc, [30, 57])
    assert budget_store.committed(ledger_redis, [(KEY, edge.counter())], [MODEL]) == \
        [(spend, tokens)]
    assert ledger_redis.zcard(store.ENG_WAIT_KEY) == 0


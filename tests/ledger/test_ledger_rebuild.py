"""A Redis that comes back without its data: a real redis-server without persistence
(Debian's 7.0) is stopped and started again empty under a real ledger process and a real
limits sidecar. The ledger notices at once, holds the budgets, rebuilds the bill from the
usage file and the engine records, the same bill as before (the key's and its team's
budget counters), and only then lets budgets admit again: a key refused at its budget
before is refused after, never admitted in between.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import grpc
from tokengate import budget_store
from tokengate import config as tg_config
from tokengate import redis_keys as store
from tokengate.ledger.calculator import Calculator
from tokengate.ledger.report import UsageRow, query
from tokengate.v1 import limits_pb2 as pb

from tests.conftest import MODEL
from tests.fixtures_ledger import (
    PrivateRedis,
    UsageWriter,
    make_event,
    svc_name,
    wait_until,
)
from tests.ledger.test_ledger_corrections import (
    KEY,
    EdgeBudget,
    bill_config,
    now_ts,
)
from tests.ledger.test_ledger_engine import EngineWriter, record, start_ledger, status
from tests.limits.test_limits import limits_stub

MAX_TOKENS = 60     # each request's completion limit: its reservation
# what the edge saw of each request and what its replica generated
# (name, usage event fields, generated: None = no record ever comes)
WORKLOAD = [
    ("left", {"usage_source": "estimate", "client_aborted": True,
              "completion_tokens": MAX_TOKENS}, 40),
    ("stream_left", {"stream": True, "usage_source": "running", "client_aborted": True,
                     "completion_tokens": 3}, 17),
    ("no_record", {"usage_source": "final", "completion_tokens": 30}, None),
]
LATE = 25     # a stream that left after 3 tokens, whose record comes after its bill
ORPHAN = 57   # a stream cut without a usage event


def bill_of(row: UsageRow) -> tuple[object, ...]:
    """What a row bills (not how it got there: a correction before the loss is a direct
    bill in the rebuild)."""
    return (row.day, row.key_id, row.model, row.requests, row.prompt_tokens,
            row.completion_tokens, row.cached_tokens, row.settled_engine, row.engine_missing,
            row.orphans, row.aborted, row.statuses, round(row.cost, 12))


def test_after_redis_lost_its_data_budgets_admit_only_the_same_bill_again(
        ledger_config_path: Path, private_redis: Callable[..., PrivateRedis],
        usage_writer: UsageWriter, tmp_path: Path) -> None:
    r = private_redis()  # no persistence: a restart loses everything
    calc = Calculator(tg_config.load(ledger_config_path))
    generated = [40, 17, 30, LATE, ORPHAN]
    bill_nano = sum(budget_store.nano(calc.charge(12, g, 0, 0, MODEL).cost) for g in generated)
    worst = budget_store.nano(calc.charge(12, MAX_TOKENS, 0, 0, MODEL).cost)
    # the day's spend limit: the whole bill fits, one more request's worst case does not
    spend = (bill_nano + worst // 2) / 1e9
    engine = EngineWriter(tmp_path / "replica" / "engine.jsonl")
    config = bill_config(ledger_config_path, tmp_path / "tokengate.yaml",
                         budgets=[{"period": "day", "spend": spend}],
                         engine_usage_files=[str(engine.path)], engine_wait_s=3.0,
                         engine_orphan_s=1.0)
    cfg = tg_config.load(config)
    name = svc_name("test-ledger-rebuild")
    client = r.client()
    with limits_stub(config, r.url, "test-limits-rebuild") as stub:
        edge = EdgeBudget(stub, cfg)
        led = start_ledger(config, r.url, name, usage_file=usage_writer.path, engine_files=[])
        try:
            wait_until(lambda: status(name)["rebuilds"] == 1 and not status(name)["rebuilding"],
                       30, what="the ledger's first start read up to date")
            for _name, fields, gen in WORKLOAD:
                ev = make_event(key_id=KEY, ts=now_ts(), **fields)
                assert edge.reserve(ev.request_id, max_tokens=MAX_TOKENS).admitted
                usage_writer.write(ev)
                edge.settle(ev)
                if gen is not None:
                    finish = "abort" if ev.client_aborted else "length"
                    engine.record(record(ev.request_id, gen=gen, finish=finish,
                                         source="abort" if finish == "abort" else "stats",
                                         arrival=now_ts(), ts=now_ts(), key_id=KEY,
                                         endpoint="chat"))
            late = make_event(key_id=KEY, ts=now_ts(), stream=True, usage_source="running",
                              client_aborted=True, completion_tokens=3)
            assert edge.reserve(late.request_id, max_tokens=MAX_TOKENS).admitted
            usage_writer.write(late)
            edge.settle(late)
            wait_until(lambda: status(name)["engine_missing"] == 2, 30,
                       what="two requests billed with the edge's numbers")
            engine.record(record(late.request_id, gen=LATE, finish="abort", source="abort",
                                 arrival=now_ts(), ts=now_ts(), key_id=KEY, endpoint="chat"))
            cut = make_event(key_id=KEY, ts=now_ts())
            assert edge.reserve(cut.request_id, max_tokens=MAX_TOKENS).admitted
            engine.record(record(cut.request_id, gen=ORPHAN, finish="abort", source="abort",
                                 arrival=now_ts(), ts=now_ts(), key_id=KEY, endpoint="chat"))
            wait_until(lambda: (status(name)["corrections"], status(name)["orphans"]) == (1, 1)
                       and not client.hlen(store.BUDGET_FIX_KEY), 30,
                       what="the late record's correction, the orphan's bill, the fixes")
            before = [bill_of(row) for row in query(client)]
            assert before[0][5] == sum(generated)  # the engine's numbers
            # the key's counter and its team's (the key is the team's one member) hold
            # the bill
            counters = [(KEY, edge.counter()), (KEY, edge.team_counter())]
            whole = (bill_nano, sum(12 + g for g in generated))
            assert budget_store.committed(client, counters, [MODEL]) == [whole, whole]
            refused = edge.reserve(f"{1:032x}", max_tokens=MAX_TOKENS)
            assert (refused.admitted, refused.limited_by) == (False, pb.BUDGET_SPEND)

            # Redis loses its data
            r.stop()
            r.start()
            answers = []
            while True:
                rebuilt = status(name)["rebuilds"] == 2 and not status(name)["rebuilding"]
                try:
                    answers.append(edge.reserve(f"{2:032x}", max_tokens=MAX_TOKENS).limited_by)
                except grpc.RpcError as e:  # Redis down or starting: the sidecar says so
                    assert e.code() == grpc.StatusCode.UNAVAILABLE
                if rebuilt:
                    break
                time.sleep(0.05)  # an edge's next request
            # never admitted on a bill that was not whole (limited_by NONE)
            assert pb.BUDGET_NONE not in answers
            assert pb.BUDGET_REBUILDING in answers
            assert answers[-1] == pb.BUDGET_SPEND
            after = [bill_of(row) for row in query(client)]
            assert after == before
            # the team's pooled budget was rebuilt too: the same spend, nothing reserved,
            # and a team budget the bill had reached still refuses
            assert budget_store.committed(client, counters, [MODEL]) == [whole, whole]
            team = next(c for c in edge.counters() if c.name == edge.team_counter())
            team.spend_limit_nano = bill_nano + worst // 2
            pooled = stub.ReserveBudget(pb.BudgetReserveRequest(
                key_id=KEY, request_id=f"{3:032x}", counters=[team], cost_nano=worst,
                tokens=12 + MAX_TOKENS), timeout=5)
            assert (pooled.admitted, pooled.limited_by) == (False, pb.BUDGET_SPEND)
            assert client.exists(store.ready_key(name))
            assert not client.exists(store.rebuild_key(KEY))
            log = led.log_path.read_text()
        finally:
            led.stop()
    assert "Redis lost its data (the ledger's ready mark is gone): rebuilding" in log

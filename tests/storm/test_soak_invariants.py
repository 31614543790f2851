"""The invariants ``make soak`` checks (``tokengate_dev.bench.soak_invariants``), each on
crafted data where it holds and where it breaks: one request answered whole through
replica R0 (its client record, usage event, bill, engine record and the replica's
counters), then what a fault or a defect changes.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
from tokengate.ledger.engine_record import EngineRecord
from tokengate.ledger.event import UsageEvent
from tokengate_dev.bench import soak_invariants as inv
from tokengate_dev.bench.soak_invariants import (
    ClientRequest,
    Fault,
    ReplicaLife,
    SoakData,
)
from tokengate_vllm.record import rfc3339

pytestmark = pytest.mark.unit

R0, R1 = "127.0.0.1:9001", "127.0.0.1:9002"
T = 1_800_000_000.0  # wall-clock s; the data below put the monotonic clock equal to it
A, B = "a" * 32, "b" * 32


def client(rid: str = A, t: float = T, status: int = 200, error: str = "none",
           prompt: int = 10, completion: int = 5, reused: bool = False,
           dur: float = 1.0) -> ClientRequest:
    return ClientRequest(t, t + dur, status, error, rid, reused, prompt, completion)


def event(rid: str = A, t: float = T, status: int = 200, prompt: int = 10,
          completion: int = 5, upstream: str | None = R0, error: str | None = None,
          usage: str = "final", dur: float = 1.0) -> UsageEvent:
    return UsageEvent(request_id=rid, ts=rfc3339(t), key_id="k", model="m", endpoint="chat",
                      status=status, stream=True, token_estimate=prompt,
                      count_source="counter", reserved=prompt + 16, prompt_tokens=prompt,
                      completion_tokens=completion, cached_tokens=0, system_tokens=0,
                      usage_source=usage, client_aborted=False, ttft_ms=10.0,
                      total_ms=dur * 1000, upstream=upstream, error=error)


def bill(rid: str = A, prompt: int = 10, completion: int = 5,
         settled: str = "engine") -> dict[str, str]:
    return {"rid": rid, "prompt": str(prompt), "completion": str(completion),
            "settled": settled}


def record(rid: str = A, t: float = T + 0.9, prompt: int = 10, generated: int = 5,
           finish: str = "length") -> EngineRecord:
    return EngineRecord(
        request_id=f"chatcmpl-{rid}", index=0, n=1, ts=rfc3339(t), arrival_ts=rfc3339(T),
        model="m", key_id="k", endpoint="chat", finish_reason=finish, source="abort" if finish == "abort" else "stats",
        num_prompt_tokens=prompt, num_generation_tokens=generated, num_cached_tokens=0,
        prefilled=generated > 0, max_tokens=16, num_preemptions=0, e2e_ms=900.0,
        queued_ms=0.0, prefill_ms=5.0, decode_ms=800.0)


def life(replica: str = R0, prompt: int = 10, generated: int = 5, since: float = 0.0,
         running: int = 0, killed: int = 0) -> ReplicaLife:
    return ReplicaLife(replica, since, prompt, generated, running, 0, killed)


def data(**kw: Any) -> SoakData:
    """The one request answered whole, everything settled; ``kw`` replaces fields."""
    base = SoakData(
        clients=[client()], events=[event()], bills=[bill()],
        records={R0: [record()], R1: []}, lives=[life(), life(R1, 0, 0)],
        spans={"traced": 2, "exported": 2}, spans_received=2,
        edge={"queue_requests": 0, "queue_tokens": 0,
              "outstanding_tokens": {R0: 0, R1: 0}, "out": {R0: False, R1: False}},
        ledger={"lag_bytes": 0, "engine_lag_bytes": 0, "waiting": 0, "pending": 0,
                "eng_wait": 0})
    return replace(base, **kw)


def fault(kind: str, start: float = T + 0.5, end: float = T + 1.5, target: str = "nginx",
          pids: tuple[int, ...] = ()) -> Fault:
    return Fault(kind, target, start, end, pids)


def test_every_invariant_holds_for_a_request_answered_whole() -> None:
    checks = inv.check_all(data())
    assert [(c.name, c.held) for c in checks] == [(f.__name__, True) for f in inv.CHECKS]


# -- events_once


def test_an_answered_request_without_an_event_breaks_events_once() -> None:
    c = inv.events_once(data(events=[]))
    assert (c.held, c.figures["no_event"]) == (False, 1)


def test_a_request_id_with_two_events_breaks_events_once() -> None:
    c = inv.events_once(data(events=[event(), event()]))
    assert (c.held, c.figures["duplicate_event_ids"]) == (False, 1)


def test_a_stream_cut_by_an_nginx_kill_needs_no_event() -> None:
    cut = client(error="disconnected", completion=2)
    c = inv.events_once(data(clients=[cut], events=[], faults=[fault("nginx_worker")]))
    assert (c.held, c.figures["no_event_nginx_killed"]) == (True, 1)


def test_an_answer_whose_nginx_was_killed_right_after_is_billed_from_its_engine() -> None:
    """Answered whole, then nginx killed before the log phase wrote the event: the
    engine records billed it; a kill later than LOG_PHASE_S, or no bill, explains
    nothing."""
    soon = fault("nginx_master", start=T + 1.0 + inv.LOG_PHASE_S / 2, end=T + 3)
    lost = data(events=[], faults=[soon])
    assert inv.events_once(lost).figures["no_event_nginx_killed"] == 1
    assert inv.events_once(lost).held and inv.tokens_whole(lost).held
    assert inv.tokens_whole(lost).figures["event_lost_to_an_nginx_kill"] == 1
    late = fault("nginx_master", start=T + 1.0 + inv.LOG_PHASE_S + 0.5, end=T + 4)
    assert not inv.events_once(data(events=[], faults=[late])).held
    assert not inv.tokens_whole(data(events=[], faults=[late])).held
    assert not inv.events_once(data(events=[], bills=[], faults=[soon])).held


def test_a_cut_stream_without_an_event_and_no_nginx_kill_breaks_events_once() -> None:
    cut = client(error="disconnected", completion=2)
    c = inv.events_once(data(clients=[cut], events=[],
                             faults=[fault("replica", target=R0)]))
    assert (c.held, c.figures["no_event"]) == (False, 1)


def test_an_event_no_client_got_an_answer_for_breaks_events_once_outside_faults() -> None:
    assert not inv.events_once(data(events=[event(), event(B)])).held
    c = inv.events_once(data(events=[event(), event(B)], faults=[fault("nginx_master")]))
    assert (c.held, c.figures["events_without_answer"]) == (True, 1)


# -- ledger_once


def test_an_event_billed_twice_breaks_ledger_once() -> None:
    c = inv.ledger_once(data(bills=[bill(), bill()]))
    assert (c.held, c.figures["billed_more_than_once"]) == (False, 1)


def test_an_event_never_billed_breaks_ledger_once() -> None:
    c = inv.ledger_once(data(bills=[]))
    assert (c.held, c.figures["not_billed"]) == (False, 1)


def test_a_bill_of_engine_records_without_an_event_keeps_ledger_once() -> None:
    c = inv.ledger_once(data(bills=[bill(), bill(B)],
                             records={R0: [record(), record(B)], R1: []}))
    assert (c.held, c.figures["bills_of_engine_records_without_event"]) == (True, 1)


def test_a_bill_of_nothing_known_breaks_ledger_once() -> None:
    c = inv.ledger_once(data(bills=[bill(), bill(B)]))
    assert (c.held, c.figures["bills_unexplained"]) == (False, 1)


# -- tokens_whole


def test_a_bill_with_other_tokens_than_the_client_got_breaks_tokens_whole() -> None:
    c = inv.tokens_whole(data(bills=[bill(completion=6)]))
    assert (c.held, c.figures["mismatched"], c.figures["client_completion"],
            c.figures["ledger_completion"]) == (False, 1, 5, 6)


def test_an_event_with_other_tokens_than_the_client_got_breaks_tokens_whole() -> None:
    assert not inv.tokens_whole(data(events=[event(prompt=11)])).held


def test_a_refused_request_is_no_whole_answer() -> None:
    refused = client(status=429, prompt=-1, completion=-1)
    c = inv.tokens_whole(data(clients=[refused], events=[event(status=429, prompt=0,
                                                                completion=0)],
                              bills=[bill(prompt=0, completion=0)]))
    assert (c.held, c.figures["whole_answers"]) == (True, 0)


# -- tokens_engine


def test_a_cut_stream_billed_what_its_engine_generated_holds() -> None:
    cut = {"events": [event(usage="running", completion=3)], "bills": [bill(completion=4)],
           "records": {R0: [record(generated=4, finish="abort")], R1: []}}
    c = inv.tokens_engine(data(**cut))
    assert (c.held, c.figures["with_an_abort_record"], c.figures["billed_exactly"]) == \
        (True, 1, 1)


def test_a_cut_stream_billed_the_edges_numbers_breaks_tokens_engine() -> None:
    cut = {"events": [event(usage="running", completion=3)],
           "bills": [bill(completion=3, settled="edge")],
           "records": {R0: [record(generated=4, finish="abort")], R1: []}}
    c = inv.tokens_engine(data(**cut))
    assert (c.held, c.figures["billed_otherwise"]) == (False, 1)


def test_engine_records_of_a_request_without_an_event_not_billed_break_tokens_engine(
        ) -> None:
    orphan = record(B, generated=7, finish="abort")
    c = inv.tokens_engine(data(records={R0: [record(), orphan], R1: []}))
    assert (c.held, c.figures["not_billed_once"],
            c.figures["not_billed_once_without_an_event"], c.figures["engine_completion"],
            c.figures["ledger_completion"]) == (False, 1, 1, 12, 5)


def test_engine_records_of_a_request_without_an_event_billed_as_an_orphan_hold() -> None:
    orphan = {"rid": B, "prompt": "10", "completion": "7", "settled": "engine",
              "orphan": "1"}
    d = data(records={R0: [record(), record(B, generated=7, finish="abort")], R1: []},
             bills=[bill(), orphan])
    c = inv.tokens_engine(d)
    assert (c.held, c.figures["billed_exactly"], c.figures["of_which_without_an_event"]) == \
        (True, 2, 1)
    assert inv.ledger_once(d).figures["bills_of_engine_records_without_event"] == 1


def test_a_bill_corrected_by_late_records_is_billed_once_what_they_say() -> None:
    late = {"kind": "correction", "rid": A, "prompt": "0", "completion": "2",
            "settled": "engine"}
    d = data(events=[event(usage="running", completion=3)],
             bills=[bill(completion=3, settled="edge"), late],
             records={R0: [record(generated=5, finish="abort")], R1: []})
    assert inv.tokens_engine(d).held
    c = inv.ledger_once(d)
    assert (c.held, c.figures["bills"], c.figures["corrections"]) == (True, 1, 1)


def test_audit_entries_of_key_commands_are_no_bills() -> None:
    created = {"kind": "key_created", "rid": "", "key": "k2"}
    assert inv.ledger_once(data(bills=[bill(), created])).figures["bills_unexplained"] == 0


# -- tokens_replicas


def test_counters_above_the_records_break_tokens_replicas() -> None:
    c = inv.tokens_replicas(data(lives=[life(generated=6), life(R1, 0, 0)]))
    assert (c.held, c.figures["mismatched"]) == (False, 1)


def test_records_of_a_killed_lifetime_do_not_count_for_the_next() -> None:
    # R0 was killed at T + 2: its record at T + 0.9 died with it; the new lifetime's
    # counters hold what came after
    after = record(B, t=T + 5, prompt=20, generated=8)
    c = inv.tokens_replicas(data(records={R0: [record(), after], R1: []},
                                 lives=[life(prompt=20, generated=8, since=T + 2, killed=1),
                                        life(R1, 0, 0)]))
    assert (c.held, c.figures["lifetimes_ended_by_a_kill_not_comparable"]) == (True, 1)


# -- reservations


def test_an_open_budget_reservation_breaks_reservations_and_says_what_could_settle_it(
        ) -> None:
    c = inv.reservations(data(open_reservations=["tg:bg:{k}:r:" + A, "tg:bg:{k}:r:" + B]))
    assert (c.held, c.figures["open_budget_reservations"], c.figures["open_with_event"],
            c.figures["open_with_neither"]) == (False, 2, 1, 1)


def test_spend_left_in_flight_breaks_reservations() -> None:
    assert not inv.reservations(data(budget_in_flight={"tg:bg:{k}:*:day:1:rs:5": 77})).held


# -- idle


@pytest.mark.parametrize("change", [
    {"edge": {"queue_requests": 1, "queue_tokens": 300, "outstanding_tokens": {R0: 0},
              "out": {R0: False}}},
    {"edge": {"queue_requests": 0, "queue_tokens": 0, "outstanding_tokens": {R0: 300},
              "out": {R0: False}}},
    {"edge": {"queue_requests": 0, "queue_tokens": 0, "outstanding_tokens": {R0: 0},
              "out": {R0: True}}},
    {"lives": [life(running=1)]},
    {"ledger": {"lag_bytes": 0, "engine_lag_bytes": 0, "waiting": 2, "pending": 2,
                "eng_wait": 0}},
], ids=["queued", "outstanding", "replica-out", "replica-running", "ledger-waiting"])
def test_anything_left_queued_or_in_flight_breaks_idle(change: dict[str, Any]) -> None:
    assert not inv.idle(data(**change)).held


# -- spans


def test_spans_neither_exported_nor_counted_lost_break_spans() -> None:
    c = inv.spans(data(spans={"traced": 10, "exported": 7, "lost:killed": 2}))
    assert (c.held, c.figures["lost"]["killed"]) == (False, 2)


def test_spans_counted_lost_keep_spans() -> None:
    assert inv.spans(data(spans={"traced": 10, "exported": 7, "lost:killed": 3})).held


# -- errors_explained


def test_a_502_of_a_request_on_a_killed_replica_is_explained() -> None:
    c = inv.errors_explained(data(clients=[client(status=502)],
                                  events=[event(status=502, error="upstream_failed")],
                                  faults=[fault("replica", target=R0)]))
    assert (c.held, c.figures["explained"]) == (True, {"its replica killed": 1})


def test_a_502_of_a_request_on_another_replica_than_the_killed_one_breaks(
        ) -> None:
    c = inv.errors_explained(data(clients=[client(status=502)],
                                  events=[event(status=502, upstream=R1)],
                                  faults=[fault("replica", target=R0)]))
    assert (c.held, c.figures["unexplained"]) == (False, 1)


def test_a_budget_503_during_a_redis_stall_is_explained_and_without_one_breaks() -> None:
    refused = {"clients": [client(status=503)],
               "events": [event(status=503, upstream=None, error="budget_unavailable")]}
    assert inv.errors_explained(data(**refused, faults=[fault("redis_stall")])).held
    assert not inv.errors_explained(data(**refused, faults=[fault("sighup")])).held


def test_a_reset_with_no_fault_breaks_errors_explained() -> None:
    reset = client("", status=0, error="disconnected", prompt=-1, completion=-1)
    c = inv.errors_explained(data(clients=[reset], events=[]))
    assert (c.held, c.figures["by_kind"]) == (False, {"disconnected": 1})


def test_a_refused_connection_while_nginx_restarts_is_explained() -> None:
    refused = client("", t=T + 1, status=0, error="connect", prompt=-1, completion=-1,
                     dur=0.0)
    assert inv.errors_explained(data(clients=[refused], events=[],
                                     faults=[fault("nginx_master")])).held


# -- reload_resets


def test_a_reset_of_an_unread_request_on_an_open_connection_during_a_reload_holds() -> None:
    reset = client("", t=T + 1, status=0, error="disconnected", reused=True, dur=0.01)
    c = inv.reload_resets(data(clients=[client(), reset], faults=[fault("config_apply")]))
    assert (c.held, c.figures["resets"]) == (True, 1)
    assert inv.errors_explained(data(clients=[client(), reset],
                                     faults=[fault("config_apply")])).held


def test_a_reset_of_a_new_connection_during_a_reload_breaks_reload_resets() -> None:
    reset = client("", t=T + 1, status=0, error="disconnected", reused=False, dur=0.01)
    c = inv.reload_resets(data(clients=[client(), reset], faults=[fault("sighup")]))
    assert (c.held, c.figures["resets_of_unread_requests_on_open_connections"]) == (False, 0)


def test_a_request_read_and_billed_but_reset_during_a_reload_breaks_reload_resets() -> None:
    reset = client("", t=T + 1, status=0, error="disconnected", reused=True, dur=0.01)
    c = inv.reload_resets(data(clients=[client(), reset], events=[event(), event(B)],
                               faults=[fault("keys")]))
    assert (c.held, c.figures["events_of_reset_requests"]) == (False, 1)


# -- error_log


def test_nginxs_alert_for_a_killed_worker_is_allowed_and_others_break() -> None:
    killed = "2026/12/05 10:00:00 [alert] 100#100: worker process 4242 exited on signal 9"
    crit = "2026/12/05 10:00:01 [crit] 4243#4243: *9 connect() to unix:/x.sock failed"
    ok = inv.error_log(data(error_log=[killed, "... [notice] 1#1: reconfiguring"],
                            faults=[fault("nginx_worker", pids=(4242,))]))
    assert (ok.held, ok.figures["of_killed_workers"]) == (True, 1)
    assert not inv.error_log(data(error_log=[killed])).held  # no worker was killed
    assert not inv.error_log(data(error_log=[crit],
                                  faults=[fault("nginx_worker", pids=(4242,))])).held

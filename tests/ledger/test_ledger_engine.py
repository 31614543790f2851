"""The ledger joins the edge's usage events with the vLLM plugin's engine records (real
Redis, records written the way the plugin writes them): the engine's numbers are the
bill, in any order, across restarts (kill -9 of two real ledgers sharing one Redis),
exactly once; a missing record keeps the edge's numbers after the wait; records of no
edge request are counted, not billed; ``tokengate usage`` shows what the engine settled.
(Over 600 lines: one contract, the join of events with engine records, checked from
both sides with one set of record and ledger helpers.)
"""

from __future__ import annotations

import json
import logging
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import yaml
from tokengate import config as tg_config
from tokengate import redis_client
from tokengate import redis_keys as store
from tokengate.ledger.calculator import charge
from tokengate.ledger.event import UsageEvent
from tokengate.ledger.ledger import Ledger, engine_ledger_id
from tokengate.ledger.report import UsageRow, query
from tokengate_dev import devstack

from tests.fixtures_ledger import UsageWriter, make_event, svc_name, wait_until

DAY = "2026-11-29"


def record(rid: str, *, prompt: int = 12, gen: int = 30, cached: int = 0, index: int = 0,
           n: int = 1, prompt_index: int | None = None, prefilled: bool = True,
           finish: str = "length", source: str = "stats", max_tokens: int | None = 256,
           arrival: str = f"{DAY}T16:40:00.130Z",
           ts: str = f"{DAY}T16:40:00.540Z", key_id: str | None = None,
           endpoint: str | None = None) -> dict[str, Any]:
    """An engine record as the plugin writes it (tokengate_vllm.record): chat
    ``chatcmpl-<rid>``, or completions ``cmpl-<rid>-<prompt_index>``; ``key_id`` and
    ``endpoint``: what the edge sent with the request (null: sent to vLLM directly)."""
    request_id = f"chatcmpl-{rid}" if prompt_index is None else f"cmpl-{rid}-{prompt_index}"
    return {"request_id": request_id, "index": index, "n": n, "ts": ts, "arrival_ts": arrival,
            "model": "tiny-qwen3", "key_id": key_id, "endpoint": endpoint,
            "finish_reason": finish, "source": source,
            "num_prompt_tokens": prompt, "num_generation_tokens": gen,
            "num_cached_tokens": cached, "prefilled": prefilled, "max_tokens": max_tokens,
            "num_preemptions": 0, "e2e_ms": 410.0, "queued_ms": 0.05 if prefilled else None,
            "prefill_ms": 12.0 if prefilled else None,
            "decode_ms": 390.0 if gen else None}


class EngineWriter(UsageWriter):
    """Writes engine records like the plugin: whole lines, O_APPEND."""

    def record(self, rec: dict[str, Any]) -> None:
        self.write_raw(json.dumps(rec, separators=(",", ":")).encode() + b"\n")


@pytest.fixture
def engine_writer(tmp_path: Path) -> Iterator[EngineWriter]:
    w = EngineWriter(tmp_path / "engine" / "engine.jsonl")
    yield w
    w.close()


@pytest.fixture
def joined(cfg: tg_config.Config, ledger_redis: redis.Redis, redis_url: str,
           usage_writer: UsageWriter,
           engine_writer: EngineWriter) -> Iterator[Callable[..., Ledger]]:
    """``make(ledger_id="test", **Ledger kwargs)``: an in-process ledger over the test's
    usage file and engine file (engine wait 30 s unless given)."""
    made: list[Ledger] = []

    def make(ledger_id: str = "test", **kw: Any) -> Ledger:
        kw.setdefault("engine_files", [engine_writer.path])
        kw.setdefault("engine_wait_s", 30.0)
        led = Ledger(cfg, redis_client.connect(cfg.redis, url=redis_url), usage_writer.path,
                     ledger_id, **kw)
        made.append(led)
        return led

    yield make
    for led in made:
        led.close()


def the_row(client: redis.Redis) -> UsageRow:
    (row,) = query(client)
    return row


def stats(client: redis.Redis, ledger_id: str) -> dict[str, int]:
    return {k: int(v) for k, v in client.hgetall(store.stats_key(ledger_id)).items()}


def audit(client: redis.Redis) -> dict[str, dict[str, str]]:
    """The bills' entries of the audit stream by request id (corrections apart)."""
    return {f["rid"]: f for _id, f in client.xrange(store.AUDIT_KEY) if "kind" not in f}


def test_the_engine_numbers_bill_clients_that_left_in_either_order(
        cfg, ledger_redis, usage_writer, engine_writer, joined):
    """A stream whose client left after 3 tokens (the engine generated 17), a
    non-streaming request whose client left (billed its reservation by the edge: the
    engine generated 40), and a whole response: records before the event, after it, or
    in the same read."""
    left_stream = make_event(stream=True, usage_source="running", client_aborted=True,
                             completion_tokens=3, status=200)
    left_plain = make_event(usage_source="estimate", client_aborted=True, completion_tokens=244,
                            reserved=256)
    whole = make_event(prompt_tokens=12, completion_tokens=30)
    led = joined()
    engine_writer.record(record(left_stream.request_id, gen=17, finish="abort", source="abort"))
    led.drain()
    usage_writer.write(left_stream)
    usage_writer.write(left_plain)
    assert led.drain().applied == 1          # the stream's record was there already
    assert ledger_redis.hlen(store.PENDING_KEY) == 1
    engine_writer.record(record(left_plain.request_id, gen=40, finish="abort", source="abort"))
    usage_writer.write(whole)
    engine_writer.record(record(whole.request_id, gen=30))
    totals = led.drain()
    # the usage file is read before the engine file: both later events waited a moment
    assert (totals.applied, totals.settled_engine, totals.parked, totals.engine_records,
            totals.disagreements, totals.engine_missing) == (3, 3, 2, 3, 0, 0)
    row = the_row(ledger_redis)
    assert (row.requests, row.settled_engine, row.prompt_tokens, row.completion_tokens,
            row.aborted, row.estimated, row.disagreements) == (3, 3, 36, 87, 2, 0, 0)
    w = cfg.models["tiny-qwen3"].cost
    assert row.cost == pytest.approx(sum(charge(12, c, weights=w).cost for c in (17, 40, 30)),
                                     rel=1e-12)
    a = audit(ledger_redis)[left_plain.request_id]
    assert (a["settled"], a["completion"], a["edge_completion"], a["records"], a["complete"]) \
        == ("engine", "40", "244", "1", "1")
    # nothing is left waiting or kept
    assert ledger_redis.hlen(store.PENDING_KEY) == 0 == ledger_redis.zcard(store.ENG_WAIT_KEY)
    assert not ledger_redis.exists(store.eng_key(whole.request_id))


def test_a_replica_added_by_configuration_is_billed_with_its_engines_numbers(
        cfg, ledger_redis, redis_url, usage_writer, engine_writer, tmp_path):
    """The configuration lists a second replica's engine file while the ledger runs
    (`config apply` or an edit, then the ledger's reload): its requests wait for that
    file's records and are billed with them, not with the edge's numbers."""
    first = cfg.model_copy(update={"ledger": cfg.ledger.model_copy(
        update={"engine_usage_files": [engine_writer.path], "engine_wait_s": 30.0})})
    led = Ledger(first, redis_client.connect(cfg.redis, url=redis_url), usage_writer.path,
                 "test")
    try:
        second = EngineWriter(tmp_path / "engine" / "replica-2.jsonl")
        led.reconfigure(first.model_copy(update={"ledger": first.ledger.model_copy(
            update={"engine_usage_files": [engine_writer.path, second.path]})}))
        left = make_event(usage_source="estimate", client_aborted=True,
                          completion_tokens=244, reserved=256)
        usage_writer.write(left)
        second.record(record(left.request_id, gen=40, finish="abort", source="abort"))
        totals = led.drain()
        assert (totals.applied, totals.settled_engine, totals.engine_records) == (1, 1, 1)
        row = the_row(ledger_redis)
        assert (row.requests, row.settled_engine, row.completion_tokens) == (1, 1, 40)
        assert [src.path for src in led.engines] == [engine_writer.path, second.path]
        second.close()
    finally:
        led.close()


def test_a_disagreement_is_counted_logged_and_billed_with_the_engines_numbers(
        ledger_redis, usage_writer, engine_writer, joined, caplog):
    ev = make_event(prompt_tokens=12, completion_tokens=30)
    usage_writer.write(ev)
    engine_writer.record(record(ev.request_id, prompt=12, gen=31))
    led = joined()
    with caplog.at_level(logging.WARNING, logger="tokengate.ledger"):
        totals = led.drain()
    assert (totals.settled_engine, totals.disagreements) == (1, 1)
    row = the_row(ledger_redis)
    assert (row.completion_tokens, row.disagreements, row.settled_engine) == (31, 1, 1)
    assert stats(ledger_redis, "test")["disagreements"] == 1
    assert f"request {ev.request_id} (demo, tiny-qwen3): the edge and the engine disagree: " \
           "completion 30 (edge) != 31 (engine); billed the engine's" in caplog.text


def test_n_2_sums_the_childrens_tokens_and_bills_the_prompt_once(ledger_redis, usage_writer,
                                                                 engine_writer, joined):
    """Two children of one chat request: 6 + 6 generated, the prompt (12) counted per
    child by the engine, once by usage.prompt_tokens; the second child's prompt came
    from the prefix cache (billed: the first child's, none cached)."""
    ev = make_event(prompt_tokens=12, completion_tokens=12)
    usage_writer.write(ev)
    engine_writer.record(record(ev.request_id, n=2, index=1, gen=6, cached=8))
    led = joined()
    assert led.drain().applied == 0          # one child of two: it waits
    assert ledger_redis.hlen(store.eng_key(ev.request_id)) == 1
    engine_writer.record(record(ev.request_id, n=2, index=0, gen=6))
    assert led.drain().applied == 1
    row = the_row(ledger_redis)
    assert (row.prompt_tokens, row.completion_tokens, row.cached_tokens, row.disagreements) \
        == (12, 12, 0, 0)
    assert audit(ledger_redis)[ev.request_id]["records"] == "2"


def test_completions_with_several_prompts_wait_for_every_prompt(ledger_redis, usage_writer,
                                                                engine_writer, joined):
    """``cmpl-<id>-<i>``: the records say which prompts exist, not how many; the
    counter's count of the whole request (token_estimate, 5 + 9) says when all are
    there. Without a counter's count, the final usage's prompt_tokens does."""
    two = make_event(endpoint="completions", token_estimate=14, prompt_tokens=14,
                     completion_tokens=16)
    three = make_event(endpoint="completions", count_source="estimate", token_estimate=20,
                       prompt_tokens=21, completion_tokens=24)
    usage_writer.write(two)
    usage_writer.write(three)
    engine_writer.record(record(two.request_id, prompt_index=0, prompt=5, gen=8))
    for i, p in enumerate((6, 7)):
        engine_writer.record(record(three.request_id, prompt_index=i, prompt=p, gen=8))
    led = joined()
    assert led.drain().applied == 0   # prompt 0 of 2 (5 of 14), prompts 0, 1 of 3 (13 of 21)
    engine_writer.record(record(two.request_id, prompt_index=1, prompt=9, gen=8))
    engine_writer.record(record(three.request_id, prompt_index=2, prompt=8, gen=8))
    totals = led.drain()
    assert (totals.applied, totals.settled_engine, totals.disagreements) == (2, 2, 0)
    row = the_row(ledger_redis)
    assert (row.prompt_tokens, row.completion_tokens) == (14 + 21, 16 + 24)


def test_a_missing_record_bills_the_edges_numbers_after_the_wait(ledger_redis, usage_writer,
                                                                 engine_writer, joined, caplog):
    ev = make_event(stream=True, usage_source="running", client_aborted=True,
                    completion_tokens=9)
    led = joined(engine_wait_s=0.4)
    usage_writer.write(ev)
    assert led.drain().applied == 0
    assert (led.waiting, ledger_redis.zcard(store.wait_key("test"))) == (1, 1)
    time.sleep(0.5)
    with caplog.at_level(logging.INFO, logger="tokengate.ledger"):
        totals = led.drain()
    assert (totals.applied, totals.settled_engine, totals.engine_missing) == (1, 0, 1)
    row = the_row(ledger_redis)
    assert (row.completion_tokens, row.engine_missing, row.settled_engine) == (9, 1, 0)
    assert audit(ledger_redis)[ev.request_id]["settled"] == "edge"
    assert f"request {ev.request_id}: no engine record within 0.4 s; billed the edge's " \
           "numbers (running: prompt 12, completion 9)" in caplog.text
    # The record comes after all: it corrects the bill to the engine's numbers, once.
    engine_writer.record(record(ev.request_id, gen=25, finish="abort", source="abort"))
    totals = led.drain()
    assert (totals.engine_records, totals.engine_late, totals.corrections) == (1, 0, 1)
    row = the_row(ledger_redis)
    assert (row.requests, row.completion_tokens, row.engine_missing, row.settled_engine,
            row.corrections) == (1, 25, 0, 1, 1)
    assert stats(ledger_redis, "test")["corrections"] == 1
    assert not ledger_redis.exists(store.open_key(ev.request_id))  # closed: complete


def test_the_wait_is_not_over_while_the_engine_file_is_behind(ledger_redis, usage_writer,
                                                               engine_writer, joined):
    """The sweep bills a waiting event only once the engine file was read past the end
    of its wait: a ledger that was stopped longer than the wait finds the record that
    was written in time (kill -9 then restart, without waiting)."""
    ev = make_event(usage_source="estimate", client_aborted=True, completion_tokens=244)
    first = joined(engine_wait_s=0.3)
    usage_writer.write(ev)
    first.drain()
    first.close()
    engine_writer.record(record(ev.request_id, gen=40, finish="abort", source="abort"))
    time.sleep(0.5)      # the wait is over while nobody reads the engine file
    again = joined(engine_wait_s=0.3)
    again.drain()
    row = the_row(ledger_redis)
    assert (row.completion_tokens, row.settled_engine, row.engine_missing) == (40, 1, 0)


def test_a_request_that_left_while_queued_costs_nothing(ledger_redis, usage_writer,
                                                        engine_writer, joined):
    """The engine never prefilled it (vllm:prompt_tokens did not count it either)."""
    ev = make_event(usage_source="estimate", client_aborted=True, completion_tokens=244,
                    system_tokens=5)
    usage_writer.write(ev)
    engine_writer.record(record(ev.request_id, prefilled=False, gen=0, finish="abort",
                                source="abort"))
    joined().drain()
    row = the_row(ledger_redis)
    assert (row.requests, row.prompt_tokens, row.completion_tokens, row.system_tokens,
            row.cost, row.settled_engine) == (1, 0, 0, 0, 0.0, 1)


def test_events_without_engine_usage_are_billed_at_once(ledger_redis, usage_writer,
                                                        engine_writer, joined):
    """A request refused by the edge or rejected by vLLM (usage "none") never reaches
    the engine: no wait."""
    ev = make_event(status=429, usage_source="none", prompt_tokens=0, completion_tokens=0,
                    error="rate_limit_exceeded")
    usage_writer.write(ev)
    led = joined()
    totals = led.drain()
    assert (totals.applied, totals.parked, totals.settled_engine) == (1, 0, 0)
    assert audit(ledger_redis)[ev.request_id]["settled"] == "edge"
    # A vLLM that failed after it started generating (500, no usage): records that came
    # first bill nothing either, whichever order (counted late, dropped).
    failed = make_event(status=500, usage_source="none", prompt_tokens=0, completion_tokens=0,
                        error="upstream_error")
    engine_writer.record(record(failed.request_id, gen=7, finish="error"))
    led.drain()
    usage_writer.write(failed)
    totals = led.drain()
    assert (totals.applied, totals.engine_late, totals.settled_engine) == (2, 1, 0)
    assert not ledger_redis.exists(store.eng_key(failed.request_id))
    assert ledger_redis.zcard(store.ENG_WAIT_KEY) == 0
    assert the_row(ledger_redis).completion_tokens == 0


def test_the_doctors_probe_records_are_counted_apart_without_a_warning(
        ledger_redis, engine_writer, joined, caplog):
    """tokengate doctor sends its probe to the replica directly (X-Request-Id
    tokengate-doctor-<hex>): an expected record of no edge request, not billed, counted
    as engine_probes, not as unmatched, and logged by no warning."""
    probe = f"chatcmpl-tokengate-doctor-{random.getrandbits(128):032x}"
    engine_writer.record({**record("x"), "request_id": probe})
    led = joined()
    with caplog.at_level(logging.WARNING, logger="tokengate.ledger"):
        totals = led.drain()
    assert (totals.engine_records, totals.engine_probes, totals.engine_unmatched,
            totals.applied) == (1, 1, 0, 0)
    assert query(ledger_redis) == []
    s = stats(ledger_redis, engine_ledger_id("test", engine_writer.path))
    assert (s["engine_probes"], s.get("engine_unmatched", 0)) == (1, 0)
    assert probe not in caplog.text
    # read again (a replay) it is a duplicate, not a second probe
    engine_writer.record({**record("x"), "request_id": probe})
    assert (led.drain().engine_probes, led.totals.engine_duplicates) == (1, 1)


def test_records_of_no_edge_request_are_counted_not_billed(ledger_redis, engine_writer,
                                                          joined, caplog):
    """A request sent to vLLM directly: an id of vLLM's own (no edge id inside) is
    unmatched at once; an edge-like id whose event never comes after engine_orphan_s."""
    engine_writer.record({**record("x"), "request_id": "chatcmpl-5f1c0e7c-9a2b-4b1e"})
    lonely = f"{random.getrandbits(128):032x}"
    engine_writer.record(record(lonely, n=2, index=0))
    engine_writer.record(record(lonely, n=2, index=1))
    # long enough that a loaded machine's first drain still comes within it
    led = joined(engine_orphan_s=3.0)
    with caplog.at_level(logging.WARNING, logger="tokengate.ledger"):
        totals = led.drain()
        assert (totals.engine_records, totals.engine_unmatched) == (3, 1)
        wait_until(lambda: led.drain().engine_unmatched == 3, 20,
                   what="the edge-like records unmatched after engine_orphan_s")
        totals = led.totals
    assert (totals.engine_records, totals.engine_unmatched, totals.applied) == (3, 3, 0)
    assert query(ledger_redis) == []
    assert not ledger_redis.exists(store.eng_key(lonely))
    assert ledger_redis.zcard(store.ENG_WAIT_KEY) == 0
    eid = engine_ledger_id("test", engine_writer.path)
    assert stats(ledger_redis, eid)["engine_unmatched"] == 3
    assert "1 engine record(s) of requests that did not come through the edge " \
           "(chatcmpl-5f1c0e7c-9a2b-4b1e); not billed" in caplog.text
    assert f"request {lonely}: no edge event within 3 s of its 2 engine record(s) " \
           f"(chatcmpl-{lonely}#0, chatcmpl-{lonely}#1); not billed" in caplog.text


def test_replays_bill_nothing_twice(ledger_redis, usage_writer, engine_writer, joined):
    """Duplicated lines in both files, then another ledger id over the same files (a
    lost checkpoint): every event and record is a duplicate."""
    events = [make_event(completion_tokens=10 + i) for i in range(4)]
    for ev in events:
        usage_writer.write(ev)
        engine_writer.record(record(ev.request_id, gen=ev.completion_tokens + 1))
    usage_writer.write(events[0])
    engine_writer.record(record(events[1].request_id, gen=12))
    totals = joined().drain()
    assert (totals.applied, totals.duplicates, totals.engine_records,
            totals.engine_duplicates, totals.disagreements) == (4, 1, 4, 1, 4)
    before = the_row(ledger_redis)
    again = joined("other").drain()
    assert (again.applied, again.duplicates, again.engine_records,
            again.engine_duplicates) == (0, 5, 0, 5)
    assert the_row(ledger_redis) == before
    assert before.completion_tokens == sum(ev.completion_tokens + 1 for ev in events)


# -- real processes: two ledgers, kill -9 -------------------------------------------------


def joined_config(base: Path, out: Path, **ledger: Any) -> Path:
    raw = yaml.safe_load(base.read_text())
    raw.setdefault("ledger", {}).update(ledger)
    out.write_text(yaml.safe_dump(raw, sort_keys=False))
    return out


def start_ledger(config_path: Path, redis_url: str, name: str, *, usage_file: Path | None,
                 engine_files: list[Path]) -> devstack.Service:
    svc = devstack.ledger_service(config_path, usage_file, redis_url, ledger_id=name,
                                  name=name)
    for f in engine_files:
        svc.argv += ["--engine-file", str(f)]
    if usage_file is None:
        svc.argv.append("--engine-only")
    return svc.start()


def status(name: str) -> dict[str, Any]:
    return dict(json.loads((devstack.VAR / "run" / f"{name}.status.json").read_text()))


class Workload:
    """Events and their records, spread over two engine files (two vLLM hosts; an
    n = 2 request's children on both), each request's records written from 0.3 s
    before to 0.3 s after its event, at ``per_s`` events a second. Every fifth client
    leaves (the edge saw fewer tokens than the engine generated), every 97th response
    disagrees, ``missing`` requests get no record at all."""

    def __init__(self, n: int, missing: int, seed: int) -> None:
        rng = random.Random(seed)
        self.events: list[UsageEvent] = []
        self.records: dict[str, list[tuple[int, dict[str, Any]]]] = {}
        self.bill: dict[str, tuple[int, int]] = {}   # request id -> (prompt, completion)
        self.disagree = 0
        for i in range(n):
            prompt = rng.randint(1, 3000)
            children = 2 if i % 7 == 0 else 1
            gens = [rng.randint(0, 500) for _ in range(children)]
            left = i % 5 == 0
            edge_completion = sum(gens)
            if left:
                edge_completion = max(0, sum(gens) - rng.randint(1, 30))
            elif i % 97 == 3 and i >= missing:
                edge_completion += 1
                self.disagree += 1
            ev = make_event(rng, prompt_tokens=prompt, token_estimate=prompt,
                            completion_tokens=edge_completion, client_aborted=left,
                            usage_source="running" if left else "final", stream=left,
                            ts=f"{DAY}T{i // 3600 % 24:02d}:{i // 60 % 60:02d}:{i % 60:02d}.000Z")
            self.events.append(ev)
            if i < missing:
                self.bill[ev.request_id] = (prompt, edge_completion)
                continue
            recs = []
            for c in range(children):
                r = record(ev.request_id, prompt=prompt, gen=gens[c], n=children, index=c,
                           finish="abort" if left else "length",
                           source="abort" if left else "stats",
                           arrival=ev.ts, ts=ev.ts)
                recs.append((rng.choice((0, 1)) if children == 1 else c, r))
            self.records[ev.request_id] = recs
            self.bill[ev.request_id] = (prompt, sum(gens))

    def write(self, usage: UsageWriter, engines: list[EngineWriter], per_s: float,
              rng: random.Random, hold: threading.Lock | None = None) -> None:
        """Everything, in a shuffled order close to the events' (blocking). ``hold``:
        taken before each line; while another thread holds it the writing pauses, and
        the time it waited moves the rest of the timeline back (the files stop growing,
        then go on at the same pace)."""
        timeline: list[tuple[float, Callable[[], None]]] = []
        for i, ev in enumerate(self.events):
            t = i / per_s
            timeline.append((t, lambda ev=ev: usage.write(ev)))
            for which, r in self.records.get(ev.request_id, []):
                timeline.append((max(0.0, t + rng.uniform(-0.3, 0.3)),
                                 lambda which=which, r=r: engines[which].record(r)))
        timeline.sort(key=lambda x: x[0])
        t0 = time.monotonic()
        for at, do in timeline:
            delay = t0 + at - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            if hold is None:
                do()
                continue
            asked = time.monotonic()
            with hold:
                t0 += time.monotonic() - asked
                do()


@pytest.mark.slow
def test_two_ledgers_killed_at_random_bill_every_request_once(
        cfg, ledger_config_path, ledger_redis, redis_url, usage_writer, tmp_path):
    """The edge host's ledger (usage file + engine file A) and a vLLM host's ledger
    (--engine-only, engine file B) share one Redis; both are killed with SIGKILL at
    random moments, 8 times, while the files grow. Afterwards every request is billed
    once: the engine's numbers (Σ generated, the prompt once) where records exist, the
    edge's for the 5 without, and every disagreement is counted once.

    Each kill waits until the edge host's ledger has billed something, and the files
    stop growing while a killed ledger starts again (on a loaded machine a start took
    long enough for the writing to end before half the kills: 3 of 8 mid-stream)."""
    work = Workload(2500, missing=5, seed=61)
    engines = [EngineWriter(tmp_path / f"engine-{h}" / "engine.jsonl") for h in "ab"]
    config = joined_config(ledger_config_path, tmp_path / "tokengate.yaml", engine_wait_s=8.0)
    edge_name, vllm_name = svc_name("test-ledger-edge-host"), svc_name("test-ledger-vllm-host")
    rng = random.Random(62)
    hold = threading.Lock()
    writer = threading.Thread(target=work.write,
                              args=(usage_writer, engines, 300.0, random.Random(63), hold),
                              daemon=True)

    def start(which: str) -> devstack.Service:
        if which == "edge":
            return start_ledger(config, redis_url, edge_name, usage_file=usage_writer.path,
                                engine_files=[engines[0].path])
        return start_ledger(config, redis_url, vllm_name, usage_file=None,
                            engine_files=[engines[1].path])

    def billed() -> int:
        return int(ledger_redis.hget(store.stats_key(edge_name), "applied") or 0)

    svcs = {"edge": start("edge"), "vllm": start("vllm")}
    writer.start()
    mid_stream_kills = 0
    try:
        for _ in range(8):
            time.sleep(rng.uniform(0.1, 0.6))
            wait_until(lambda: billed() > 0, 60, what="the edge host's ledger billing")
            which = rng.choice(("edge", "vllm"))
            proc = svcs[which].proc
            assert proc is not None
            with hold:
                mid_stream_kills += 0 < billed() < len(work.events)
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait(5)
                svcs[which] = start(which)
        writer.join()
        wait_until(lambda: billed() == len(work.events), 60, what="every request billed")
        time.sleep(0.5)
    finally:
        for s in svcs.values():
            s.stop()
        for e in engines:
            e.close()
    assert mid_stream_kills >= 4
    edge = stats(ledger_redis, edge_name)
    engine_records = sum(len(r) for r in work.records.values())
    got = {k: sum(stats(ledger_redis, engine_ledger_id(n, e.path)).get(k, 0)
                  for n, e in ((edge_name, engines[0]), (vllm_name, engines[1])))
           for k in ("engine_records", "engine_duplicates", "engine_late", "engine_unmatched")}
    assert got == {"engine_records": engine_records, "engine_duplicates": 0,
                   "engine_late": 0, "engine_unmatched": 0}
    assert (edge["applied"], edge.get("duplicates", 0), edge.get("settled_engine"),
            edge.get("engine_missing"), edge.get("disagreements")) == \
        (len(work.events), 0, len(work.events) - 5, 5, work.disagree)
    row = the_row(ledger_redis)
    assert row.prompt_tokens == sum(p for p, _c in work.bill.values())
    assert row.completion_tokens == sum(c for _p, c in work.bill.values())
    assert (row.requests, row.settled_engine, row.engine_missing, row.disagreements) == \
        (len(work.events), len(work.events) - 5, 5, work.disagree)
    seen = sum(ledger_redis.scard(k) for k in ledger_redis.scan_iter(store.seen_key("*")))
    assert seen == len(work.events) == ledger_redis.xlen(store.AUDIT_KEY)
    assert ledger_redis.hlen(store.PENDING_KEY) == 0 == ledger_redis.zcard(store.ENG_WAIT_KEY)
    assert not list(ledger_redis.scan_iter(store.eng_key("*")))


def test_the_status_file_and_the_report_show_the_engines_part(
        ledger_config_path, config_path, ledger_redis, redis_url, usage_writer, engine_writer,
        tmp_path):
    """A real ledger's status file counts what the engine settled, the disagreement and
    the waiting event; ``tokengate usage`` shows the engine column and the JSON fields."""
    config = joined_config(ledger_config_path, tmp_path / "tokengate.yaml", engine_wait_s=60.0)
    agree, differ, waits = (make_event(completion_tokens=30) for _ in range(3))
    for ev in (agree, differ, waits):
        usage_writer.write(ev)
    engine_writer.record(record(agree.request_id, gen=30))
    engine_writer.record(record(differ.request_id, gen=29))
    name = svc_name("test-ledger-engine-status")
    svc = start_ledger(config, redis_url, name, usage_file=usage_writer.path,
                       engine_files=[engine_writer.path])
    try:
        wait_until(lambda: (status(name)["applied"], status(name)["waiting"]) == (2, 1),
                   what="two billed, one waiting")
        s = status(name)
        # all three waited: the usage file is read first
        assert (s["settled_engine"], s["disagreements"], s["engine_records"], s["parked"],
                s["engine_lag_bytes"]) == (2, 1, 2, 3, 0)
    finally:
        svc.stop()
    r = subprocess.run([sys.executable, "-m", "tokengate.cli", "usage", "--config",
                        str(config_path), "--redis-url", redis_url, "--json"],
                       capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode == 0, r.stderr
    total = json.loads(r.stdout)["total"]
    assert (total["requests"], total["settled_engine"], total["disagreements"],
            total["completion_tokens"]) == (2, 2, 1, 59)
    r = subprocess.run([sys.executable, "-m", "tokengate.cli", "usage", "--config",
                        str(config_path), "--redis-url", redis_url],
                       capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode == 0, r.stderr
    header = next(ln for ln in r.stdout.splitlines() if "requests" in ln)
    assert header.split("┃")[4:8] == [" requests ", " errors ", " engine ", " prompt "]
    total_line = [ln for ln in r.stdout.splitlines() if "total" in ln][-1]
    assert [c.strip() for c in total_line.split("│")][4:10] == ["2", "0", "2", "24", "0", "59"]


def test_engine_only_needs_engine_files(config_path):
    r = subprocess.run([sys.executable, "-m", "tokengate.ledger.service", "--config",
                        str(config_path), "--engine-only", "--once"],
                       capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode == 2 and "engine_only without engine files" in r.stderr


@pytest.mark.unit
def test_make_runs_ledger_reads_the_embedded_vllms_engine_records(
        config_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``make run``'s ledger gets the file the embedded vLLM's plugin writes, unless the
    configuration names engine files itself (then those, from the configuration)."""
    monkeypatch.setattr(devstack, "nginx_service",
                        lambda *a, **k: devstack.Service("nginx", ["true"], lambda: False))
    raw = yaml.safe_load(config_path.read_text())

    def ledger_argv(**ledger: Any) -> list[str]:
        raw["ledger"] = {**raw.get("ledger", {}), **ledger}
        path = tmp_path / "tokengate.yaml"
        path.write_text(yaml.safe_dump(raw))
        (svc,) = [s for s in devstack.stack(path) if s.name == "ledger"]
        (vllm,) = [s for s in devstack.stack(path) if s.name == "vllm"]
        assert vllm.env["TOKENGATE_ENGINE_USAGE_FILE"] == str(devstack.VAR / "usage/engine.jsonl")
        return svc.argv

    argv = ledger_argv()
    assert argv[argv.index("--engine-file") + 1] == str(devstack.VAR / "usage" / "engine.jsonl")
    assert "--engine-file" not in ledger_argv(engine_usage_files=["elsewhere/engine.jsonl"])

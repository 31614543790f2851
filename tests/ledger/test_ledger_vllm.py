"""The ledger reconciles with vLLM's own counters: the real vLLM CPU server with the plugin
behind the real edge, a real ledger reading the edge's usage file and the plugin's engine
records, and a mixed workload whose clients leave early. Then, for a budgeted key (the
real limits sidecar behind the edge): a stream cut by killed nginx workers, billed from
its record alone, and a replica whose records the ledger follows only after its requests
were billed, which correct those bills.

What must hold exactly (vLLM 0.32's counting, ``tokengate_vllm.record``):

    Σ completion_tokens in the ledger = growth of vllm:generation_tokens_total
    Σ prompt_tokens in the ledger     = growth of vllm:prompt_tokens_total
                                        - Σ over n > 1 engine requests of
                                          (children prefilled - 1) x its prompt

(vLLM counts a prompt once per child that the engine computed; the ledger bills it once
per engine request.) One request's record never reaches the ledger (the engine file the
ledger reads is the plugin's file less that record, a lost write): after
``ledger.engine_wait_s`` it is billed its own final usage, which equals what the engine
counted for it, so both sums still hold. The ledger is killed with SIGKILL in the middle.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
import redis
import yaml
from tokengate import budget_store
from tokengate import config as tg_config
from tokengate import redis_keys as store
from tokengate.ledger.calculator import Calculator
from tokengate.ledger.engine_record import EngineRecord, parse_record
from tokengate.ledger.ledger import engine_ledger_id
from tokengate.ledger.report import query
from tokengate_dev import devstack

from tests.conftest import MODEL, TEST_DIR, key_digest
from tests.fixtures_edge import MAIN_KEY, Edge, free_port, patient_redis_config
from tests.fixtures_ledger import svc_name, wait_until
from tests.fixtures_vllm import VllmFactory, VllmServer
from tests.ledger.test_ledger_corrections import KEY, bill_config
from tests.ledger.test_ledger_engine import joined_config, start_ledger, status

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

DROPPED_MAX_TOKENS = 13      # the one request whose record the ledger never sees
# ledger.engine_wait_s of this test's ledger: long enough that a loaded machine's records
# arrive within it (at 3 s one came late and its request was billed from the edge:
# engine_missing 2, not 1; at 10 s, with 20 requests, so did an n = 2 stream's once)
WAIT_S = 20.0



@pytest.fixture
def engine_vllm(vllm_server: VllmFactory) -> VllmServer:
    """The session's vLLM CPU server (the plugin writes its engine records; vLLM's
    default scheduler), once nothing of an earlier test runs on it: the test's sums are
    differences of vLLM's counters around its own traffic."""
    v = vllm_server()
    v.wait_idle()
    return v


class Relay(threading.Thread):
    """Copies the plugin's complete lines into the file the ledger reads, as they come,
    less the records ``drop`` picks (one write per batch, like the plugin)."""

    def __init__(self, src: Path, dst: Path, drop: Callable[[EngineRecord], bool]) -> None:
        super().__init__(daemon=True)
        self.src, self.dst, self.drop = src, dst, drop
        self.offset = src.stat().st_size if src.exists() else 0
        self.stop = threading.Event()
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.unlink(missing_ok=True)

    def copy(self) -> None:
        if not self.src.exists():
            return
        with self.src.open("rb") as f:
            f.seek(self.offset)
            data = f.read()
        end = data.rfind(b"\n") + 1
        if not end:
            return
        keep = [ln + b"\n" for ln in data[:end].splitlines() if not self.drop(parse_record(ln))]
        fd = os.open(self.dst, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            if keep:
                os.write(fd, b"".join(keep))
        finally:
            os.close(fd)
        self.offset += end

    def run(self) -> None:
        while not self.stop.wait(0.05):
            self.copy()


def settled_metrics(v: VllmServer, offset: int, engine_requests: int) -> dict[str, float]:
    """vLLM's counters once ``engine_requests`` records were written after ``offset`` and
    the counters stopped moving."""
    wait_until(lambda: len(v.records_since(offset)) >= engine_requests, 120,
               what=f"{engine_requests} engine records")
    return v.steady_metrics()


def test_the_ledger_bills_exactly_what_vllm_counted(
        cfg, engine_vllm: VllmServer, edge_variant_off_vllm: Callable[..., Edge],
        ledger_config_path: Path, ledger_redis: redis.Redis, redis_url: str, tmp_path: Path):
    """Streaming and non-streaming chats, a chat free to stop at EOS, streams whose
    client leaves after a few chunks (one of them n = 2), non-streaming requests whose
    client times out, completions with two prompts, an n = 2 chat, Anthropic Messages
    (whole, streamed, and a stream the client leaves), and the request whose record is
    lost; the ledger is killed (SIGKILL) and restarted while they run."""
    v = engine_vllm

    def upstream(raw: dict[str, Any]) -> None:
        raw["models"][MODEL]["upstreams"] = [v.address]
        # the requests whose client times out must still be generating after 1.5 s on a
        # quiet machine too: room for 8000 tokens
        raw["models"][MODEL]["max_tokens_cap"] = 8150

    edge = edge_variant_off_vllm("ledger-vllm", upstream)
    engine_file = tmp_path / "engine" / "engine.jsonl"
    relay = Relay(v.usage_file, engine_file, lambda r: r.max_tokens == DROPPED_MAX_TOKENS)
    config = joined_config(ledger_config_path, tmp_path / "tokengate.yaml",
                           engine_wait_s=WAIT_S)
    name = svc_name("test-ledger-vllm")
    offset, before = v.size(), v.metrics()
    relay.start()
    ledger = start_ledger(config, redis_url, name, usage_file=edge.usage_file,
                          engine_files=[engine_file])

    def client(timeout: float = 300) -> openai.OpenAI:
        return openai.OpenAI(base_url=edge.base_url, api_key=MAIN_KEY, max_retries=0,
                             timeout=timeout)

    exact = {"ignore_eos": True}
    usage_opts = {"include_usage": True}

    def chat(max_tokens: int, free: bool = False) -> None:
        client().chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"chat {max_tokens}"}],
            max_tokens=max_tokens, extra_body=None if free else exact)

    def stream(max_tokens: int, leave_after: int | None = None, n: int = 1) -> None:
        s = client().chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"stream {max_tokens}"}],
            max_tokens=max_tokens, n=n, stream=True, stream_options=usage_opts,
            extra_body=exact)
        chunks = 0
        for chunk in s:
            chunks += bool(chunk.choices and chunk.choices[0].delta.content)
            if leave_after is not None and chunks >= leave_after:
                break
        s.close()

    def timeout(max_tokens: int) -> None:
        with pytest.raises(openai.APITimeoutError):
            client(timeout=1.5).chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "timeout"}],
                max_tokens=max_tokens, extra_body=exact)

    def completions(max_tokens: int) -> None:
        client().completions.create(model=MODEL, prompt=["first prompt", "the second one"],
                                    max_tokens=max_tokens, extra_body=exact)

    def messages(max_tokens: int, stream: bool = False,
                 leave_after: int | None = None) -> None:
        c = anthropic.Anthropic(base_url=edge.base_url.removesuffix("/v1"), api_key=MAIN_KEY,
                                max_retries=0, timeout=300)
        body: dict[str, Any] = {
            "model": MODEL, "max_tokens": max_tokens, "extra_body": exact,
            "messages": [{"role": "user", "content": f"messages {max_tokens}"}]}
        if not stream:
            c.messages.create(**body)
            return
        with c.messages.stream(**body) as s:
            for i, _text in enumerate(s.text_stream):
                if leave_after is not None and i + 1 >= leave_after:
                    break

    def responses(max_tokens: int, stream: bool = False,
                  leave_after: int | None = None) -> None:
        body: dict[str, Any] = {"model": MODEL, "max_output_tokens": max_tokens,
                                "input": f"responses {max_tokens}", "extra_body": exact}
        if not stream:
            client().responses.create(**body)
            return
        with client().responses.stream(**body) as s:
            deltas = 0
            for event in s:
                deltas += event.type == "response.output_text.delta"
                if leave_after is not None and deltas >= leave_after:
                    break

    def n2(max_tokens: int) -> None:
        client().chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "two"}], max_tokens=max_tokens,
            n=2, extra_body=exact)

    # (job, engine requests it makes)
    jobs: list[tuple[Callable[[], None], int]] = [
        (lambda: chat(5), 1), (lambda: chat(17), 1), (lambda: chat(40), 1),
        (lambda: chat(30, free=True), 1), (lambda: chat(DROPPED_MAX_TOKENS), 1),
        (lambda: stream(12), 1), (lambda: stream(33), 1),
        # clients that leave: far more than a fast machine generates before the close
        # reaches vLLM
        (lambda: stream(6000, leave_after=3), 1), (lambda: stream(6000, leave_after=10), 1),
        (lambda: stream(6000, leave_after=4, n=2), 2),
        (lambda: timeout(8000), 1), (lambda: timeout(8000), 1),
        (lambda: completions(8), 2), (lambda: n2(11), 2),
        (lambda: messages(9), 1), (lambda: messages(14, stream=True), 1),
        (lambda: messages(6000, stream=True, leave_after=3), 1),
        (lambda: responses(7), 1), (lambda: responses(15, stream=True), 1),
        (lambda: responses(6000, stream=True, leave_after=3), 1),
    ]
    killed_mid_stream = False
    try:
        with ThreadPoolExecutor(5) as pool:
            futs = [pool.submit(job) for job, _n in jobs]
            wait_until(lambda: 2 <= len(edge.events()) < len(jobs), 120,
                       what="some requests finished, not all")
            assert ledger.proc is not None
            os.kill(ledger.proc.pid, signal.SIGKILL)
            ledger.proc.wait(5)
            killed_mid_stream = len(edge.events()) < len(jobs)
            ledger = start_ledger(config, redis_url, name, usage_file=edge.usage_file,
                                  engine_files=[engine_file])
            for f in futs:
                f.result()
        after = settled_metrics(v, offset, sum(n for _job, n in jobs))
        wait_until(lambda: len(edge.events()) == len(jobs), 30, what="every usage event")
        wait_until(lambda: relay.offset == v.size(), 10, what="the relay caught up")
        wait_until(lambda: (status(name)["waiting"], int(ledger_redis.hget(
            store.stats_key(name), "applied") or 0)) == (0, len(jobs)), 60,
            what="every request billed")
    finally:
        ledger.stop()
        relay.stop.set()
        relay.join(5)
    assert killed_mid_stream

    records = v.records_since(offset)
    events = {ev["request_id"]: ev for ev in edge.events()}
    assert {r.edge_request_id for r in records} == set(events)
    (row,) = query(ledger_redis)
    generated = after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"]
    prompt_counted = after["vllm:prompt_tokens_total"] - before["vllm:prompt_tokens_total"]
    per_request: dict[str, list[EngineRecord]] = {}
    for r in records:
        per_request.setdefault(r.request_id, []).append(r)
    repeated_prompts = sum((sum(c.prefilled for c in children) - 1) * children[0].num_prompt_tokens
                           for children in per_request.values()
                           if children[0].n > 1 and any(c.prefilled for c in children))
    assert repeated_prompts > 0      # the n = 2 requests' second prompts
    assert row.completion_tokens == generated > 0
    assert row.prompt_tokens == prompt_counted - repeated_prompts > 0
    assert (row.requests, row.settled_engine, row.engine_missing, row.disagreements) == \
        (len(jobs), len(jobs) - 1, 1, 0)
    # the same bill per endpoint
    assert {ep: c["requests"] for ep, c in row.endpoints.items()} == \
        {"chat": 13, "completions": 1, "messages": 3, "responses": 3}
    for f in ("prompt_tokens", "completion_tokens"):
        assert sum(c[f] for c in row.endpoints.values()) == getattr(row, f)
    assert sum(c["cost"] for c in row.endpoints.values()) == pytest.approx(row.cost)

    # Each request: clients that left pay what the engine generated, not what the edge saw.
    audit = {f["rid"]: f for _id, f in ledger_redis.xrange(store.AUDIT_KEY)}
    (lost,) = [r for r in records if r.max_tokens == DROPPED_MAX_TOKENS]
    assert audit[lost.edge_request_id]["settled"] == "edge"
    assert (int(audit[lost.edge_request_id]["completion"]),
            int(audit[lost.edge_request_id]["prompt"])) == \
        (lost.num_generation_tokens, lost.num_prompt_tokens) == \
        (events[lost.edge_request_id]["completion_tokens"],
         events[lost.edge_request_id]["prompt_tokens"])
    left = [rid for rid, ev in events.items() if ev["client_aborted"]]
    assert len(left) == 7
    for rid in left:
        gen = sum(r.num_generation_tokens for r in records if r.edge_request_id == rid)
        assert audit[rid]["settled"] == "engine"
        assert int(audit[rid]["completion"]) == gen
        assert int(audit[rid]["edge_completion"]) == events[rid]["completion_tokens"]
    assert any(int(audit[rid]["completion"]) != events[rid]["completion_tokens"]
               for rid in left)
    s = status(name)
    assert (s["engine_unmatched"], s["engine_late"], s["disagreements"]) == (0, 0, 0)
    eng = {k: int(x) for k, x in ledger_redis.hgetall(
        store.stats_key(engine_ledger_id(name, engine_file))).items()}
    assert (eng["engine_records"], eng.get("engine_duplicates", 0)) == (len(records) - 1, 0)


# -- a budgeted key through the edge: bills the engine's records make after the fact ----

TEAM_KEY = "tg-test-team"
BUDGET_LIMITS_SOCKET = TEST_DIR / "ledger-vllm-limits.sock"


@dataclass
class BudgetStack:
    """The real edge (global limits on) in front of the session's vLLM, a real
    tokengate-limits on the session's Redis, and the configuration a ledger of that
    Redis reads (``ledger`` settings per test); the key ``KEY`` has a day's budget."""

    vllm: VllmServer
    edge: Edge
    base_config: Path
    tmp: Path

    def follow(self, relay_to: Path, name: str, redis_url: str, **ledger: Any
               ) -> tuple[Path, int, Relay, devstack.Service]:
        """The vLLM's records from now on relayed into ``relay_to``, and a ledger
        ``name`` of the edge's usage file with the ``ledger`` settings: (its
        configuration, the vLLM file's offset, the relay, the ledger)."""
        config = bill_config(self.base_config, self.tmp / "ledger.yaml", **ledger)
        relay = Relay(self.vllm.usage_file, relay_to, lambda r: False)
        offset = self.vllm.size()
        relay.start()
        ledger_svc = start_ledger(config, redis_url, name, usage_file=self.edge.usage_file,
                                  engine_files=[])
        # a first start rebuilds (no ready mark in the flushed Redis) and holds the
        # budgeted key meanwhile: the edge refuses its requests with a 503 until the
        # ledger sets its ready mark (with the holds' release, in one pipeline)
        with redis.Redis.from_url(redis_url) as client:
            wait_until(lambda: client.exists(store.ready_key(name)), 60,
                       what="the ledger's first rebuild to end")
        return config, offset, relay, ledger_svc

    def client(self, timeout: float = 300) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.edge.base_url, api_key=TEAM_KEY, max_retries=0,
                             timeout=timeout)


@pytest.fixture
def budget_stack(engine_vllm: VllmServer, edge_variant_off_vllm: Callable[..., Edge],
                 config_path: Path, ledger_config_path: Path, ledger_redis: redis.Redis,
                 redis_url: str, tmp_path: Path) -> Iterator[BudgetStack]:
    Path(f"{BUDGET_LIMITS_SOCKET}.0").unlink(missing_ok=True)
    limits = devstack.limits_service(patient_redis_config(config_path, "ledger-vllm-limits"),
                                     free_port(), redis_url, unix_socket=BUDGET_LIMITS_SOCKET,
                                     workers=1, name=svc_name("test-ledger-vllm-limits"))
    limits.start()
    wait_until(lambda: Path(f"{BUDGET_LIMITS_SOCKET}.0").exists(), 20,
               what="the limits socket")

    def edit(raw: dict[str, Any]) -> None:
        raw["models"][MODEL]["upstreams"] = [engine_vllm.address]
        raw["models"][MODEL]["max_tokens_cap"] = 8150
        raw["keys"][KEY] = {"sha256": key_digest(TEAM_KEY), "rpm": 10_000,
                            "tpm": 10_000_000, "budgets": [{"period": "day", "spend": 1.0}]}
        raw["global_limits"] = {"enabled": True, "listen": "127.0.0.1:1",
                                "unix_socket": str(BUDGET_LIMITS_SOCKET)}
        raw["edge"]["global_limits_timeout_ms"] = 5000

    try:
        yield BudgetStack(engine_vllm, edge_variant_off_vllm("ledger-vllm-budget", edit),
                          ledger_config_path, tmp_path)
    finally:
        limits.stop()


def engine_cost(calc: Calculator, records: list[EngineRecord]) -> tuple[int, int]:
    """(spend in nano-units, tokens) the engine's records of whole requests bill, each
    request rounded up to the nano-unit as the edge rounds."""
    spend = tokens = 0
    for r in records:
        spend += budget_store.nano(calc.charge(r.num_prompt_tokens, r.num_generation_tokens,
                                               r.num_cached_tokens, 0, MODEL).cost)
        tokens += r.num_prompt_tokens + r.num_generation_tokens
    return spend, tokens


def nginx_workers(edge: Edge) -> list[int]:
    """The worker processes of the edge's nginx master (the process devstack started)."""
    assert edge.service.proc is not None
    pid = edge.service.proc.pid
    return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def test_a_stream_cut_by_a_killed_nginx_worker_is_billed_to_its_key_from_its_record(
        budget_stack: BudgetStack, ledger_redis: redis.Redis, redis_url: str,
        tmp_path: Path) -> None:
    """A stream through the edge whose nginx workers are killed (SIGKILL) mid-stream: the
    edge writes no usage event and never settles its budget reservation; vLLM aborts the
    request and the plugin's record names the key and the endpoint. The ledger bills that
    record to the key after ``engine_orphan_s`` and settles the reservation, so the
    key's bill and budget counters hold what the engine generated."""
    stack, v = budget_stack, budget_stack.vllm
    engine_file = tmp_path / "engine" / "engine.jsonl"
    name = svc_name("test-ledger-vllm-orphan")
    config, offset, relay, ledger = stack.follow(
        engine_file, name, redis_url, engine_usage_files=[str(engine_file)],
        engine_wait_s=5.0, engine_orphan_s=2.0)
    try:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "a long story"}],
                "max_tokens": 6000, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", f"{stack.edge.base_url}/chat/completions", json=body,
                          headers={"Authorization": f"Bearer {TEAM_KEY}"},
                          timeout=300) as resp:
            assert resp.status_code == 200
            rid = resp.headers["x-request-id"]
            lines = resp.iter_lines()
            for _ in range(3):
                assert next(lines).startswith("data: ")
                next(lines)
            for pid in nginx_workers(stack.edge):
                os.kill(pid, signal.SIGKILL)
            with pytest.raises(httpx.HTTPError):
                for _line in lines:
                    pass
        key = f"chatcmpl-{rid}#0"
        wait_until(lambda: key in {r.key for r in v.records_since(offset)}, 120,
                   what="the aborted stream's record")
        wait_until(lambda: any(f.get("rid") == rid for _id, f in
                               ledger_redis.xrange(store.AUDIT_KEY)), 60,
                   what="the record billed as an orphan")
    finally:
        ledger.stop()
        relay.stop.set()
        relay.join(5)
    assert rid not in {ev["request_id"] for ev in stack.edge.events()}
    (rec,) = [r for r in v.records_since(offset) if r.key == key]
    assert (rec.key_id, rec.endpoint, rec.source, rec.finish_reason) == \
        (KEY, "chat", "abort", "abort")
    assert 0 < rec.num_generation_tokens < 6000
    bill = {f["rid"]: f for _id, f in ledger_redis.xrange(store.AUDIT_KEY)}[rid]
    assert (bill["key"], bill["orphan"], bill["settled"], bill["endpoint"], bill["status"],
            int(bill["prompt"]), int(bill["completion"])) == \
        (KEY, "1", "engine", "chat", "0", rec.num_prompt_tokens, rec.num_generation_tokens)
    assert ledger_redis.get(store.reservation_key(KEY, rid)) == "settled"
    calc = Calculator(tg_config.load(config))
    counter = budget_store.counter_name("*", "day", datetime.now(UTC).date())
    assert budget_store.committed(ledger_redis, [(KEY, counter)], [MODEL]) == \
        [engine_cost(calc, [rec])]


def test_a_replica_whose_records_the_ledger_follows_late_is_billed_its_engines_numbers(
        budget_stack: BudgetStack, ledger_redis: redis.Redis, redis_url: str,
        tmp_path: Path) -> None:
    """A replica whose engine file the ledger does not follow yet (added by
    configuration, the ledger not told): a stream whose client leaves, a request whose
    client times out and a whole chat through the edge are billed with the edge's
    numbers after ``engine_wait_s``. The ledger is killed, the file listed, the ledger
    started again: the records correct each bill once, and the key's bill and budget
    counters end at the engine's numbers."""
    stack, v = budget_stack, budget_stack.vllm
    replica = tmp_path / "engine" / "replica-2.jsonl"
    name = svc_name("test-ledger-vllm-late")
    config, offset, relay, ledger = stack.follow(
        replica, name, redis_url, engine_usage_files=[str(tmp_path / "replica-1.jsonl")],
        engine_wait_s=1.0)
    exact = {"ignore_eos": True}
    try:
        s = stack.client().chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "leave"}], max_tokens=6000,
            stream=True, stream_options={"include_usage": True}, extra_body=exact)
        for i, _chunk in enumerate(s):
            if i == 3:
                break
        s.close()
        with pytest.raises(openai.APITimeoutError):
            stack.client(timeout=1.5).chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "timeout"}],
                max_tokens=8000, extra_body=exact)
        stack.client().chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "whole"}], max_tokens=9,
            extra_body=exact)
        wait_until(lambda: len(v.records_since(offset)) == 3, 120, what="three records")
        wait_until(lambda: status(name)["engine_missing"] == 3, 60,
                   what="three bills with the edge's numbers")
        assert ledger.proc is not None
        os.kill(ledger.proc.pid, signal.SIGKILL)
        ledger.proc.wait(10)
        raw = yaml.safe_load(config.read_text())
        raw["ledger"]["engine_usage_files"].append(str(replica))
        config.write_text(yaml.safe_dump(raw, sort_keys=False))
        ledger = start_ledger(config, redis_url, name, usage_file=stack.edge.usage_file,
                              engine_files=[])
        wait_until(lambda: status(name)["corrections"] == 3 and
                   not ledger_redis.hlen(store.BUDGET_FIX_KEY), 60,
                   what="three corrections and their budget fixes")
    finally:
        ledger.stop()
        relay.stop.set()
        relay.join(5)
    records = v.records_since(offset)
    (row,) = query(ledger_redis)
    assert (row.requests, row.completion_tokens, row.prompt_tokens, row.corrections,
            row.settled_engine, row.engine_missing) == \
        (3, sum(r.num_generation_tokens for r in records),
         sum(r.num_prompt_tokens for r in records), 3, 3, 0)
    events = stack.edge.events()
    assert sum(ev["completion_tokens"] for ev in events) != row.completion_tokens
    calc = Calculator(tg_config.load(config))
    counter = budget_store.counter_name("*", "day", datetime.now(UTC).date())
    assert budget_store.committed(ledger_redis, [(KEY, counter)], [MODEL]) == \
        [engine_cost(calc, records)]

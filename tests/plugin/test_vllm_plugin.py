"""tokengate's vLLM plugin in a real vLLM CPU server: the engine usage records of a mixed
workload add up exactly to vLLM's own counters, and the token-weighted scheduler serves a
light request before a heavy one that arrived earlier.

The server is the session's queue server (tests/fixtures_vllm.py): the one ``make run``
starts (``devstack.vllm_service``) with the plugin's scheduler (``--scheduler-cls``) and
two running slots (``--max-num-seqs 2``), so that requests wait in the queue the
scheduler orders, and without the billing flags, which the engine records do not
depend on. The scheduler is wrapped by tests/paced_scheduler.py, which slows the engine's steps only while a queue test holds
its file: the tests that need requests queued behind blockers then end the blockers
themselves, whatever the machine's speed. The stat-logger part is loaded by vLLM
from the plugin's entry point (installed by ``make setup``).

How vLLM 0.32 counts (vllm/v1/metrics/stats.py, loggers.py, engine/output_processor.py,
engine/parallel_sampling.py): ``vllm:generation_tokens_total`` grows by the tokens of
every engine output the frontend processes; ``vllm:prompt_tokens_total`` grows by a
request's whole prompt (cached tokens included) at its first output. An ``n = 2``
request is two engine requests (children ``0_<id>``, ``1_<id>``): the prompt counter
grows by exactly twice the prompt, ``usage.prompt_tokens`` counts it once. A request
aborted before its first output (it waited in the queue) adds nothing to either.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from datetime import datetime, timedelta
from pathlib import Path

import openai
import pytest
from tokengate.ledger.engine_record import EngineRecord

from tests.conftest import MODEL
from tests.fixtures_vllm import PACE_FILE, VllmServer

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.fixture
def plugin_vllm(queue_vllm: VllmServer) -> VllmServer:
    """The session's queue server (tests/fixtures_vllm.py), once nothing of an earlier
    test runs on it."""
    queue_vllm.wait_idle()
    return queue_vllm


def rid() -> str:
    """An id like the edge's $request_id (32 hex), sent as X-Request-Id."""
    return uuid.uuid4().hex


def hdr(request_id: str) -> dict[str, str]:
    return {"X-Request-Id": request_id}


def msgs(text: str = "Tell me a story.") -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


EXACT = {"ignore_eos": True}  # the tiny model's random weights may emit EOS early
# A request that must still be generating while others queue or time out: seconds even on a
# quiet machine, where the tiny model makes a few thousand tokens a second
BLOCKER_TOKENS = 7000
LEAVER_TOKENS = 6000   # a stream whose client leaves after a few chunks


def wait_for(pred: Callable[[], bool], what: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def settle(v: VllmServer, offset: int, keys: set[str]) -> tuple[list[EngineRecord],
                                                                 dict[str, float]]:
    """Wait until records with exactly ``keys`` appeared after ``offset`` and vLLM's
    counters stopped moving; the records and the counters then."""
    wait_for(lambda: keys <= {r.key for r in v.records_since(offset)},
             f"records {sorted(keys - {r.key for r in v.records_since(offset)})}")
    now = v.steady_metrics()
    return v.records_since(offset), now


def assert_reconciles(records: list[EngineRecord], keys: set[str], before: dict[str, float],
                      after: dict[str, float]) -> None:
    """One record per finished engine request, and their sums are vLLM's counters."""
    assert sorted(r.key for r in records) == sorted(keys)
    grown_gen = after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"]
    grown_prompt = after["vllm:prompt_tokens_total"] - before["vllm:prompt_tokens_total"]
    assert sum(r.num_generation_tokens for r in records) == grown_gen
    assert sum(r.num_prompt_tokens for r in records if r.prefilled) == grown_prompt


def first_token_at(r: EngineRecord) -> datetime:
    """Wall-clock time of the request's first token: its finish less its decode time."""
    assert r.decode_ms is not None
    return datetime.fromisoformat(r.ts) - timedelta(milliseconds=r.decode_ms)


def by_key(records: list[EngineRecord]) -> dict[str, EngineRecord]:
    return {r.key: r for r in records}


def test_vllm_loads_the_plugin_and_the_cpu_scheduler(plugin_vllm: VllmServer):
    log = plugin_vllm.log_path.read_text()
    assert f"engine usage records: engine 0 writes to {plugin_vllm.usage_file}" in log
    # CPU: async scheduling off, so the factory extends Scheduler, not AsyncScheduler.
    assert "token-weighted scheduler: on Scheduler, weight = prompt + 0.7 x max_tokens, " \
           "aging bound 3600 s" in log


def test_a_chat_completion_leaves_one_record_with_its_usage(plugin_vllm: VllmServer):
    v, r0 = plugin_vllm, rid()
    offset, before = v.size(), v.metrics()
    resp = v.client().chat.completions.create(model=MODEL, messages=msgs(), max_tokens=7,
                                              extra_headers=hdr(r0), extra_body=EXACT)
    assert resp.id == f"chatcmpl-{r0}"
    assert resp.usage is not None and resp.usage.completion_tokens == 7
    key = f"chatcmpl-{r0}#0"
    records, after = settle(v, offset, {key})
    assert_reconciles(records, {key}, before, after)
    rec = by_key(records)[key]
    assert rec.edge_request_id == r0
    assert (rec.index, rec.n, rec.model, rec.finish_reason, rec.source, rec.prefilled) == \
        (0, 1, MODEL, "length", "stats", True)
    assert (rec.num_prompt_tokens, rec.num_generation_tokens, rec.num_cached_tokens,
            rec.max_tokens, rec.num_preemptions) == \
        (resp.usage.prompt_tokens, 7, 0, 7, 0)
    assert rec.e2e_ms > 0 and rec.prefill_ms is not None and rec.decode_ms is not None


def test_an_n_2_request_is_two_records_and_counts_its_prompt_twice(plugin_vllm: VllmServer):
    v, r0 = plugin_vllm, rid()
    offset, before = v.size(), v.metrics()
    resp = v.client().chat.completions.create(model=MODEL, messages=msgs(), max_tokens=6, n=2,
                                              extra_headers=hdr(r0), extra_body=EXACT)
    assert resp.usage is not None
    assert (len(resp.choices), resp.usage.completion_tokens) == (2, 12)
    keys = {f"chatcmpl-{r0}#0", f"chatcmpl-{r0}#1"}
    records, after = settle(v, offset, keys)
    assert_reconciles(records, keys, before, after)
    assert after["vllm:prompt_tokens_total"] - before["vllm:prompt_tokens_total"] == \
        2 * resp.usage.prompt_tokens
    assert after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] == \
        resp.usage.completion_tokens
    for rec in records:
        assert (rec.request_id, rec.n, rec.num_prompt_tokens, rec.num_generation_tokens) == \
            (f"chatcmpl-{r0}", 2, resp.usage.prompt_tokens, 6)
    assert sorted(r.index for r in records) == [0, 1]


def test_a_record_names_the_key_and_endpoint_the_edge_sent(plugin_vllm: VllmServer):
    """The edge's X-Tokengate-Key and X-Tokengate-Endpoint (the plugin's middleware,
    tokengate_vllm.edge) are in the record of a whole chat, of each child of an n = 2
    completions request, and of a stream whose client left (an abort record, written
    after the request's task was cancelled); a request sent without them names none."""
    v = plugin_vllm
    whole, two, left, direct = rid(), rid(), rid(), rid()
    offset = v.size()
    edge = {"X-Tokengate-Key": "team-a", "X-Tokengate-Endpoint": "chat"}
    v.client().chat.completions.create(model=MODEL, messages=msgs(), max_tokens=5,
                                       extra_headers={**hdr(whole), **edge}, extra_body=EXACT)
    v.client().completions.create(model=MODEL, prompt="Once upon a time", max_tokens=4, n=2,
                                  extra_headers={**hdr(two), "X-Tokengate-Key": "team-b",
                                                 "X-Tokengate-Endpoint": "completions"},
                                  extra_body=EXACT)
    stream = v.client(timeout=300).chat.completions.create(
        model=MODEL, messages=msgs(), max_tokens=LEAVER_TOKENS, stream=True,
        extra_headers={**hdr(left), **edge, "X-Tokengate-Endpoint": "messages"},
        extra_body=EXACT)
    for i, _chunk in enumerate(stream):
        if i == 3:
            break
    stream.close()
    v.client().chat.completions.create(model=MODEL, messages=msgs(), max_tokens=3,
                                       extra_headers=hdr(direct), extra_body=EXACT)
    keys = {f"chatcmpl-{whole}#0", f"cmpl-{two}-0#0", f"cmpl-{two}-0#1",
            f"chatcmpl-{left}#0", f"chatcmpl-{direct}#0"}
    records, _after = settle(v, offset, keys)
    named = {r.key: (r.key_id, r.endpoint, r.source) for r in records if r.key in keys}
    assert named == {
        f"chatcmpl-{whole}#0": ("team-a", "chat", "stats"),
        f"cmpl-{two}-0#0": ("team-b", "completions", "stats"),
        f"cmpl-{two}-0#1": ("team-b", "completions", "stats"),
        f"chatcmpl-{left}#0": ("team-a", "messages", "abort"),
        f"chatcmpl-{direct}#0": (None, None, "stats"),
    }


@contextmanager
def paced() -> Iterator[None]:
    """vLLM's engine steps slowed (tests/paced_scheduler.py) while the block runs: a
    blocker then runs until the test's client leaves, however fast the machine."""
    PACE_FILE.touch()
    try:
        yield
    finally:
        PACE_FILE.unlink(missing_ok=True)


def test_the_scheduler_serves_a_light_request_before_an_earlier_heavy_one(
        plugin_vllm: VllmServer):
    """Both slots busy (two streams); a heavy request (a ~2000-token prompt) arrives,
    then a light one. The first slot to free (block-a's client leaves) goes to the light
    one: FCFS would give it to the heavy one, which arrived first."""
    v = plugin_vllm
    ids = {name: rid() for name in ("block-a", "block-b", "heavy", "light")}
    first_token: dict[str, float] = {}
    started = {name: threading.Event() for name in ids}
    leave = {name: threading.Event() for name in ("block-a", "block-b")}
    offset, before = v.size(), v.metrics()

    def stream(name: str, content: str, max_tokens: int) -> None:
        s = v.client(timeout=300).chat.completions.create(
            model=MODEL, messages=msgs(content), max_tokens=max_tokens, stream=True,
            extra_headers=hdr(ids[name]), extra_body=EXACT)
        for chunk in s:
            if chunk.choices and chunk.choices[0].delta.content and name not in first_token:
                first_token[name] = time.monotonic()
                started[name].set()
            if name in leave and leave[name].is_set():
                break
        s.close()

    heavy_prompt = " ".join(f"w{i}" for i in range(1000))

    def waiting(n: int) -> Callable[[], bool]:
        return lambda: v.metrics()["vllm:num_requests_waiting"] == n

    with paced(), ThreadPoolExecutor(4) as pool:
        futs = [pool.submit(stream, "block-a", "a", BLOCKER_TOKENS),
                pool.submit(stream, "block-b", "b", BLOCKER_TOKENS)]
        assert started["block-a"].wait(120) and started["block-b"].wait(120)
        futs.append(pool.submit(stream, "heavy", heavy_prompt, 20))
        wait_for(waiting(1), "the heavy request queued")
        futs.append(pool.submit(stream, "light", "hi", 5))
        wait_for(waiting(2), "the light request queued")
        time.sleep(0.6)  # both wait at least this long (queued_ms below)
        leave["block-a"].set()
        assert started["light"].wait(120)
        leave["block-b"].set()
        for f in futs:
            f.result()
    keys = {f"chatcmpl-{i}#0" for i in ids.values()}
    records, after = settle(v, offset, keys)
    assert_reconciles(records, keys, before, after)
    rec = {name: by_key(records)[f"chatcmpl-{i}#0"] for name, i in ids.items()}
    assert rec["heavy"].num_prompt_tokens > 1500 and rec["light"].num_prompt_tokens < 20
    # Both waited for the slot block-a freed, the heavy one arrived first...
    assert rec["heavy"].arrival_ts < rec["light"].arrival_ts < rec["block-a"].ts
    assert rec["heavy"].queued_ms is not None and rec["heavy"].queued_ms > 500
    assert rec["light"].queued_ms is not None and rec["light"].queued_ms > 100
    # ... and the light one was served first: its first token, by the engine's clock
    # (finish - decode time; the client threads' own clocks lag by whatever the GIL and
    # a loaded machine add, which once put the heavy one's first chunk first).
    assert first_token_at(rec["light"]) < first_token_at(rec["heavy"])
    assert rec["light"].ts < rec["heavy"].ts


def test_a_request_aborted_while_it_waits_is_recorded_unprefilled(plugin_vllm: VllmServer):
    """A client that leaves while its request waits for a slot: vLLM removes it from the
    scheduler's (token-weighted) waiting queue; its record has no tokens generated and
    ``prefilled`` false, and vLLM's prompt counter did not count it either."""
    v = plugin_vllm
    ids = {name: rid() for name in ("block-a", "block-b", "waiter")}
    offset, before = v.size(), v.metrics()
    running = {name: threading.Event() for name in ("block-a", "block-b")}
    stop = threading.Event()

    def blocker(name: str) -> None:
        s = v.client(timeout=300).chat.completions.create(
            model=MODEL, messages=msgs(name), max_tokens=BLOCKER_TOKENS, stream=True,
            extra_headers=hdr(ids[name]), extra_body=EXACT)
        for _ in s:
            running[name].set()
            if stop.is_set():
                break
        s.close()

    with paced(), ThreadPoolExecutor(2) as pool:
        futs = [pool.submit(blocker, n) for n in running]
        assert all(e.wait(120) for e in running.values())
        waiter = v.client(timeout=300).chat.completions.create(
            model=MODEL, messages=msgs("waiting"), max_tokens=50, stream=True,
            extra_headers=hdr(ids["waiter"]), extra_body=EXACT)
        wait_for(lambda: v.metrics()["vllm:num_requests_waiting"] == 1, "the waiter queued")
        waiter.close()
        wait_for(lambda: f"chatcmpl-{ids['waiter']}#0" in {r.key for r in
                                                          v.records_since(offset)},
                 "the waiter's record")
        stop.set()
        for f in futs:
            f.result()
    keys = {f"chatcmpl-{i}#0" for i in ids.values()}
    records, after = settle(v, offset, keys)
    assert_reconciles(records, keys, before, after)
    w = by_key(records)[f"chatcmpl-{ids['waiter']}#0"]
    assert (w.finish_reason, w.source, w.prefilled, w.num_generation_tokens, w.queued_ms) == \
        ("abort", "abort", False, 0, None)
    assert w.num_prompt_tokens > 0
    for name in running:
        b = by_key(records)[f"chatcmpl-{ids[name]}#0"]
        assert (b.finish_reason, b.source, b.prefilled) == ("abort", "abort", True)
        assert 0 < b.num_generation_tokens < BLOCKER_TOKENS


def test_a_mixed_workload_reconciles_exactly_with_vllms_counters(plugin_vllm: VllmServer):
    """Streaming and non-streaming chats, completions with two prompts, an n = 2 request,
    and clients that leave early (streams closed after a few chunks, non-streaming
    requests timing out), all at once: one record per engine request, Σ generated =
    growth of vllm:generation_tokens_total, Σ prompt (prefilled) = growth of
    vllm:prompt_tokens_total."""
    v = plugin_vllm
    offset, before = v.size(), v.metrics()
    expect: dict[str, Callable[[dict[str, EngineRecord]], None]] = {}
    keys: set[str] = set()

    def chat(max_tokens: int) -> None:
        r0 = rid()
        resp = v.client(timeout=300).chat.completions.create(
            model=MODEL, messages=msgs(f"chat {max_tokens}"), max_tokens=max_tokens,
            extra_headers=hdr(r0), extra_body=EXACT)
        u = resp.usage
        assert u is not None
        key = f"chatcmpl-{r0}#0"
        keys.add(key)

        def check(recs: dict[str, EngineRecord]) -> None:
            r = recs[key]
            assert (r.finish_reason, r.source, r.num_prompt_tokens, r.num_generation_tokens) == \
                ("length", "stats", u.prompt_tokens, u.completion_tokens)
        expect[key] = check

    def chat_free(max_tokens: int) -> None:
        """No ignore_eos: it may stop at EOS; usage and record still agree."""
        r0 = rid()
        resp = v.client(timeout=300).chat.completions.create(
            model=MODEL, messages=msgs("free"), max_tokens=max_tokens, extra_headers=hdr(r0))
        u = resp.usage
        assert u is not None
        key = f"chatcmpl-{r0}#0"
        keys.add(key)
        reason = resp.choices[0].finish_reason

        def check(recs: dict[str, EngineRecord]) -> None:
            r = recs[key]
            assert (r.finish_reason, r.num_prompt_tokens, r.num_generation_tokens) == \
                (reason, u.prompt_tokens, u.completion_tokens)
        expect[key] = check

    def stream(max_tokens: int, leave_after: int | None = None, n: int = 1) -> None:
        r0 = rid()
        s = v.client(timeout=300).chat.completions.create(
            model=MODEL, messages=msgs(f"stream {max_tokens}"), max_tokens=max_tokens, n=n,
            stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True},
            extra_headers=hdr(r0), extra_body=EXACT)
        seen_usage, content_chunks = None, 0
        for chunk in s:
            if chunk.usage is not None:
                seen_usage = chunk.usage
            if chunk.choices and chunk.choices[0].delta.content:
                content_chunks += 1
            if leave_after is not None and content_chunks >= leave_after:
                break
        s.close()
        ks = [f"chatcmpl-{r0}#{i}" for i in range(n)]
        keys.update(ks)

        def check(recs: dict[str, EngineRecord]) -> None:
            rs = [recs[k] for k in ks]
            gen = sum(r.num_generation_tokens for r in rs)
            if leave_after is None:
                assert seen_usage is not None
                assert [r.finish_reason for r in rs] == ["length"] * n
                assert gen == seen_usage.completion_tokens == n * max_tokens
            else:
                # The engine generated at least what the client saw (the edge bills
                # only that today), never more than asked.
                assert [(r.finish_reason, r.source) for r in rs] == [("abort", "abort")] * n
                assert seen_usage is not None and gen >= seen_usage.completion_tokens
                assert gen >= content_chunks and all(r.num_generation_tokens < max_tokens
                                                     for r in rs)
        expect[ks[0]] = check

    def chat_timeout(max_tokens: int) -> None:
        r0 = rid()
        with pytest.raises(openai.APITimeoutError):
            v.client(timeout=1.5).chat.completions.create(
                model=MODEL, messages=msgs("timeout"), max_tokens=max_tokens,
                extra_headers=hdr(r0), extra_body=EXACT)
        key = f"chatcmpl-{r0}#0"
        keys.add(key)

        def check(recs: dict[str, EngineRecord]) -> None:
            r = recs[key]
            assert (r.finish_reason, r.source) == ("abort", "abort")
            assert r.num_generation_tokens < max_tokens
        expect[key] = check

    def completions_two_prompts(max_tokens: int) -> None:
        r0 = rid()
        resp = v.client(timeout=300).completions.create(
            model=MODEL, prompt=["first prompt", "the second prompt"], max_tokens=max_tokens,
            extra_headers=hdr(r0), extra_body=EXACT)
        u = resp.usage
        assert u is not None and resp.id == f"cmpl-{r0}"
        ks = [f"cmpl-{r0}-{i}#0" for i in range(2)]
        keys.update(ks)

        def check(recs: dict[str, EngineRecord]) -> None:
            rs = [recs[k] for k in ks]
            assert [r.edge_request_id for r in rs] == [r0, r0]
            assert sum(r.num_prompt_tokens for r in rs) == u.prompt_tokens
            assert sum(r.num_generation_tokens for r in rs) == u.completion_tokens == \
                2 * max_tokens
        expect[ks[0]] = check

    def n2(max_tokens: int) -> None:
        r0 = rid()
        resp = v.client(timeout=300).chat.completions.create(
            model=MODEL, messages=msgs("two"), max_tokens=max_tokens, n=2,
            extra_headers=hdr(r0), extra_body=EXACT)
        u = resp.usage
        assert u is not None
        ks = [f"chatcmpl-{r0}#{i}" for i in range(2)]
        keys.update(ks)

        def check(recs: dict[str, EngineRecord]) -> None:
            rs = [recs[k] for k in ks]
            assert [r.num_prompt_tokens for r in rs] == [u.prompt_tokens] * 2
            assert sum(r.num_generation_tokens for r in rs) == u.completion_tokens
        expect[ks[0]] = check

    jobs: list[Callable[[], None]] = [
        lambda: chat(5), lambda: chat(17), lambda: chat(40), lambda: chat_free(30),
        lambda: stream(12), lambda: stream(33), lambda: stream(9),
        # clients that leave: asked for far more than a fast machine generates before
        # the close reaches vLLM (300 tokens once finished first, "length", not "abort")
        lambda: stream(LEAVER_TOKENS, leave_after=3), lambda: stream(LEAVER_TOKENS, leave_after=10),
        lambda: stream(LEAVER_TOKENS, leave_after=4, n=2),
        lambda: chat_timeout(8000), lambda: chat_timeout(8000),
        lambda: completions_two_prompts(8), lambda: n2(11),
    ]
    with ThreadPoolExecutor(6) as pool:
        for f in [pool.submit(j) for j in jobs]:
            f.result()
    records, after = settle(v, offset, keys)
    assert_reconciles(records, keys, before, after)
    recs = by_key(records)
    assert len(expect) == len(jobs)
    for check in expect.values():
        check(recs)
    assert {r.edge_request_id is not None for r in records} == {True}


def test_the_gpu_checks_workload_reconciles_on_the_cpu_server(plugin_vllm: VllmServer,
                                                              tmp_path: Path):
    """tokengate_dev.bench.gpu_check, the part of dev/gpu_check.sh that needs no GPU: its mixed
    workload (short, long, leaving, n = 2, timing out) against this server reconciles."""
    out = tmp_path / "figures.json"
    r = subprocess.run([sys.executable, "-m", "tokengate_dev.bench.gpu_check", "run",
                        "--url", plugin_vllm.url.removesuffix("/v1"), "--model", MODEL,
                        "--usage-file", str(plugin_vllm.usage_file), "--duration", "8",
                        "--rate", "1.5", "--burst", "0", "--seed", "4", "--label", "cpu",
                        "--out", str(out)],
                       capture_output=True, text=True, timeout=600, check=False)
    assert r.returncode == 0, r.stdout + r.stderr
    f = json.loads(out.read_text())
    assert f["reconciled"] and f["errors"] == 0 and f["missing"] == []
    assert f["records"] == f["records_expected"] > 0
    assert f["generation_tokens"] == f["generation_counter"] > 0
    assert f["prompt_tokens"] == f["prompt_counter"] > 0

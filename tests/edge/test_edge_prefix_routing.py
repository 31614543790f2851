"""Routing by the prefix cache at the edge (models.<name>.routing): the replica each
policy picks, the expected prefix hit in a response header and the usage event, and the
prediction's metrics.

Real nginx (2 workers), the session's real counter (the test configuration routes
tiny-qwen3 by prefix, blocks of 128 tokens: it returns each prompt's block hashes) and
two of TokenStorm's fast upstreams as replicas. The counter follows the KV events of the
session's vLLM only, not of these replicas, so the edge's own approximate index
(tokengate.prefix) predicts their hits; the expected numbers are computed here from the
counter's own block hashes for the same bodies. The precise path: two of TokenStorm's
simulated replicas (a real prefix cache, vLLM's KV events) and a counter that follows
their events; the hit the edge expects is then the cached_tokens the replica reports.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families
from tokengate.counter import frames
from tokengate.v1 import counter_pb2, counter_pb2_grpc
from tokengate_dev import devstack
from tokenstorm.null_server import FastUpstream
from tokenstorm.process import free_port
from tokenstorm.upstream.sim import SimReplica, SimSettings

from tests.conftest import MODEL, PORT_OFFSET, TEST_DIR
from tests.fixtures_edge import MAIN_KEY, Edge

HEADERS = {"Authorization": f"Bearer {MAIN_KEY}", "Content-Type": "application/json"}
EXPECTED = "x-tokengate-expected-cached-tokens"
SOURCE = "x-tokengate-expected-cached-source"
# a system prompt of several 128-token blocks that every request below shares
SYSTEM = "You are a careful assistant. " + " ".join(f"rule {i}: answer briefly." for i in
                                                    range(150))


def _name(up: FastUpstream) -> str:
    return f"127.0.0.1:{up.port}"


def _edge(edge_variant_off_vllm: Callable[..., Edge], name: str, ups: list[FastUpstream],
          **routing: Any) -> Edge:
    """An edge in front of ``ups`` routing as ``routing`` says; the replicas' metrics are
    not read (every replica ranks alike: the policy alone decides)."""
    def edit(raw: dict[str, Any]) -> None:
        m = raw["models"][MODEL]
        m["upstreams"] = [_name(u) for u in ups]
        m["embedded"] = False
        m["routing"] = {**m.get("routing", {}), "kv_events": {}, **routing}
        raw["edge"]["admission"] = {"metrics_interval_ms": 0}
    return edge_variant_off_vllm(name, edit)


def _body(question: str, max_tokens: int = 2, stream: bool = False,
          system: bool = True) -> dict[str, Any]:
    return {"model": MODEL, "max_tokens": max_tokens, "stream": stream,
            "messages": [{"role": "system", "content": SYSTEM}] * system
            + [{"role": "user", "content": question}]}


def _chat(e: Edge, question: str, system: bool = True) -> httpx.Response:
    r = httpx.post(e.base_url + "/chat/completions",
                   content=json.dumps(_body(question, system=system)),
                   headers=HEADERS, timeout=30)
    assert r.status_code == 200, r.text
    return r


def _idle(e: Edge) -> None:
    """Waits until no replica has outstanding tokens (every request's log phase ran)."""
    deadline = time.monotonic() + 5
    while any(st["outstanding_tokens"] for st in e.status()["upstreams"][MODEL].values()):
        assert time.monotonic() < deadline, e.status()["upstreams"]
        time.sleep(0.05)


@pytest.fixture(scope="module")
def count(counter_stub: counter_pb2_grpc.TokenCounterStub
          ) -> Callable[[dict[str, Any]], counter_pb2.CountReply]:
    """The session counter's reply for a chat body (what the edge is told)."""
    def call(body: dict[str, Any]) -> counter_pb2.CountReply:
        return counter_stub.CountTokens(counter_pb2.CountRequest(
            model=MODEL, endpoint=counter_pb2.ENDPOINT_CHAT, body=json.dumps(body).encode()))
    return call


def _shared_tokens(sent: counter_pb2.CountReply, now: counter_pb2.CountReply) -> int:
    """Tokens of `now`'s prompt in blocks that `sent`'s prompt had (the same hash at the
    same place, from the first block on), at most (prompt_tokens - 1) // block_size
    blocks: what the approximate index holds for a replica that got `sent` (exactly:
    fewer than 64 blocks, where every block is recorded)."""
    a, b = sent.block_hashes, now.block_hashes
    blocks = 0
    while blocks * 8 < min(len(a), len(b)) and a[blocks * 8:blocks * 8 + 8] == \
            b[blocks * 8:blocks * 8 + 8]:
        blocks += 1
    blocks = min(blocks, (now.prompt_tokens - 1) // now.block_size)
    assert blocks < 64
    return blocks * now.block_size


def test_the_counter_gives_the_shared_prompt_several_blocks(
        count: Callable[[dict[str, Any]], counter_pb2.CountReply]) -> None:
    # the premise of the tests below: blocks of 128, three or more of them shared
    one, two = count(_body("What is 1 + 1?")), count(_body("Name a colour."))
    assert (one.block_size, len(one.block_hashes)) == (128, 8 * (one.prompt_tokens // 128))
    assert _shared_tokens(one, two) >= 3 * 128


def test_a_shared_prefix_goes_back_to_the_replica_that_got_it(
        edge_variant_off_vllm: Callable[..., Edge], replicas: Callable[..., FastUpstream],
        count: Callable[[dict[str, Any]], counter_pb2.CountReply]) -> None:
    a, b = replicas(), replicas()
    e = _edge(edge_variant_off_vllm, "prefix-approx", [a, b], policy="prefix")
    first = _chat(e, "What is 1 + 1?")
    # nothing was sent anywhere yet: no hit expected, the index is the edge's
    assert (first.headers[EXPECTED], first.headers[SOURCE]) == ("0", "approximate")
    got = first.headers["x-tokengate-upstream"]
    sent = [count(_body("What is 1 + 1?"))]
    for question in ("Name a colour.", "Name a colour.", "Spell 'cat'."):
        _idle(e)
        r = _chat(e, question)
        now = count(_body(question))
        # the index holds the chains of every prompt sent there: the longest shared one
        want = max(_shared_tokens(before, now) for before in sent)
        # (prompt - hit) + outstanding: the replica that got the first costs `want` less
        assert (r.headers["x-tokengate-upstream"], r.headers[EXPECTED], r.headers[SOURCE]) \
            == (got, str(want), "approximate")
        ev = e.event(r.headers["x-request-id"])
        assert (ev["upstream"], ev["expected_cached_tokens"], ev["expected_cached_source"]) \
            == (got, want, "approximate")
        sent.append(now)
    assert e.event(first.headers["x-request-id"])["expected_cached_tokens"] == 0


def test_load_outweighs_the_prefix_hit(
        edge_variant_off_vllm: Callable[..., Edge], replicas: Callable[..., FastUpstream],
        count: Callable[[dict[str, Any]], counter_pb2.CountReply]) -> None:
    a, b = replicas(itl_ms=20), replicas(itl_ms=20)
    # a load weight of 1: one running request of the prefix (its prompt + 200 reserved
    # tokens) outweighs the hit (at the default 0.25 it takes four such)
    e = _edge(edge_variant_off_vllm, "prefix-load", [a, b], policy="prefix", load_weight=1.0)
    got = _chat(e, "What is 1 + 1?").headers["x-tokengate-upstream"]
    _idle(e)
    # a stream of 200 tokens (4 s) with the same prefix goes there too, and stays
    with httpx.stream("POST", e.base_url + "/chat/completions", headers=HEADERS,
                      content=json.dumps(_body("Count to 200.", 200, True)),
                      timeout=30) as long:
        assert long.headers["x-tokengate-upstream"] == got
        held = int(long.headers[EXPECTED])
        assert held > 0
        outstanding = e.status()["upstreams"][MODEL][got]["outstanding_tokens"]
        prompt = count(_body("Name a colour.")).prompt_tokens
        # its outstanding tokens (its prompt + 200 reserved) exceed the prefill the hit
        # saves: cost there (prompt - hit) + outstanding > prompt, the cost elsewhere
        assert outstanding > held
        r = _chat(e, "Name a colour.")
        other = _name(b) if got == _name(a) else _name(a)
        assert (r.headers["x-tokengate-upstream"], r.headers[EXPECTED]) == (other, "0")
        assert int(r.headers["x-token-count"]) == prompt
    # with the load gone the hit wins again (both replicas now hold the prefix: either)
    _idle(e)
    r = _chat(e, "Spell 'cat'.")
    assert int(r.headers[EXPECTED]) > 0


def test_the_prediction_and_the_index_are_in_the_metrics(
        edge_variant_off_vllm: Callable[..., Edge],
        replicas: Callable[..., FastUpstream]) -> None:
    a, b = replicas(), replicas()
    e = _edge(edge_variant_off_vllm, "prefix-metrics", [a, b], policy="prefix")
    answers = [_chat(e, q) for q in ("What is 1 + 1?", "Name a colour.", "Spell 'cat'.")]
    events = [e.event(r.headers["x-request-id"]) for r in answers]
    expected = sum(ev["expected_cached_tokens"] for ev in events)
    cached = sum(ev["cached_tokens"] for ev in events)
    over = sum(max(0, ev["expected_cached_tokens"] - ev["cached_tokens"]) for ev in events)
    assert expected > 0
    text = httpx.get(f"http://127.0.0.1:{e.status_port}/metrics", timeout=10).text
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(text) for s in f.samples}
    labels = (("model", MODEL), ("source", "approximate"))
    assert samples[("tokengate_prefix_expected_tokens_total", labels)] == expected
    assert samples.get(("tokengate_prefix_cached_tokens_total", labels), 0) == cached
    assert samples.get(("tokengate_prefix_overestimated_tokens_total", labels), 0) == over
    for up in (a, b):
        # the replicas' metrics are not read here: the index's default
        assert samples[("tokengate_prefix_capacity_blocks",
                        (("model", MODEL), ("replica", _name(up))))] == 8192
    size = samples[("tokengate_prefix_index_capacity_bytes", ())]
    free = samples[("tokengate_prefix_index_free_bytes", ())]
    assert size >= 32 * 2**20 - 2**16 and 0 < free < size


def test_round_robin_takes_each_replica_in_turn(
        edge_variant_off_vllm: Callable[..., Edge],
        replicas: Callable[..., FastUpstream]) -> None:
    a, b = replicas(), replicas()
    e = _edge(edge_variant_off_vllm, "prefix-rr", [a, b], policy="round_robin")
    served = [_chat(e, "What is 1 + 1?") for _ in range(6)]
    names = [r.headers["x-tokengate-upstream"] for r in served]
    # one turn counter for both nginx workers: strictly alternating, prefix or not
    assert names[0] != names[1] and names == names[:2] * 3, names
    assert all(EXPECTED not in r.headers for r in served)
    ev = e.event(served[-1].headers["x-request-id"])
    assert (ev["expected_cached_tokens"], ev["expected_cached_source"]) == (0, None)


def test_least_outstanding_is_unchanged_and_predicts_nothing(
        edge_variant_off_vllm: Callable[..., Edge],
        replicas: Callable[..., FastUpstream]) -> None:
    slow, fast = replicas(ttft_ms=1500), replicas()
    e = _edge(edge_variant_off_vllm, "prefix-lo", [slow, fast], policy="least_outstanding")
    # the counter still sends the block hashes (its configuration routes by prefix);
    # the edge's policy ignores them: 8 requests 2 at a time, the slow replica's
    # reservation keeps every request that comes meanwhile on the fast one
    with httpx.Client(timeout=30) as c:
        def one(_: int) -> httpx.Response:
            return c.post(e.base_url + "/chat/completions", headers=HEADERS,
                          content=json.dumps(_body("What is 1 + 1?")))
        with ThreadPoolExecutor(2) as pool:
            answers = list(pool.map(one, range(8)))
    assert [r.status_code for r in answers] == [200] * 8
    on_fast = sum(r.headers["x-tokengate-upstream"] == _name(fast) for r in answers)
    assert on_fast >= 6
    assert all(EXPECTED not in r.headers for r in answers)
    ev = e.event(answers[-1].headers["x-request-id"])
    assert (ev["expected_cached_tokens"], ev["expected_cached_source"]) == (0, None)


def _metrics(e: Edge) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = httpx.get(f"http://127.0.0.1:{e.status_port}/metrics", timeout=10).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


@dataclass
class Precise:
    """Two simulated replicas with KV events, a counter following both, an edge routing
    by prefix in front of them; ``hits(question)``: the counter's prefix_hits for that
    chat body (replica -> tokens); ``worker_hits``: the same, asked of each counter worker
    (each follows the replicas' KV events on its own)."""

    sims: list[SimReplica]
    edge: Edge
    hits: Callable[..., dict[str, int]]
    worker_hits: Callable[..., list[dict[str, int]]]

    def until(self, question: str, ok: Callable[[dict[str, int]], bool],
              system: bool = True) -> None:
        """Wait until every counter worker's view of ``question``'s hits satisfies ``ok``,
        the workers agree, and two polls in a row saw the same (a replica's events for one
        request may come in several batches)."""
        deadline = time.monotonic() + 15
        last: list[dict[str, int]] = []
        while True:
            views = self.worker_hits(question, system)
            if all(ok(h) for h in views) and views[1:] == views[:-1] and views == last:
                return
            assert time.monotonic() < deadline, views
            last = views
            time.sleep(0.1)


@contextmanager
def _precise(edge_variant_off_vllm: Callable[..., Edge], config_path: Path, tmp_path: Path,
             name: str, itl_ms: float = 1) -> Iterator[Precise]:
    model_dir = Path(yaml.safe_load(config_path.read_text())["models"][MODEL]["dir"])
    sims = [SimReplica(SimSettings(model=MODEL, model_dir=model_dir, block_size=16,
                                   prefill_tokens_per_s=1e6, ttft_overhead_ms=0,
                                   itl_ms=itl_ms,
                                   kv_events_endpoint=f"tcp://127.0.0.1:{free_port()}"),
                       name=f"test-sim-{name}{PORT_OFFSET or ''}", state_dir=tmp_path)
            for _ in range(2)]
    try:
        for sim in sims:
            sim.start()
        events = {sim.address: sim.settings.kv_events_endpoint for sim in sims}

        def edit(raw: dict[str, Any]) -> None:
            m = raw["models"][MODEL]
            m["upstreams"] = list(events)
            m["embedded"] = False
            m["routing"] = {**m.get("routing", {}), "policy": "prefix", "block_size": 16,
                            "kv_events": events}
            raw["edge"]["admission"] = {"metrics_interval_ms": 0}
        raw = yaml.safe_load(config_path.read_text())
        edit(raw)
        path = TEST_DIR / f"{name}-counter.yaml"
        path.write_text(yaml.safe_dump(raw, sort_keys=False))
        sock, port = TEST_DIR / f"{name}-counter.sock", free_port()
        counter = devstack.counter_service(path, port=port, unix_socket=sock, workers=2,
                                           name=f"test-counter-{name}{PORT_OFFSET or ''}")
        counter.start()
        try:
            e = edge_variant_off_vllm(name, edit, counter_socket=sock)
            with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = counter_pb2_grpc.TokenCounterStub(channel)

                def request(question: str, system: bool) -> counter_pb2.CountRequest:
                    return counter_pb2.CountRequest(
                        model=MODEL, endpoint=counter_pb2.ENDPOINT_CHAT,
                        body=json.dumps(_body(question, system=system)).encode())

                def hits(question: str, system: bool = True) -> dict[str, int]:
                    reply = stub.CountTokens(request(question, system))
                    return {h.upstream: h.cached_tokens for h in reply.prefix_hits}

                def worker_hits(question: str, system: bool = True) -> list[dict[str, int]]:
                    views = []
                    for i in range(2):
                        with frames.Client(f"{sock}.{i}") as c:
                            reply = c.count(request(question, system))
                        views.append({h.upstream: h.cached_tokens for h in reply.prefix_hits})
                    return views

                yield Precise(sims, e, hits, worker_hits)
        finally:
            counter.stop()
    finally:
        for sim in sims:
            sim.stop()


def test_the_counters_kv_events_predict_the_replicas_hit_exactly(
        edge_variant_off_vllm: Callable[..., Edge], config_path: Path,
        tmp_path: Path) -> None:
    with _precise(edge_variant_off_vllm, config_path, tmp_path, "prefix-events") as p:
        e, events = p.edge, [sim.address for sim in p.sims]
        # both replicas followed (connected), nothing cached yet
        p.until("What is 1 + 1?", lambda h: set(h) == set(events))
        first = _chat(e, "What is 1 + 1?")
        assert (first.headers[EXPECTED], first.headers[SOURCE]) == ("0", "events")
        got = first.headers["x-tokengate-upstream"]
        # the replica's BlockStored events reach the counter
        p.until("Name a colour.", lambda h: h.get(got, 0) > 0)
        want = p.hits("Name a colour.")
        assert want[next(a for a in events if a != got)] == 0
        r = _chat(e, "Name a colour.")
        assert (r.headers["x-tokengate-upstream"], r.headers[EXPECTED],
                r.headers[SOURCE]) == (got, str(want[got]), "events")
        ev = e.event(r.headers["x-request-id"])
        # the replica served exactly the predicted tokens from its cache
        assert (ev["expected_cached_tokens"], ev["cached_tokens"]) == (want[got], want[got])
        labels = (("model", MODEL), ("source", "events"))
        samples = _metrics(e)
        assert samples[("tokengate_prefix_expected_tokens_total", labels)] == want[got]
        assert samples[("tokengate_prefix_cached_tokens_total", labels)] == want[got]
        assert ("tokengate_prefix_overestimated_tokens_total", labels) not in samples


def test_a_replica_killed_mid_run_is_learned_again_and_only_its_requests_fail(
        edge_variant_off_vllm: Callable[..., Edge], config_path: Path,
        tmp_path: Path) -> None:
    """A replica killed (SIGKILL) under load: only requests in flight on it fail (the
    edge passes new ones to the other: nothing was sent to the dead one); restarted on
    the same port, its sequence numbers start again, so the counter forgets what it held
    (no stale hit) and learns it again from its new events."""
    with _precise(edge_variant_off_vllm, config_path, tmp_path, "prefix-kill",
                  itl_ms=20) as p:
        e, (a, b) = p.edge, p.sims
        p.until("What is 1 + 1?", lambda h: set(h) == {a.address, b.address})
        questions = [f"Question {i}: name a colour." for i in range(6)]
        done: list[tuple[float, float, int, str]] = []  # sent, ended, status, replica
        stop = time.monotonic() + 1e9

        def client(i: int) -> None:
            with httpx.Client(timeout=30) as c:
                while time.monotonic() < stop:
                    sent = time.monotonic()
                    try:
                        r = c.post(e.base_url + "/chat/completions", headers=HEADERS,
                                   content=json.dumps(_body(questions[i % 6], 20, True)))
                        status, where = r.status_code, r.headers.get(
                            "x-tokengate-upstream", "")
                    except httpx.HTTPError:
                        status, where = 0, ""
                    done.append((sent, time.monotonic(), status, where))

        with ThreadPoolExecutor(4) as pool:
            for i in range(4):
                pool.submit(client, i)
            try:
                deadline = time.monotonic() + 20
                while not any(w == a.address for *_, w in done):
                    assert time.monotonic() < deadline, "no request reached the first replica"
                    time.sleep(0.1)
                held = p.hits(questions[0]).get(a.address, 0)
                # a prompt only the first replica holds, which no client sends again: any
                # hit on it after the restart would be stale (the clients' own prompts are
                # re-learned from their new requests as soon as the edge sends it one)
                only_a = "Held by the first replica only: " + " ".join(
                    f"h{j}" for j in range(40))
                r = httpx.post(a.url + "/chat/completions", json=_body(only_a, system=False),
                               timeout=30)
                assert r.status_code == 200, r.text
                p.until(only_a, lambda h: h.get(a.address, 0) > 0, False)
                killed = time.monotonic()
                assert a.service.proc is not None
                a.service.proc.kill()
                a.service.proc.wait()
                dead = time.monotonic()  # until then it may still accept a connection
                time.sleep(1)
                a.service.start()
                # connected again: what it held before is gone (re-learned, not stale)
                p.until("What is 1 + 1?", lambda h: a.address in h)
                assert p.hits(only_a, False).get(a.address) == 0
                time.sleep(2)
            finally:
                # the clients stop on a failure above too: the pool's exit waits for them
                stop = time.monotonic()
        failed = [d for d in done if d[2] != 200]
        assert failed, "the kill failed no request in flight: it proved nothing"
        # every failure was sent before the replica was gone and ended after the kill
        # (in flight on it); at most one per client
        assert all(sent < dead and ended > killed for sent, ended, _, _ in failed), failed
        assert len(failed) <= 4
        after = [d for d in done if d[0] > dead + 0.5]
        assert after and all(d[2] == 200 for d in after)
        assert held > 0
        # back in (it was out until a health probe passed): a prompt neither replica
        # holds (no shared system prompt: ties rotate) lands on it sooner or later, and
        # its new events predict the next hit exactly
        deadline, i = time.monotonic() + 30, 0
        words = " ".join(f"w{j}" for j in range(40))
        while True:
            question, i = f"Unseen {i}: {words}", i + 1
            if _chat(e, question, False).headers["x-tokengate-upstream"] == a.address:
                break
            assert time.monotonic() < deadline, "the restarted replica never came back"
            time.sleep(0.3)
        p.until(question, lambda h: h.get(a.address, 0) > 0, False)
        want = p.hits(question, False)[a.address]
        r = _chat(e, question, False)
        ev = e.event(r.headers["x-request-id"])
        assert (r.headers["x-tokengate-upstream"], ev["expected_cached_tokens"],
                ev["cached_tokens"]) == (a.address, want, want)

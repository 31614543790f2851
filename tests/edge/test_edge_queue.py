"""Fair queueing (edge.queue, lua/tokengate/queue.lua) on the real edge.

One replica (TokenStorm's fast upstream) answers each request after ``TTFT_MS``, and the
model's ``max_concurrency`` is 1: while one request is served, the others wait in their
keys' queues, and the order they are dispatched in is the queue's (the virtual token
counters, priorities), seen in the order the answers end. A test waits for the queue
depth it needs (the ``tokengate_queue_requests`` gauge) before it sends the next request,
so nothing depends on how fast the machine is.
"""

from __future__ import annotations

import json
import os
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from tokenstorm.null_server import FastUpstream

from tests.conftest import MODEL, key_digest
from tests.fixtures_edge import Edge
from tests.fixtures_ledger import wait_until

TTFT_MS = 700
QUEUE_KEYS = {"q-heavy": ("tg-test-q-heavy", "normal", 1.0),
              "q-light": ("tg-test-q-light", "normal", 1.0),
              "q-low": ("tg-test-q-low", "low", 1.0)}


def _edge(edge_variant_off_vllm: Callable[..., Edge], name: str, up: FastUpstream,
          **queue: Any) -> Edge:
    def edit(raw: dict[str, Any]) -> None:
        m = raw["models"][MODEL]
        m["upstreams"] = [f"127.0.0.1:{up.port}"]
        m["embedded"] = False
        m["max_concurrency"] = 1
        raw["edge"]["queue"] = {"enabled": True, "max_wait_ms": 20_000,
                                "key_max_requests": 3, **queue}
        for key_id, (key, priority, share) in QUEUE_KEYS.items():
            raw["keys"][key_id] = {"sha256": key_digest(key), "rpm": 1000,
                                   "tpm": 10_000_000, "priority": priority,
                                   "fair_share": share}
    return edge_variant_off_vllm(name, edit)


def _chat(e: Edge, key_id: str, timeout: float = 60,
          headers: dict[str, str] | None = None) -> httpx.Response:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    return httpx.post(e.base_url + "/chat/completions", content=json.dumps(body),
                      headers={"Authorization": f"Bearer {QUEUE_KEYS[key_id][0]}",
                               "Content-Type": "application/json", **(headers or {})},
                      timeout=timeout)


class Sender:
    """Requests sent from threads; ``ended`` lists (label, answer) in the order the
    answers came back."""

    def __init__(self, e: Edge) -> None:
        self.e = e
        self.ended: list[tuple[str, httpx.Response | Exception]] = []
        self.threads: list[threading.Thread] = []
        self.lock = threading.Lock()

    def send(self, label: str, key_id: str, **kw: Any) -> None:
        def run() -> None:
            try:
                r: httpx.Response | Exception = _chat(self.e, key_id, **kw)
            except Exception as exc:  # noqa: BLE001 - the test looks at it
                r = exc
            with self.lock:
                self.ended.append((label, r))
        t = threading.Thread(target=run)
        t.start()
        self.threads.append(t)

    def join(self) -> dict[str, httpx.Response | Exception]:
        for t in self.threads:
            t.join(120)
        return dict(self.ended)

    def order(self) -> list[str]:
        return [label for label, _ in self.ended]


def _gauges(e: Edge) -> dict[tuple[str, str], float]:
    text = httpx.get(f"http://127.0.0.1:{e.status_port}/metrics", timeout=10).text
    return {(s.name, s.labels.get("priority") or s.labels.get("reason") or ""): s.value
            for f in text_string_to_metric_families(text) for s in f.samples
            if s.name.startswith("tokengate_queue_")}


def _waiting(e: Edge, n: int, priority: str = "normal") -> None:
    wait_until(lambda: _gauges(e).get(("tokengate_queue_requests", priority)) == n, 30,
               what=f"{n} requests waiting ({priority})")


def _in_service(e: Edge, up: FastUpstream) -> None:
    """Waits until a request holds the replica's one slot."""
    wait_until(lambda: e.status()["upstreams"][MODEL][f"127.0.0.1:{up.port}"]
               ["outstanding_tokens"] > 0, 30, what="a request in service")


def _queued(e: Edge, up: FastUpstream, s: Sender, served: tuple[str, str],
            *waiting: tuple[str, str]) -> None:
    """Sends ``served`` (label, key) and waits until it holds the replica's one slot, then
    each of ``waiting`` in turn, waiting until it waits (the keys' priority: normal)."""
    s.send(*served)
    _in_service(e, up)
    for n, (label, key) in enumerate(waiting, 1):
        s.send(label, key)
        _waiting(e, n)


@pytest.fixture
def slow_replica(replicas: Callable[..., FastUpstream]) -> FastUpstream:
    return replicas(ttft_ms=TTFT_MS)


def test_requests_wait_instead_of_503_and_a_light_key_passes_a_flooding_one(
        edge_variant_off_vllm: Callable[..., Edge], slow_replica: FastUpstream) -> None:
    """One request in service, two of the heavy key waiting, then the light key's: it is
    served next, not after both as first come, first served would. Its counter was lifted
    to the smallest of the keys waiting (the heavy key's), no higher; equal counters go to
    the key with fewer requests waiting."""
    e = _edge(edge_variant_off_vllm, "queue-vtc", slow_replica)
    s = Sender(e)
    _queued(e, slow_replica, s, ("heavy-0", "q-heavy"), ("heavy-1", "q-heavy"),
            ("heavy-2", "q-heavy"), ("light", "q-light"))
    answers = s.join()
    assert all(isinstance(r, httpx.Response) and r.status_code == 200
               for r in answers.values()), answers
    assert s.order() == ["heavy-0", "light", "heavy-1", "heavy-2"]
    waited = {k: int(r.headers["x-tokengate-queue-ms"]) for k, r in answers.items()
              if isinstance(r, httpx.Response)}
    assert waited["heavy-0"] == 0 and min(waited["heavy-1"], waited["light"]) > 0
    assert waited["light"] < waited["heavy-1"] < waited["heavy-2"]
    events = {k: e.event(r.headers["x-request-id"]) for k, r in answers.items()
              if isinstance(r, httpx.Response)}
    assert {k: ev["queue_ms"] for k, ev in events.items()} == waited
    g = _gauges(e)
    assert g[("tokengate_queue_requests", "normal")] == 0
    assert g[("tokengate_queue_tokens", "normal")] == 0
    assert g[("tokengate_queue_wait_seconds_count", "")] == 3


def test_a_higher_priority_is_served_first(edge_variant_off_vllm: Callable[..., Edge],
                                           slow_replica: FastUpstream) -> None:
    e = _edge(edge_variant_off_vllm, "queue-priority", slow_replica)
    s = Sender(e)
    s.send("first", "q-heavy")
    _in_service(e, slow_replica)
    s.send("low", "q-low")
    _waiting(e, 1, "low")
    s.send("normal", "q-light")
    _waiting(e, 1, "normal")
    answers = s.join()
    assert all(isinstance(r, httpx.Response) and r.status_code == 200
               for r in answers.values()), answers
    assert s.order() == ["first", "normal", "low"]


def test_the_bounds_and_the_deadline_answer_in_the_apis_shape(
        edge_variant_off_vllm: Callable[..., Edge], slow_replica: FastUpstream) -> None:
    """A key at key_max_requests gets 429 queue_full, a request past its deadline (its
    own, shorter, header) 503 queue_timeout: both with Retry-After, nothing reserved,
    a usage event each."""
    e = _edge(edge_variant_off_vllm, "queue-bounds", slow_replica, key_max_requests=2)
    s = Sender(e)
    _queued(e, slow_replica, s, ("served", "q-heavy"), ("a", "q-heavy"), ("b", "q-heavy"))
    full = _chat(e, "q-heavy")
    assert full.status_code == 429, full.text
    err = full.json()["error"]
    assert (err["type"], err["code"]) == ("requests", "queue_full")
    assert int(full.headers["retry-after"]) >= 1
    # a low-priority request waits behind both of them, whatever the machine's speed
    late = _chat(e, "q-low", headers={"X-Tokengate-Queue-Timeout-Ms": "300"})
    assert late.status_code == 503, late.text
    assert late.json()["error"]["code"] == "queue_timeout"
    assert "(its limit: 300 ms)" in late.json()["error"]["message"]
    assert int(late.headers["retry-after"]) >= 1
    ev = e.event(late.headers["x-request-id"])
    assert (ev["status"], ev["error"], ev["reserved"]) == (503, "queue_timeout", 0)
    assert ev["queue_ms"] >= 300
    assert e.event(full.headers["x-request-id"])["error"] == "queue_full"
    answers = s.join()
    assert [r.status_code for r in answers.values() if isinstance(r, httpx.Response)] == \
        [200, 200, 200]
    g = _gauges(e)
    assert (g[("tokengate_queue_refused_total", "key_full")],
            g[("tokengate_queue_refused_total", "timeout")]) == (1, 1)


def test_a_client_that_leaves_while_queued_is_taken_out_at_once(
        edge_variant_off_vllm: Callable[..., Edge], slow_replica: FastUpstream) -> None:
    e = _edge(edge_variant_off_vllm, "queue-left", slow_replica)
    s = Sender(e)
    s.send("served", "q-heavy")
    _in_service(e, slow_replica)
    s.send("gone", "q-light", timeout=0.3)
    s.join()
    gone = dict(s.ended)["gone"]
    assert isinstance(gone, httpx.TimeoutException)
    wait_until(lambda: _gauges(e).get(("tokengate_queue_refused_total", "left")) == 1, 10,
               what="the queued client's leaving counted")
    ev = [x for x in e.events() if x["key_id"] == "q-light"]
    assert len(ev) == 1 and ev[0]["status"] == 499 and ev[0]["reserved"] == 0
    assert ev[0]["queue_ms"] > 0 and ev[0]["upstream"] is None
    g = _gauges(e)
    assert g[("tokengate_queue_requests", "normal")] == 0
    # the queue is not stuck on it: the next request is served
    assert _chat(e, "q-light").status_code == 200


def test_a_reload_while_requests_wait_loses_none(
        edge_variant_off_vllm: Callable[..., Edge], slow_replica: FastUpstream) -> None:
    e = _edge(edge_variant_off_vllm, "queue-reload", slow_replica)
    s = Sender(e)
    for i in range(3):
        s.send(f"r{i}", "q-heavy" if i % 2 else "q-light")
    _waiting(e, 2)
    assert e.service.proc is not None
    e.service.proc.send_signal(signal.SIGHUP)  # nginx -s reload: new workers, same dicts
    answers = s.join()
    assert [r.status_code for r in answers.values() if isinstance(r, httpx.Response)] == \
        [200, 200, 200], answers
    # the gauge drops in the log phase, after the answer was sent
    wait_until(lambda: _gauges(e)[("tokengate_queue_requests", "normal")] == 0,
               what="the queue gauge back at 0")


def _workers(e: Edge) -> list[int]:
    assert e.service.proc is not None
    master = e.service.proc.pid
    return [int(p) for p in
            Path(f"/proc/{master}/task/{master}/children").read_text().split()]


def test_a_worker_killed_with_requests_in_flight_and_queued_leaves_nothing_counted(
        edge_variant_off_vllm: Callable[..., Edge], slow_replica: FastUpstream) -> None:
    """SIGKILL of every nginx worker while one request is served and one waits: the
    master starts new workers, which take the dead workers' in-flight request out of the
    replica's count (else it stayed at max_concurrency for good) and their ticket out of
    the queue; the next request is served."""
    e = _edge(edge_variant_off_vllm, "queue-killed", slow_replica)
    s = Sender(e)
    _queued(e, slow_replica, s, ("served", "q-heavy"), ("queued", "q-light"))
    before = _workers(e)
    for w in before:
        os.kill(w, signal.SIGKILL)
    wait_until(lambda: len(set(_workers(e)) - set(before)) == 2, 30, what="new workers")
    s.join()
    wait_until(lambda: _gauges(e).get(("tokengate_queue_requests", "normal")) == 0, 30,
               what="the dead worker's ticket out of the queue")
    up = e.status()["upstreams"][MODEL][f"127.0.0.1:{slow_replica.port}"]
    assert up["outstanding_tokens"] == 0
    r = _chat(e, "q-light", headers={"X-Tokengate-Queue-Timeout-Ms": "5000"})
    assert r.status_code == 200, r.text

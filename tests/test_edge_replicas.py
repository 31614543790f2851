"""Several vLLM replicas behind one model: the edge sends each request to the replica with
the fewest outstanding reserved tokens, takes a replica that fails out (and back in when
its health probe passes), and tries another one only when nothing was sent yet.

The replicas are TokenStorm's fast upstream (it answers like vLLM 0.32) on several
ports, standing in for GPU vLLM servers; one of them is slow.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
from tokengate.storm.null_server import FastUpstream, free_port
from tokengate.storm.upstream import UpstreamOptions

from tests.conftest import MODEL
from tests.fixtures_edge import MAIN_KEY, Edge

HEADERS = {"Authorization": f"Bearer {MAIN_KEY}", "Content-Type": "application/json"}


def _edge(edge_variant_off_vllm: Callable[..., Edge], name: str, ups: list[FastUpstream],
          **edge: Any) -> Edge:
    def edit(raw: dict[str, Any]) -> None:
        raw["models"][MODEL]["upstreams"] = [f"127.0.0.1:{u.port}" for u in ups]
        raw["models"][MODEL]["embedded"] = False
        raw["edge"].update(edge)
    return edge_variant_off_vllm(name, edit)


def _chat(e: Edge, max_tokens: int = 4, stream: bool = False) -> httpx.Response:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": max_tokens, "stream": stream}
    return httpx.post(e.base_url + "/chat/completions", content=json.dumps(body),
                      headers=HEADERS, timeout=60)


def test_requests_go_to_the_replica_with_the_fewest_outstanding_tokens(
        edge_variant_off_vllm: Callable[..., Edge],
        replicas: Callable[..., FastUpstream]) -> None:
    slow, fast = replicas(ttft_ms=1500), replicas()
    e = _edge(edge_variant_off_vllm, "replicas-balance", [slow, fast])
    # 24 requests, 4 at a time: a request on the slow replica holds its reservation for
    # 1.5 s, so while one is there every new request goes to the fast one
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda _: _chat(e), range(24)))
    assert [r.status_code for r in answers] == [200] * 24
    served = Counter(r.headers["x-tokengate-upstream"] for r in answers)
    assert served[f"127.0.0.1:{fast.port}"] >= 18, served
    # the usage event names the replica that served
    r = answers[-1]
    assert e.event(r.headers["x-request-id"])["upstream"] == r.headers["x-tokengate-upstream"]
    # nothing is outstanding once every request ended
    deadline = time.monotonic() + 5
    while any(st["outstanding_tokens"] for st in e.status()["upstreams"][MODEL].values()):
        assert time.monotonic() < deadline, e.status()["upstreams"]
        time.sleep(0.1)


def test_a_dead_replica_costs_no_request_and_is_taken_out(
        edge_variant_off_vllm: Callable[..., Edge],
        replicas: Callable[..., FastUpstream]) -> None:
    a, b = replicas(), replicas()
    e = _edge(edge_variant_off_vllm, "replicas-dead", [a, b], upstream_eject_s=30,
              upstream_health_interval_ms=0)
    a.stop()
    dead, alive = f"127.0.0.1:{a.port}", f"127.0.0.1:{b.port}"
    # connection refused before anything was sent: nginx passes the request on
    answers = [_chat(e, stream=i % 2 == 1) for i in range(10)]
    assert [r.status_code for r in answers] == [200] * 10
    assert {r.headers["x-tokengate-upstream"] for r in answers} == {alive}
    st = e.status()["upstreams"][MODEL]
    assert (st[dead]["out"], st[alive]["out"]) == (True, False)
    assert "upstream " + dead + " of " + MODEL + " out for 30 s" in e.log_path.read_text()


def test_the_health_probe_takes_a_replica_out_and_back_in(
        edge_variant_off_vllm: Callable[..., Edge],
        replicas: Callable[..., FastUpstream]) -> None:
    a, b = replicas(), replicas()
    e = _edge(edge_variant_off_vllm, "replicas-health", [a, b],
              upstream_health_interval_ms=200, upstream_health_timeout_ms=150)
    name = f"127.0.0.1:{a.port}"

    def out() -> bool:
        return bool(e.status()["upstreams"][MODEL][name]["out"])

    def wait_for(want: bool) -> None:
        deadline = time.monotonic() + 10
        while out() != want:
            assert time.monotonic() < deadline, f"{name} out={out()}, wanted {want}"
            time.sleep(0.1)

    wait_for(False)
    a.stop()
    wait_for(True)
    # no request is sent to it while it is out
    answers = [_chat(e) for _ in range(6)]
    assert {r.headers["x-tokengate-upstream"] for r in answers} == {f"127.0.0.1:{b.port}"}
    a.start()
    wait_for(False)


def test_every_replica_down_is_a_502_in_openai_shape(
        edge_variant_off_vllm: Callable[..., Edge],
        replicas: Callable[..., FastUpstream]) -> None:
    a, b = replicas(), replicas()
    e = _edge(edge_variant_off_vllm, "replicas-all-down", [a, b],
              upstream_health_interval_ms=0)
    a.stop()
    b.stop()
    r = _chat(e)
    assert r.status_code == 502
    assert r.json()["error"]["code"] == "upstream_unavailable"
    assert r.headers["retry-after"] == "5"
    ev = e.event(r.headers["x-request-id"])
    assert (ev["status"], ev["error"], ev["upstream"]) == \
        (502, "upstream_unavailable", r.headers["x-tokengate-upstream"])


class FakeDNS:
    """A DNS server on 127.0.0.1 (UDP) answering A queries for the names in ``records``
    (changeable while it runs) and NXDOMAIN for anything else, in RFC 1035's wire format:
    the edge's resolver speaks real DNS to it."""

    def __init__(self) -> None:
        self.records: dict[str, str] = {}
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _answer(self, q: bytes) -> bytes:
        i, labels = 12, []
        while q[i]:
            labels.append(q[i + 1:i + 1 + q[i]].decode())
            i += 1 + q[i]
        qtype = int.from_bytes(q[i + 1:i + 3], "big")
        question = q[12:i + 5]
        addr = self.records.get(".".join(labels)) if qtype == 1 else None
        if addr is None:  # NXDOMAIN, no answer
            return q[:2] + b"\x81\x83\x00\x01\x00\x00\x00\x00\x00\x00" + question
        answer = (b"\xc0\x0c\x00\x01\x00\x01" + (1).to_bytes(4, "big") + b"\x00\x04"
                  + socket.inet_aton(addr))
        return q[:2] + b"\x81\x80\x00\x01\x00\x01\x00\x00\x00\x00" + question + answer

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                q, peer = self.sock.recvfrom(512)
            except TimeoutError:
                continue
            self.sock.sendto(self._answer(q), peer)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self.sock.close()


def test_a_replica_given_by_name_follows_its_dns_record(
        edge_variant_off_vllm: Callable[..., Edge], tmp_path: Path) -> None:
    port = free_port()
    a = FastUpstream(UpstreamOptions(model=MODEL), port=port, name="dns-a",
                     state_dir=tmp_path).start()
    b = FastUpstream(UpstreamOptions(model=MODEL), port=port, name="dns-b",
                     state_dir=tmp_path, host="127.0.0.2").start()
    dns = FakeDNS()
    name = f"replica.tokengate.test:{port}"
    try:
        def edit(raw: dict[str, Any]) -> None:
            raw["models"][MODEL]["upstreams"] = [name]
            raw["models"][MODEL]["embedded"] = False
            raw["edge"].update(dns_resolvers=[f"127.0.0.1:{dns.port}"],
                               upstream_resolve_interval_ms=200,
                               upstream_health_interval_ms=0)
        # the name resolves nowhere yet: compiled without an address, out meanwhile
        e = edge_variant_off_vllm("replicas-dns", edit)
        r = _chat(e)
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == "upstream_unavailable"

        def address() -> Any:
            return e.status()["upstreams"][MODEL][name]["address"]

        def wait_for(addr: str) -> None:
            deadline = time.monotonic() + 10
            while address() != addr:
                assert time.monotonic() < deadline, f"address {address()}, wanted {addr}"
                time.sleep(0.1)

        dns.records["replica.tokengate.test"] = "127.0.0.1"
        wait_for("127.0.0.1")
        assert _chat(e).status_code == 200
        # the replica moves: the edge follows without a reload, and the old one can go
        dns.records["replica.tokengate.test"] = "127.0.0.2"
        wait_for("127.0.0.2")
        a.stop()
        answers = [_chat(e) for _ in range(4)]
        assert [x.status_code for x in answers] == [200] * 4
        # a name that stops resolving keeps the address it had
        dns.records.clear()
        time.sleep(0.6)
        assert address() == "127.0.0.2" and _chat(e).status_code == 200
    finally:
        dns.close()
        a.stop()
        b.stop()

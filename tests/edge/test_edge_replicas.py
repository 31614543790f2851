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
from concurrent import futures
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import httpx
from tokengate.v1 import limits_pb2 as pb
from tokengate.v1 import limits_pb2_grpc as pb_grpc
from tokenstorm.null_server import FastUpstream, free_port
from tokenstorm.upstream import UpstreamOptions

from tests.conftest import MODEL
from tests.fixtures_edge import MAIN_KEY, Edge, at_once

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



def test_an_ejected_replica_stays_out_until_a_probe_passes(
        edge_variant_off_vllm: Callable[..., Edge],
        replicas: Callable[..., FastUpstream]) -> None:
    # ejections of 1 s, probes 1.5 s apart: an ejection that expired by itself would
    # show the dead replica in again between the two
    a, b = replicas(), replicas()
    e = _edge(edge_variant_off_vllm, "replicas-stay-out", [a, b], upstream_eject_s=1,
              upstream_health_interval_ms=1500, upstream_health_timeout_ms=300)
    dead, alive = f"127.0.0.1:{a.port}", f"127.0.0.1:{b.port}"
    a.stop()

    def out() -> bool:
        return bool(e.status()["upstreams"][MODEL][dead]["out"])

    served: list[str] = []
    while not out():  # a request that tries it fails over and takes it out
        r = _chat(e)
        assert r.status_code == 200, r.text
        served.append(r.headers["x-tokengate-upstream"])
    outs: list[bool] = []
    deadline = time.monotonic() + 4  # four ejection periods, two probes or more
    while time.monotonic() < deadline:
        r = _chat(e)
        assert r.status_code == 200, r.text
        served.append(r.headers["x-tokengate-upstream"])
        outs.append(out())
    assert set(served) == {alive}
    assert set(outs) == {True}, outs
    a.start()
    deadline = time.monotonic() + 10
    while out():
        assert time.monotonic() < deadline, "the replica was not readmitted"
        time.sleep(0.1)
    log = e.log_path.read_text()
    # one line when it went out (the first failed request or probe), one when back in
    went_out = log.count(f"upstream {dead} of {MODEL} out until its health probe passes") \
        + log.count(f"upstream {dead} of {MODEL} failed its health probe")
    assert (went_out, log.count(f"upstream {dead} of {MODEL} passed its health probe: "
                                "back in")) == (1, 1), log



def test_an_outage_under_load_logs_the_ejection_not_every_request(
        edge_variant_off_vllm: Callable[..., Edge],
        replicas: Callable[..., FastUpstream]) -> None:
    # the fault run's replicas (50 ms to the first token, 25 ms a token), 16 clients, the
    # default probes (2 s), ejections of 1 s: an outage of 5 s
    a, b = replicas(ttft_ms=50, itl_ms=25), replicas(ttft_ms=50, itl_ms=25)
    e = _edge(edge_variant_off_vllm, "replicas-outage", [a, b], upstream_eject_s=1)
    dead = f"127.0.0.1:{a.port}"
    a.stop()
    stop_at = time.monotonic() + 5

    def client(_: int) -> list[int]:
        codes = []
        while time.monotonic() < stop_at:
            codes.append(_chat(e).status_code)
        return codes

    with ThreadPoolExecutor(16) as pool:
        codes = [c for one in pool.map(client, range(16)) for c in one]
    a.start()
    deadline = time.monotonic() + 10
    while e.status()["upstreams"][MODEL][dead]["out"]:
        assert time.monotonic() < deadline, "the replica was not readmitted"
        time.sleep(0.1)
    assert set(codes) == {200}, Counter(codes)
    log = e.log_path.read_text().splitlines()
    # no line per probe or metrics read of the dead replica (every 1-2 s)
    assert [ln for ln in log if "context: ngx.timer" in ln and "connect()" in ln] == []
    kinds = Counter()
    for ln in log:
        if "connect() failed" in ln and f'upstream: "http://{dead}/' in ln:
            kinds["connect"] += 1  # a request that chose it before it was out
        elif dead in ln:
            kinds[ln.split(f"upstream {dead} of {MODEL} ", 1)[-1].split(" (")[0]] += 1
    # at most one try per client: the ones on their way when it went out
    assert kinds.pop("connect", 0) <= 16, kinds
    went_out = kinds.pop("out until its health probe passes", 0) \
        + kinds.pop("failed its health probe: out until it answers, context: ngx.timer", 0)
    assert (went_out, dict(kinds)) == (1, {
        "passed its health probe: back in, context: ngx.timer": 1,
        "sends no vLLM metrics": 1}), kinds


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



class SlowAdmittingLimits(pb_grpc.GlobalLimitsServicer):
    """A GlobalLimits that admits every request after 50 ms (a Redis round trip under
    load): the access phase yields between choosing a replica and forwarding to it."""

    def Reserve(self, request: Any, context: Any) -> Any:
        time.sleep(0.05)
        return pb.ReserveReply(admitted=True, remaining_requests=request.rpm_limit - 1,
                               remaining_tokens=request.tpm_limit - request.tokens)

    def Settle(self, request: Any, context: Any) -> Any:
        return pb.SettleReply(found=True)


def test_a_burst_on_two_idle_equal_replicas_splits_evenly(
        edge_variant_off_vllm: Callable[..., Edge],
        replicas: Callable[..., FastUpstream], tmp_path: Path) -> None:
    sock = tmp_path / "limits.sock"
    server = grpc.server(futures.ThreadPoolExecutor(32))
    pb_grpc.add_GlobalLimitsServicer_to_server(SlowAdmittingLimits(), server)
    server.add_insecure_port(f"unix:{sock}.0")
    server.start()
    # each request holds its replica for 1 s: all 32 are in flight together
    a, b = replicas(ttft_ms=1000), replicas(ttft_ms=1000)

    def edit(raw: dict[str, Any]) -> None:
        raw["models"][MODEL]["upstreams"] = [f"127.0.0.1:{u.port}" for u in (a, b)]
        raw["models"][MODEL]["embedded"] = False
        raw["global_limits"] = {"enabled": True, "listen": "127.0.0.1:1",
                                "unix_socket": str(sock)}
        raw["edge"]["global_limits_timeout_ms"] = 3000

    try:
        e = edge_variant_off_vllm("replicas-burst", edit)
        first = _chat(e)  # the count of this body is cached from here on
        assert (first.status_code, first.headers["x-tokengate-limits"]) == (200, "global")
        answers = at_once(32, lambda: _chat(e))
    finally:
        server.stop(0)
    assert [(r.status_code, r.headers["x-tokengate-limits"]) for r in answers] == \
        [(200, "global")] * 32
    served = Counter(r.headers["x-tokengate-upstream"] for r in answers)
    # the pick and the count of what the replica now carries are one step: 16/16 +- 2
    assert len(served) == 2 and min(served.values()) >= 14, served

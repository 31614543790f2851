"""The counter's index of what each replica's prefix cache holds (tokengate.counter.kv_index),
fed by a fake KV-event publisher: a ZMQ XPUB socket that sends what vLLM's
``ZmqEventPublisher`` sends (``[topic, 8-byte big-endian seq, msgpack KVEventBatch]``,
encoded with vLLM's own types) and that sees each subscription arrive, so no message is
sent before a subscriber can get it. A real vLLM restart is the bench's business; here
a publisher whose seq goes back or skips stands for it, and its socket closing for a
replica going down.

First one ``Follower`` in this process, then real ``tokengate-counter`` processes (two
workers each, both following the publishers): the ``prefix_hits`` of their replies,
a reload that changes ``routing.kv_events``, and the index's metrics.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import yaml
import zmq
from tokengate import prefix_hash
from tokengate.counter import frames, kv_index
from tokengate.v1 import counter_pb2
from tokengate_dev import devstack
from tokenstorm.process import free_port

from tests.conftest import MODEL, PORT_OFFSET, TEST_DIR, VLLM_IN_PROCESS
from tests.fixtures_ledger import wait_until

pytestmark = VLLM_IN_PROCESS  # a test imports vLLM's classes (tests/conftest.py)

BLOCK = 16
PROMPT = list(range(1000, 1000 + BLOCK * 4))   # 4 full blocks, of which 3 can be hits
HASHES = prefix_hash.block_hashes(PROMPT, BLOCK)


class FakePublisher:
    """A KV-event publisher on 127.0.0.1:<free port> that speaks vLLM 0.32's wire format
    (vllm/distributed/kv_events.py). ``int_hashes``: hashes as vLLM's default int form."""

    def __init__(self, int_hashes: bool = False, port: int | None = None) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.XPUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.XPUB_VERBOSE, 1)  # every subscription, not only the first
        self.port = port or free_port()
        self.sock.bind(f"tcp://127.0.0.1:{self.port}")
        self.endpoint = f"tcp://127.0.0.1:{self.port}"
        self.int_hashes = int_hashes
        self.subscribers = 0

    def wait_subscribers(self, n: int, timeout_s: float = 30.0) -> None:
        """Until ``n`` subscriptions (one per follower) have reached the socket."""
        deadline = time.monotonic() + timeout_s
        while self.subscribers < n:
            left = deadline - time.monotonic()
            assert left > 0, f"{self.subscribers} of {n} subscribers after {timeout_s} s"
            if self.sock.poll(int(left * 1000)) and self.sock.recv()[:1] == b"\x01":
                self.subscribers += 1

    def send(self, seq: int, events: list[Any]) -> None:
        from vllm.distributed.kv_events import KVEventBatch

        payload = msgspec.msgpack.Encoder().encode(KVEventBatch(ts=time.time(), events=events))
        self.sock.send_multipart([b"kv-events", seq.to_bytes(8, "big"), payload])

    def stored(self, blocks: range) -> Any:
        from vllm.distributed.kv_events import BlockStored

        hashes: list[Any] = [HASHES[i] for i in blocks]
        if self.int_hashes:
            hashes = [int.from_bytes(h, "big") & ((1 << 64) - 1) for h in hashes]
        return BlockStored(block_hashes=hashes, parent_block_hash=None,
                           token_ids=PROMPT[blocks.start * BLOCK:blocks.stop * BLOCK],
                           block_size=BLOCK, lora_id=None, medium="GPU", lora_name=None)

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


@pytest.fixture
def publisher() -> Iterator[FakePublisher]:
    with contextlib.closing(FakePublisher()) as p:
        yield p


KEYS = [kv_index.key_of(h) for h in HASHES]


def resets(upstream: str, reason: str) -> float:
    return kv_index.RESETS.labels("m", upstream, reason)._value.get()


@pytest.mark.unit
@pytest.mark.parametrize("int_hashes", [False, True])
def test_a_follower_learns_a_replica_and_relearns_it_after_a_restart_or_a_gap(
        int_hashes: bool) -> None:
    pub = FakePublisher(int_hashes)
    up = f"127.0.0.1:{pub.port}"
    replica = kv_index.ReplicaIndex("m", up, pub.endpoint)
    follower = kv_index.Follower(replica, zmq.Context.instance()).start()
    index = kv_index.ModelIndex((replica,))
    try:
        pub.wait_subscribers(1)
        wait_until(lambda: replica.live, 10, what="the follower connected")
        # live and idle: an entry, with nothing held
        assert index.hits(KEYS, 4, BLOCK) == [(up, 0)]
        pub.send(5, [pub.stored(range(3))])  # the first seq seen starts the count
        wait_until(lambda: replica.last_seq == 5, 10, what="seq 5")
        assert index.hits(KEYS, 4, BLOCK) == [(up, 3 * BLOCK)]
        assert index.hits(KEYS, 2, BLOCK) == [(up, 2 * BLOCK)]
        pub.send(6, [pub.stored(range(3, 4))])
        wait_until(lambda: replica.held(KEYS, 4) == 4, 10, what="block 3")
        # at most cacheable_blocks: vLLM always computes the prompt's last token
        most = prefix_hash.cacheable_blocks(len(PROMPT), BLOCK)
        assert most == 3 and index.hits(KEYS, most, BLOCK) == [(up, 3 * BLOCK)]

        # the publisher started again (seq 0): forgotten, then re-learned from its events
        before = resets(up, "restart")
        pub.send(0, [pub.stored(range(1))])
        wait_until(lambda: replica.last_seq == 0, 10, what="seq 0")
        assert index.hits(KEYS, 4, BLOCK) == [(up, BLOCK)]
        assert resets(up, "restart") == before + 1
        # seq 1 lost: whatever it said is unknown, so nothing older is trusted
        before = resets(up, "gap")
        pub.send(2, [pub.stored(range(2, 4))])
        wait_until(lambda: replica.last_seq == 2, 10, what="seq 2")
        assert replica.held(KEYS, 4) == 0 and replica.held(KEYS[2:], 2) == 2
        assert resets(up, "gap") == before + 1
        assert kv_index.BLOCKS.labels("m", up)._value.get() == 2

        # the replica goes away: no entry (the edge then treats it as one without events)
        pub.close()
        wait_until(lambda: not replica.live, 10, what="the disconnect")
        assert index.hits(KEYS, 4, BLOCK) == [] and not replica.blocks
        assert resets(up, "disconnected") >= 1
    finally:
        follower.stop()
        if not pub.sock.closed:
            pub.close()
    assert not follower.alive


# -- a real counter ------------------------------------------------------------------------

def count_request(salt: str | None = None) -> counter_pb2.CountRequest:
    body: dict[str, Any] = {"model": MODEL, "prompt": PROMPT, "max_tokens": 1}
    if salt:
        body["cache_salt"] = salt
    return counter_pb2.CountRequest(model=MODEL, endpoint=counter_pb2.ENDPOINT_COMPLETIONS,
                                    body=json.dumps(body).encode())


def hits(sock: Path, salt: str | None = None) -> dict[str, int]:
    with frames.Client(str(sock), timeout_s=10) as c:
        reply = c.count(count_request(salt))
    return {h.upstream: h.cached_tokens for h in reply.prefix_hits}


def write_config(base: Path, out: Path, events: dict[str, str], metrics: str) -> None:
    raw = yaml.safe_load(base.read_text())
    m = raw["models"][MODEL]
    # the replicas are never called: the counter only follows their publishers
    m["upstreams"] = [*events, "127.0.0.1:9"]
    m["embedded"] = False
    m["routing"] = {"policy": "prefix", "block_size": BLOCK, "kv_events": events}
    raw["metrics"] = {"counter_listen": metrics}
    out.write_text(yaml.safe_dump(raw, sort_keys=False))


def metric(listen: str, name: str, **labels: str) -> float | None:
    """The value of the counter's series ``name{labels}``; None when it has none."""
    with urllib.request.urlopen(f"http://{listen}/metrics", timeout=5) as r:
        text = r.read().decode()
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        if line.startswith(name + "{"):
            series, _, value = line.rpartition(" ")
            if ",".join(sorted(series[len(name) + 1:-1].split(","))) == want:
                return float(value)
    return None


@pytest.mark.unit
def test_an_unreachable_publisher_is_said_once_an_outage_never_per_request(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    # what the counter's unit with PrivateNetwork=yes did silently: no publisher
    # reachable, every answer's cached tokens only the edge's approximate guess
    monkeypatch.setattr(kv_index, "_SILENT_S", 0.3)
    port = free_port()
    replica = kv_index.ReplicaIndex("m", "10.9.9.9:8000", f"tcp://127.0.0.1:{port}")
    caplog.set_level(logging.INFO, logger=kv_index.log.name)
    follower = kv_index.Follower(replica, zmq.Context.instance()).start()
    try:
        def said() -> list[str]:
            return [r.getMessage() for r in caplog.records if "kv events of" in r.getMessage()]
        wait_until(lambda: said(), 10, what="the warning")
        time.sleep(1.0)  # several polls and reconnects later: still the one line
        [line] = said()
        assert line.startswith(f"kv events of 10.9.9.9:8000: not connected to "
                               f"tcp://127.0.0.1:{port} for ")
        assert not replica.live
        pub = FakePublisher(port=port)  # it comes up: one line more
        try:
            wait_until(lambda: replica.live, 10, what="the connection")
            wait_until(lambda: len(said()) == 2, 10, what="the connected line")
            assert said()[1] == (f"kv events of 10.9.9.9:8000: connected to "
                                 f"tcp://127.0.0.1:{port}")
        finally:
            pub.close()
    finally:
        follower.stop()


def test_the_counters_replies_carry_each_live_replicas_hit(config_path: Path) -> None:
    """Two workers follow two publishers (and a replica whose publisher is not there):
    each reply has the block hashes and one hit per live replica; a publisher that
    restarts is re-learned; a reload drops a replica from kv_events and adds one."""
    d = TEST_DIR / "prefix-index"
    d.mkdir(parents=True, exist_ok=True)
    a, b, c = FakePublisher(), FakePublisher(), FakePublisher(int_hashes=True)
    ua, ub, uc = (f"127.0.0.1:{p.port}" for p in (a, b, c))
    nobody = f"127.0.0.1:{free_port()}"
    listen = f"127.0.0.1:{free_port()}"
    path = d / "tokengate.yaml"
    write_config(config_path, path, {ua: a.endpoint, ub: b.endpoint,
                                     nobody: f"tcp://{nobody}"}, listen)
    sock = d / "counter.sock"
    socks = [Path(f"{sock}.{i}") for i in range(2)]
    svc = devstack.counter_service(path, port=free_port(), unix_socket=sock, workers=2,
                                   name=f"test-prefix-index{PORT_OFFSET or ''}").start()
    try:
        for p in (a, b):
            p.wait_subscribers(2)
        wait_until(lambda: all(hits(s) == {ua: 0, ub: 0} for s in socks), 20,
                   what="both replicas live in both workers, holding nothing")
        with frames.Client(str(socks[0]), timeout_s=10) as client:
            reply = client.count(count_request())
        assert reply.block_size == BLOCK
        assert reply.block_hashes == b"".join(h[:8] for h in HASHES)
        first_sent = time.time()
        a.send(0, [a.stored(range(4))])
        b.send(0, [b.stored(range(2))])
        # 4 blocks held, 3 usable: the prompt's last token is always computed
        wait_until(lambda: all(hits(s) == {ua: 3 * BLOCK, ub: 2 * BLOCK} for s in socks),
                   20, what="the stored blocks in both workers")
        # another salt is another chain: no hit
        assert hits(socks[1], salt="tenant-2") == {ua: 0, ub: 0}

        # a restarts (its seq goes back to 0) with one block
        a.send(0, [a.stored(range(1))])
        wait_until(lambda: all(hits(s)[ua] == BLOCK for s in socks), 20,
                   what="a re-learned after its restart")
        assert metric(listen, "tokengate_counter_kv_index_resets_total", model=MODEL,
                      upstream=ua, reason="restart") == 2  # one per worker
        assert metric(listen, "tokengate_counter_kv_index_blocks", model=MODEL,
                      upstream=ub) == 2
        assert metric(listen, "tokengate_counter_kv_index_live", model=MODEL,
                      upstream=nobody) == 0
        # when each publisher last sent (what `tokengate doctor` shows): never for nobody
        assert metric(listen, "tokengate_counter_kv_last_event_timestamp_seconds",
                      model=MODEL, upstream=ua) >= first_sent
        assert metric(listen, "tokengate_counter_kv_last_event_timestamp_seconds",
                      model=MODEL, upstream=nobody) == 0

        # a reload: b is no longer followed, c (int hashes) is; a keeps what it learned
        write_config(config_path, path, {ua: a.endpoint, uc: c.endpoint}, listen)
        assert svc.proc is not None
        os.kill(svc.proc.pid, signal.SIGHUP)
        c.wait_subscribers(2)
        wait_until(lambda: all(hits(s) == {ua: BLOCK, uc: 0} for s in socks), 30,
                   what="the reloaded kv_events in both workers")
        c.send(0, [c.stored(range(2))])
        wait_until(lambda: all(hits(s) == {ua: BLOCK, uc: 2 * BLOCK} for s in socks), 20,
                   what="c's blocks")
    finally:
        svc.stop()
        for p in (a, b, c):
            p.close()

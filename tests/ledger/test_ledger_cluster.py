"""Redis Cluster: the global-limit windows and the ledger on a real 3-node cluster."""

from __future__ import annotations

import asyncio
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from tokengate import config as tg_config
from tokengate import redis_client
from tokengate.config import RedisConfig
from tokengate.ledger.ledger import Ledger
from tokengate.ledger.report import query
from tokengate.limits.window import GlobalLimiter, window_keys
from tokengate_dev import devstack

from tests.fixtures_ledger import PORT_OFFSET, UsageWriter, make_event, wait_until
from tests.ledger.test_ledger import assert_ledger_equals, workload

CLUSTER_PORTS = tuple(p + PORT_OFFSET for p in (16391, 16392, 16393))


@pytest.fixture(scope="module")
def cluster_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A 3-master Redis Cluster (no replicas) on loopback."""
    svcs = []
    try:
        for port in CLUSTER_PORTS:
            d = tmp_path_factory.mktemp(f"cluster-{port}")
            svc = devstack.redis_service(port=port, name=f"test-redis-cluster-{port}")
            svc.argv += ["--dir", str(d), "--cluster-enabled", "yes",
                         "--cluster-config-file", "nodes.conf"]
            svcs.append(svc.start())
        subprocess.run(["redis-cli", "--cluster", "create",
                        *[f"127.0.0.1:{p}" for p in CLUSTER_PORTS], "--cluster-yes"],
                       check=True, capture_output=True, timeout=30)
        # Every node must see the whole slot map: a node that still says CLUSTERDOWN
        # fails the first command routed to it (seen on a loaded machine).
        probes = [redis.Redis(port=p, decode_responses=True) for p in CLUSTER_PORTS]
        wait_until(lambda: all(p.cluster("info")["cluster_state"] == "ok" for p in probes),
                   30, what="cluster_state:ok on every node")
        yield f"redis://127.0.0.1:{CLUSTER_PORTS[0]}/0"
    finally:
        for s in svcs:
            s.stop()


@pytest.mark.slow
def test_global_limit_windows_spread_over_the_cluster(cluster_url):
    keys = [f"key-{i}" for i in range(12)]

    async def go() -> list[tuple[bool, bool, int]]:
        client = redis_client.connect_async(RedisConfig(url=cluster_url, cluster=True), 1.0)
        lim = GlobalLimiter(client)
        out = []
        for k in keys:
            a = await lim.reserve(k, None, 10, 1000, 700, "a" * 32)
            b = await lim.reserve(k, None, 10, 1000, 700, "b" * 32)
            s = await lim.settle(k, None, "a" * 32, 100)
            out.append((a.admitted, b.admitted, s.window_tokens))
        await client.aclose()
        return out

    assert asyncio.run(go()) == [(True, False, 100)] * len(keys)
    slots = {redis.cluster.key_slot(window_keys(k)[0].encode()) for k in keys}
    sync = redis.cluster.RedisCluster.from_url(cluster_url)
    nodes = {sync.get_node_from_key(window_keys(k)[0]).port for k in keys}
    assert len(slots) == len(keys) and len(nodes) == 3
    sync.close()


@pytest.mark.slow
def test_ledger_applies_exactly_once_on_the_cluster(cluster_url, cfg: tg_config.Config,
                                                    tmp_path: Path):
    client = redis_client.connect(RedisConfig(url=cluster_url, cluster=True))
    writer = UsageWriter(tmp_path / "usage.jsonl")
    events = workload(500, seed=31)
    for ev in events:
        writer.write(ev)
    writer.write(events[0])                       # a duplicate line
    led = Ledger(cfg, client, writer.path, "cluster")
    totals = led.drain()
    assert (totals.applied, totals.duplicates) == (500, 1)
    assert_ledger_equals(client, events, cfg)
    extra = make_event(prompt_tokens=3)
    writer.write(extra)
    led.drain()
    assert_ledger_equals(client, events + [extra], cfg)
    led.close()
    writer.close()


@pytest.mark.slow
def test_the_engine_join_on_the_cluster(cluster_url, cfg: tg_config.Config, tmp_path: Path):
    """Edge events, engine records (an n = 2 request, a client that left) and a missing
    record: every key the join touches lives in the ledger's slot."""
    from tests.ledger.test_ledger_engine import EngineWriter, record

    client = redis_client.connect(RedisConfig(url=cluster_url, cluster=True))
    writer = UsageWriter(tmp_path / "usage.jsonl")
    engine = EngineWriter(tmp_path / "engine.jsonl")
    key = {"key_id": "cluster-join"}  # the cluster is not flushed between tests
    two = make_event(prompt_tokens=12, completion_tokens=12, **key)
    left = make_event(usage_source="running", client_aborted=True, completion_tokens=2, **key)
    lost = make_event(prompt_tokens=7, completion_tokens=5, **key)
    for ev in (two, left, lost):
        writer.write(ev)
    engine.record(record(two.request_id, n=2, index=0, gen=5))
    engine.record(record(two.request_id, n=2, index=1, gen=7))
    engine.record(record(left.request_id, gen=9, finish="abort", source="abort"))
    led = Ledger(cfg, client, writer.path, "cluster-join", engine_files=[engine.path],
                 engine_wait_s=0.3)
    led.drain()
    time.sleep(0.4)
    totals = led.drain()
    assert (totals.applied, totals.settled_engine, totals.engine_missing) == (3, 2, 1)
    (row,) = query(client, key_id="cluster-join")
    assert (row.prompt_tokens, row.completion_tokens) == (12 + 12 + 7, 12 + 9 + 5)
    led.close()
    writer.close()
    engine.close()

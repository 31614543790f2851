"""The suite's own machinery: the xdist group that keeps the vLLM tests on one worker."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

# pure: starts no process of the stack (make test-unit)
pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]


def test_the_vllm_group_runs_on_one_worker_under_loadgroup(tmp_path: Path) -> None:
    # what make test does (-n 2 --dist loadgroup), on tests grouped by tests.conftest's
    # xdist_group: pytest 9.2 ignores the name xdist 3.8 sets, which spread the group
    (tmp_path / "conftest.py").write_text(
        "import sys\n"
        f"sys.path.insert(0, {str(ROOT)!r})\n"
        "from tests.conftest import xdist_group\n\n"
        "def pytest_collection_modifyitems(config, items):\n"
        "    for item in items:\n"
        "        if item.name.startswith('test_grouped'):\n"
        "            xdist_group(config, item, 'vllm')\n")
    (tmp_path / "test_some.py").write_text(
        "import time\n"
        "import pytest\n\n"
        "@pytest.mark.parametrize('i', range(8))\n"
        "def test_grouped(i):\n    time.sleep(0.05)\n\n"
        "@pytest.mark.parametrize('i', range(8))\n"
        "def test_free(i):\n    time.sleep(0.05)\n")
    r = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", "2",
                        "--dist", "loadgroup", "-v", str(tmp_path)], cwd=tmp_path,
                       capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 0, r.stdout + r.stderr
    ran = re.findall(r"\[(gw\d)\] .*PASSED .*::test_grouped\[\d\]@vllm", r.stdout)
    assert len(ran) == 8 and len(set(ran)) == 1, r.stdout


def test_no_fixed_port_of_one_worker_is_another_workers() -> None:
    # each xdist worker adds 500 to every fixed port of the suite (conftest.PORT_OFFSET):
    # two ranges 500 * k apart put workers i and i + k on one port (up to four workers)
    from tests import (
        conftest,
        fixtures_edge,
        fixtures_ledger,
        fixtures_storm,
        fixtures_vllm,
    )
    from tests.ledger import test_ledger_cluster, test_tracing_export
    from tests.limits import test_limits
    from tests.storm import test_sim_replica

    off = conftest.PORT_OFFSET
    ranges = {
        "vLLM (session)": [conftest.VLLM_PORT],
        "vLLM (others)": range(fixtures_vllm.OTHER_PORTS, fixtures_vllm.OTHER_PORTS + 10),
        "counter": [conftest.COUNTER_PORT],
        "edge": [fixtures_edge.EDGE_PORT],
        "edge status": [fixtures_edge.EDGE_PORT + fixtures_edge.STATUS_PORT_DELTA],
        "edge variants": fixtures_edge.VARIANT_RANGE,
        "edge variants' status": [p + fixtures_edge.STATUS_PORT_DELTA
                                  for p in fixtures_edge.VARIANT_RANGE],
        "redis": [fixtures_ledger.REDIS_PORT, *fixtures_ledger.PRIVATE_REDIS_PORTS],
        "redis cluster": test_ledger_cluster.CLUSTER_PORTS,
        "limits": test_limits.LIMITS_PORTS,
        "fast upstreams": [fixtures_storm.FAST_PORT, fixtures_storm.SLOW_PORT],
        "vLLM's KV events": [int(conftest.KV_EVENTS.rpartition(":")[2])],
        "KV events of the simulated replica's vLLM": [test_sim_replica.KV_PORT],
        "OTLP receiver (session)": [fixtures_vllm.OTLP_PORT],
        "the tracing export tests' receivers": test_tracing_export.PORTS,
    }
    owner: dict[int, str] = {}
    for name, ports in ranges.items():
        for p in ports:
            assert p - off not in owner, f"{name} and {owner[p - off]} share port {p}"
            owner[p - off] = name
    clashes = sorted({(owner[p], owner[p + 500 * k], k) for p in owner for k in range(1, 4)
                      if p + 500 * k in owner})
    assert clashes == []
    # and none of them, with four workers' offsets, is one free_port() may hand out
    from tokenstorm.process import FREE_PORTS
    assert not FREE_PORTS or max(owner) + off + 3 * 500 < FREE_PORTS.start

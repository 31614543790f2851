"""Prometheus endpoints of the sidecars (``prometheus_client``), one loopback port each
(``metrics.*_listen`` of tokengate.yaml, ``--metrics-listen`` on the command line).

The counter and the global limits may run several worker processes
(``tokengate.grpc_server``): with more than one, ``serve`` (in the parent, before any
worker starts) points ``PROMETHEUS_MULTIPROC_DIR`` at a fresh folder, the spawned workers
inherit it and import the modules that define their metrics afresh, so each writes its
own memory-mapped files there (prometheus_client's multiprocess mode), and the parent
serves the sum of them all on one port. A worker that dies and is restarted leaves its
counts in its files: counters keep growing, as Prometheus expects. With one worker
(which runs in the parent itself) and for the ledger (one process) the default registry
is served.
"""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"


def parse_listen(value: str | None) -> tuple[str, int] | None:
    """``"127.0.0.1:8082"`` -> ``("127.0.0.1", 8082)``; ``None`` or ``"none"`` -> None."""
    if value is None or value == "none":
        return None
    host, _, port = value.rpartition(":")
    return host.strip("[]"), int(port)


def serve(listen: str | None, name: str, workers: int = 1) -> bool:
    """Serve ``/metrics`` on ``listen`` (``host:port``; None or "none": nothing) from a
    daemon thread of this process. ``name``: the sidecar, for the folder's name;
    ``workers``: the worker processes it is about to spawn (1: none, it serves in this
    process). A port that cannot be bound is said on stderr and the sidecar goes on
    without metrics: an observability port never stops counting, limits or billing.
    Returns whether it serves."""
    addr = parse_listen(listen)
    if addr is None:
        return False
    multiprocess = workers > 1
    if multiprocess:
        folder = tempfile.mkdtemp(prefix=f"tokengate-{name}-metrics-")
        os.environ[MULTIPROC_ENV] = folder
        atexit.register(shutil.rmtree, folder, True)
    from prometheus_client import REGISTRY, CollectorRegistry, start_http_server

    registry = REGISTRY
    if multiprocess:
        from prometheus_client import multiprocess as mp

        registry = CollectorRegistry()
        mp.MultiProcessCollector(registry)
    try:
        start_http_server(addr[1], addr=addr[0], registry=registry)
    except OSError as e:
        print(f"tokengate-{name}: metrics not served on {listen}: {e}", file=sys.stderr,
              flush=True)
        return False
    return True

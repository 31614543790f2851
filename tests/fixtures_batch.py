"""Fixtures of the Batch API tests: a whole stack of its own (private Redis with an
append-only file fsynced on every write, the session's counter, an nginx edge, the
usage ledger, tokengate-batch), each part started with devstack's builders as ``make
run`` starts them, in front of TokenStorm's fast upstream (``batch_stack``) or the
session's vLLM CPU server (``batch_stack_vllm``).

``BatchStack.kill(part)`` sends SIGKILL to a part's whole process group and
``start(part)`` brings it back on the same ports and files: the crash tests.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import openai
import pytest
import yaml
from tokengate_dev import devstack
from tokenstorm.null_server import FastUpstream
from tokenstorm.process import group_members
from tokenstorm.upstream import UpstreamOptions

from tests.conftest import MODEL, PORT_OFFSET, TEST_DIR, key_digest
from tests.fixtures_edge import TEST_LUA_PATH, VARIANT_PORTS, Edge, _start_edge
from tests.fixtures_ledger import PRIVATE_REDIS_PORTS, PrivateRedis, free_port

# key id -> key
KEYS = {"tenant-a": "tg-test-batch-a", "tenant-b": "tg-test-batch-b"}
WORKER_SECRET = "tg-test-batch-worker"  # the service's own (batch.worker_sha256)


@dataclass
class BatchStack:
    """A running stack with the Batch API."""

    root: Path
    config_path: Path
    redis: PrivateRedis
    edge: Edge
    ledger: devstack.Service
    batch: devstack.Service
    upstream: FastUpstream | None = None
    stopped: list[str] = field(default_factory=list)

    def client(self, key_id: str = "tenant-a") -> openai.OpenAI:
        """The official client for ``key_id``, no retries of its own."""
        return openai.OpenAI(base_url=self.edge.base_url, api_key=KEYS[key_id], max_retries=0,
                             timeout=60)

    def services(self) -> dict[str, devstack.Service]:
        assert self.redis.svc is not None
        return {"redis": self.redis.svc, "edge": self.edge.service, "ledger": self.ledger,
                "batch": self.batch}

    def kill(self, part: str) -> None:
        """SIGKILL every process of ``part`` (redis, edge, ledger, batch)."""
        svc = self.services()[part]
        assert svc.proc is not None
        with contextlib.suppress(ProcessLookupError):
            os.killpg(svc.proc.pid, signal.SIGKILL)
        svc.proc.wait(10)
        deadline = time.monotonic() + 10
        while group_members(svc.proc.pid):  # nginx's workers die after their master
            assert time.monotonic() < deadline, f"{part}: processes left after SIGKILL"
            time.sleep(0.02)

    def start(self, part: str) -> None:
        """Start ``part`` again (same ports, same files) and wait until it is ready."""
        if part == "redis":
            self.redis.start()
        else:
            self.services()[part].start()

    def wait_batch(self, client: openai.OpenAI, batch_id: str, timeout_s: float = 120.0,
                   until: Callable[[Any], bool] | None = None) -> Any:
        """Poll the batch until it is final (or ``until(batch)``), as a user would."""
        deadline = time.monotonic() + timeout_s
        while True:
            b = client.batches.retrieve(batch_id)
            if (until(b) if until else b.status in ("completed", "failed", "expired",
                                                    "cancelled")):
                return b
            if time.monotonic() > deadline:
                raise AssertionError(f"batch {batch_id} still {b.status}: {b.request_counts}"
                                     f"\n{self.batch.log_tail()}")
            time.sleep(0.2)

    def ledger_applied(self) -> int:
        """Events the ledger applied (its status file)."""
        status = TEST_DIR / "run" / f"{self.ledger.name}.status.json"
        try:
            return int(json.loads(status.read_text()).get("applied", 0))
        except (OSError, ValueError):
            return 0

    def stop(self) -> None:
        for svc in (self.batch, self.ledger, self.edge.service):
            svc.stop()
        self.redis.stop()
        if self.upstream is not None:
            self.upstream.stop()


def _stack_yaml(base: Path, root: Path, upstream: str, redis_url: str,
                edge_port: int, edit: Callable[[dict[str, Any]], None] | None) -> Path:
    raw = yaml.safe_load(base.read_text())
    raw["redis"]["url"] = redis_url
    raw["redis"]["timeout_ms"] = 2000
    raw["keys"] = {k: {"sha256": key_digest(v), "rpm": 100000, "tpm": 100_000_000}
                   for k, v in KEYS.items()}
    m = raw["models"][MODEL]
    m["upstreams"] = [upstream]
    m["embedded"] = False
    m.get("routing", {}).pop("kv_events", None)
    raw.setdefault("edge", {})["usage_file"] = str(root / "usage.jsonl")
    raw["edge"]["count_timeout_ms"] = 3000
    raw["edge"]["global_limits_timeout_ms"] = 5000
    raw["ledger"]["usage_file"] = str(root / "usage.jsonl")
    raw["ledger"]["engine_usage_files"] = []
    (root / "worker.key").write_text(WORKER_SECRET + "\n")
    raw["batch"] = {"enabled": True, "unix_socket": str(root / "batch.sock"),
                    "edge_url": f"http://127.0.0.1:{edge_port}",
                    "worker_sha256": key_digest(WORKER_SECRET),
                    "worker_secret_file": str(root / "worker.key"),
                    "files_dir": str(root / "files")}
    if edit is not None:
        edit(raw)
    path = root / "tokengate.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def start_stack(config_path: Path, name: str, upstream: FastUpstream | None,
                upstream_addr: str, edit: Callable[[dict[str, Any]], None] | None = None
                ) -> BatchStack:
    """Start a Batch API stack named ``name`` under TEST_DIR/batch/<name>."""
    root = TEST_DIR / "batch" / f"{name}{PORT_OFFSET or ''}"
    if root.exists():
        import shutil
        shutil.rmtree(root)
    root.mkdir(parents=True)
    (root / "redis").mkdir()
    redis = PrivateRedis(free_port(PRIVATE_REDIS_PORTS), root / "redis", persist=True).start()
    edge_port = next(VARIANT_PORTS)
    path = _stack_yaml(config_path, root, upstream_addr, redis.url, edge_port, edit)
    parts: list[Any] = [redis]
    try:
        edge = _start_edge(path, edge_port, f"test-nginx-batch-{name}{PORT_OFFSET or ''}",
                           TEST_DIR / "counter.sock", root / "usage.jsonl")
        parts.append(edge.service)
        ledger = devstack.ledger_service(path, redis_url=redis.url,
                                         name=f"test-ledger-batch-{name}{PORT_OFFSET or ''}")
        ledger.log_dir = TEST_DIR / "log"
        ledger.start()
        parts.append(ledger)
        batch = devstack.batch_service(path, name=f"test-batch-{name}{PORT_OFFSET or ''}")
        batch.log_dir = TEST_DIR / "log"
        batch.log_path.unlink(missing_ok=True)
        batch.start()
    except Exception:
        for p in reversed(parts):
            p.stop()
        raise
    assert edge.service.env.get("LUA_PATH") == TEST_LUA_PATH
    return BatchStack(root, path, redis, edge, ledger, batch, upstream)


@contextlib.contextmanager
def fast_stack(config_path: Path, name: str, itl_ms: float = 0.0,
               edit: Callable[[dict[str, Any]], None] | None = None) -> Iterator[BatchStack]:
    """A Batch API stack named ``name`` in front of a fast upstream that answers a token
    every ``itl_ms``; ``edit`` changes its tokengate.yaml. Stopped when the block ends."""
    up = FastUpstream(UpstreamOptions(model=MODEL, itl_ms=itl_ms), name=f"batch-{name}-upstream")
    up.start()
    try:
        stack = start_stack(config_path, name, up, f"127.0.0.1:{up.port}", edit)
    except Exception:
        up.stop()
        raise
    try:
        yield stack
    finally:
        stack.stop()


@pytest.fixture(scope="module")
def batch_stack(config_path: Path, counter_addr: str,
                request: pytest.FixtureRequest) -> Iterator[BatchStack]:
    """A Batch API stack in front of a fast upstream (answers like vLLM 0.32, with
    usage); one per test module."""
    name = request.module.__name__.rsplit(".", 1)[-1].removeprefix("test_")
    with fast_stack(config_path, name, itl_ms=1.0) as stack:
        yield stack


@pytest.fixture(scope="module")
def batch_stack_vllm(config_path: Path, counter_addr: str, vllm_url: str,
                     request: pytest.FixtureRequest) -> Iterator[BatchStack]:
    """A Batch API stack in front of the session's vLLM CPU server."""
    name = request.module.__name__.rsplit(".", 1)[-1].removeprefix("test_") + "-vllm"
    stack = start_stack(config_path, name, None, vllm_url.removeprefix("http://")
                        .removesuffix("/v1").rstrip("/"))
    try:
        yield stack
    finally:
        stack.stop()

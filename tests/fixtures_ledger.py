"""Fixtures of the ledger / billing / global-limit tests: real Redis, real sidecars.

- ``redis_url``: the session's Redis (devstack.redis_service on 16380, persistence off)
- ``ledger_redis``: a client on it with the ledger's database flushed for the test
- ``private_redis``: a factory of Redis processes owned by one test (to kill/restart)
- ``usage_writer``: appends usage events to a file the way the edge does (one
  ``write()`` per line, O_APPEND) and rotates it the nginx way (rename + new file)
- ``make_event``: a valid usage event with overrides
"""

from __future__ import annotations

import os
import random
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import pytest
import redis
import yaml
from tokengate.ledger.event import UsageEvent
from tokengate_dev import devstack

from tests.conftest import PORT_OFFSET

REDIS_PORT = 16380 + PORT_OFFSET
PRIVATE_REDIS_PORTS = range(16381 + PORT_OFFSET, 16390 + PORT_OFFSET)


def svc_name(base: str) -> str:
    """A service (log, status file) name unique to this test session."""
    return f"{base}{PORT_OFFSET or ''}"


def free_port(candidates: range) -> int:
    for port in candidates:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {candidates}")


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """URL of the session's real Redis (devstack.redis_service on port 16380)."""
    svc = devstack.redis_service(port=REDIS_PORT, name=svc_name("test-redis")).start()
    try:
        yield f"redis://127.0.0.1:{REDIS_PORT}/0"
    finally:
        svc.stop()


@pytest.fixture(scope="session")
def ledger_config_path(config_path: Path) -> Path:
    """The test configuration with ``ledger.rotate_wait_s: 0.5`` (tests rotate fast)."""
    raw = yaml.safe_load(config_path.read_text())
    raw.setdefault("ledger", {})["rotate_wait_s"] = 0.5
    path = config_path.with_name("tokengate-ledger.yaml")
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


@pytest.fixture
def ledger_redis(redis_url: str) -> Iterator[redis.Redis]:
    """A client on the session Redis, database flushed before the test."""
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    client.flushdb()
    yield client
    client.close()


class PrivateRedis:
    """A redis-server owned by one test: ``kill()`` (SIGKILL), ``stop()`` (SIGTERM,
    which saves the data set when persistence is on) and ``start()`` again on the same
    port and data directory."""

    def __init__(self, port: int, data_dir: Path, persist: bool) -> None:
        self.port = port
        self.data_dir = data_dir
        self.persist = persist
        self.svc: devstack.Service | None = None
        self.url = f"redis://127.0.0.1:{port}/0"

    def start(self) -> PrivateRedis:
        svc = devstack.redis_service(port=self.port, name=f"test-redis-{self.port}")
        # Later options override earlier ones on redis-server's command line.
        svc.argv += ["--dir", str(self.data_dir)]
        if self.persist:
            svc.argv += ["--appendonly", "yes", "--appendfsync", "always"]
        self.svc = svc.start()
        return self

    def stop(self) -> None:
        if self.svc is not None:
            self.svc.stop()

    def kill(self) -> None:
        if self.svc is not None and self.svc.proc is not None:
            self.svc.proc.kill()
            self.svc.proc.wait(5)

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(self.url, decode_responses=True)


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[Callable[..., PrivateRedis]]:
    """Factory: ``private_redis(persist=True)`` starts a Redis only this test uses."""
    made: list[PrivateRedis] = []

    def make(persist: bool = False) -> PrivateRedis:
        port = free_port(PRIVATE_REDIS_PORTS)
        d = tmp_path / f"redis-{port}"
        d.mkdir()
        r = PrivateRedis(port, d, persist).start()
        made.append(r)
        return r

    yield make
    for r in made:
        r.stop()


_BASE = UsageEvent(
    request_id="0" * 32, ts="2026-11-29T16:40:00.123Z", key_id="demo", model="tiny-qwen3",
    endpoint="chat", status=200, stream=False, token_estimate=12, count_source="counter",
    reserved=268, prompt_tokens=12, completion_tokens=30, cached_tokens=0, system_tokens=0,
    usage_source="final", client_aborted=False, ttft_ms=35.5, total_ms=410.25,
    upstream="127.0.0.1:18000", error=None)


def make_event(rng: random.Random | None = None, **fields: Any) -> UsageEvent:
    """A valid event; a random request id unless given, then ``fields`` overrides."""
    r = rng or random
    rid = fields.pop("request_id", None) or f"{r.getrandbits(128):032x}"
    return replace(_BASE, request_id=rid, **fields)


class UsageWriter:
    """Writes usage lines like the edge: one O_APPEND ``write()`` per line."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self.written: list[UsageEvent] = []

    def write(self, ev: UsageEvent) -> None:
        os.write(self.fd, (ev.to_json() + "\n").encode())
        self.written.append(ev)

    def write_raw(self, data: bytes) -> None:
        os.write(self.fd, data)

    def rotate(self, suffix: str = ".1") -> Path:
        """Rename the file (existing rotations shift by one, like logrotate) and
        reopen a new one at the original path (nginx reopen)."""
        target = self.path.with_name(self.path.name + suffix)
        if suffix.startswith(".") and suffix[1:].isdigit():
            n = int(suffix[1:])
            older = sorted((p for p in self.path.parent.glob(self.path.name + ".*")
                            if p.suffix[1:].isdigit()), key=lambda p: -int(p.suffix[1:]))
            for p in older:
                if int(p.suffix[1:]) >= n:
                    p.rename(p.with_suffix(f".{int(p.suffix[1:]) + 1}"))
        self.path.rename(target)
        self.reopen()
        return target

    def reopen(self) -> None:
        os.close(self.fd)
        self.fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def close(self) -> None:
        os.close(self.fd)


@pytest.fixture
def usage_writer(tmp_path: Path) -> Iterator[UsageWriter]:
    """An edge-like writer of ``<tmp>/usage/usage.jsonl``."""
    w = UsageWriter(tmp_path / "usage" / "usage.jsonl")
    yield w
    w.close()


def wait_until(pred: Callable[[], bool], timeout_s: float = 20.0, step_s: float = 0.05,
               what: str = "condition") -> None:
    """Poll ``pred`` until true; AssertionError naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if pred():
                return
        except (redis.RedisError, OSError, ValueError, grpc.RpcError):
            pass
        time.sleep(step_s)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")

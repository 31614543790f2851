"""The session's vLLM CPU servers: one per distinct set of flags, booted once (60-90 s on
2 cores) by the first test that asks for it and stopped when the session ends.

``vllm_url`` is the server ``make run`` starts (``devstack.vllm_service``: the flags
billing relies on, the tokengate plugin writing engine records); ``vllm_server(...)``
gives that one with no arguments, or another for other flags: extra arguments (the
plugin test's scheduler and two running slots), flags left out (the doctor's vLLM
without the billing flags), extra environment. Tests that read vLLM's own counters on a
shared server take differences around their own traffic after ``wait_idle()``; each
server's engine records go to a file of its own (``usage_file``), read from an offset.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from tokengate import config as tg_config
from tokengate.ledger.engine_record import EngineRecord, parse_record
from tokengate_dev import devstack
from tokengate_dev.bench import scheduler_figures
from tokengate_dev.otlp_receiver import OtlpReceiver
from tokenstorm.process import Service

from tests.conftest import MODEL, PORT_OFFSET, TEST_DIR, VLLM_PORT

# ports of the servers after the first (18000 + offset): 18050 + offset, 18051 + offset, ...
OTHER_PORTS = 18050 + PORT_OFFSET
# the session's OTLP receiver (gRPC), where the first server exports its request spans
OTLP_PORT = VLLM_PORT + 140


@dataclass
class VllmServer:
    """A running vLLM CPU server of the session."""

    url: str                 # .../v1
    port: int
    usage_file: Path         # the tokengate plugin's engine records
    log_path: Path
    argv: list[str]

    @property
    def address(self) -> str:
        """host:port, as a model's ``upstreams`` names it."""
        return f"127.0.0.1:{self.port}"

    def client(self, **kw: Any) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url, api_key="unused", max_retries=0, **kw)

    def metrics(self) -> dict[str, float]:
        """vLLM's metrics on /metrics, summed over label sets: name -> value (the
        scheduler benchmark's reading, tokengate_dev.bench.scheduler_figures)."""
        return scheduler_figures.metrics(self.url, timeout_s=5)

    def steady_metrics(self, timeout_s: float = 120.0) -> dict[str, float]:
        """The metrics once they stood still for 0.5 s (every request that finished has
        been counted)."""
        return self._poll(lambda _m: True, timeout_s)

    def wait_idle(self, timeout_s: float = 120.0) -> dict[str, float]:
        """Waits until no request runs or waits and the token counters stood still for
        0.5 s (what an earlier test left, e.g. a stream whose client left, has ended);
        returns the metrics then."""
        return self._poll(lambda m: not (m.get("vllm:num_requests_running", 0)
                                         + m.get("vllm:num_requests_waiting", 0)), timeout_s)

    def _poll(self, done: Callable[[dict[str, float]], bool],
              timeout_s: float) -> dict[str, float]:
        deadline = time.monotonic() + timeout_s
        prev = self.metrics()
        while True:
            time.sleep(0.5)
            now = self.metrics()
            if now == prev and done(now):
                return now
            assert time.monotonic() < deadline, f"vLLM on {self.port} never settled: {now}"
            prev = now

    def size(self) -> int:
        return self.usage_file.stat().st_size if self.usage_file.exists() else 0

    def records_since(self, offset: int) -> list[EngineRecord]:
        """Records in complete lines after byte ``offset`` (a line being written is not
        one yet, as for the ledger's tail)."""
        if not self.usage_file.exists():
            return []
        data = self.usage_file.read_bytes()[offset:]
        return [parse_record(x) for x in data[: data.rfind(b"\n") + 1].splitlines()]


VllmFactory = Callable[..., VllmServer]

# Each server's model runs on one OpenMP thread, not bound to a core. By default vLLM's
# CPU worker binds one thread per core (VLLM_CPU_OMP_THREADS_BIND=auto: both cores here)
# and the threads of a step wait for each other spinning; beside the suite's other
# servers and pytest workers on 2 cores they spin while the other is descheduled. 10
# chat requests of 64 tokens to the default server took 78 s and 46 CPU-s that way,
# 11 s and 9 CPU-s with this (the tiny model gains nothing from a second thread).
ONE_THREAD = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="session")
def otlp_receiver() -> Iterator[OtlpReceiver]:
    """The session's OTLP trace receiver (gRPC on ``OTLP_PORT``): the first vLLM server
    exports its request spans there (tests/edge/test_edge_tracing.py reads them)."""
    rx = OtlpReceiver(grpc_port=OTLP_PORT).start()
    try:
        yield rx
    finally:
        rx.stop()


@pytest.fixture(scope="session")
def vllm_server(cfg: tg_config.Config, otlp_receiver: OtlpReceiver) -> Iterator[VllmFactory]:
    """``vllm_server(extra_args=(), drop=(), env=None, label=None)`` -> the session's
    server with devstack's flags plus ``extra_args``, less the flags in ``drop``, with
    ``env`` added to its environment: booted on first use, shared by every test that asks
    for the same. ``label`` names its folder (``TEST_DIR/vllm-<label>``: its engine
    records and log name); default: its port. The first server (no arguments) exports
    its request spans to ``otlp_receiver`` (devstack's tracing flags)."""
    def get(extra_args: Sequence[str] = (), drop: Sequence[str] = (),
            env: dict[str, str] | None = None, label: str | None = None) -> VllmServer:
        spec = (tuple(extra_args), tuple(drop), tuple(sorted((env or {}).items())))
        if spec in SERVERS:
            return SERVERS[spec][1]
        default = spec == ((), (), ())  # the one the configuration's upstreams name
        # the first port no running server holds (stop_servers frees one mid-session)
        used = {server.port for _svc, server, _group in SERVERS.values()}
        port = VLLM_PORT if default else next(p for p in itertools.count(OTHER_PORTS)
                                              if p not in used)
        label = "" if default else f"-{label or port}"
        name = f"test-vllm{label}{PORT_OFFSET or ''}"
        usage = TEST_DIR / (f"vllm{label}" if label else "usage") / "engine.jsonl"
        usage.parent.mkdir(parents=True, exist_ok=True)
        usage.unlink(missing_ok=True)
        tracing = tg_config.TracingConfig(enabled=True,
                                          endpoint=f"http://127.0.0.1:{OTLP_PORT}")
        svc = devstack.vllm_service(cfg.models[MODEL], port=port, name=name,
                                    engine_usage_file=usage,
                                    tracing=tracing if default else None)
        if default:
            svc.env["OTEL_BSP_SCHEDULE_DELAY"] = "100"  # ms: spans reach the test soon
        missing = [f for f in drop if f not in svc.argv]
        assert not missing, f"devstack's vLLM no longer passes {missing}"
        svc.argv = [a for a in svc.argv if a not in drop] + list(extra_args)
        svc.env.update({**ONE_THREAD, **(env or {})})
        svc.log_path.unlink(missing_ok=True)
        svc.start()
        server = VllmServer(f"http://127.0.0.1:{port}/v1", port, usage, svc.log_path,
                            list(svc.argv))
        SERVERS[spec] = (svc, server, BOOTING_GROUP[0])
        return server

    try:
        yield get
    finally:
        stop_servers(None)


# The session's servers by their flags: (service, server, the xdist group whose test
# booted it). Every test that asks for a server is in that group (tests/conftest.py's
# vllm_group), so the group's last test stops it (stop_servers): an idle engine still
# takes ~1 % of a core and 2-3 GB for the rest of the session.
SERVERS: dict[tuple[Any, ...], tuple[Service, VllmServer, str | None]] = {}
BOOTING_GROUP: list[str | None] = [None]  # the group of the test running now


def stop_servers(group: str | None) -> None:
    """Stop the servers booted by ``group``'s tests (None: every server)."""
    for spec, (svc, _server, booted_by) in list(SERVERS.items()):
        if group is None or booted_by == group:
            svc.stop()
            del SERVERS[spec]


@pytest.fixture(scope="session")
def vllm_url(vllm_server: VllmFactory) -> str:
    """Base URL (…/v1) of the real vLLM CPU server on the embedded model (devstack's
    flags; engine records in the test folder, so test traffic never lands in make run's
    file)."""
    return vllm_server().url


@pytest.fixture(scope="module")
def vllm_http(vllm_url: str) -> Iterator[httpx.Client]:
    """An HTTP client of the session's vLLM server, based at its /v1/ (the parity tests
    post the same bodies there as to the counter)."""
    with httpx.Client(base_url=vllm_url + "/", timeout=300) as client:
        yield client


# The session's second server: the plugin's token-weighted scheduler, whose steps the
# queue tests can slow down (tests/paced_scheduler.py, on the engine's path through
# PYTHONPATH), with two running slots so that requests wait in the queue it orders, an
# aging bound of an hour (a queued request waits as long as its blockers run, which on a
# loaded machine was over a minute), and none of the flags billing relies on: the
# doctor's test of a vLLM started without them uses the same boot.
SCHEDULER = "tests.paced_scheduler.PacedTokenWeightedScheduler"
BILLING_FLAGS = ("--enable-prompt-tokens-details", "--enable-auto-tool-choice",
                 "--tool-call-parser", "hermes")
PACE_FILE = TEST_DIR / "vllm-queue" / "pace"
QUEUE_ENGINE = TEST_DIR / "vllm-queue" / "engine.jsonl"  # its engine records
ROOT = Path(__file__).resolve().parents[1]


SPARE_PACE_FILE = TEST_DIR / "vllm-spare" / "pace"
SPARE_STEPS_FILE = TEST_DIR / "vllm-spare" / "steps.jsonl"  # its paced steps


@pytest.fixture(scope="session")
def spare_vllm(vllm_server: VllmFactory) -> VllmServer:
    """A server of the plugin's scheduler under ``--scheduling-policy priority`` (its
    spare-capacity rules, tokengate_vllm.scheduler), three seats, steps paced while
    ``SPARE_PACE_FILE`` exists and then written to ``SPARE_STEPS_FILE``
    (tests/paced_scheduler.py), no billing flags."""
    from tests.paced_scheduler import PACE_ENV, STEPS_ENV

    SPARE_PACE_FILE.parent.mkdir(parents=True, exist_ok=True)
    SPARE_PACE_FILE.unlink(missing_ok=True)
    return vllm_server(extra_args=("--scheduler-cls", SCHEDULER, "--max-num-seqs", "3",
                                   "--scheduling-policy", "priority"),
                       drop=BILLING_FLAGS,
                       env={PACE_ENV: str(SPARE_PACE_FILE), STEPS_ENV: str(SPARE_STEPS_FILE),
                            "PYTHONPATH": str(ROOT)},
                       label="spare")


@pytest.fixture(scope="session")
def queue_vllm(vllm_server: VllmFactory) -> VllmServer:
    """The second server (above): the token-weighted scheduler, two slots, no billing
    flags; ``PACE_FILE`` exists while a test slows its steps."""
    from tests.paced_scheduler import PACE_ENV

    PACE_FILE.parent.mkdir(parents=True, exist_ok=True)
    PACE_FILE.unlink(missing_ok=True)
    return vllm_server(extra_args=("--scheduler-cls", SCHEDULER, "--max-num-seqs", "2"),
                       drop=BILLING_FLAGS,
                       env={"TOKENGATE_SCHED_MAX_WAIT_S": "3600", PACE_ENV: str(PACE_FILE),
                            "PYTHONPATH": str(ROOT)}, label="queue")

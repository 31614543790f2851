"""``make soak``: the whole stack under a bounded TokenStorm load for a while, with faults
made at random (kill -9, Redis stopped, stalled and restarted, reloads, key commands),
then the invariants that must hold whatever happened (``soak_invariants``), each printed
with its figures. The last line reads ``soak: N of M invariants held``; the exit status
is 0 only when all held.
(Over 600 lines: one driver whose stack, fault runner and collectors share the stack's
handles, its ports and the run's clock; the checks are in ``soak_invariants``.)

The stack is the one ``make run`` starts (``devstack``'s builders), on ports and in a
folder of its own (``var/bench-soak``, emptied first), every feature on: global limits
and budgets through the limits sidecar and Redis (persisted, as ``make run``'s), the fair
queue (``edge.queue``, ``max_concurrency`` per replica), prefix routing on the replicas'
KV events, tracing exported over OTLP to a collector in this process
(``tokengate_dev.otlp_receiver``), and ``--replicas`` simulated vLLM replicas
(``tokenstorm sim-replica``) writing engine usage records, which the ledger reads. A
``Supervisor`` keeps every part up and restarts one that dies, as systemd's
``Restart=on-failure`` with ``RestartSec=2`` of tokengate's units would (1 s, then 2 s).

The load: two TokenStorm runs side by side, streamed (``--stream-share`` of the rate)
and not, Poisson arrivals at ``--rate`` requests/s in all, shared system prompts, three
API keys: one with a spend budget, one with a token budget and twice the fair share, one
whose RPM refuses about a tenth of its requests. Both run in processes of their own, and
record each answer's X-Request-Id.

The faults, one at a time, about every ``--fault-every`` seconds (each next one once the
part is back), from 10 s into the load until ``--quiet`` seconds before its end; each
kind in turn in an order the seed draws, so a 15-minute soak makes each kind two or three
times:

    nginx_worker   kill -9 of one nginx worker (its master starts another)
    nginx_master   kill -9 of nginx's master (the supervisor stops its workers and
                   starts nginx again)
    counter, ledger, limits
                   kill -9 of that sidecar
    replica        kill -9 of one simulated replica
    redis_down     Redis stopped (SIGTERM) and kept down 3-8 s, then started
    redis_stall    Redis stopped with SIGSTOP for 2-6 s, then SIGCONT
    redis_restart  Redis stopped (SIGTERM) and started again at once
    sighup         nginx reloaded with SIGHUP
    config_apply   a key's description changed in the configuration, ``tokengate config
                   apply`` (recompile and reload the edge), then SIGHUP to the counter,
                   the limits sidecar and the ledger (their ``systemctl reload``)
    keys           ``tokengate keys create``, ``rotate`` and ``revoke`` of a key of its
                   own (each reloads nginx)

The same seed gives the same load (prompts, lengths, arrival times) and the same fault
schedule (kinds, targets, gaps and durations); when a fault's part takes long to come
back, the schedule is followed later.

Once the load is over and every part is up, the soak waits for the stack to settle: the
ledger has read everything and billed what waited for engine records (an engine record
without an edge event waits the ledger's ``engine_orphan_s``, 15 s here), the edge's last
budget settlements are in, the span export is done. Then it collects the usage events, the ledger's audit
stream, the engine records, each replica's counters, the span counts, the budget
reservations, the state of the edge, the ledger and the replicas, and nginx's error log,
and checks the invariants. Results: ``bench/results/soak-<time>.json`` and
``bench/results/soak-latest.json``; the parts' logs stay in ``var/bench-soak/log``.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import pickle
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import yaml
from tokengate import config as tg_config
from tokengate import redis_keys
from tokengate.budget_store import SETTLED
from tokengate.ledger.engine_record import EngineRecord, parse_record
from tokengate.ledger.event import EventError, parse_event
from tokengate.ledger.ledger import default_ledger_id, engine_ledger_id
from tokengate.redis_client import SyncRedis, connect
from tokenstorm.arrivals import ArrivalSpec
from tokenstorm.client import ERROR_NAMES
from tokenstorm.process import (
    Backoff,
    Service,
    ServiceError,
    Supervisor,
    free_port,
    group_members,
)
from tokenstorm.profiles import OutputPolicy
from tokenstorm.prompts import Sharing, StreamOptions
from tokenstorm.runner import RunSpec, execute
from tokenstorm.upstream.sim import SimReplica, SimSettings

from tokengate_dev import devstack
from tokengate_dev.bench import results
from tokengate_dev.bench import soak_invariants as inv
from tokengate_dev.otlp_receiver import OtlpReceiver

SOAK_VAR = devstack.VAR / "bench-soak"
USAGE_FILE = SOAK_VAR / "usage" / "usage.jsonl"
MODEL = "tiny-qwen3"
WARMUP_S = 10.0       # load before the first fault
BACK_TIMEOUT_S = 90.0  # longest wait for a part to be back after a fault
_T = TypeVar("_T")


@dataclass
class SoakOptions:
    """``make soak``'s knobs (``main``'s ``--help``). Times in s, rates in requests/s,
    lengths in tokens."""

    duration_s: float = 900.0
    seed: int = 0
    rate: float = 10.0
    stream_share: float = 0.75
    replicas: int = 3
    fault_every_s: float = 20.0
    quiet_s: float = 20.0
    prompt_mean: int = 350
    prompt_sd: int = 150
    tenants: int = 6
    prefix_tokens: int = 200
    output_ratio: float = 0.2
    max_output: int = 160
    max_concurrency: int = 8
    itl_ms: float = 15.0
    orphan_s: float = 15.0
    settle_timeout_s: float = 240.0


# -- the stack ---------------------------------------------------------------------------


@dataclass(frozen=True)
class LoadKey:
    """An API key of the load: its id, its secret and its settings in tokengate.yaml."""

    name: str
    settings: dict[str, Any]

    @property
    def secret(self) -> str:
        return f"tg-{self.name}-key"


def load_keys(opts: SoakOptions) -> list[LoadKey]:
    """The three keys of the load (the module docstring); requests go to them in turn."""
    per_key_rpm = opts.rate * 60 / 3
    big = {"rpm": 1_000_000, "tpm": 1_000_000_000}
    return [
        LoadKey("soak-spend", {**big, "budgets": [{"period": "day", "spend": 1000.0}]}),
        LoadKey("soak-tokens", {**big, "fair_share": 2.0,
                                "budgets": [{"period": "month", "tokens": 10**12}]}),
        # refuses about a tenth of its share: answered 429s, billed nothing
        LoadKey("soak-rpm", {"rpm": max(1, int(per_key_rpm * 0.9)), "tpm": 1_000_000_000}),
    ]


@dataclass
class Ports:
    """Every TCP port of the soak's stack: free ones, never ``make run``'s."""

    edge: int = field(default_factory=free_port)
    status: int = field(default_factory=free_port)
    counter: int = field(default_factory=free_port)
    limits: int = field(default_factory=free_port)
    redis: int = field(default_factory=free_port)
    otlp: int = field(default_factory=free_port)
    sims: list[int] = field(default_factory=list)
    kv_events: list[int] = field(default_factory=list)


def write_config(path: Path, opts: SoakOptions, ports: Ports,
                 engine_files: list[Path]) -> Path:
    """The soak's tokengate.yaml (the checkout's model; everything else the soak's own)."""
    checkout = tg_config.load(devstack.ROOT / "tokengate.yaml").models[MODEL]
    run = SOAK_VAR / "run"
    upstreams = [f"127.0.0.1:{p}" for p in ports.sims]
    raw: dict[str, Any] = {
        "models": {MODEL: {
            "dir": str(Path(checkout.dir).resolve()), "max_model_len": 8192,
            "output_reserve": 256, "max_tokens_cap": 4096, "upstreams": upstreams,
            "max_concurrency": opts.max_concurrency,
            "routing": {"policy": "prefix", "block_size": 16, "hash_algo": "sha256",
                        "kv_events": {u: f"tcp://127.0.0.1:{p}"
                                      for u, p in zip(upstreams, ports.kv_events, strict=True)},
                        "load_weight": 0.25}}},
        "keys": {k.name: {"sha256": _sha256(k.secret), **k.settings}
                 for k in load_keys(opts)},
        "redis": {"url": f"redis://127.0.0.1:{ports.redis}/0"},
        "ledger": {"usage_file": str(USAGE_FILE),
                   "audit_maxlen": 10_000_000,
                   "engine_usage_files": [str(f) for f in engine_files],
                   "engine_wait_s": 5.0, "engine_orphan_s": opts.orphan_s,
                   "console": {"admins": {}}},
        "global_limits": {"enabled": True, "listen": f"127.0.0.1:{ports.limits}",
                          "unix_socket": str(run / "limits.sock")},
        "metrics": {"counter_listen": None, "ledger_listen": None, "limits_listen": None},
        "access_log": {"file": str(SOAK_VAR / "log" / "access.sampled.log")},
        "edge": {"listen": f"127.0.0.1:{ports.edge}",
                 "status_listen": f"127.0.0.1:{ports.status}",
                 # two cores run all of it: the counter gets time before the edge estimates
                 "count_timeout_ms": 1500,
                 "queue": {"enabled": True, "max_wait_ms": 30000}},
        "tracing": {"enabled": True, "endpoint": f"http://127.0.0.1:{ports.otlp}",
                    "protocol": "grpc", "sample_ratio": 1.0},
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    tg_config.load(path)  # a ConfigError here is the soak's own bug
    return path


def _sha256(text: str) -> str:
    import hashlib

    return hashlib.sha256(text.encode()).hexdigest()


class Stack:
    """The soak's parts (``devstack``'s builders, logs in ``var/bench-soak/log``) under a
    ``Supervisor`` running in a thread of its own. ``roles``: role -> service ("redis",
    "counter", "limits", "sim0".., "nginx", "ledger")."""

    def __init__(self, opts: SoakOptions, ports: Ports, say: Any) -> None:
        self.opts, self.ports, self.say = opts, ports, say
        run = SOAK_VAR / "run"
        run.mkdir(parents=True, exist_ok=True)
        self.engine_files = [SOAK_VAR / "engine" / f"sim{i}.jsonl" for i in range(opts.replicas)]
        self.config = write_config(SOAK_VAR / "tokengate.yaml", opts, ports, self.engine_files)
        self.edge_dir = SOAK_VAR / "edge"
        model = tg_config.load(self.config).models[MODEL]
        self.replicas = list(model.upstreams)
        roles: dict[str, Service] = {
            "redis": devstack.redis_service(ports.redis, name="soak-redis", persist=True,
                                            data_dir=SOAK_VAR / "redis"),
            "counter": devstack.counter_service(self.config, port=ports.counter,
                                                unix_socket=run / "counter.sock", workers=2,
                                                name="soak-counter", metrics_listen="none"),
            "limits": devstack.limits_service(self.config, port=ports.limits,
                                              unix_socket=run / "limits.sock",
                                              name="soak-limits", metrics_listen="none"),
        }
        for i, port in enumerate(ports.sims):
            settings = SimSettings(
                model=MODEL, model_dir=Path(model.dir), max_model_len=8192, block_size=16,
                num_gpu_blocks=4096, itl_ms=opts.itl_ms, tokenizer="counter",
                kv_events_endpoint=f"tcp://127.0.0.1:{ports.kv_events[i]}",
                engine_usage_file=self.engine_files[i])
            roles[f"sim{i}"] = SimReplica(settings, port=port, name=f"soak-sim{i}",
                                          state_dir=SOAK_VAR).service
        roles["nginx"] = devstack.nginx_service(
            self.config, port=ports.edge, counter_socket=run / "counter.sock",
            counter_workers=2, workers=2, name="soak-nginx", prefix=self.edge_dir,
            status_port=ports.status)
        roles["ledger"] = devstack.ledger_service(self.config, name="soak-ledger",
                                                  engine_files=self.engine_files,
                                                  metrics_listen="none")
        for svc in roles.values():
            svc.log_dir = SOAK_VAR / "log"
        self.roles = roles
        self.sup = Supervisor(list(roles.values()), say=say,
                              backoff=Backoff(first_s=1.0, max_s=2.0, stable_s=30.0),
                              tick_s=0.1)
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._up = threading.Event()

    def start(self, timeout_s: float = 300.0) -> None:
        """Start every part (in order, each once the one before is ready); raises
        ``ServiceError`` when one fails its first start."""
        def run() -> None:
            try:
                self.sup.run(on_up=self._up.set)
            except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
                self._error = e
                self._up.set()

        self._thread = threading.Thread(target=run, name="supervisor", daemon=True)
        self._thread.start()
        if not self._up.wait(timeout_s):
            raise ServiceError(f"the stack was not up after {timeout_s:.0f} s")
        if self._error is not None:
            raise self._error

    def stop(self) -> None:
        self.sup.request_stop()
        if self._thread is not None:
            self._thread.join(120)

    def name(self, role: str) -> str:
        return self.roles[role].name

    def up(self, role: str) -> bool:
        return self.sup.state(self.name(role)) == "up"

    def all_up(self) -> bool:
        return all(self.up(r) for r in self.roles)

    def pid(self, role: str) -> int:
        proc = self.roles[role].proc
        assert proc is not None
        return proc.pid

    def nginx_workers(self) -> set[int]:
        """The pids of nginx's worker processes now (its master's group, less the
        master)."""
        master = self.pid("nginx")
        return set(group_members(master)) - {master}


def wait_for(cond: Any, timeout_s: float, poll_s: float = 0.1) -> bool:
    """Poll ``cond()`` until true (True) or ``timeout_s`` passed (False)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(poll_s)
    return bool(cond())


# -- faults -------------------------------------------------------------------------------


@dataclass(frozen=True)
class PlannedFault:
    """One fault of the schedule: its ``kind``, ``gap_s`` after the previous one (or the
    warm-up), ``target`` (a replica's index for kind replica), ``hold_s`` (how long
    Redis stays down or stalled)."""

    kind: str
    gap_s: float
    target: int = 0
    hold_s: float = 0.0


def plan_faults(opts: SoakOptions) -> list[PlannedFault]:
    """The seeded schedule: every kind in a drawn order, again and again, with gaps of
    0.5 to 1.5 x ``fault_every_s``; enough for the whole duration."""
    rng = random.Random(opts.seed)
    out: list[PlannedFault] = []
    total = 0.0
    while total < opts.duration_s:
        kinds = list(inv.KINDS)
        rng.shuffle(kinds)
        for kind in kinds:
            gap = opts.fault_every_s * rng.uniform(0.5, 1.5)
            hold = rng.uniform(3.0, 8.0) if kind == "redis_down" else \
                rng.uniform(2.0, 6.0) if kind == "redis_stall" else 0.0
            out.append(PlannedFault(kind, round(gap, 2), rng.randrange(opts.replicas),
                                    round(hold, 2)))
            total += gap
    return out


class FaultRunner:
    """Makes the planned faults on ``stack`` from ``start`` (monotonic s) + warm-up until
    ``until``, one at a time, each recorded as an ``inv.Fault`` once its part is back;
    ``notes``: what went wrong making one (a command that failed)."""

    def __init__(self, stack: Stack, plan: list[PlannedFault], start: float, until: float,
                 seed: int, say: Any) -> None:
        self.stack, self.plan, self.say = stack, plan, say
        self.start, self.until = start, until
        self.rng = random.Random(seed + 1)  # which worker, which key name
        self.faults: list[inv.Fault] = []
        self.notes: list[str] = []
        self.stop = threading.Event()
        self._keys = 0
        self._applies = 0
        self._thread = threading.Thread(target=self._run, name="faults", daemon=True)

    def run_in_background(self) -> None:
        self._thread.start()

    def join(self) -> None:
        self.stop.set()
        self._thread.join(BACK_TIMEOUT_S * 3)

    def _run(self) -> None:
        at = self.start + WARMUP_S
        for p in self.plan:
            at = max(at + p.gap_s, time.monotonic() + 2.0)
            if at >= self.until or self.stop.wait(max(0.0, at - time.monotonic())):
                return
            try:
                fault = self.make(p)
            except Exception as e:  # noqa: BLE001 - a fault that failed is noted, not fatal
                self.notes.append(f"{p.kind}: {type(e).__name__}: {e}")
                self.say(f"fault {p.kind} failed: {e}")
                continue
            self.faults.append(fault)
            self.say(f"{p.kind:<13} {fault.target:<16} back after "
                     f"{fault.end - fault.start:5.1f} s")
            at = time.monotonic()

    def make(self, p: PlannedFault) -> inv.Fault:
        """Make one fault and wait for its part to be back."""
        s = self.stack
        t0 = time.monotonic()
        if p.kind == "nginx_worker":
            workers = s.nginx_workers()
            victim = self.rng.choice(sorted(workers))
            os.kill(victim, signal.SIGKILL)
            self._wait(lambda: victim not in s.nginx_workers()
                       and len(s.nginx_workers()) >= len(workers), "a new nginx worker")
            return inv.Fault(p.kind, "nginx", t0, time.monotonic(), (victim,))
        if p.kind == "redis_stall":
            pid = s.pid("redis")
            os.kill(pid, signal.SIGSTOP)
            time.sleep(p.hold_s)
            os.kill(pid, signal.SIGCONT)
            return inv.Fault(p.kind, "redis", t0, time.monotonic(), (pid,))
        if p.kind == "sighup":
            old = s.nginx_workers()
            os.kill(s.pid("nginx"), signal.SIGHUP)
            self._wait_reloaded(old)
            return inv.Fault(p.kind, "nginx", t0, time.monotonic(), (s.pid("nginx"),))
        if p.kind == "config_apply":
            return self._config_apply(t0)
        if p.kind == "keys":
            return self._key_commands(t0)
        role = {"nginx_master": "nginx", "redis_down": "redis", "redis_restart": "redis",
                "replica": f"sim{p.target}"}.get(p.kind, p.kind)
        if p.kind == "redis_down":
            s.sup.hold(s.name(role), p.hold_s)
        sig = signal.SIGTERM if p.kind in ("redis_down", "redis_restart") else signal.SIGKILL
        proc = s.roles[role].proc
        assert proc is not None
        os.kill(proc.pid, sig)
        self._wait(lambda: s.roles[role].proc is not proc and s.up(role), f"{role} back")
        target = s.replicas[p.target] if p.kind == "replica" else role
        return inv.Fault(p.kind, target, t0, time.monotonic(), (proc.pid,))

    def _wait(self, cond: Any, what: str) -> None:
        if not wait_for(cond, BACK_TIMEOUT_S):
            raise TimeoutError(f"{what}: not after {BACK_TIMEOUT_S:.0f} s")

    def _wait_reloaded(self, old: set[int]) -> None:
        """Until the workers before a reload are gone (they finish what they serve)."""
        self._wait(lambda: not (self.stack.nginx_workers() & old), "the old nginx workers gone")

    def _tokengate(self, *args: str) -> None:
        r = subprocess.run([sys.executable, "-m", "tokengate.cli", *args],
                           capture_output=True, text=True, timeout=120, check=False)
        if r.returncode != 0:
            raise RuntimeError(f"tokengate {' '.join(args[:2])} exited {r.returncode}: "
                               + (r.stderr or r.stdout).strip()[-500:])

    def _config_apply(self, t0: float) -> inv.Fault:
        s = self.stack
        self._applies += 1
        raw = yaml.safe_load(s.config.read_text())
        raw["keys"]["soak-spend"]["description"] = f"soak config apply {self._applies}"
        s.config.write_text(yaml.safe_dump(raw, sort_keys=False))
        old = s.nginx_workers()
        self._tokengate("config", "apply", str(s.config), "--edge", str(s.edge_dir))
        pids = []
        for role in ("counter", "limits", "ledger"):  # their `systemctl reload`
            pid = s.pid(role)
            os.kill(pid, signal.SIGHUP)
            pids.append(pid)
        self._wait_reloaded(old)
        return inv.Fault("config_apply", "nginx", t0, time.monotonic(), tuple(pids))

    def _key_commands(self, t0: float) -> inv.Fault:
        s = self.stack
        self._keys += 1
        name = f"soak-churn-{self._keys}"
        common = ["--config", str(s.config), "--edge", str(s.edge_dir)]
        old = s.nginx_workers()
        self._tokengate("keys", "create", name, "--rpm", "60", "--tpm", "100000", *common)
        self._tokengate("keys", "rotate", name, "--overlap", "0", *common)
        self._tokengate("keys", "revoke", name, *common)
        self._wait_reloaded(old)
        return inv.Fault("keys", "nginx", t0, time.monotonic())


# -- the load -----------------------------------------------------------------------------


def load_specs(opts: SoakOptions, base_url: str, model_dir: Path) -> list[RunSpec]:
    """The two TokenStorm runs: streamed and not (module docstring)."""
    keys = tuple(k.secret for k in load_keys(opts))
    common: dict[str, Any] = {
        "url": base_url, "model": MODEL, "model_dir": model_dir, "max_model_len": 8192,
        "duration_s": opts.duration_s,
        "profile": f"normal:mean={opts.prompt_mean},sd={opts.prompt_sd}",
        "sharing": Sharing(opts.tenants, opts.prefix_tokens, 2),
        "output": OutputPolicy(ratio=opts.output_ratio, max_output=opts.max_output),
        "keys": keys, "timeout_s": 90.0, "max_lag_ms": 100.0, "connections": 8}
    out = []
    for name, share, stream, seed in (("stream", opts.stream_share, True, opts.seed),
                                      ("json", 1 - opts.stream_share, False, opts.seed + 1)):
        if share > 0:
            out.append(RunSpec(**common, arrival=ArrivalSpec("poisson", rate=opts.rate * share),
                               stream=StreamOptions(stream=stream), seed=seed,
                               name=f"soak {name}"))
    return out


def _load(spec: RunSpec, out: Path) -> None:
    """A load process: run ``spec``, write its records (``pickle``) to ``out``."""
    result = execute(spec, progress=False)
    r = result.records
    clients = [inv.ClientRequest(
        # a request that never left (its connect failed) counts from its scheduled time
        sent=result.start + float(r.sent[i] if math.isfinite(r.sent[i]) else r.sched[i]),
        end=result.start + float(r.end[i]), status=int(r.status[i]),
        error=ERROR_NAMES[int(r.error[i])], request_id=str(r.request_id[i]),
        reused=bool(r.reused[i]), prompt_tokens=int(r.prompt[i]),
        completion_tokens=int(r.completion[i])) for i in range(len(r))]
    out.write_bytes(pickle.dumps({"clients": clients, "summary": result.summary.to_json()}))


# -- collecting ---------------------------------------------------------------------------


def _metrics(url: str) -> dict[str, float]:
    """A Prometheus text page as {"name{labels}": value}."""
    out = {}
    with urllib.request.urlopen(url, timeout=10) as resp:
        for line in resp.read().decode().splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                out[name] = float(value)
    return out


def _sum(metrics: dict[str, float], family: str) -> float:
    return sum(v for k, v in metrics.items() if k == family or k.startswith(family + "{"))


def edge_state(stack: Stack) -> dict[str, Any]:
    """The edge's queues and replicas from its status server's /metrics."""
    m = _metrics(f"http://127.0.0.1:{stack.ports.status}/metrics")
    outstanding, out = {}, {}
    for r in stack.replicas:
        label = f'{{model="{MODEL}",replica="{r}"}}'
        outstanding[r] = int(m.get("tokengate_upstream_outstanding_tokens" + label, 0))
        out[r] = m.get("tokengate_upstream_up" + label, 1) == 0
    return {"queue_requests": int(_sum(m, "tokengate_queue_requests")),
            "queue_tokens": int(_sum(m, "tokengate_queue_tokens")),
            "outstanding_tokens": outstanding, "out": out}


# the ledger's counts in Redis (since its first start, across its restarts), of its usage
# file and of its engine files
LEDGER_COUNTS = ("applied", "duplicates", "settled_engine", "engine_missing", "disagreements",
                 "corrections", "orphans", "engine_records", "engine_duplicates",
                 "engine_unmatched", "engine_late")


def ledger_state(stack: Stack, client: SyncRedis) -> dict[str, Any]:
    """What the ledger has left to do (its status file's lags and waits, the join's state
    in Redis: events waiting, engine records kept) and what it did (its counts in
    Redis)."""
    status = json.loads((devstack.VAR / "run" / "soak-ledger.status.json").read_text())
    ledger_id = default_ledger_id(USAGE_FILE)
    counts = Counter[str]()
    for lid in [ledger_id, *(engine_ledger_id(ledger_id, f) for f in stack.engine_files)]:
        for k, v in client.hgetall(redis_keys.stats_key(lid)).items():
            if k in LEDGER_COUNTS:
                counts[str(k)] += int(v)
    return {"lag_bytes": status.get("lag_bytes"), "engine_lag_bytes":
            status.get("engine_lag_bytes"), "waiting": status.get("waiting"),
            "pending": int(client.hlen(redis_keys.PENDING_KEY)),
            "eng_wait": int(client.zcard(redis_keys.ENG_WAIT_KEY)),
            **{k: counts[k] for k in LEDGER_COUNTS}}


def span_counts(client: SyncRedis) -> dict[str, int]:
    h = client.hgetall(redis_keys.spans_key(default_ledger_id(USAGE_FILE)))
    return {str(k): int(v) for k, v in h.items()}


def settled(stack: Stack, client: SyncRedis) -> bool:
    """Nothing left to read, bill, settle or export: the edge's last settlements go out
    from a timer after the usage event is written (or the ledger makes them from the
    event)."""
    try:
        led, edge = ledger_state(stack, client), edge_state(stack)
        spans = span_counts(client)
        open_, _ = read_budgets(client)
    except (OSError, ValueError):
        return False
    lost = sum(v for k, v in spans.items() if k.startswith("lost:"))
    if open_:
        answered = {json.loads(line).get("request_id") for line in _lines(USAGE_FILE)}
        if any(k.rpartition(":r:")[2] in answered for k in open_):
            return False
    return (led["lag_bytes"] == 0 and led["engine_lag_bytes"] == 0 and not led["waiting"]
            and not led["pending"] and not led["eng_wait"] and not edge["queue_requests"]
            and spans.get("traced", 0) == spans.get("exported", 0) + lost)


def _lines(path: Path) -> list[bytes]:
    return path.read_bytes().splitlines() if path.exists() else []


def _parsed(path: Path, parse: Callable[[bytes], _T], notes: list[str]) -> list[_T]:
    """Every line of ``path`` parsed; a line that is not one is noted and skipped."""
    out = []
    for line in _lines(path):
        try:
            out.append(parse(line))
        except EventError as e:
            notes.append(f"{path.name}: bad line ({e})")
    return out


def read_records(stack: Stack, notes: list[str]) -> dict[str, list[EngineRecord]]:
    return {replica: _parsed(path, parse_record, notes)
            for replica, path in zip(stack.replicas, stack.engine_files, strict=True)}


def read_bills(client: SyncRedis) -> list[dict[str, str]]:
    """The audit stream's bills (entries with a request id), oldest first."""
    out: list[dict[str, str]] = []
    start = "-"
    while True:
        batch = client.xrange(redis_keys.AUDIT_KEY, start, "+", count=10_000)
        if not batch:
            return out
        out += [{str(k): str(v) for k, v in fields.items()} for _id, fields in batch
                if "rid" in fields]
        start = "(" + str(batch[-1][0])


def read_budgets(client: SyncRedis) -> tuple[list[str], dict[str, int]]:
    """(budget reservation records not settled, in-flight counters not 0). A record
    says "settled" for ten minutes after its settlement, then expires: one that expires
    between the scan and the read is gone, not open."""
    open_ = []
    for k in client.scan_iter(match=f"{redis_keys.BUDGET_PREFIX}:*:r:*", count=1000):
        v = client.get(k)
        if v is not None and v != SETTLED:
            open_.append(str(k))
    in_flight = {}
    for pattern in ("rs", "rt"):
        for k in client.scan_iter(match=f"{redis_keys.BUDGET_PREFIX}:*:{pattern}:*",
                                  count=1000):
            v = client.get(k)
            if v is not None and float(v) != 0:
                in_flight[str(k)] = int(float(v))
    return open_, in_flight


def replica_lives(stack: Stack, faults: list[inv.Fault]) -> list[inv.ReplicaLife]:
    out = []
    for r in stack.replicas:
        # records after a kill are the next lifetime's: its supervisor restarts nothing
        # sooner than 1 s after
        kills = [f.start + 0.5 for f in faults if f.kind == inv.REPLICA_KILL and f.target == r]
        m = _metrics(f"http://{r}/metrics")
        label = f'{{engine="0",model_name="{MODEL}"}}'
        out.append(inv.ReplicaLife(
            r, max(kills, default=0.0), int(m.get("vllm:prompt_tokens_total" + label, 0)),
            int(m.get("vllm:generation_tokens_total" + label, 0)),
            int(m.get("vllm:num_requests_running" + label, 0)),
            int(m.get("vllm:num_requests_waiting" + label, 0)), len(kills)))
    return out


# -- the run ------------------------------------------------------------------------------


class Clock:
    """Lines said with the seconds since the soak began."""

    def __init__(self) -> None:
        self.t0 = time.monotonic()
        self.lines: list[str] = []
        self._lock = threading.Lock()

    def say(self, line: str) -> None:
        text = f"[{time.monotonic() - self.t0:7.1f} s] {line}"
        with self._lock:
            self.lines.append(text)
        print(text, flush=True)


def soak(opts: SoakOptions) -> dict[str, Any]:
    """Run the soak; the results (``main`` writes them)."""
    clock = Clock()
    say = clock.say
    if SOAK_VAR.exists():
        shutil.rmtree(SOAK_VAR)
    SOAK_VAR.mkdir(parents=True)
    ports = Ports(sims=[free_port() for _ in range(opts.replicas)],
                  kv_events=[free_port() for _ in range(opts.replicas)])
    collector = OtlpReceiver(grpc_port=ports.otlp, keep=False).start()
    stack = Stack(opts, ports, say)
    notes: list[str] = []
    plan = plan_faults(opts)
    # other work on the machine slows every part down (and a restart most): say how busy
    out: dict[str, Any] = {"started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                           "options": asdict(opts),
                           "machine": {"cpus": os.cpu_count(),
                                       "load_average_before": os.getloadavg()}}
    try:
        say(f"starting the stack in {SOAK_VAR.relative_to(devstack.ROOT)} "
            f"(edge 127.0.0.1:{ports.edge}) ...")
        stack.start()
        model_dir = Path(tg_config.load(stack.config).models[MODEL].dir)
        specs = load_specs(opts, f"http://127.0.0.1:{ports.edge}/v1", model_dir)
        say(f"load: {opts.rate:g} req/s for {opts.duration_s:g} s ("
            + ", ".join(f"{s.name} {s.arrival.rate:g} req/s" for s in specs if s.arrival)
            + f"); faults about every {opts.fault_every_s:g} s, seed {opts.seed}")
        ctx = mp.get_context("spawn")
        files = [SOAK_VAR / f"load-{i}.pickle" for i in range(len(specs))]
        # not daemonic: TokenStorm forks its workers
        procs = [ctx.Process(target=_load, args=(spec, f))
                 for spec, f in zip(specs, files, strict=True)]
        for p in procs:
            p.start()
        load_start = time.monotonic() + 5.0  # the runs build their prompts, then start
        runner = FaultRunner(stack, plan, load_start,
                             load_start + opts.duration_s - opts.quiet_s, opts.seed, say)
        runner.run_in_background()
        for p in procs:
            p.join(opts.duration_s + 600)
        runner.join()
        say(f"load over; {len(runner.faults)} faults; waiting for every part to be up")
        if not wait_for(stack.all_up, BACK_TIMEOUT_S):
            notes.append("not every part was up after the load")
        loads = []
        for f, p in zip(files, procs, strict=True):
            if p.exitcode != 0 or not f.exists():
                raise RuntimeError(f"a load process failed (exit {p.exitcode})")
            loads.append(pickle.loads(f.read_bytes()))
        client = connect(tg_config.load(stack.config).redis)
        say("settling: the ledger reads and bills everything, the spans are exported ...")
        if not wait_for(lambda: settled(stack, client), opts.settle_timeout_s, poll_s=1.0):
            notes.append(f"not settled after {opts.settle_timeout_s:g} s")
        time.sleep(1.0)  # the replicas' last records and counters
        open_, in_flight = read_budgets(client)
        data = inv.SoakData(
            clients=[c for ld in loads for c in ld["clients"]], events=_parsed(USAGE_FILE, parse_event, notes),
            wall_to_mono=time.monotonic() - time.time(), bills=read_bills(client),
            records=read_records(stack, notes), lives=replica_lives(stack, runner.faults),
            spans=span_counts(client), spans_received=collector.received,
            open_reservations=open_, budget_in_flight=in_flight, edge=edge_state(stack),
            ledger=ledger_state(stack, client),
            error_log=[line for line in stack.roles["nginx"].log_path.read_text(
                errors="replace").splitlines()],
            faults=runner.faults)
        checks = inv.check_all(data)
        out.update(
            load={s.name: ld["summary"] for s, ld in zip(specs, loads, strict=True)},
            requests=len(data.clients), events=len(data.events), bills=len(data.bills),
            engine_records=sum(len(v) for v in data.records.values()),
            faults=[asdict(f) | {"start": round(f.start - clock.t0, 2),
                                 "end": round(f.end - clock.t0, 2)} for f in runner.faults],
            fault_kinds=dict(Counter(f.kind for f in runner.faults)),
            load_average_after=os.getloadavg(),
            notes=notes + runner.notes, supervisor=clock.lines,
            checks=[c.to_json() for c in checks])
        return out
    finally:
        stack.stop()
        collector.stop()


def render(out: dict[str, Any]) -> list[str]:
    """The lines printed after a soak: the load, the faults, each invariant with its
    figures (and what broke it), then ``soak: N of M invariants held``."""
    counts = (f"requests {out['requests']:,}, usage events {out['events']:,}, bills "
              f"{out['bills']:,}, engine records {out['engine_records']:,}")
    kinds = ", ".join(f"{k} {n}" for k, n in sorted(out["fault_kinds"].items()))
    lines = [counts, f"faults: {kinds or 'none'}"]
    for note in out["notes"]:
        lines.append(f"note: {note}")
    held = 0
    for c in out["checks"]:
        held += c["held"]
        lines.append(f"{'held  ' if c['held'] else 'BROKEN'} {c['name']}: {c['title']}")
        lines.append("       " + json.dumps(c["figures"], separators=(", ", ": ")))
        for s in c["samples"]:
            lines.append(f"       - {s}")
    lines.append(f"soak: {held} of {len(out['checks'])} invariants held")
    return lines


def parse_args(argv: list[str] | None = None) -> tuple[SoakOptions, Path | None]:
    d = SoakOptions()
    p = argparse.ArgumentParser(prog="python -m tokengate_dev.bench.soak", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duration", type=float, default=d.duration_s, metavar="S",
                   help="seconds of load (default: %(default)s; make soak SOAK_S=N)")
    p.add_argument("--seed", type=int, default=d.seed,
                   help="the load's and the fault schedule's seed (default: %(default)s)")
    p.add_argument("--rate", type=float, default=d.rate, metavar="REQ_PER_S",
                   help="Poisson arrivals, both runs together (default: %(default)s)")
    p.add_argument("--stream-share", type=float, default=d.stream_share, metavar="X",
                   help="share of the rate that streams (default: %(default)s)")
    p.add_argument("--replicas", type=int, default=d.replicas, metavar="N",
                   help="simulated replicas (default: %(default)s)")
    p.add_argument("--fault-every", type=float, default=d.fault_every_s, metavar="S",
                   help="mean seconds between faults (default: %(default)s)")
    p.add_argument("--quiet", type=float, default=d.quiet_s, metavar="S",
                   help="no fault in the load's last S seconds (default: %(default)s)")
    p.add_argument("--out", type=Path, default=None, metavar="FILE.json",
                   help="result file (default: bench/results/soak-<time>.json)")
    a = p.parse_args(argv)
    if a.duration <= WARMUP_S + a.quiet or a.rate <= 0 or a.replicas < 2 \
            or not 0 <= a.stream_share <= 1 or a.fault_every <= 0:
        p.error(f"--duration must exceed {WARMUP_S:g} s + --quiet; --rate and --fault-every "
                "> 0; --replicas >= 2 (one is killed at a time); --stream-share 0..1")
    opts = SoakOptions(duration_s=a.duration, seed=a.seed, rate=a.rate,
                       stream_share=a.stream_share, replicas=a.replicas,
                       fault_every_s=a.fault_every, quiet_s=a.quiet)
    return opts, a.out


def main(argv: list[str] | None = None) -> None:
    opts, out_path = parse_args(argv)
    t0 = time.monotonic()
    try:
        out = soak(opts)
    except (ServiceError, RuntimeError) as e:
        sys.exit(f"soak: {e}")
    out["elapsed_s"] = round(time.monotonic() - t0, 1)
    path = results.write(out, "soak", out_path)
    lines = render(out)
    print("\n".join(lines[:-1]))
    print(f"results: {path} ({out['elapsed_s']:g} s)")
    print(lines[-1])
    sys.exit(0 if all(c["held"] for c in out["checks"]) else 1)


if __name__ == "__main__":
    main()

"""``make bench-routing``: the edge's replica choice (``models.<name>.routing``) measured
side by side, on simulated GPU replicas at scale and on two vLLM CPU replicas.
(Over 600 lines: both sections run the same policies, workloads and report over one
gateway builder, so they stay in one module.)

Every policy gets the same seeded, open-loop, streaming TokenStorm workload through the
real gateway (the counter and the nginx edge, as ``make run`` starts them):

- ``round_robin``; ``least_outstanding`` (the default: fewest outstanding reserved
  tokens); ``prefix`` **approximate** (no ``routing.kv_events``: the edge's own index of
  what it sent where); ``prefix`` **precise** (each replica's KV events, followed by the
  counter, which returns each replica's hit with the count).
- Two workloads. ``shared``: many tenants whose prompts all start with their own long
  system prompt, then the history of one of their conversations (multi-turn: a later
  turn extends an earlier one; ``tokenstorm.prompts.Sharing``). ``unique``: the same
  lengths with nothing shared.

**Simulated replicas** (the default section): ``--replicas`` ``tokenstorm sim-replica``
processes (``tokenstorm.upstream.sim``), each a GPU-like vLLM replica with a real prefix
cache (vLLM's block hashes, LRU eviction, ``cached_tokens`` in usage) and KV events in
vLLM's wire format. Their settings make prefill the part of TTFT that the prefix cache
saves: uncached prompt tokens go through one first-come-first-served prefill queue per
replica at ``--prefill-tokens-per-s``, so a replica that recomputes a long system prompt
delays every request behind it; and each replica's KV cache (``--num-gpu-blocks``) holds
the prefixes of some of the tenants, not all: the fleet together can hold them all only
when each tenant's requests keep to a few replicas. The replicas are started once; before
every run their prefix caches are emptied (vLLM's ``POST /reset_prefix_cache``; its
``AllBlocksCleared``, published at the replica's next engine step, which a request
shorter than a block then brings, empties the precise index too) and the edge is
started afresh (its approximate index and outstanding tokens empty), so no run inherits
another's cache. Two counters run beside them: one follows the replicas' KV events
(precise; round robin and least outstanding read no hits), one follows none (approximate:
the edge takes any hit the counter returns as the replica's).

**vLLM CPU replicas** (``--vllm``): two real vLLM servers (``devstack.vllm_service``,
``--kv-events-config``, ``--block-size``, a small ``--num-gpu-blocks-override``) and a
small workload; prefix caches reset between runs the same way (``VLLM_SERVER_DEV_MODE``).
The tiny model's prefill is cheap on a CPU, so there the cached-token ratio is the
figure that shows the routing; TTFT differences stay small.

Per workload and policy: the cached-token ratio (``cached_tokens`` / prompt tokens, as
vLLM reports them), TTFT p50/p90 (ms from the scheduled send), output tokens/s, and how
the requests spread over the replicas (from the edge's usage events). Then the aims
with met / not met: on ``shared``, precise prefix routing at least 1.5x the
cached-token ratio of least-outstanding and at most 0.5x its TTFT p90; on ``unique``, at
least 0.95x its output tokens/s. Results: ``bench/results/routing-<time>.json`` and
``bench/results/routing-latest.json``.

About 3.5 minutes on 2 cores with the defaults (eight 20 s runs and their drain); the
vLLM section adds about four (two vLLM starts, eight 16 s runs).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
import time
import urllib.request
from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml
from rich.console import Console
from rich.table import Table
from tokengate import config as tg_config
from tokenstorm import report
from tokenstorm.arrivals import ArrivalSpec
from tokenstorm.process import Service, ServiceError, free_port
from tokenstorm.profiles import OutputPolicy
from tokenstorm.prompts import Sharing, StreamOptions
from tokenstorm.runner import RunResult, RunSpec, execute
from tokenstorm.upstream.sim import SimReplica, SimSettings

from tokengate_dev import devstack
from tokengate_dev.bench import results

BENCH_VAR = devstack.VAR / "bench-routing"
BENCH_KEY = "tg-bench-routing-key"
MODEL = "tiny-qwen3"


@dataclass(frozen=True)
class Policy:
    """One way of choosing a replica: ``label`` (tables), ``key`` (JSON), the model's
    ``routing.policy`` and whether ``routing.kv_events`` names each replica's publisher."""

    label: str
    key: str
    policy: str
    kv_events: bool = False

    @property
    def counter_follows_events(self) -> bool:
        """Whether the counter the edge asks follows the replicas' KV events. The edge
        takes every hit the counter returns as the replica's (``tokengate.prefix``), so
        the approximate policy needs a counter that follows none; the policies that
        read no hits (round robin, least outstanding) share the precise one's."""
        return self.kv_events or self.policy != "prefix"


POLICIES = (
    Policy("round robin", "round_robin", "round_robin"),
    Policy("least outstanding", "least_outstanding", "least_outstanding"),
    Policy("prefix, approximate", "prefix_approximate", "prefix"),
    Policy("prefix, precise", "prefix_precise", "prefix", kv_events=True),
)
BASELINE, PRECISE = "least_outstanding", "prefix_precise"

# The aims: (workload, label, figure, comparison, target); each figure is
# precise prefix's over least-outstanding's.
AIMS = [
    ("shared", "cached-token ratio, precise prefix / least outstanding",
     "cached_ratio_x", ">=", 1.5),
    ("shared", "TTFT p90, precise prefix / least outstanding", "ttft_p90_x", "<=", 0.5),
    ("unique", "output tokens/s, precise prefix / least outstanding",
     "output_tokens_per_s_x", ">=", 0.95),
]


@dataclass(frozen=True)
class Workload:
    """One TokenStorm workload: prompts of ``prompt_mean`` +- ``prompt_sd`` tokens (a
    normal profile; at least the shared prefix and one word), ``output_tokens`` each,
    Poisson arrivals at ``rate`` req/s for ``duration_s``; ``sharing``: who shares
    which prefix."""

    name: str
    sharing: Sharing
    prompt_mean: int
    prompt_sd: int
    output_tokens: int
    rate: float
    duration_s: float

    def describe(self) -> str:
        return (f"{self.name}: {self.sharing.describe()}; prompts ~{self.prompt_mean} "
                f"(sd {self.prompt_sd}) tokens, {self.output_tokens} output tokens, "
                f"Poisson {self.rate:g} req/s for {self.duration_s:g} s")


@dataclass
class RoutingOptions:
    """``make bench-routing``'s knobs (see ``main``'s ``--help``). Token counts are
    tokens, rates req/s, times s unless named ``_ms``."""

    replicas: int = 4
    tenants: int = 16
    prefix_tokens: int = 3000
    conversations: int = 2
    history_tokens: int = 800
    history_sd: int = 300
    output_tokens: int = 24
    load: float = 1.3
    unique_load: float = 0.75
    rate: float | None = None
    unique_rate: float | None = None
    duration_s: float = 20.0
    block_size: int = 16
    num_gpu_blocks: int = 1600
    # the simulated replicas' --max-model-len: one request must fit their KV cache
    # (1,599 blocks of 16 = 25,584 tokens), whatever the checkout's model allows
    sim_max_model_len: int = 8192
    prefill_tokens_per_s: float = 8000.0
    itl_ms: float = 10.0
    ttft_overhead_ms: float = 5.0
    load_weight: float | None = None   # None: the checkout's tokengate.yaml
    edge_workers: int = 2
    counter_workers: int = 1
    seed: int = 0
    workloads: tuple[str, ...] = ("shared", "unique")
    policies: tuple[str, ...] = tuple(p.key for p in POLICIES)
    max_lag_ms: float = 25.0
    sim: bool = True
    vllm: bool = False
    vllm_requests: int = 48
    vllm_rate: float = 3.0
    vllm_tenants: int = 4
    vllm_prefix_tokens: int = 1000
    vllm_num_gpu_blocks: int = 96
    vllm_max_model_len: int = 2048
    # vLLM's CPU attention takes blocks of a multiple of 32 tokens ("No common block
    # size for 16 (CPU_ATTN: [MultipleOf(32)])"; 128 when none is given)
    vllm_block_size: int = 32

    def workload(self, name: str) -> Workload:
        """The sim section's ``shared`` or ``unique`` workload, of the same lengths. Its
        rate: ``rate`` (``unique_rate``), else the one whose prefill work, were nothing
        cached, is ``load`` (``unique_load``) times what the fleet can prefill
        (``prefill_load``): above 1 for ``shared``, which the fleet serves only by its
        prefix caches; below for ``unique``, which it serves without any."""
        sharing = Sharing(self.tenants, self.prefix_tokens, self.conversations) \
            if name == "shared" else Sharing()
        mean = self.prefix_tokens + self.history_tokens
        rate, load = (self.rate, self.load) if name == "shared" else \
            (self.unique_rate, self.unique_load)
        if rate is None:
            rate = round(load * self.replicas * self.prefill_tokens_per_s / mean, 2)
        return Workload(name, sharing, mean, self.history_sd, self.output_tokens, rate,
                        self.duration_s)

    def vllm_workload(self, name: str) -> Workload:
        """The vLLM section's workloads: ``vllm_requests`` requests at ``vllm_rate``, one
        conversation per tenant (a replica's 96 blocks of 32 tokens hold two tenants'
        prompts, not all four)."""
        prefix = self.vllm_prefix_tokens
        sharing = Sharing(self.vllm_tenants, prefix, 1) if name == "shared" else Sharing()
        return Workload(name, sharing, prefix + 300, 100, 8, self.vllm_rate,
                        self.vllm_requests / self.vllm_rate)

    def sim_settings(self, model: tg_config.ModelConfig, endpoint: str) -> SimSettings:
        """One simulated replica publishing KV events on ``endpoint``."""
        return SimSettings(model=model.name, model_dir=Path(model.dir),
                           max_model_len=self.sim_max_model_len, block_size=self.block_size,
                           num_gpu_blocks=self.num_gpu_blocks,
                           prefill_tokens_per_s=self.prefill_tokens_per_s,
                           ttft_overhead_ms=self.ttft_overhead_ms, itl_ms=self.itl_ms,
                           kv_events_endpoint=endpoint, tokenizer="counter")

    def prefill_load(self, w: Workload) -> float:
        """The fleet's prefill work offered by ``w`` if no prompt token were cached:
        rate x mean prompt tokens / (replicas x prefill tokens/s); above 1 the fleet
        keeps up only by its prefix caches."""
        return w.rate * w.prompt_mean / (self.replicas * self.prefill_tokens_per_s)


# -- the gateway's configuration ---------------------------------------------------------

def write_config(path: Path, upstreams: list[str], kv_events: dict[str, str], policy: str,
                 opts: RoutingOptions, block_size: int, edge_port: int = 0,
                 usage_file: Path | None = None, max_model_len: int | None = None) -> Path:
    """tokengate.yaml for the bench: the checkout's models, ``MODEL`` served by
    ``upstreams`` and routed by ``policy`` (``routing.kv_events``: ``kv_events``), one
    key with limits far above the load (still reserved and settled on every request),
    the edge on ``edge_port``, its usage events in ``usage_file``; ``block_size``: the
    replicas' --block-size; ``max_model_len``: theirs when it is not the checkout's."""
    raw = yaml.safe_load((devstack.ROOT / "tokengate.yaml").read_text())
    for m in raw["models"].values():
        m["dir"] = str((devstack.ROOT / m["dir"]).resolve())
    m = raw["models"][MODEL]
    if max_model_len is not None:
        m["max_model_len"] = max_model_len
        m["max_tokens_cap"] = min(m.get("max_tokens_cap") or max_model_len, max_model_len)
    m["upstreams"] = list(upstreams)
    m["embedded"] = False
    m["routing"] = {"policy": policy, "block_size": block_size, "hash_algo": "sha256",
                    "kv_events": dict(kv_events), "load_weight": opts.load_weight}
    raw["keys"] = {"bench": {"sha256": hashlib.sha256(BENCH_KEY.encode()).hexdigest(),
                             "rpm": 1_000_000_000, "tpm": 1_000_000_000_000}}
    usage = usage_file or BENCH_VAR / "usage.jsonl"
    raw.setdefault("ledger", {})["usage_file"] = str(usage)
    raw.setdefault("access_log", {})["file"] = str(BENCH_VAR / "access.sampled.log")
    edge = raw.setdefault("edge", {})
    edge["listen"] = f"127.0.0.1:{edge_port or free_port()}"
    # two cores run the replicas, the counters, the edge and TokenStorm: give the counter
    # room before the edge falls back to an estimate (which carries no block hashes)
    edge["count_timeout_ms"] = 3000
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def start_all(services: list[Service]) -> None:
    """Spawn every service, then wait for all (they start side by side); on a failure
    stop them all and raise ``ServiceError``."""
    try:
        for s in services:
            s.spawn()
        pending = list(services)
        while pending:
            pending = [s for s in pending if not s.poll_start()]
            time.sleep(0.1)
    except BaseException:
        for s in services:
            s.stop()
        raise


def reset_prefix_cache(base_url: str, timeout_s: float = 30.0) -> None:
    """vLLM's ``POST /reset_prefix_cache`` on a replica (``base_url``: http://host:port),
    again until it succeeds (it fails while a request holds blocks); RuntimeError after
    ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        req = urllib.request.Request(base_url + "/reset_prefix_cache", method="POST")
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                if json.loads(r.read()).get("success") is True:
                    return
        except (OSError, ValueError):
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{base_url}: the prefix cache could not be reset")
        time.sleep(0.2)


def warm_up(base_url: str, model: tg_config.ModelConfig) -> None:
    """One short chat request straight to a replica (``base_url``: http://host:port):
    about 10 prompt tokens and 2 output tokens, less than one KV block."""
    body = json.dumps({"model": model.name, "max_tokens": 2,
                       "messages": [{"role": "user", "content": "warm up"}]}).encode()
    req = urllib.request.Request(base_url + "/v1/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        r.read()


def spread(usage_file: Path, upstreams: list[str]) -> dict[str, Any]:
    """Requests per replica (the usage events' ``upstream``), the busiest replica's share,
    and the prediction's hit rate: expected cached tokens the replica then reported as
    cached over all expected ones (the usage events' ``expected_cached_tokens``, policy
    prefix only)."""
    per: Counter[str] = Counter()
    expected = confirmed = 0
    for ev in results.events(usage_file):
        per[str(ev.get("upstream"))] += 1
        exp = ev.get("expected_cached_tokens")
        if isinstance(exp, int) and exp > 0:
            expected += exp
            confirmed += min(exp, int(ev.get("cached_tokens") or 0))
    total = sum(per.values())
    return {"requests": {u: per.get(u, 0) for u in upstreams},
            "busiest_share": max(per.values()) / total if total else None,
            "expected_cached_tokens": expected,
            "prediction_hit_rate": confirmed / expected if expected else None}


# -- one section: replicas, counters, then every workload x policy -----------------------

@dataclass
class Section:
    """The running parts of one section: replicas (their ``host:port`` names, KV-event
    endpoints, block size, context length when not the checkout's), the two counters'
    sockets."""

    name: str
    upstreams: list[str]
    endpoints: dict[str, str]
    block_size: int
    max_model_len: int | None = None
    services: list[Service] = field(default_factory=list)
    counter_sockets: dict[bool, Path] = field(default_factory=dict)

    def stop(self) -> None:
        for s in reversed(self.services):
            s.stop()


def _counters(section: Section, opts: RoutingOptions) -> list[Service]:
    """The counter that follows the replicas' KV events and the one that follows none,
    each when a policy of ``opts`` asks it."""
    out = []
    need = {p.counter_follows_events for p in POLICIES if p.key in opts.policies}
    for events in sorted(need):
        tag = "events" if events else "plain"
        cfg = write_config(BENCH_VAR / f"{section.name}-counter-{tag}.yaml",
                           section.upstreams, section.endpoints if events else {},
                           "prefix", opts, section.block_size,
                           max_model_len=section.max_model_len)
        sock = BENCH_VAR / f"{section.name}-counter-{tag}.sock"
        section.counter_sockets[events] = sock
        out.append(devstack.counter_service(cfg, port=free_port(), unix_socket=sock,
                                            workers=opts.counter_workers,
                                            name=f"bench-routing-counter-{tag}",
                                            metrics_listen="none"))
    return out


def run_one(section: Section, w: Workload, pol: Policy, opts: RoutingOptions,
            model: tg_config.ModelConfig, console: Console) -> dict[str, Any]:
    """Empty the replicas' prefix caches, start an edge routing by ``pol``, send ``w``
    through it; the run's summary, spread and the options of the edge."""
    for u in section.upstreams:
        reset_prefix_cache(f"http://{u}")
        # vLLM queues AllBlocksCleared and publishes it at its next engine step
        # (vllm/v1/core/block_pool.py take_events): until a request comes, the precise
        # index still holds the last run's blocks. A prompt shorter than one block
        # caches nothing.
        warm_up(f"http://{u}", model)
    time.sleep(0.3)  # the events reach the counter before the first request
    usage = BENCH_VAR / f"usage-{section.name}-{w.name}-{pol.key}.jsonl"
    usage.unlink(missing_ok=True)
    port = free_port()
    cfg = write_config(BENCH_VAR / f"{section.name}-edge-{pol.key}.yaml", section.upstreams,
                       section.endpoints if pol.kv_events else {}, pol.policy, opts,
                       section.block_size, edge_port=port, usage_file=usage,
                       max_model_len=section.max_model_len)
    edge = devstack.nginx_service(cfg, port=port, counter_socket=section.counter_sockets[
        pol.counter_follows_events], counter_workers=opts.counter_workers, workers=opts.edge_workers,
        name="bench-routing-edge", prefix=BENCH_VAR / "edge", status_port=free_port())
    edge.start()
    try:
        spec = RunSpec(
            url=f"http://127.0.0.1:{port}/v1", model=model.name, model_dir=Path(model.dir),
            max_model_len=section.max_model_len or model.max_model_len,
            arrival=ArrivalSpec("poisson", rate=w.rate), duration_s=w.duration_s,
            profile=f"normal:mean={w.prompt_mean},sd={w.prompt_sd}", sharing=w.sharing,
            output=OutputPolicy(fixed=w.output_tokens), stream=StreamOptions(stream=True),
            keys=(BENCH_KEY,), seed=opts.seed, max_lag_ms=opts.max_lag_ms,
            name=f"{section.name} {w.name} {pol.label}", connections=16)
        result = execute(spec, console=console)
    finally:
        edge.stop()
    out = _figures(result)
    out["spread"] = spread(usage, section.upstreams)
    _say(console, pol, out)
    return out


def _figures(r: RunResult) -> dict[str, Any]:
    s = r.summary
    a = s.all
    return {"requests": s.requests, "ok": a.ok, "valid": s.valid,
            "invalid_reasons": s.invalid_reasons, "errors": s.errors,
            "status_counts": s.status_counts,
            "cached_token_ratio": a.cached_token_ratio, "cached_tokens": a.cached_tokens,
            "ttft_p50_ms": a.ttft_ms.p50, "ttft_p90_ms": a.ttft_ms.p90,
            "ttft_p99_ms": a.ttft_ms.p99, "e2e_p90_ms": a.e2e_ms.p90,
            "output_tokens_per_s": a.output_tokens_per_s, "rps": a.rps,
            "send_lag_p99_ms": s.send_lag_ms.p99, "summary": s.to_json()}


def _say(console: Console, pol: Policy, f: dict[str, Any]) -> None:
    line = (f"  {pol.label:<22} cached {report._f(f['cached_token_ratio'], 3):>6}  TTFT p50 "
            f"{report._f(f['ttft_p50_ms'], 0):>6} p90 {report._f(f['ttft_p90_ms'], 0):>6} ms"
            f"  {report._f(f['output_tokens_per_s'], 0):>6} out tok/s  ok {f['ok']}/"
            f"{f['requests']}")
    if not f["valid"]:
        line += "  [red]INVALID: " + "; ".join(f["invalid_reasons"]) + "[/]"
    console.print(line)


def run_section(section: Section, workloads: list[Workload], opts: RoutingOptions,
                model: tg_config.ModelConfig, console: Console) -> dict[str, Any]:
    """Every workload x policy on the section's running replicas."""
    out: dict[str, Any] = {"replicas": section.upstreams, "workloads": {}}
    for w in workloads:
        console.rule(f"{section.name}: {w.describe()}")
        runs: dict[str, Any] = {}
        for pol in POLICIES:
            if pol.key in opts.policies:
                runs[pol.key] = run_one(section, w, pol, opts, model, console)
        out["workloads"][w.name] = {"workload": {**asdict(w), "sharing": asdict(w.sharing)},
                                    "policies": runs}
    out["aims"] = aims(out["workloads"])
    return out


def sim_section(opts: RoutingOptions, model: tg_config.ModelConfig,
                console: Console) -> dict[str, Any]:
    """The simulated fleet: ``opts.replicas`` sim replicas, both counters, every run."""
    reps = [SimReplica(opts.sim_settings(model, f"tcp://127.0.0.1:{free_port()}"),
                       name=f"bench-routing-sim{i}", state_dir=BENCH_VAR)
            for i in range(opts.replicas)]
    section = Section("sim", [r.address for r in reps],
                      {r.address: r.settings.kv_events_endpoint or "" for r in reps},
                      opts.block_size, max_model_len=opts.sim_max_model_len)
    section.services = [r.service for r in reps] + _counters(section, opts)
    s = reps[0].settings
    console.print(f"  {opts.replicas} simulated replicas: {s.num_gpu_blocks} KV blocks of "
                  f"{s.block_size} tokens each ({(s.num_gpu_blocks - 1) * s.block_size:,} "
                  f"tokens), prefill {s.prefill_tokens_per_s:,.0f} tokens/s, ITL "
                  f"{s.itl_ms:g} ms; routing.load_weight {opts.load_weight:g}")
    with console.status("starting the simulated replicas and the two counters ..."):
        start_all(section.services)
    try:
        workloads = [opts.workload(n) for n in opts.workloads]
        for w in workloads:
            console.print(f"  {w.name}: offered prefill load with nothing cached "
                          f"{opts.prefill_load(w):.2f} of the fleet's")
        out = run_section(section, workloads, opts, model, console)
    finally:
        section.stop()
    out["replica_settings"] = {k: str(v) if isinstance(v, Path) else v
                               for k, v in asdict(s).items()}
    out["offered_prefill_load"] = {w.name: opts.prefill_load(w) for w in workloads}
    return out


def vllm_section(opts: RoutingOptions, console: Console) -> dict[str, Any]:
    """Two vLLM CPU replicas with prefix caching and KV events, a small workload."""
    ports = [free_port(), free_port()]
    upstreams = [f"127.0.0.1:{p}" for p in ports]
    endpoints = {u: f"tcp://127.0.0.1:{free_port()}" for u in upstreams}
    cfg_path = write_config(BENCH_VAR / "vllm-replicas.yaml", upstreams, endpoints, "prefix",
                            opts, opts.vllm_block_size, max_model_len=opts.vllm_max_model_len)
    vmodel = tg_config.load(cfg_path).models[MODEL]
    services = []
    for i, port in enumerate(ports):
        svc = devstack.vllm_service(vmodel, port=port, name=f"bench-routing-vllm{i}",
                                    engine_usage_file=BENCH_VAR / f"engine{i}.jsonl")
        svc.argv += ["--num-gpu-blocks-override", str(opts.vllm_num_gpu_blocks)]
        svc.env["VLLM_SERVER_DEV_MODE"] = "1"  # POST /reset_prefix_cache
        svc.log_dir = BENCH_VAR / "log"
        services.append(svc)
    section = Section("vllm", upstreams, endpoints, opts.vllm_block_size,
                      opts.vllm_max_model_len)
    section.services = services + _counters(section, opts)
    console.print(f"  2 vLLM CPU replicas: {opts.vllm_num_gpu_blocks} KV blocks of "
                  f"{opts.vllm_block_size} tokens each; starting them takes a minute or two")
    with console.status("starting two vLLM CPU servers and the two counters ..."):
        start_all(section.services)
    try:
        for u in upstreams:  # a first request costs more than the others: not in a run
            warm_up(f"http://{u}", vmodel)
        out = run_section(section, [opts.vllm_workload(n) for n in opts.workloads], opts,
                          vmodel, console)
    finally:
        section.stop()
    out["num_gpu_blocks"] = opts.vllm_num_gpu_blocks
    return out


# -- aims and tables ---------------------------------------------------------------------

def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None:
        return None
    if b == 0:
        return math.inf if a > 0 else None
    return a / b


def aims(workloads: dict[str, Any]) -> list[dict[str, Any]]:
    """Each aim of ``AIMS`` whose workload and both policies ran: measured ratio and
    whether it is met (a run marked invalid still counts; its table row says so)."""
    out = []
    for wname, label, fig, op, target in AIMS:
        runs = workloads.get(wname, {}).get("policies", {})
        if PRECISE not in runs or BASELINE not in runs:
            continue
        p, b = runs[PRECISE], runs[BASELINE]
        src = {"cached_ratio_x": "cached_token_ratio", "ttft_p90_x": "ttft_p90_ms",
               "output_tokens_per_s_x": "output_tokens_per_s"}[fig]
        v = _ratio(p[src], b[src])
        met = v is not None and (v >= target if op == ">=" else v <= target)
        out.append({"workload": wname, "aim": label, "figure": fig, "op": op,
                    "target": target, "precise": p[src], "least_outstanding": b[src],
                    "measured": v, "met": met,
                    "valid_runs": bool(p["valid"] and b["valid"])})
    return out


def render(section: str, out: dict[str, Any]) -> list[Table]:
    """One table per workload (each policy's figures), then the aims."""
    tables = []
    for wname, wdata in out["workloads"].items():
        t = Table(title=f"{section}: {wname}", header_style="bold")
        for c in ("policy", "cached-token ratio", "TTFT p50 ms", "TTFT p90 ms",
                  "output tok/s", "ok / sent", "busiest replica", ""):
            t.add_column(c, justify="left" if c in ("policy", "") else "right",
                         no_wrap=c == "policy")
        for pol in POLICIES:
            f = wdata["policies"].get(pol.key)
            if f is None:
                continue
            share = f["spread"]["busiest_share"]
            t.add_row(pol.label, report._f(f["cached_token_ratio"], 3),
                      report._f(f["ttft_p50_ms"], 0), report._f(f["ttft_p90_ms"], 0),
                      report._f(f["output_tokens_per_s"], 0), f"{f['ok']} / {f['requests']}",
                      "-" if share is None else f"{100 * share:.0f}%",
                      "" if f["valid"] else "[red]invalid run[/]")
        tables.append(t)
    if out.get("aims"):
        t = Table(title=f"{section}: aims", header_style="bold")
        for c in ("workload", "aim", "precise / least outstanding", "measured", "target", ""):
            t.add_column(c, justify="right" if c in ("measured", "target") else "left")
        for a in out["aims"]:
            t.add_row(a["workload"], a["aim"],
                      f"{report._f(a['precise'], 3)} / {report._f(a['least_outstanding'], 3)}",
                      "-" if a["measured"] is None else f"{a['measured']:.2f}x",
                      f"{a['op']} {a['target']:g}x",
                      ("[green]met[/]" if a["met"] else "[red]not met[/]")
                      + ("" if a["valid_runs"] else " (invalid run)"))
        tables.append(t)
    return tables


def run_bench(opts: RoutingOptions, console: Console) -> dict[str, Any]:
    """Every section ``opts`` asks for; the JSON ``main`` writes."""
    BENCH_VAR.mkdir(parents=True, exist_ok=True)
    model = tg_config.load(devstack.ROOT / "tokengate.yaml").models[MODEL]
    if opts.load_weight is None:
        opts.load_weight = model.routing.load_weight
    out: dict[str, Any] = {"started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                           "options": {k: list(v) if isinstance(v, tuple) else v
                                       for k, v in asdict(opts).items()},
                           "sections": {}}
    if opts.sim:
        console.rule("simulated GPU replicas")
        out["sections"]["sim"] = sim_section(opts, model, console)
    if opts.vllm:
        console.rule("vLLM CPU replicas")
        out["sections"]["vllm"] = vllm_section(opts, console)
    return out


def parse_args(argv: list[str] | None = None
               ) -> tuple[RoutingOptions, Path | None, Path | None]:
    """The options, the result file (None: the default) and the state folder (None:
    ``BENCH_VAR``) from the command line."""
    d = RoutingOptions()
    p = argparse.ArgumentParser(prog="python -m tokengate_dev.bench.routing",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("workload")
    g.add_argument("--tenants", type=int, default=d.tenants,
                   help="tenants of the shared workload (default: %(default)s)")
    g.add_argument("--prefix-tokens", type=int, default=d.prefix_tokens, metavar="T",
                   help="tokens of each tenant's system prompt (default: %(default)s)")
    g.add_argument("--conversations", type=int, default=d.conversations, metavar="C",
                   help="conversations per tenant (default: %(default)s)")
    g.add_argument("--history-tokens", type=int, default=d.history_tokens, metavar="N",
                   help="mean prompt tokens beyond the system prompt (default: %(default)s)")
    g.add_argument("--history-sd", type=int, default=d.history_sd, metavar="N",
                   help="their standard deviation (default: %(default)s)")
    g.add_argument("--output-tokens", type=int, default=d.output_tokens, metavar="N",
                   help="output tokens per request (default: %(default)s)")
    g.add_argument("--load", type=float, default=d.load, metavar="X",
                   help="the shared workload's rate: its prefill work with nothing cached "
                        "is X times what the fleet can prefill (default: %(default)s)")
    g.add_argument("--unique-load", type=float, default=d.unique_load, metavar="X",
                   help="the same for the unique workload (default: %(default)s)")
    g.add_argument("--rate", type=float, default=None, metavar="REQ_PER_S",
                   help="Poisson arrivals of the shared workload (default: from --load)")
    g.add_argument("--unique-rate", type=float, default=None, metavar="REQ_PER_S",
                   help="arrivals of the unique workload (default: from --unique-load)")
    g.add_argument("--duration", type=float, default=d.duration_s, metavar="S",
                   help="seconds of arrivals per run (default: %(default)s)")
    g.add_argument("--workloads", default=",".join(d.workloads), metavar="W1,W2",
                   help="shared, unique (default: %(default)s)")
    g.add_argument("--policies", default=",".join(d.policies), metavar="P1,P2",
                   help="of " + ", ".join(p.key for p in POLICIES) + " (default: all)")
    g.add_argument("--seed", type=int, default=d.seed)
    r = p.add_argument_group("replicas and gateway")
    r.add_argument("--replicas", type=int, default=d.replicas, metavar="N",
                   help="simulated replicas (default: %(default)s)")
    r.add_argument("--num-gpu-blocks", type=int, default=d.num_gpu_blocks, metavar="N",
                   help="KV-cache blocks per simulated replica (default: %(default)s)")
    r.add_argument("--block-size", type=int, default=d.block_size, metavar="TOKENS",
                   help="tokens per KV block, every replica's (default: %(default)s)")
    r.add_argument("--prefill-tokens-per-s", type=float, default=d.prefill_tokens_per_s,
                   help="simulated replicas' prefill speed (default: %(default)s)")
    r.add_argument("--itl-ms", type=float, default=d.itl_ms,
                   help="simulated replicas' inter-token latency (default: %(default)s)")
    r.add_argument("--load-weight", type=float, default=None,
                   help="routing.load_weight of the prefix policies (default: the "
                        "checkout's tokengate.yaml)")
    r.add_argument("--edge-workers", type=int, default=d.edge_workers)
    r.add_argument("--counter-workers", type=int, default=d.counter_workers)
    s = p.add_argument_group("sections")
    s.add_argument("--vllm", action="store_true",
                   help="also run the vLLM CPU section (two real replicas)")
    s.add_argument("--vllm-only", action="store_true", help="only the vLLM CPU section")
    s.add_argument("--vllm-requests", type=int, default=d.vllm_requests, metavar="N",
                   help="requests per vLLM run (default: %(default)s)")
    s.add_argument("--vllm-rate", type=float, default=d.vllm_rate, metavar="REQ_PER_S",
                   help="arrivals of the vLLM runs (default: %(default)s)")
    s.add_argument("--vllm-num-gpu-blocks", type=int, default=d.vllm_num_gpu_blocks,
                   metavar="N", help="KV-cache blocks per vLLM replica (default: "
                                     "%(default)s)")
    p.add_argument("--out", type=Path, default=None, metavar="FILE.json",
                   help="result file (default: bench/results/routing-<time>.json)")
    p.add_argument("--var", type=Path, default=None, metavar="DIR",
                   help="folder of the runs' configurations, sockets, logs and usage "
                        "events (default: var/bench-routing in the checkout)")
    a = p.parse_args(argv)
    workloads = tuple(x for x in a.workloads.split(",") if x)
    policies = tuple(x for x in a.policies.split(",") if x)
    bad = [x for x in workloads if x not in ("shared", "unique")] + \
        [x for x in policies if x not in {p.key for p in POLICIES}]
    if bad:
        p.error(f"unknown workload or policy: {', '.join(bad)}")
    opts = replace(
        d, tenants=a.tenants, prefix_tokens=a.prefix_tokens, conversations=a.conversations,
        history_tokens=a.history_tokens, history_sd=a.history_sd,
        output_tokens=a.output_tokens, load=a.load,
        unique_load=a.unique_load, rate=a.rate, unique_rate=a.unique_rate, duration_s=a.duration, workloads=workloads,
        policies=policies, seed=a.seed, replicas=a.replicas, num_gpu_blocks=a.num_gpu_blocks,
        block_size=a.block_size, prefill_tokens_per_s=a.prefill_tokens_per_s,
        itl_ms=a.itl_ms, load_weight=a.load_weight, edge_workers=a.edge_workers,
        counter_workers=a.counter_workers, sim=not a.vllm_only, vllm=a.vllm or a.vllm_only,
        vllm_requests=a.vllm_requests, vllm_rate=a.vllm_rate,
        vllm_num_gpu_blocks=a.vllm_num_gpu_blocks)
    return opts, a.out, a.var


def main(argv: list[str] | None = None) -> None:
    global BENCH_VAR
    opts, out_path, var = parse_args(argv)
    if var is not None:
        BENCH_VAR = var.resolve()
    console = Console(width=None if sys.stdout.isatty() else 120)
    console.print("make bench-routing: round robin, least outstanding, prefix approximate "
                  "and precise, through the gateway (numbers are this machine's)")
    t0 = time.monotonic()
    try:
        out = run_bench(opts, console)
    except (ServiceError, RuntimeError) as e:
        sys.exit(f"bench-routing: {e}")
    out["elapsed_s"] = round(time.monotonic() - t0, 1)
    path = results.write(out, "routing", out_path)
    for name, section in out["sections"].items():
        for t in render(name, section):
            console.print(t)
    console.print(f"results: {path} ({out['elapsed_s']:g} s)")


if __name__ == "__main__":
    main()

"""One TokenStorm run: plan, fork workers, show progress, merge, summarize.

The parent builds the whole schedule (``arrivals.schedule``) and the prompt builder,
then forks ``workers`` processes; request i goes to worker ``i % workers`` (open loop)
so every worker follows the same global schedule, or each worker gets a contiguous
block (closed loop). Workers share the parent's monotonic clock (CLOCK_MONOTONIC is
system-wide), pre-open their connections, report ready, and start together at a time
the parent picks. The parent draws live progress (rich) from shared counters.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tokenstorm import client as sc
from tokenstorm.arrivals import ArrivalSpec, schedule
from tokenstorm.profiles import BurstProfile, OutputPolicy, Plan, TokenLimits, make_profile
from tokenstorm.prompts import PromptBuilder, Sharing, StreamOptions
from tokenstorm.report import SLO, Records, Summary, summarize

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@dataclass(frozen=True)
class RunSpec:
    """Everything that defines a run (the CLI's options, as data).

    ``arrival`` (open loop) or ``concurrency`` > 0 (closed loop, per worker) — not
    both. ``duration_s``: length of the schedule (open loop) or of the closed loop (s).
    ``profile``: a ``profiles.make_profile`` spec. ``sharing``: which requests share
    prompt prefixes (``prompts.Sharing``; default none). ``max_lag_ms``: send lag beyond
    which a request counts as late (run invalid above 1 % late). ``headers``: (name,
    value) pairs added to every request (a gateway's routing headers).
    """

    url: str
    model: str
    model_dir: Path
    max_model_len: int = 8192
    endpoint: str = "chat"
    arrival: ArrivalSpec | None = None
    concurrency: int = 0
    duration_s: float = 10.0
    max_requests: int | None = None
    profile: str = "normal"
    sharing: Sharing = field(default_factory=Sharing)
    output: OutputPolicy = field(default_factory=OutputPolicy)
    min_output: int = 16
    stream: StreamOptions = field(default_factory=StreamOptions)
    keys: tuple[str, ...] = ()
    send_token_count: bool = False
    check_prompt_tokens: bool = True
    workers: int = 1
    connections: int = 32
    max_connections: int = 4096
    timeout_s: float = 60.0
    seed: int = 0
    max_lag_ms: float = 10.0
    slo: SLO = field(default_factory=SLO)
    name: str = "run"
    headers: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        if (self.arrival is None) == (self.concurrency <= 0):
            raise ValueError("give an arrival process (open loop) or a concurrency "
                             "(closed loop), not both")
        if self.workers < 1:
            raise ValueError("workers must be >= 1")

    @property
    def offered(self) -> str:
        if self.arrival is None:
            return f"closed loop, {self.concurrency * self.workers} in flight"
        a = self.arrival
        target = (f"{a.rate:,.6g} req/s" if a.rate is not None
                  else f"{a.token_rate:,.0f} tokens/s")
        extra = f" burstiness {a.burstiness:g}" if a.process == "gamma" else ""
        return f"{a.process}{extra} {target}"


@dataclass
class RunResult:
    """A run: what was asked, planned and measured. ``start``: the monotonic time of the
    schedule's offset 0, s (records are seconds from it; CLOCK_MONOTONIC is
    system-wide, so other processes' monotonic times compare with it)."""

    spec: RunSpec
    plan: Plan
    records: Records
    summary: Summary
    start: float = 0.0


_builders: dict[tuple[str, str, str, int, Sharing], PromptBuilder] = {}


def prompt_builder(model_dir: Path, model: str, endpoint: str, seed: int,
                   sharing: Sharing | None = None) -> PromptBuilder:
    """A cached ``PromptBuilder`` (building one tokenizes a sample, ~1 s)."""
    sharing = sharing or Sharing()
    key = (str(model_dir), model, endpoint, seed, sharing)
    if key not in _builders:
        _builders[key] = PromptBuilder(model_dir, model, endpoint,  # type: ignore[arg-type]
                                       seed, sharing=sharing)
    return _builders[key]


def plan_for(spec: RunSpec, builder: PromptBuilder) -> Plan:
    """The run's requests (times and lengths) from the spec."""
    limits = TokenLimits(min_input=builder.min_prompt_tokens, max_model_len=spec.max_model_len,
                         min_output=spec.min_output)
    profile = make_profile(spec.profile, limits, spec.output)
    if spec.arrival is not None:
        return schedule(spec.arrival, profile, spec.duration_s, spec.seed, spec.max_requests)
    # Closed loop: lengths only; enough for 100k req/s per worker for the duration.
    n = spec.max_requests or int(100000 * spec.duration_s) * spec.workers + 1000
    one = ArrivalSpec("constant", rate=1.0)
    return schedule(one, profile, float(n), spec.seed, n)


def execute(spec: RunSpec, progress: bool = True, console: Any = None) -> RunResult:
    """Run ``spec`` and summarize it. Raises ``RuntimeError`` when a worker cannot
    connect or dies."""
    builder = prompt_builder(spec.model_dir, spec.model, spec.endpoint, spec.seed,
                             spec.sharing)
    plan = plan_for(spec, builder)
    n = len(plan)
    target = sc.Target.parse(spec.url)
    cfg = sc.ClientConfig(
        target=target, endpoint_path=target.base_path + builder.path[3:], keys=spec.keys,
        stream=spec.stream, send_token_count=spec.send_token_count, timeout_s=spec.timeout_s,
        connections=spec.connections if spec.arrival is not None else spec.concurrency,
        max_connections=spec.max_connections, concurrency=spec.concurrency,
        duration_s=spec.duration_s, headers=spec.headers)
    w = spec.workers
    if spec.arrival is not None:
        shares = [list(range(k, n, w)) for k in range(w)]
    else:
        per = n // w
        shares = [list(range(k * per, (k + 1) * per)) for k in range(w)]
    ctx = mp.get_context("fork")
    counters = ctx.RawArray("d", w * sc.PROGRESS_FIELDS)
    pipes = []
    procs = []
    for k in range(w):
        parent_end, child_end = ctx.Pipe()
        p = ctx.Process(target=sc.run_worker,
                        args=(cfg, builder, plan, shares[k], counters, k, child_end),
                        daemon=True)
        p.start()
        child_end.close()
        pipes.append(parent_end)
        procs.append(p)
    try:
        for k, pipe in enumerate(pipes):
            if not pipe.poll(60):
                raise RuntimeError(f"worker {k} did not start")
            msg, detail = pipe.recv()
            if msg != "ready":
                raise RuntimeError(str(detail))
        start = time.monotonic() + 0.2
        for pipe in pipes:
            pipe.send(("start", start))
        results = _collect(spec, pipes, procs, counters, n, start, progress, console)
    finally:
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
    records = _merge(results, plan, len(spec.keys) or 1)
    burst_seconds = None
    profile = make_profile(spec.profile, TokenLimits(), spec.output)
    if isinstance(profile, BurstProfile) and len(records):
        span = float(np.nanmax(records.end) - np.nanmin(records.sched))
        grid = np.arange(0.0, span, 0.001)
        burst_seconds = float((grid % profile.period_s < profile.burst_s).sum()) * 0.001
    open_loop = spec.arrival is not None
    samples = [s for r in results for s in r.error_samples][:20]
    summary = summarize(
        records, name=spec.name, target=spec.url, mode="open loop" if open_loop else
        "closed loop", offered=spec.offered, stream=spec.stream.stream, workers=w,
        duration_s=spec.duration_s, slo=spec.slo, max_lag_ms=spec.max_lag_ms,
        open_loop=open_loop, key_names=[f"key{i}" for i in range(len(spec.keys))],
        check_prompt=spec.check_prompt_tokens,
        meta={"profile": spec.profile, "sharing": asdict(spec.sharing),
              "endpoint": spec.endpoint, "seed": spec.seed,
              "send_token_count": spec.send_token_count,
              "connections_opened": sum(r.connections_opened for r in results),
              "client_cpu_s": round(sum(r.cpu_s for r in results), 4),
              "planned_requests": n if open_loop else None},
        error_samples=samples, burst_seconds=burst_seconds)
    return RunResult(spec, plan, records, summary, start)


def _collect(spec: RunSpec, pipes: list[Any], procs: list[Any], counters: Any, n: int,
             start: float, progress: bool, console: Any) -> list[sc.WorkerResult]:
    results: list[sc.WorkerResult | None] = [None] * len(pipes)
    live = None
    task = None
    if progress and (console is None or console.is_terminal):
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

        live = Progress(TextColumn("[bold]{task.description}"), BarColumn(),
                        TextColumn("{task.fields[stats]}"), TimeElapsedColumn(),
                        console=console, transient=True, refresh_per_second=4)
        total = spec.duration_s
        task = live.add_task(spec.name, total=total, stats="")
        live.start()
    deadline = start + spec.duration_s + spec.timeout_s + 30
    try:
        while any(r is None for r in results):
            for k, pipe in enumerate(pipes):
                if results[k] is None and pipe.poll(0.05):
                    msg, detail = pipe.recv()
                    if msg != "result":
                        raise RuntimeError(str(detail))
                    results[k] = detail
            for k, p in enumerate(procs):
                if results[k] is None and not p.is_alive() and not pipes[k].poll(0):
                    raise RuntimeError(f"worker {k} exited with {p.exitcode}")
            if time.monotonic() > deadline:
                raise RuntimeError("workers did not finish in time")
            if live is not None and task is not None:
                c = np.frombuffer(counters, dtype=np.float64).reshape(len(pipes), -1).sum(0)
                el = max(time.monotonic() - start, 1e-9)
                stats = (f"sent {int(c[sc.P_SENT]):,} done {int(c[sc.P_DONE]):,} "
                         f"({c[sc.P_DONE] / el:,.0f}/s) ok {int(c[sc.P_OK]):,} "
                         f"429 {int(c[sc.P_429]):,} err {int(c[sc.P_ERR]):,} "
                         f"in-flight {int(c[sc.P_INFLIGHT]):,} "
                         f"out {c[sc.P_OUT_TOKENS] / el:,.0f} tok/s")
                live.update(task, completed=min(el, spec.duration_s), stats=stats)
    finally:
        if live is not None:
            live.stop()
    return [r for r in results if r is not None]


def _merge(results: list[sc.WorkerResult], plan: Plan, n_keys: int) -> Records:
    cols: dict[str, list[np.ndarray]] = {}
    for r in results:
        for k, v in r.columns().items():
            cols.setdefault(k, []).append(np.frombuffer(v, dtype=v.typecode).copy()
                                          if len(v) else np.empty(0, dtype=v.typecode))
    merged = {k: np.concatenate(v) for k, v in cols.items()}
    idx = merged.pop("index").astype(np.int64)
    order = np.argsort(idx, kind="stable")
    idx = idx[order]
    merged = {k: v[order] for k, v in merged.items()}
    itl = np.concatenate([np.frombuffer(r.itl, dtype=np.float64) for r in results]) \
        if results else np.empty(0)
    request_id = np.array([x for r in results for x in r.request_id], dtype=object)[order]
    return Records(
        sched=merged["sched"], sent=merged["sent"], first=merged["first"], end=merged["end"],
        status=merged["status"].astype(np.int64), prompt=merged["prompt"].astype(np.int64),
        completion=merged["completion"].astype(np.int64),
        cached=merged["cached"].astype(np.int64), header_count=merged["header_count"].astype(np.int64),
        chunks=merged["chunks"].astype(np.int64), error=merged["error"].astype(np.int64),
        limit=merged["limit"].astype(np.int64), retry_after=merged["retry_after"],
        expected_prompt=plan.inputs[idx].astype(np.int64),
        planned_output=plan.outputs[idx].astype(np.int64),
        key=(idx % n_keys).astype(np.int64), burst=plan.burst[idx], itl=itl,
        reused=merged["reused"].astype(np.int8), request_id=request_id)

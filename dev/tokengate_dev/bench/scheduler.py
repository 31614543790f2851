"""``make bench-scheduler``: vLLM's first come, first served order against tokengate's
token-weighted scheduler, on the real vLLM CPU server and the tiny model.

The server ``make run`` starts (``devstack.vllm_service``) is started twice with the same
flags: ``--scheduler-cls tokengate_vllm.scheduler.TokenWeightedScheduler`` and a small
``--max-num-seqs`` (4 running requests, so that a queue forms), first with
``TOKENGATE_SCHED_POLICY=fcfs`` (vLLM's own waiting queue), then ``weighted``. Each gets
the same seeded, open-loop, streaming TokenStorm workload, sent directly to vLLM: a
``long_tail`` run then a ``burst`` run (``PROFILES``; output tokens ``output_ratio`` x
prompt, at most ``max_output``: the tiny model's 8k context has to hold both). Each
request is *short* or *long* by the scheduler's own weight, prompt tokens + 0.7 x
max_tokens, against ``long_weight`` (2,500 tokens).

Per profile and policy it reports TTFT p50/p99 of short and of long requests (client
side, ms from the scheduled send, nearest rank), and the engine side as
``scheduler_figures`` defines it (what ``gpu_check``, ``dev/gpu_check.sh``, reports on a
GPU): output tokens/s, the longest queue wait (the engine records' ``queued_ms``), the
mean one (``vllm:request_queue_time_seconds``), mean running and waiting requests
(gauges sampled every 0.5 s), tokens per engine iteration
(``vllm:iteration_tokens_total``) and whether the records reconcile with vLLM's token
counters; then every figure as a weighted / FCFS ratio, and what a CPU run can and cannot
show. The engine records go to the bench's own folder (``var/bench-scheduler/``), never
to ``make run``'s file. Results: ``bench/results/scheduler-<time>.json`` and
``bench/results/scheduler-latest.json``.

About six minutes on 2 cores (two vLLM startups of 1.5-3 minutes each, four 30 s runs
and their drain); the machine's other load shows in the figures.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table
from tokengate import config as tg_config
from tokengate_vllm import settings as sched_settings
from tokenstorm import report
from tokenstorm.arrivals import ArrivalSpec
from tokenstorm.process import Service
from tokenstorm.profiles import OutputPolicy
from tokenstorm.prompts import StreamOptions
from tokenstorm.report import Records
from tokenstorm.runner import RunResult, RunSpec, execute, prompt_builder

from tokengate_dev import devstack
from tokengate_dev.bench import scheduler_figures as ef

RESULTS = devstack.ROOT / "bench" / "results"
BENCH_VAR = devstack.VAR / "bench-scheduler"
SCHEDULER = "tokengate_vllm.scheduler.TokenWeightedScheduler"
POLICIES = ("fcfs", "weighted")

# TokenStorm's profiles, scaled to the tiny model's 8k context and to a few minutes:
# long_tail's tail (10k by default) would be clipped to the context and leave 16 output
# tokens; a 30 s run with 5 % long requests has one or two of them; burst's minute-long
# period is a whole run.
PROFILES = {
    "long_tail": "long_tail:p_tail=0.2,tail_mean=6000,tail_sd=1000",
    "burst": "burst:period_s=30,burst_s=10",
}


@dataclass
class SchedBenchOptions:
    """``make bench-scheduler`` knobs: seconds of arrivals per profile, Poisson arrivals
    per second, vLLM's running slots, output tokens per prompt token and their cap, the
    weight (tokens) from which a request is long, the scheduler's output weight and aging
    bound (s), vLLM's port, the workload seed, the per-request client timeout (s) and
    the send lag (ms) beyond which TokenStorm calls a request late."""

    duration_s: float = 30.0
    rate: float = 2.5
    max_num_seqs: int = 4
    output_ratio: float = 0.03
    max_output: int = 200
    long_weight: float = 2500.0
    output_weight: float = sched_settings.DEFAULT_OUTPUT_WEIGHT
    max_wait_s: float = sched_settings.DEFAULT_MAX_WAIT_S
    port: int = 18950
    seed: int = 0
    timeout_s: float = 300.0
    # vLLM takes both cores while the generator sends; the latencies measured here are
    # hundreds of ms and more, so 100 ms of send lag still leaves the offered load intact.
    max_lag_ms: float = 100.0
    profiles: list[str] = field(default_factory=lambda: list(PROFILES))


# -- the workload ------------------------------------------------------------------------

def workload(opts: SchedBenchOptions, model: tg_config.ModelConfig,
             url: str | None = None) -> list[RunSpec]:
    """One TokenStorm run per profile of ``opts.profiles``: open loop (Poisson at
    ``opts.rate``), streaming with cumulative usage, ``ignore_eos`` (exact output
    lengths), sent to vLLM at ``url`` (default: the bench's port) without a key.
    Identical for both policies (same seed, same prompts)."""
    url = url or f"http://127.0.0.1:{opts.port}/v1"
    return [RunSpec(url=url, model=model.name, model_dir=model.dir,
                    max_model_len=model.max_model_len,
                    arrival=ArrivalSpec("poisson", rate=opts.rate), duration_s=opts.duration_s,
                    profile=PROFILES[name],
                    output=OutputPolicy(ratio=opts.output_ratio, max_output=opts.max_output),
                    stream=StreamOptions(stream=True), timeout_s=opts.timeout_s,
                    seed=opts.seed, max_lag_ms=opts.max_lag_ms, name=name)
            for name in opts.profiles]


def request_weight(prompt_tokens: np.ndarray, max_tokens: np.ndarray,
                   output_weight: float) -> np.ndarray:
    """The scheduler's weight of each request (``tokengate_vllm.request_queue``):
    prompt tokens + ``output_weight`` x max_tokens, in prompt-token units."""
    return prompt_tokens.astype(np.float64) + output_weight * max_tokens.astype(np.float64)


# -- figures of recorded runs ------------------------------------------------------------

@dataclass
class ClientFigures:
    """What TokenStorm's clients saw in one run: requests and completed ones per class,
    TTFT p50/p99 (ms, nearest rank) per class, failed requests."""

    requests: dict[str, int]
    ok: dict[str, int]
    ttft_ms: dict[str, dict[str, float | None]]
    failed: int


def client_figures(r: Records, long_weight: float, output_weight: float) -> ClientFigures:
    """``ClientFigures`` of TokenStorm's records: a request is long when its weight
    (``request_weight`` of its planned prompt and max_tokens) is ``long_weight`` or more;
    TTFT counts completed requests only (status 200, no client error)."""
    long = request_weight(r.expected_prompt, r.planned_output, output_weight) >= long_weight
    ok = (r.status == 200) & (r.error == 0)
    ttft = (r.first - r.sched) * 1000.0
    out = ClientFigures(requests={}, ok={}, ttft_ms={}, failed=int((~ok).sum()))
    for name, sel in (("short", ~long), ("long", long)):
        done = sel & ok & np.isfinite(ttft)
        vals = [float(x) for x in ttft[done]]
        out.requests[name] = int(sel.sum())
        out.ok[name] = int((sel & ok).sum())
        out.ttft_ms[name] = {"p50": _round(ef.percentile(vals, 50)),
                             "p99": _round(ef.percentile(vals, 99))}
    return out


def _round(v: float | None, digits: int = 1) -> float | None:
    return None if v is None else round(v, digits)


@dataclass
class ProfileRun:
    """One profile under one policy: the client side, the engine side, and TokenStorm's
    verdict on the run (invalid: it fell behind its schedule or a count differed)."""

    profile: str
    policy: str
    client: ClientFigures
    engine: ef.EngineFigures
    valid: bool
    invalid_reasons: list[str]

    def to_json(self) -> dict[str, Any]:
        return {"profile": self.profile, "policy": self.policy, "valid": self.valid,
                "invalid_reasons": self.invalid_reasons, "client": asdict(self.client),
                "engine": {**asdict(self.engine), "reconciled": self.engine.reconciled}}


# (label, how to read it from ProfileRun.to_json(), digits)
ROWS: list[tuple[str, tuple[str, ...], int]] = [
    ("TTFT short p50 (ms)", ("client", "ttft_ms", "short", "p50"), 0),
    ("TTFT short p99 (ms)", ("client", "ttft_ms", "short", "p99"), 0),
    ("TTFT long p50 (ms)", ("client", "ttft_ms", "long", "p50"), 0),
    ("TTFT long p99 (ms)", ("client", "ttft_ms", "long", "p99"), 0),
    ("output tokens/s", ("engine", "output_tokens_per_s"), 1),
    ("longest queue wait (ms)", ("engine", "max_queued_ms"), 0),
    ("mean queue wait (ms)", ("engine", "mean_queue_ms"), 0),
    ("mean running requests", ("engine", "mean_running"), 2),
    ("mean waiting requests", ("engine", "mean_waiting"), 2),
    ("tokens per iteration", ("engine", "tokens_per_iteration"), 1),
]


def pick(run: dict[str, Any], path: tuple[str, ...]) -> Any:
    v: Any = run
    for k in path:
        v = v.get(k) if isinstance(v, dict) else None
    return v


def ratio(weighted: float | None, fcfs: float | None) -> float | None:
    """weighted / FCFS; None when either is missing or FCFS is 0."""
    if weighted is None or fcfs is None or fcfs == 0:
        return None
    return weighted / fcfs


def ratios(runs: dict[str, dict[str, dict[str, Any]]]) -> dict[str, dict[str, float | None]]:
    """Every ``ROWS`` figure as weighted / FCFS, per profile; ``runs[policy][profile]``
    is ``ProfileRun.to_json()``."""
    out: dict[str, dict[str, float | None]] = {}
    for profile in runs.get("fcfs", {}):
        w = runs.get("weighted", {}).get(profile)
        if w is None:
            continue
        f = runs["fcfs"][profile]
        out[profile] = {label: _round(ratio(pick(w, path), pick(f, path)), 3)
                        for label, path, _ in ROWS}
    return out


def _num(v: Any, digits: int) -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "-"
    return f"{v:,.{digits}f}"


def render(out: dict[str, Any]) -> Table:
    """The side-by-side table: per profile, FCFS, weighted and weighted / FCFS."""
    runs = out["runs"]
    t = Table(title="make bench-scheduler: FCFS vs token-weighted (vLLM CPU, tiny model)",
              header_style="bold")
    for c in ("profile", "figure", "FCFS", "weighted", "weighted / FCFS"):
        t.add_column(c, justify="left" if c in ("profile", "figure") else "right")
    for profile in out["options"]["profiles"]:
        f, w = runs.get("fcfs", {}).get(profile), runs.get("weighted", {}).get(profile)
        if f is None or w is None:
            continue
        rs = out["ratios"].get(profile, {})
        counts = (f"{f['client']['requests']['short']} short, "
                  f"{f['client']['requests']['long']} long")
        t.add_row(profile, "requests", counts, counts, "")
        for label, path, digits in ROWS:
            r = rs.get(label)
            t.add_row("", label, _num(pick(f, path), digits), _num(pick(w, path), digits),
                      "-" if r is None else f"x{r:.2f}")

        def verdict(run: dict[str, Any]) -> str:
            bad = []
            if not run["valid"]:
                bad.append("[red]INVALID[/]")
            if not run["engine"]["reconciled"]:
                bad.append("[red]not reconciled[/]")
            if run["client"]["failed"]:
                bad.append(f"[red]{run['client']['failed']} failed[/]")
            return ", ".join(bad) or "[green]valid, reconciled[/]"

        t.add_row("", "run", verdict(f), verdict(w), "")
        t.add_section()
    return t


def _change(out: dict[str, Any], profile: str, label: str) -> str:
    """``FCFS -> weighted (xratio)`` of one ``ROWS`` figure."""
    path, digits = next((p, d) for name, p, d in ROWS if name == label)
    f, w = out["runs"]["fcfs"][profile], out["runs"]["weighted"][profile]
    r = out["ratios"][profile].get(label)
    return (f"{_num(pick(f, path), digits)} -> {_num(pick(w, path), digits)}"
            + ("" if r is None else f" (x{r:.2f})"))


def shows(out: dict[str, Any]) -> str:
    """What the run's ratios say about the ordering, as a sentence that follows the
    numbers (a noisy run may not show the expected direction, and then says so)."""
    rs = out["ratios"]
    names = list(rs)

    def each(label: str) -> list[float | None]:
        return [rs[p].get(label) for p in names]

    def xs(label: str) -> str:
        return ", ".join(f"{p} " + ("-" if r is None else f"x{r:.2f}")
                         for p, r in zip(names, each(label)))

    def all_below(label: str) -> bool:
        return all(r is not None and r < 1 for r in each(label))

    bound_ms = out["options"]["max_wait_s"] * 1000
    waits = [pick(out["runs"]["weighted"][p], ("engine", "max_queued_ms")) for p in names]
    longest = max((w for w in waits if w is not None), default=None)
    parts = [("What this CPU run shows: the ordering itself, in front of "
              f"{out['options']['max_num_seqs']} running slots.")]
    bound = f"{bound_ms / 1000:g} s"
    if all_below("TTFT short p99 (ms)"):
        parts.append(f"Short requests stop waiting behind long ones: their TTFT p99 fell "
                     f"({xs('TTFT short p99 (ms)')}).")
    else:
        text = (f"Short requests' TTFT p99 did not fall everywhere "
                f"({xs('TTFT short p99 (ms)')}): the order of the waiting queue helps only "
                "while short and long requests wait together; a short request waiting for "
                "slots that long ones took while nothing else waited (the scheduler orders "
                "the waiting queue, it does not preempt) waits under either order, and two "
                "runs minutes apart on a shared machine can differ by more than that")
        parts.append(text + ".")
    longs = xs("TTFT long p99 (ms)")
    parts.append(f"Long requests pay for it (TTFT p99 {longs})"
                 if all(r is not None and r > 1 for r in each("TTFT long p99 (ms)"))
                 else f"Long requests' TTFT p99: {longs}")
    if longest is None:
        parts[-1] += "."
    elif longest <= bound_ms:
        parts[-1] += (f"; the longest wait, {longest:,.0f} ms, stayed under the aging "
                      f"bound ({bound}).")
    else:
        parts[-1] += (f"; the longest wait, {longest:,.0f} ms, is the aging bound ({bound}) "
                      "plus the time a slot took to free up.")
    parts.append(f"Lightest first lowers the mean queue wait ({xs('mean queue wait (ms)')})"
                 if all_below("mean queue wait (ms)") else
                 f"Mean queue wait: {xs('mean queue wait (ms)')}")
    parts[-1] += (f"; output tokens/s: {xs('output tokens/s')} (the same work in another "
                  "order).")
    invalid = [f"{pol} {p}" for pol, runs in out["runs"].items() for p, r in runs.items()
               if not r["valid"] or not r["engine"]["reconciled"]]
    if invalid:
        parts.append(f"Not valid: {', '.join(invalid)} (see the table): read those "
                     "figures with care.")
    return " ".join(parts)


def findings(out: dict[str, Any]) -> list[str]:
    """What the run shows, in numbers, and what a CPU run cannot show."""
    opts = out["options"]
    seqs = opts["max_num_seqs"]
    lines = [(f"{profile}: TTFT short p50 {_change(out, profile, 'TTFT short p50 (ms)')} ms, "
              f"p99 {_change(out, profile, 'TTFT short p99 (ms)')} ms; TTFT long p99 "
              f"{_change(out, profile, 'TTFT long p99 (ms)')} ms; longest wait "
              f"{_change(out, profile, 'longest queue wait (ms)')} ms, mean "
              f"{_change(out, profile, 'mean queue wait (ms)')} ms; output tokens/s "
              f"{_change(out, profile, 'output tokens/s')}; mean running "
              f"{_change(out, profile, 'mean running requests')} of {seqs}; tokens per "
              f"iteration {_change(out, profile, 'tokens per iteration')}.")
             for profile in out["ratios"]]
    lines.append(shows(out))
    lines.append(
        "What it cannot show: GPU utilization (there is no GPU; the seed reports 63% -> 89% "
        "on A100s), and the batch growth the seed reports (3.2 -> 5.7 running requests). "
        "On a GPU the batch is bounded by KV-cache memory and the token budget of a step, "
        "and serving short requests first lets more of them share steps that cost about "
        "the same: idle compute put to work, which is what the seed's figures measure. "
        f"Here --max-num-seqs {seqs} caps the batch so that a queue forms at all (the "
        "tiny model's KV cache would hold thousands of requests), and on 2 shared CPU "
        "cores a step's time grows with the tokens in it, so there is no idle compute to "
        "fill: mean running and tokens per iteration move with the order of prefills, not "
        "with freed GPU capacity. dev/gpu_check.sh measures them on a GPU.")
    lines.append(
        "The 2 cores are shared with other work: a single run is noisy; compare ratios "
        "across runs rather than single milliseconds.")
    return lines


# -- running it --------------------------------------------------------------------------

def vllm_for(policy: str, model: tg_config.ModelConfig, opts: SchedBenchOptions,
             usage_file: Path) -> Service:
    """``make run``'s vLLM with the plugin's scheduler under ``policy``, its engine
    records in ``usage_file``; the same flags for every policy."""
    svc = devstack.vllm_service(model, port=opts.port, name=f"bench-vllm-{policy}",
                                engine_usage_file=usage_file)
    svc.argv += ["--scheduler-cls", SCHEDULER, "--max-num-seqs", str(opts.max_num_seqs)]
    svc.env.update({
        sched_settings.POLICY_ENV: policy,
        sched_settings.OUTPUT_WEIGHT_ENV: f"{opts.output_weight:g}",
        sched_settings.MAX_WAIT_ENV: f"{opts.max_wait_s:g}",
    })
    return svc


def warm_up(spec: RunSpec) -> None:
    """A short and a long request, one after the other, before the measured runs: the
    first requests of a fresh server pay one-time costs."""
    builder = prompt_builder(spec.model_dir, spec.model, spec.endpoint, spec.seed)
    for i, prompt in enumerate((200, 6000)):
        # indices far from the runs' own, so no run prompt is a prefix-cache hit
        body = builder.body(10_000_000 + i, prompt, 16, StreamOptions(stream=False))
        req = urllib.request.Request(spec.url + "/chat/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as resp:
            resp.read()


def measure(spec: RunSpec, policy: str, usage_file: Path, opts: SchedBenchOptions,
            console: Console) -> tuple[ProfileRun, RunResult]:
    """One TokenStorm run against the bench's vLLM, then its engine records (one per
    request, aborted ones included) and vLLM's settled counters."""
    base = spec.url.removesuffix("/v1")
    offset = usage_file.stat().st_size if usage_file.exists() else 0
    before = ef.metrics(base)
    sampler = ef.GaugeSampler(base)
    with sampler:
        result = execute(spec, console=console)
    n = len(result.records)
    recs = ef.wait_for_records(usage_file, offset, lambda rs: len(rs) >= n)
    after = ef.settled_metrics(base)
    s = result.summary
    engine = ef.engine_figures(recs, s.all.span_s, before, after, sampler.samples, expected=n)
    run = ProfileRun(profile=spec.name, policy=policy,
                     client=client_figures(result.records, opts.long_weight,
                                           opts.output_weight),
                     engine=engine, valid=s.valid, invalid_reasons=list(s.invalid_reasons))
    c = run.client
    console.print(
        f"  {policy:<9}{spec.name:<10}{s.requests:>4} requests ({c.requests['short']} short, "
        f"{c.requests['long']} long)  TTFT short p99 {_num(c.ttft_ms['short']['p99'], 0)} ms"
        f", long p99 {_num(c.ttft_ms['long']['p99'], 0)} ms  longest wait "
        f"{_num(engine.max_queued_ms, 0)} ms  {engine.output_tokens_per_s:,.1f} out tok/s"
        + ("" if s.valid else "  [red]INVALID: " + "; ".join(s.invalid_reasons) + "[/]")
        + ("" if engine.reconciled else "  [red]records do not reconcile[/]"))
    return run, result


def run_bench(opts: SchedBenchOptions, console: Console) -> dict[str, Any]:
    """Both policies, every profile; the JSON ``make bench-scheduler`` writes."""
    cfg = tg_config.load(devstack.ROOT / "tokengate.yaml")
    model = next(iter(cfg.models.values()))
    specs = workload(opts, model)
    BENCH_VAR.mkdir(parents=True, exist_ok=True)
    out: dict[str, Any] = {
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": {"cpus": os.cpu_count(),
                    "loadavg_before": [round(x, 2) for x in os.getloadavg()]},
        "options": asdict(opts), "profile_specs": {s.name: s.profile for s in specs},
        "runs": {}, "storm": {}}
    for policy in POLICIES:
        usage_file = BENCH_VAR / f"engine-{policy}.jsonl"
        usage_file.unlink(missing_ok=True)
        svc = vllm_for(policy, model, opts, usage_file)
        svc.log_path.unlink(missing_ok=True)
        console.rule(f"{policy}: vLLM CPU server, --max-num-seqs {opts.max_num_seqs}")
        t0 = time.monotonic()
        with console.status(f"starting vLLM ({policy}; 1.5-3 minutes on 2 cores; log "
                            f"{svc.log_path.relative_to(devstack.ROOT)}) ..."):
            svc.start()
        console.print(f"  vLLM ({policy}) ready after {time.monotonic() - t0:.0f} s")
        try:
            warm_up(specs[0])
            for spec in specs:
                run, result = measure(spec, policy, usage_file, opts, console)
                out["runs"].setdefault(policy, {})[spec.name] = run.to_json()
                out["storm"].setdefault(policy, {})[spec.name] = result.summary.to_json()
        finally:
            svc.stop()
    out["ratios"] = ratios(out["runs"])
    out["findings"] = findings(out)
    return out


def main(argv: list[str] | None = None) -> None:
    d = SchedBenchOptions()
    p = argparse.ArgumentParser(
        prog="python -m tokengate_dev.bench.scheduler", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duration", type=float, default=d.duration_s, metavar="S",
                   help="seconds of arrivals per profile (default: %(default)s)")
    p.add_argument("--rate", type=float, default=d.rate, metavar="R",
                   help="Poisson arrivals per second (default: %(default)s)")
    p.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs, metavar="N",
                   help="vLLM's running slots (default: %(default)s)")
    p.add_argument("--output-ratio", type=float, default=d.output_ratio, metavar="X",
                   help="output tokens per prompt token (default: %(default)s)")
    p.add_argument("--max-output", type=int, default=d.max_output, metavar="N",
                   help="output tokens at most (default: %(default)s)")
    p.add_argument("--long-weight", type=float, default=d.long_weight, metavar="TOKENS",
                   help="weight from which a request is long (default: %(default)s)")
    p.add_argument("--max-wait", type=float, default=d.max_wait_s, metavar="S",
                   help="the scheduler's aging bound (default: %(default)s)")
    p.add_argument("--profiles", default=",".join(d.profiles), metavar="P1,P2",
                   help=f"among {', '.join(PROFILES)} (default: %(default)s)")
    p.add_argument("--port", type=int, default=d.port, help="vLLM's port (default: %(default)s)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--out", type=Path, default=None, metavar="FILE.json",
                   help="result file (default: bench/results/scheduler-<time>.json)")
    a = p.parse_args(argv)
    profiles = [x for x in a.profiles.split(",") if x]
    unknown = [x for x in profiles if x not in PROFILES]
    if unknown or not profiles:
        p.error(f"--profiles: among {', '.join(PROFILES)}, got {a.profiles!r}")
    opts = SchedBenchOptions(duration_s=a.duration, rate=a.rate, max_num_seqs=a.max_num_seqs,
                             output_ratio=a.output_ratio, max_output=a.max_output,
                             long_weight=a.long_weight, max_wait_s=a.max_wait, port=a.port,
                             seed=a.seed, profiles=profiles)
    console = Console(width=None if sys.stdout.isatty() else 120)
    console.print(f"make bench-scheduler: FCFS then token-weighted, {', '.join(profiles)}, "
                  f"{opts.duration_s:g} s each at {opts.rate:g} req/s (numbers are this "
                  "machine's)")
    t0 = time.monotonic()
    out = run_bench(opts, console)
    out["elapsed_s"] = round(time.monotonic() - t0, 1)
    path = a.out or RESULTS / f"scheduler-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(report._clean(out), indent=2) + "\n"
    path.write_text(text)
    (path.parent / "scheduler-latest.json").write_text(text)
    console.print(render(out))
    for line in out["findings"]:
        console.print(line)
    console.print(f"results: {path} ({out['elapsed_s']:g} s)")


if __name__ == "__main__":
    main()

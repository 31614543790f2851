"""``make bench-slo``: serving to latency targets, measured as goodput on a fleet of
simulated H100 replicas through the real gateway. Long for one thing: one benchmark's
fleet, traffic, time scale and the figures each aim is judged on.

The fleet: ``--replicas`` ``tokenstorm sim-replica --gpu h100`` processes (vLLM's
scheduler, each step timed by the roofline of ``--model-config``, default Qwen3-8B's
shape; ``tokenstorm.upstream.sim_steps``), their KV caches sized from the GPU's memory
and their KV events followed by the counter, behind the nginx edge (as ``make
bench-routing`` builds it: ``tokengate_dev.bench.routing``).

The traffic: three classes sent side by side, each one ``tokenstorm run`` process with
its own key, open loop with gamma arrivals (``--burstiness``, burstier than Poisson):

- ``chat`` (interactive): short prompts, streamed answers;
- ``agent`` (sheddable): sessions of a few tenants whose prompts share a long prefix
  (system prompt and tools) and grow turn by turn;
- ``long`` (batch): long documents, short answers.

Each class has TTFT and TPOT targets; a request meets them or not (goodput: requests/s
that met both, DistServe's metric, as ``tokenstorm`` reports it). The load is a multiple
of the fleet's **capacity**, estimated from the roofline (``capacity_rps``): the rate at
which the replicas would be busy all the time, each request costing the prefill of its
uncached prompt tokens and its share of the largest decode batch within its TPOT target. Every policy gets the same seeded traffic at each load.

Aims (the latency-target design's): the ``slo`` policy's goodput at least 1.3x the best
of today's policies at 1.2x load; interactive TTFT p99 within its target up to 0.9x load;
prediction error p50 within +-10 % and p90 within +-25 %; decision cost at most 20 us;
the roofline within 20 % of every published measurement (``roofline.check``). A policy
the edge does not know yet is reported as not run, and its aims as not met.

Stalls: the replicas simulate GPUs on the machine's CPUs, beside the load generators, the
edge and whatever else runs there. A step the host runs more than ``STALL_S`` late (the
replicas' ``tokenstorm_sim_step_lateness_seconds``) holds up every stream of its replica,
which no GPU does, and a few of them decide a run's TTFT p99. A run in which a replica
stalled is run again (``--stall-repeats`` times at most; the result says how often and
how late the last one was), so the aims judge the policy, not the machine's other work.

The prediction error's floor: each replica writes engine usage records (``prefill_ms``:
a request's first scheduling to its first token); a prediction that knew each request's
own prefill step exactly, plus the median of the rest (what no step of its own
explains: the wait for the step in progress when it arrived, the HTTP and the host), and
not the wait itself, errs by this much against the same observed TTFT. The edge cannot
see where its replica is in its step; no prediction of its is expected below the floor.

The time scale (``--time-scale K``, default ``TIME_SCALE``): every TTFT the edge
observes also holds what no simulated step explains, the HTTP both ways, the replica's
parsing and tokenizing and its event loop running late on a host shared with the edge,
the load generators and other work: 10 to 20 ms at p50 and 35 to 75 ms at p90 were
measured at scale 1, against chat TTFTs of 25 to 50 ms. At scale K every simulated
step lasts K times an H100's (``time_scaled``: the roofline's FLOP/s and bandwidth
divided by K, its overhead times K; the KV cache the same), the arrivals are K times
sparser for K times as long and every target is K times longer: the same traffic in
the GPU's own time, where a faithful predictor's relative error is what it was and the
host's fixed milliseconds weigh K times less. A stall is then a step ``STALL_S`` x K
late. The aims are the same; request rates, goodput and latencies print on the scaled
clock (divide latencies, multiply rates by K for an H100's); ratios, relative errors
and the decision cost (the edge's own microseconds) need no conversion. Per run of
policy slo the bench prints the time outside the simulated GPU (the observed TTFT less
the engine records' queued and prefill time) and how many steps the host ran late.

Results: ``bench/results/slo-<time>.json`` and ``slo-latest.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table
from tokengate import config as tg_config
from tokenstorm.process import free_port
from tokenstorm.upstream import roofline
from tokenstorm.upstream.sim import LATE_BUCKETS, SimReplica, SimSettings

from tokengate_dev import devstack
from tokengate_dev.bench import results, routing

BENCH_VAR = devstack.VAR / "bench-slo"
MODEL = routing.MODEL
LATE = "tokenstorm_sim_step_lateness_seconds"
STALL_S = 0.2  # a step this late stalls its replica at time scale 1 (a bucket bound of LATE)
TIME_SCALE = 4.0  # the fleet's default time scale (module text)


@dataclass(frozen=True)
class TrafficClass:
    """One class of requests: its priority class, prompt tokens (``mean`` +- ``sd``;
    with ``tenants``: ``prefix`` shared tokens per tenant, ``conversations`` each),
    output tokens, share of the requests and targets (ms)."""

    name: str
    priority: str
    mean: int
    sd: int
    output: int
    share: float
    ttft_ms: float
    tpot_ms: float
    tenants: int = 0
    prefix: int = 0
    conversations: int = 1

    def scaled(self, k: float) -> TrafficClass:
        """This class with its targets ``k`` times longer (a fleet at time scale k)."""
        return dataclasses.replace(self, ttft_ms=self.ttft_ms * k, tpot_ms=self.tpot_ms * k)


CLASSES = (
    TrafficClass("chat", "interactive", 600, 200, 120, 0.6, 400.0, 50.0),
    TrafficClass("agent", "sheddable", 7000, 1000, 80, 0.3, 1000.0, 60.0,
                 tenants=4, prefix=6000, conversations=6),
    TrafficClass("long", "batch", 12000, 2000, 60, 0.1, 4000.0, 100.0),
)
POLICIES = ("least_outstanding", "prefix", "slo")
BASELINES = ("least_outstanding", "prefix")
KNOWN_POLICIES = ("round_robin", "least_outstanding", "prefix", "slo")


def capacity_rps(r: roofline.Roofline, replicas: int,
                 classes: tuple[TrafficClass, ...] = CLASSES) -> float:
    """Requests/s that keep ``replicas`` busy all the time with the mix of ``classes``:
    ``replicas`` / the mean GPU seconds of a request (``roofline.request_s``: the prefill
    of its uncached tokens, its shared prefix cached, and its share of the largest decode
    batch within its class's TPOT target). An estimate from the roofline, not a
    measurement."""
    mean_s = sum(c.share * roofline.request_s(r, c.mean, c.prefix if c.tenants else 0,
                                              c.output, c.tpot_ms / 1000.0)
                 for c in classes)
    return replicas / mean_s


@dataclass
class Options:
    """What ``make bench-slo`` runs (its flags)."""

    replicas: int = 2
    model_config: str = "qwen3-8b"
    loads: tuple[float, ...] = (0.6, 0.9, 1.2, 1.4)
    policies: tuple[str, ...] = POLICIES
    duration_s: float = 20.0
    burstiness: float = 0.5
    seed: int = 0
    max_model_len: int = 16384
    stall_repeats: int = 2
    time_scale: float = TIME_SCALE

    def classes(self) -> tuple[TrafficClass, ...]:
        """CLASSES at this run's time scale (their targets ``time_scale`` times longer)."""
        return tuple(c.scaled(self.time_scale) for c in CLASSES)

    def arrivals_s(self) -> float:
        """Seconds of arrivals per run on the clock: ``duration_s`` of the H100's time,
        ``time_scale`` times as long."""
        return self.duration_s * self.time_scale

    def stall_s(self) -> float:
        """How late a step stalls its replica at this time scale: ``STALL_S`` x
        ``time_scale``, up to the next bucket bound of LATE."""
        return min((b for b in LATE_BUCKETS if b >= STALL_S * self.time_scale - 1e-9),
                   default=LATE_BUCKETS[-1])


def time_scaled(gpu: str, k: float) -> dict[str, float]:
    """``SimSettings`` fields of ``gpu`` ``k`` times slower: its FLOP/s and HBM bandwidth
    divided by k, its step overhead times k; every step the roofline times
    (``Roofline.step_s``: the larger of FLOPs / FLOP/s and bytes / bandwidth per part,
    plus the overhead) lasts k times as long, its KV cache is the same. {} for k 1."""
    if k == 1:
        return {}
    g = roofline.GPUS[gpu]
    return {"gpu_tflops": g.flops / 1e12 / k, "gpu_hbm_tb_s": g.bandwidth / 1e12 / k,
            "step_overhead_ms": SimSettings.step_overhead_ms * k}


def edge_config(path: Path, upstreams: list[str], endpoints: dict[str, str], policy: str,
                port: int, usage: Path, block_size: int, max_model_len: int,
                classes: tuple[TrafficClass, ...] = CLASSES) -> Path:
    """The bench's tokengate.yaml (``routing.write_config``) with one key per class of
    ``classes``, its targets and class (used by policy slo only)."""
    routing.write_config(path, upstreams, endpoints, policy, routing.RoutingOptions(),
                         block_size, edge_port=port, usage_file=usage,
                         max_model_len=max_model_len)
    import hashlib

    import yaml

    raw = yaml.safe_load(path.read_text())
    raw["models"][MODEL]["routing"].pop("load_weight", None)   # the default weight
    for c in classes:
        raw["keys"][c.name] = {"sha256": hashlib.sha256(key(c).encode()).hexdigest(),
                               "rpm": 1_000_000_000, "tpm": 1_000_000_000_000,
                               "slo": {"ttft_ms": int(c.ttft_ms), "tpot_ms": int(c.tpot_ms)},
                               "slo_class": c.priority}
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def key(c: TrafficClass) -> str:
    return f"tg-bench-slo-{c.name}"


def storm_argv(c: TrafficClass, url: str, model: tg_config.ModelConfig, rate: float,
               opts: Options, out: Path) -> list[str]:
    """The ``tokenstorm run`` of class ``c`` (at the run's time scale: ``opts.classes()``)
    at ``rate`` req/s (its share of the load) for ``opts.arrivals_s()``."""
    argv = [sys.executable, "-m", "tokenstorm.cli", "run", "--url", url,
            "--model", model.name, "--model-dir", str(model.dir),
            "--max-model-len", str(opts.max_model_len), "--stream",
            "--profile", f"normal:mean={c.mean},sd={c.sd}", "--output-tokens",
            str(c.output), "--arrivals", "gamma", "--burstiness", str(opts.burstiness),
            "--rate", f"{rate:.4f}", "--duration", f"{opts.arrivals_s():g}",
            "--seed", str(opts.seed), "--api-key", key(c), "--max-lag-ms", "50",
            "--slo", f"ttft={c.ttft_ms:g},tpot={c.tpot_ms:g}",
            "--timeout", f"{120 * opts.time_scale:g}",
            "--name", c.name, "--out", str(out), "--quiet"]
    if c.tenants:
        argv += ["--tenants", str(c.tenants), "--shared-prefix-tokens", str(c.prefix),
                 "--conversations", str(c.conversations)]
    return argv


def class_figures(path: Path, c: TrafficClass) -> dict[str, Any]:
    """What one class's run gave (its ``tokenstorm run --out`` summary)."""
    s = json.loads(path.read_text())
    a = s["all"]
    codes = s.get("status_counts") or {}
    return {"requests": s["requests"], "ok": a["ok"], "valid": s["valid"],
            "goodput_rps": a["goodput_rps"], "rps": a["rps"],
            "ttft_p50_ms": a["ttft_ms"]["p50"], "ttft_p99_ms": a["ttft_ms"]["p99"],
            "tpot_p99_ms": a["tpot_ms"]["p99"],
            "refused": sum(v for k, v in codes.items() if k in ("429", "503")),
            "ttft_target_ms": c.ttft_ms, "tpot_target_ms": c.tpot_ms}


def lateness(upstreams: list[str]) -> dict[float, float]:
    """The replicas' steps so far by how late the host ran them: {bucket bound (s, inf
    for all): steps at most that late}, summed over ``upstreams`` (their ``/metrics``,
    ``LATE``)."""
    out: dict[float, float] = {}
    for u in upstreams:
        with urllib.request.urlopen(f"http://{u}/metrics", timeout=10) as r:
            text = r.read().decode()
        for line in text.splitlines():
            if line.startswith(LATE + "_bucket{"):
                le = line.split('le="', 1)[1].split('"', 1)[0]
                bound = float("inf") if le == "+Inf" else float(le)
                out[bound] = out.get(bound, 0.0) + float(line.rpartition(" ")[2])
    return out


def engine_file(i: int) -> Path:
    """Replica ``i``'s engine usage records."""
    return BENCH_VAR / f"engine-{i}.jsonl"


def engine_ttfts(offsets: list[int]) -> dict[str, tuple[float, float]]:
    """{the edge's request id: (queued, prefill) ms on its replica's simulated clock:
    from its arrival at the engine to its first scheduling, and from there to its first
    token} from the engine usage records the replicas appended past ``offsets`` (bytes,
    one per replica; ``tokengate_vllm.record``: its request id is vLLM's, ``chatcmpl-``
    and the edge's)."""
    out: dict[str, tuple[float, float]] = {}
    for i, start in enumerate(offsets):
        path = engine_file(i)
        if not path.exists():
            continue
        with open(path, "rb") as f:
            f.seek(start)
            for line in f.read().splitlines():
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue
                if rec.get("prefill_ms") is not None:
                    out[rec["request_id"].removeprefix("chatcmpl-")] = (
                        float(rec.get("queued_ms") or 0.0), float(rec["prefill_ms"]))
    return out


LATE_SHARES = (0.005, 0.025, 0.1)  # bounds (s) of stalls()' late_share


def stalls(before: dict[float, float], after: dict[float, float],
           stall_s: float = STALL_S) -> dict[str, Any]:
    """Between two ``lateness`` readings: ``steps`` the host ran more than ``stall_s``
    (a bucket bound of LATE) late, ``late_s``, the largest bucket bound some step
    exceeded (0: none, or no replica's lateness is known), and ``late_share``: {bound
    (ms): the share of all steps later than it} for the bounds of LATE_SHARES."""
    total = after.get(float("inf"), 0.0) - before.get(float("inf"), 0.0)

    def over(bound: float) -> float:
        return total - (after.get(bound, 0.0) - before.get(bound, 0.0))
    worst = max((b for b in after if b != float("inf") and over(b) > 0), default=0.0)
    share = {f"{b * 1000:g}": over(b) / total for b in LATE_SHARES if total and b in after}
    return {"steps": int(over(stall_s)) if stall_s in after else 0, "late_s": worst,
            "late_share": share}


def run_one(upstreams: list[str], endpoints: dict[str, str], counter_sock: Path,
            policy: str, load: float, cap: float, model: tg_config.ModelConfig,
            opts: Options, console: Console) -> dict[str, Any]:
    """Fresh prefix caches and edge, the three classes (``opts.classes()``) at ``load``
    x ``cap`` req/s."""
    for u in upstreams:
        routing.reset_prefix_cache(f"http://{u}")
        routing.warm_up(f"http://{u}", model)
    time.sleep(0.3)  # AllBlocksCleared reaches the counter before the first request
    port = free_port()
    usage = BENCH_VAR / f"usage-{policy}-{load:g}.jsonl"
    usage.unlink(missing_ok=True)
    cfg = edge_config(BENCH_VAR / f"edge-{policy}.yaml", upstreams, endpoints, policy, port,
                      usage, 16, opts.max_model_len, opts.classes())
    edge = devstack.nginx_service(cfg, port=port, counter_socket=counter_sock,
                                  counter_workers=1, workers=2, name="bench-slo-edge",
                                  prefix=BENCH_VAR / "edge", status_port=free_port())
    edge.start()
    before = lateness(upstreams)
    offsets = [engine_file(i).stat().st_size if engine_file(i).exists() else 0
               for i in range(len(upstreams))]
    try:
        procs = []
        for c in opts.classes():
            out = BENCH_VAR / f"run-{policy}-{load:g}-{c.name}.json"
            out.unlink(missing_ok=True)
            with open(BENCH_VAR / f"storm-{c.name}.log", "w") as log:
                procs.append((c, out, subprocess.Popen(
                    storm_argv(c, f"http://127.0.0.1:{port}/v1", model,
                               load * cap * c.share, opts, out),
                    stdout=subprocess.DEVNULL, stderr=log)))
        for _, _, p in procs:
            p.wait()
    finally:
        edge.stop()
    stalled = stalls(before, lateness(upstreams), opts.stall_s())
    classes: dict[str, dict[str, Any]] = {
        c.name: class_figures(out, c) if out.exists() else {"error": "no result"}
        for c, out, _ in procs}
    good = sum(float(f.get("goodput_rps") or 0.0) for f in classes.values())
    pred = predictions(usage, engine_ttfts(offsets))
    console.print(f"  {policy:<18} load {load:.1f}: goodput {good:6.2f} req/s  " + "  ".join(
        f"{n} TTFT p99 {f.get('ttft_p99_ms') or float('nan'):7.0f} ms"
        for n, f in classes.items()))
    if pred["requests"]:
        console.print(f"    TTFT prediction |error| p50/p90 {pred['abs_error_p50']:.2f}/"
                      f"{pred['abs_error_p90']:.2f} (floor {fmt(pred['floor_p50'])}/"
                      f"{fmt(pred['floor_p90'])}); outside the simulated GPU "
                      f"{fmt(pred['host_ms_p50'], '.0f')}/{fmt(pred['host_ms_p90'], '.0f')} ms; "
                      "steps later than " + ", ".join(
                          f"{b} ms {x:.1%}" for b, x in stalled["late_share"].items()))
    return {"goodput_rps": good, "classes": classes, "prediction": pred, "stalls": stalled}


def run_load(upstreams: list[str], endpoints: dict[str, str], counter_sock: Path,
             policy: str, load: float, cap: float, model: tg_config.ModelConfig,
             opts: Options, console: Console) -> dict[str, Any]:
    """``run_one``, again while its replicas stalled (module text), at most
    ``opts.stall_repeats`` more times; the last run, with ``runs``: how many were made."""
    for n in range(1, opts.stall_repeats + 2):
        r = run_one(upstreams, endpoints, counter_sock, policy, load, cap, model, opts,
                    console)
        r["runs"] = n
        s = r["stalls"]
        if not s["steps"]:
            return r
        console.print(f"    the replicas stalled: {s['steps']} steps over "
                      f"{opts.stall_s() * 1000:.0f} ms late (up to over {s['late_s'] * 1000:.0f} ms)"
                      + ("; again" if n <= opts.stall_repeats else "; kept"))
    return r


def _quantile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def fmt(x: float | None, spec: str = ".2f") -> str:
    """``x`` in ``spec``, or n/a."""
    return "n/a" if x is None else format(x, spec)


def predictions(usage: Path, engine: dict[str, tuple[float, float]]) -> dict[str, Any]:
    """From the edge's usage events (policy slo): the TTFT prediction's relative error,
    (predicted - observed) / observed, p50 and p90 of its absolute value and its median
    (sign: over or under), overall and per class (``by_class``, the key's name), the
    floor's (module text); from ``engine`` (engine_ttfts(): each request's queued and
    prefill ms on the simulated clock): ``host_ms`` p50 / p90, the observed TTFT less
    the simulated GPU's (queued + prefill: what the HTTP both ways, the replica's
    parsing and tokenizing and the host's lateness add), and ``engine_error`` p50 / p90,
    the prediction against the simulated GPU's TTFT plus the median of host_ms (the
    error on a host that always added its median); the decision cost (us) p50 and p99
    (the choice with its shared dict reads, and the predictions alone), and the
    decisions."""
    errs: list[float] = []
    by_class: dict[str, list[float]] = {}
    # (predicted, observed, queued, prefill) of the requests with engine records
    known: list[tuple[float, float, float, float]] = []
    cost: list[float] = []
    predict: list[float] = []
    decisions: dict[str, int] = {}
    for ev in results.events(usage):
        s = ev.get("slo")
        if not isinstance(s, dict):
            continue
        decisions[s["decision"]] = decisions.get(s["decision"], 0) + 1
        if s.get("decision_us") is not None:
            cost.append(float(s["decision_us"]))
        if s.get("predict_us") is not None:
            predict.append(float(s["predict_us"]))
        p, o = s.get("predicted_ttft_ms"), s.get("observed_ttft_ms")
        if p is not None and o:
            errs.append((p - o) / o)
            by_class.setdefault(str(ev.get("key_id")), []).append((p - o) / o)
            qf = engine.get(str(ev.get("request_id")))
            if qf is not None:
                known.append((p, o, *qf))
    rest = _quantile([o - f for _, o, _, f in known], 0.5) or 0.0
    floor = [abs(f + rest - o) / o for _, o, _, f in known]
    host = [o - q - f for _, o, q, f in known]
    host_med = _quantile(host, 0.5) or 0.0
    on_engine = [abs(p - (q + f + host_med)) / (q + f + host_med) for p, _, q, f in known
                 if q + f + host_med > 0]

    def spread(xs: list[float]) -> dict[str, Any]:
        return {"requests": len(xs), "median": _quantile(xs, 0.5),
                "abs_p50": _quantile([abs(e) for e in xs], 0.5),
                "abs_p90": _quantile([abs(e) for e in xs], 0.9)}
    overall = spread(errs)
    return {"requests": overall["requests"], "decisions": decisions,
            "error_median": overall["median"], "abs_error_p50": overall["abs_p50"],
            "abs_error_p90": overall["abs_p90"],
            "by_class": {k: spread(v) for k, v in sorted(by_class.items())},
            "floor_p50": _quantile(floor, 0.5), "floor_p90": _quantile(floor, 0.9),
            "host_ms_p50": host_med, "host_ms_p90": _quantile(host, 0.9),
            "engine_error_p50": _quantile(on_engine, 0.5),
            "engine_error_p90": _quantile(on_engine, 0.9),
            "decision_us_p50": _quantile(cost, 0.5), "decision_us_p99": _quantile(cost, 0.99),
            "predict_us_p50": _quantile(predict, 0.5), "predict_us_p99": _quantile(predict, 0.99)}


def aims(runs: dict[str, dict[str, Any]], check: list[tuple[Any, float, float]]
         ) -> list[dict[str, Any]]:
    """The aims with their measured figures and met / not met."""
    out = []

    def at(policy: str, load: float) -> dict[str, Any] | None:
        return runs.get(policy, {}).get(f"{load:g}")

    slo12 = at("slo", 1.2)
    best = max((r["goodput_rps"] for p in BASELINES if (r := at(p, 1.2))), default=None)
    ratio = slo12["goodput_rps"] / best if slo12 and best else None
    out.append({"aim": "slo goodput / best of today's at 1.2x load >= 1.3",
                "measured": ratio, "met": ratio is not None and ratio >= 1.3})
    worst = None
    for load_key, r in runs.get("slo", {}).items():
        if float(load_key) <= 0.9:
            chat = r["classes"]["chat"]
            x = (chat.get("ttft_p99_ms") or float("inf")) / chat["ttft_target_ms"]
            worst = x if worst is None else max(worst, x)
    out.append({"aim": "interactive TTFT p99 / target up to 0.9x load (slo) <= 1",
                "measured": worst, "met": worst is not None and worst <= 1.0})
    preds = [r["prediction"] for r in runs.get("slo", {}).values() if r["prediction"]["requests"]]
    p50 = max((p["abs_error_p50"] for p in preds), default=None)
    p90 = max((p["abs_error_p90"] for p in preds), default=None)
    out.append({"aim": "prediction error |p50| <= 10 % (worst load)", "measured": p50,
                "met": p50 is not None and p50 <= 0.10})
    out.append({"aim": "prediction error |p90| <= 25 % (worst load)", "measured": p90,
                "met": p90 is not None and p90 <= 0.25})
    for q in ("p50", "p90"):
        floor = [p[f"floor_{q}"] for p in preds if p.get(f"floor_{q}") is not None]
        out.append({"aim": f"(the error's floor |{q}| (worst load): a prediction that "
                           "knew each request's prefill step)",
                    "measured": max(floor) if floor else None, "met": None})
    cost = max((p["decision_us_p50"] for p in preds), default=None)
    out.append({"aim": "decision cost at the edge p50 <= 20 us (choice and prediction)",
                "measured": cost, "met": cost is not None and cost <= 20})
    cost = max((p["predict_us_p50"] for p in preds), default=None)
    out.append({"aim": "(the predictions alone, p50, us)", "measured": cost,
                "met": cost is not None and cost <= 20})
    err = max(abs(e) for _, _, e in check)
    out.append({"aim": "roofline within 20 % of each published measurement",
                "measured": err, "met": err <= 0.20})
    return out


def roofline_table(check: list[tuple[Any, float, float]]) -> Table:
    t = Table(title="roofline against published vLLM measurements")
    for col in ("model", "GPU", "measure", "batch", "published ms", "roofline ms", "error",
                "source"):
        t.add_column(col)
    for p, pred, err in check:
        t.add_row(p.model, p.gpu, p.what, str(p.batch), f"{p.value:g}", f"{pred:.1f}",
                  f"{err:+.1%}", p.source)
    return t


def sim_settings(model: tg_config.ModelConfig, max_model_len: int, gpu: str,
                 model_config: str, **more: Any) -> SimSettings:
    """One replica of the bench's fleet: ``model``'s tokenizer (the counter's) and name,
    vLLM's steps timed by the roofline of ``model_config`` on ``gpu``, the KV cache
    sized from the GPU's memory; ``more``: other ``SimSettings`` fields."""
    return SimSettings(model=model.name, model_dir=Path(model.dir),
                       max_model_len=max_model_len, gpu=gpu, model_config=model_config,
                       num_gpu_blocks=0, tokenizer="counter", **more).sized()


def run_bench(opts: Options, console: Console) -> dict[str, Any]:
    check = roofline.check()
    console.print(roofline_table(check))
    cfg = tg_config.load(devstack.ROOT / "tokengate.yaml")
    model = cfg.models[MODEL]
    for i in range(opts.replicas):
        engine_file(i).unlink(missing_ok=True)
    reps = [SimReplica(sim_settings(model, opts.max_model_len, "h100", opts.model_config,
                                    **time_scaled("h100", opts.time_scale),
                                    kv_events_endpoint=f"tcp://127.0.0.1:{free_port()}",
                                    engine_usage_file=engine_file(i)),
                       name=f"bench-slo-sim{i}", state_dir=BENCH_VAR)
            for i in range(opts.replicas)]
    upstreams = [r.address for r in reps]
    endpoints = {r.address: r.settings.kv_events_endpoint or "" for r in reps}
    rf = reps[0].settings.roofline()
    assert rf is not None
    cap = capacity_rps(rf, opts.replicas, opts.classes())
    k = opts.time_scale
    console.print(f"  {opts.replicas} simulated H100 replicas of {opts.model_config} "
                  f"({reps[0].settings.num_gpu_blocks:,} KV blocks each); capacity "
                  f"estimate {cap:.2f} req/s for the mix")
    console.print(f"  time scale {k:g}: every simulated step {k:g}x an H100's, arrivals "
                  f"{k:g}x sparser for {opts.arrivals_s():g} s per run, targets {k:g}x "
                  f"longer ({', '.join(f'{c.name} {c.ttft_ms:g}/{c.tpot_ms:g} ms' for c in opts.classes())}"
                  f"); a step over {opts.stall_s() * 1000:g} ms late stalls its replica")
    counter_cfg = edge_config(BENCH_VAR / "counter.yaml", upstreams, endpoints, "prefix", 0,
                              BENCH_VAR / "counter-usage.jsonl", 16, opts.max_model_len)
    sock = BENCH_VAR / "counter.sock"
    counter = devstack.counter_service(counter_cfg, port=free_port(), unix_socket=sock,
                                       workers=1, name="bench-slo-counter",
                                       metrics_listen="none")
    services = [r.service for r in reps] + [counter]
    runs: dict[str, dict[str, Any]] = {}
    with console.status("starting the simulated replicas and the counter ..."):
        routing.start_all(services)
    try:
        for policy in opts.policies:
            if policy not in KNOWN_POLICIES:
                console.print(f"  {policy}: the edge has no such policy; not run")
                continue
            runs[policy] = {f"{x:g}": run_load(upstreams, endpoints, sock, policy, x, cap,
                                               model, opts, console) for x in opts.loads}
    finally:
        for s in reversed(services):
            s.stop()
    out = {"options": asdict(opts), "capacity_rps": cap,
           "classes": [asdict(c) for c in opts.classes()], "runs": runs,
           "roofline_check": [{"published": asdict(p), "roofline_ms": pred, "error": e}
                              for p, pred, e in check]}
    out["aims"] = aims(runs, check)
    return out


def render(out: dict[str, Any], console: Console) -> None:
    t = Table(title="goodput (req/s meeting both targets) and latency per class")
    for col in ("policy", "load", "goodput", *(f"{c.name} TTFT p50/p99, TPOT p99 ms"
                                                for c in CLASSES), "refused"):
        t.add_column(col)
    for policy, by_load in out["runs"].items():
        for load, r in by_load.items():
            cells = []
            refused = 0
            for c in CLASSES:
                f = r["classes"][c.name]
                refused += f.get("refused") or 0
                cells.append(f"{f.get('ttft_p50_ms') or 0:.0f}/{f.get('ttft_p99_ms') or 0:.0f}"
                             f", {f.get('tpot_p99_ms') or 0:.0f}")
            t.add_row(policy, load, f"{r['goodput_rps']:.2f}", *cells, str(refused))
    console.print(t)
    for a in out["aims"]:
        m = a["measured"]
        val = "n/a" if m is None else f"{m:.3f}"
        verdict = "" if a["met"] is None else \
            "[green]met[/]" if a["met"] else "[red]not met[/]"
        console.print(f"  {a['aim']}: {val}  {verdict}")


def parse_args(argv: list[str] | None = None) -> tuple[Options, Path | None]:
    d = Options()
    p = argparse.ArgumentParser(prog="make bench-slo", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--replicas", type=int, default=d.replicas)
    p.add_argument("--model-config", default=d.model_config,
                   help="the replicas' model shape (default: %(default)s)")
    p.add_argument("--loads", default=",".join(f"{x:g}" for x in d.loads),
                   help="multiples of the capacity estimate (default: %(default)s)")
    p.add_argument("--policies", default=",".join(d.policies))
    p.add_argument("--duration", type=float, default=d.duration_s, metavar="S",
                   help="seconds of arrivals per run in the H100's time, x the time "
                        "scale on the clock (default: %(default)s)")
    p.add_argument("--time-scale", type=float, default=d.time_scale, metavar="K",
                   help="steps, arrivals' gaps, targets K times an H100's (module text; "
                        "default: %(default)s)")
    p.add_argument("--burstiness", type=float, default=d.burstiness,
                   help="gamma shape of the arrivals, < 1 burstier (default: %(default)s)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--stall-repeats", type=int, default=d.stall_repeats, metavar="N",
                   help="run a load again while a replica stalled, at most N more times "
                        "(default: %(default)s)")
    p.add_argument("--roofline-only", action="store_true",
                   help="print the roofline check and stop")
    p.add_argument("--out", type=Path, default=None, metavar="FILE.json")
    a = p.parse_args(argv)
    opts = Options(replicas=a.replicas, model_config=a.model_config,
                   loads=tuple(float(x) for x in a.loads.split(",") if x),
                   policies=tuple(x for x in a.policies.split(",") if x),
                   duration_s=a.duration, burstiness=a.burstiness, seed=a.seed,
                   stall_repeats=a.stall_repeats, time_scale=a.time_scale)
    if opts.time_scale < 1:
        p.error("--time-scale must be at least 1")
    if a.roofline_only:
        opts = Options(replicas=0, policies=(), loads=())
    return opts, a.out


def main(argv: list[str] | None = None) -> None:
    opts, out_path = parse_args(argv)
    console = Console()
    BENCH_VAR.mkdir(parents=True, exist_ok=True)
    if not opts.replicas:
        check = roofline.check()
        console.print(roofline_table(check))
        err = max(abs(e) for _, _, e in check)
        console.print(f"  roofline within 20 % of each published measurement: {err:.1%}  "
                      + ("[green]met[/]" if err <= 0.2 else "[red]not met[/]"))
        return
    out = run_bench(opts, console)
    render(out, console)
    path = results.write(out, "slo", out_path)
    console.print(f"results: {path}")


if __name__ == "__main__":
    main()

"""``make bench-fairness``: tenants sharing a full fleet, with today's shedding (503
overloaded) and with the fair queues (``edge.queue``), side by side in one run.

The fleet is TokenStorm's fast upstream answering after ``--ttft-ms`` and ``--itl-ms``
per token, and the model's ``max_concurrency`` gives it ``--slots`` requests at once:
its capacity is about slots / (TTFT + output x ITL) requests per second. Each tenant is
one API key and one open-loop TokenStorm run of its own (Poisson arrivals, streaming,
the same prompt and output lengths), all through one real edge and counter.

Profiles:

- ``flood``: a ``light`` tenant at ``--light-share`` of its fair share (half the
  capacity) and a ``flood`` tenant at ``--flood-factor`` (10) times its fair share.
  First ``light`` alone (its solo TTFT), then both, shedding and queueing.
- ``weighted``: three tenants of ``fair_share`` 1, 2 and 3, each offering the whole
  capacity, shedding and queueing; then queueing on two edges, each with half the slots
  and half of every tenant's traffic (each edge orders its own queues: fairness holds
  per edge, so across them when the traffic spreads evenly).

Per tenant and mode: served tokens/s (prompt + completion of the answered requests),
TTFT p50/p99 (ms from the scheduled send, answered requests), refusals (429/503); per
mode the total tokens/s and the Jain fairness index of each tenant's served tokens over
its max-min fair allocation by weight (a tenant that asks for less than its share is
entitled to what it asks; the rest is split by weight; index 1: every tenant got its
entitlement). Aims, with met / not met: ``light``'s TTFT p99 under the flood
with the queues at most 2x its solo p99; the Jain index with the queues at least 0.95
(both profiles); the queues' total tokens/s at least 0.95x shedding's. Results:
``bench/results/fairness-<time>.json`` and ``fairness-latest.json``.

About 3.5 minutes with the defaults (seven 20 s runs and their drains).
"""

from __future__ import annotations

import argparse
import hashlib
import threading
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import yaml
from rich.console import Console
from rich.table import Table
from tokengate import config as tg_config
from tokenstorm.arrivals import ArrivalSpec
from tokenstorm.null_server import FastUpstream
from tokenstorm.process import free_port
from tokenstorm.profiles import OutputPolicy
from tokenstorm.prompts import StreamOptions
from tokenstorm.runner import RunSpec, execute
from tokenstorm.upstream import UpstreamOptions

from tokengate_dev import devstack
from tokengate_dev.bench import results

BENCH_VAR = devstack.VAR / "bench-fairness"
MODEL = "tiny-qwen3"


@dataclass(frozen=True)
class Options:
    slots: int = 4
    ttft_ms: float = 400.0
    itl_ms: float = 2.0
    output_tokens: int = 16
    prompt_tokens: int = 64
    duration_s: float = 20.0
    light_share: float = 0.4
    flood_factor: float = 10.0
    seed: int = 7
    max_lag_ms: float = 50.0

    @property
    def capacity_rps(self) -> float:
        """Requests/s the slots serve: each holds one for TTFT + output x ITL."""
        return self.slots / ((self.ttft_ms + self.output_tokens * self.itl_ms) / 1000)


@dataclass(frozen=True)
class Tenant:
    name: str
    rate: float        # requests/s offered
    share: float = 1.0  # keys.<id>.fair_share

    @property
    def key(self) -> str:
        return f"tg-bench-fair-{self.name}"


def write_config(path: Path, upstream: str, tenants: list[Tenant], queue: bool,
                 opts: Options, edge_port: int, slots: int | None = None) -> Path:
    """tokengate.yaml: the checkout's models, ``MODEL`` on ``upstream`` with
    max_concurrency ``slots`` (default ``opts.slots``), one key per tenant (limits far
    above the load), admission metrics off (the slots alone decide), queues on or off."""
    raw = yaml.safe_load((devstack.ROOT / "tokengate.yaml").read_text())
    for m in raw["models"].values():
        m["dir"] = str((devstack.ROOT / m["dir"]).resolve())
    m = raw["models"][MODEL]
    m.update(upstreams=[upstream], embedded=False, max_concurrency=slots or opts.slots)
    m["routing"] = {"policy": "least_outstanding"}
    raw["keys"] = {t.name: {"sha256": hashlib.sha256(t.key.encode()).hexdigest(),
                            "rpm": 1_000_000_000, "tpm": 1_000_000_000_000,
                            "fair_share": t.share} for t in tenants}
    raw.setdefault("ledger", {})["usage_file"] = str(BENCH_VAR / "usage.jsonl")
    raw.setdefault("access_log", {})["file"] = False
    edge = raw.setdefault("edge", {})
    edge["listen"] = f"127.0.0.1:{edge_port}"
    edge["count_timeout_ms"] = 3000
    edge["admission"] = {"metrics_interval_ms": 0}
    # a key's queue holds two rounds of the slots: beyond it 429 queue_full, so a
    # flooding key's excess is refused at once instead of piling up behind its share
    edge["queue"] = {"enabled": queue, "max_wait_ms": 60_000,
                     "key_max_requests": 2 * (slots or opts.slots)}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def run_mode(tenants: list[Tenant], queue: bool, opts: Options, upstream: FastUpstream,
             counter_socket: Path, model: tg_config.ModelConfig, console: Console,
             edges: int = 1) -> dict[str, Any]:
    """``edges`` edges with the queues on or off, each with its share of the slots
    (max_concurrency slots / edges) and of every tenant's traffic (rate / edges); every
    run at once; per tenant its served tokens/s, TTFT p50 (of the edges' runs, the
    mean) and p99 (the largest), and refusals."""
    mode = "queue" if queue else "shed"
    ports, services = [], []
    for i in range(edges):
        port = free_port()
        cfg = write_config(BENCH_VAR / f"edge{i}-{mode}.yaml", f"127.0.0.1:{upstream.port}",
                           tenants, queue, opts, port, slots=opts.slots // edges)
        services.append(devstack.nginx_service(
            cfg, port=port, counter_socket=counter_socket, name=f"bench-fairness-edge{i}",
            prefix=BENCH_VAR / f"edge{i}", status_port=free_port()))
        ports.append(port)
    runs: dict[str, list[Any]] = {t.name: [] for t in tenants}
    lock = threading.Lock()

    def one(t: Tenant, i: int) -> None:
        port = ports[i]
        spec = RunSpec(
            url=f"http://127.0.0.1:{port}/v1", model=MODEL, model_dir=Path(model.dir),
            max_model_len=model.max_model_len,
            arrival=ArrivalSpec("poisson", rate=t.rate / edges), duration_s=opts.duration_s,
            profile=f"normal:mean={opts.prompt_tokens},sd=0",
            output=OutputPolicy(fixed=opts.output_tokens), stream=StreamOptions(stream=True),
            # the same schedule of a tenant in every mode: shed and queue see one load
            keys=(t.key,), seed=opts.seed + sum(map(ord, t.name)) + 1000 * i,
            max_lag_ms=opts.max_lag_ms,
            timeout_s=90, connections=64, name=f"{t.name} {mode}")
        summary = execute(spec, progress=False).summary
        with lock:
            runs[t.name].append(summary)

    try:
        for svc in services:
            svc.start()
        threads = [threading.Thread(target=one, args=(t, i))
                   for t in tenants for i in range(edges)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
    finally:
        for svc in services:
            svc.stop()
    out: dict[str, Any] = {}
    for t in tenants:
        ss = runs[t.name]
        p50 = [s.all.ttft_ms.p50 for s in ss if s.all.ttft_ms.p50 is not None]
        p99 = [s.all.ttft_ms.p99 for s in ss if s.all.ttft_ms.p99 is not None]
        out[t.name] = {
            "offered_rps": t.rate, "share": t.share,
            "served_tokens_per_s": sum(s.all.total_tokens_per_s for s in ss),
            "ok": sum(s.all.ok for s in ss), "requests": sum(s.requests for s in ss),
            "refused": sum(v for s in ss for k, v in s.status_counts.items()
                           if k in ("429", "503")),
            "ttft_p50_ms": sum(p50) / len(p50) if p50 else None,
            "ttft_p99_ms": max(p99) if p99 else None}
    console.print(f"  {mode}{f' ({edges} edges)' if edges > 1 else ''}: " + ", ".join(
        f"{n} {v['served_tokens_per_s']:.0f} tok/s p99 {v['ttft_p99_ms'] or 0:.0f} ms "
        f"refused {v['refused']}" for n, v in out.items()))
    return out


def entitlements(demand: dict[str, float], weight: dict[str, float],
                 capacity: float) -> dict[str, float]:
    """Max-min fair allocation of ``capacity`` by weight (water-filling): a tenant that
    asks for less than its weighted share gets what it asks; the rest is split again."""
    left, active, got = capacity, set(demand), {n: 0.0 for n in demand}
    while active and left > 1e-9:
        total_w = sum(weight[n] for n in active)
        share = {n: left * weight[n] / total_w for n in active}
        small = {n for n in active if demand[n] - got[n] <= share[n]}
        if not small:
            for n in active:
                got[n] += share[n]
            break
        for n in small:
            left -= demand[n] - got[n]
            got[n] = demand[n]
        active -= small
    return got


def jain(served: dict[str, float], entitled: dict[str, float]) -> float | None:
    """Jain's index of served / entitled: (sum x)^2 / (n sum x^2), 1 when every tenant
    got its entitlement (R. Jain, D. Chiu, W. Hawe, DEC-TR-301, 1984)."""
    x = [served[n] / entitled[n] for n in served if entitled[n] > 0]
    if not x:
        return None
    return sum(x) ** 2 / (len(x) * sum(v * v for v in x))


def fairness(mode: dict[str, Any], opts: Options, tenants: list[Tenant]) -> float | None:
    per_request = opts.prompt_tokens + opts.output_tokens
    total = sum(v["served_tokens_per_s"] for v in mode.values())
    demand = {t.name: t.rate * per_request for t in tenants}
    weight = {t.name: t.share for t in tenants}
    served = {n: v["served_tokens_per_s"] for n, v in mode.items()}
    return jain(served, entitlements(demand, weight, total))


def run_bench(opts: Options, console: Console) -> dict[str, Any]:
    BENCH_VAR.mkdir(parents=True, exist_ok=True)
    base = tg_config.load(devstack.ROOT / "tokengate.yaml")
    model = base.models[MODEL]
    cap = opts.capacity_rps
    half = cap / 2
    light = Tenant("light", opts.light_share * half)
    flood = Tenant("flood", opts.flood_factor * half)
    weighted = [Tenant(f"w{w}", cap, float(w)) for w in (1, 2, 3)]
    counter_cfg = write_config(BENCH_VAR / "counter.yaml", "127.0.0.1:9",
                               [light, flood, *weighted], False, opts, free_port())
    sock = BENCH_VAR / "counter.sock"
    counter = devstack.counter_service(counter_cfg, port=free_port(), unix_socket=sock,
                                       name="bench-fairness-counter", metrics_listen="none")
    up = FastUpstream(UpstreamOptions(model=MODEL, ttft_ms=opts.ttft_ms, itl_ms=opts.itl_ms),
                      name="bench-fairness-upstream")
    out: dict[str, Any] = {"options": asdict(opts), "capacity_rps": cap}
    counter.start()
    up.start()
    try:
        console.print(f"capacity about {cap:.1f} requests/s ({opts.slots} slots)")
        console.print("flood profile: light alone")
        solo = run_mode([light], True, opts, up, sock, model, console)
        flood_runs = {}
        for queue in (False, True):
            console.print(f"flood profile: light and flood, {'queue' if queue else 'shed'}")
            flood_runs["queue" if queue else "shed"] = run_mode(
                [light, flood], queue, opts, up, sock, model, console)
        weighted_runs = {}
        for queue in (False, True):
            console.print(f"weighted profile: {'queue' if queue else 'shed'}")
            weighted_runs["queue" if queue else "shed"] = run_mode(
                weighted, queue, opts, up, sock, model, console)
        console.print("weighted profile: queue, two edges (half the slots and half of "
                      "every tenant's traffic each)")
        weighted_runs["queue_2_edges"] = run_mode(weighted, True, opts, up, sock, model,
                                                  console, edges=2)
    finally:
        up.stop()
        counter.stop()
    out["flood"] = {"solo": solo, **flood_runs}
    out["weighted"] = dict(weighted_runs)
    for name, runs, tenants in (("flood", flood_runs, [light, flood]),
                                ("weighted", weighted_runs, weighted)):
        for mode, r in runs.items():
            out[name][f"{mode}_jain"] = fairness(r, opts, tenants)
            out[name][f"{mode}_total_tokens_per_s"] = sum(
                v["served_tokens_per_s"] for v in r.values())
    out["aims"] = aims(out)
    return out


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def aims(out: dict[str, Any]) -> list[dict[str, Any]]:
    f, w = out["flood"], out["weighted"]
    p99 = _ratio(f["queue"]["light"]["ttft_p99_ms"], f["solo"]["light"]["ttft_p99_ms"])
    rows = [("light TTFT p99 under the flood, queue / solo", p99, "<=", 2.0),
            ("Jain index, flood profile, queue", f["queue_jain"], ">=", 0.95),
            ("Jain index, weighted profile, queue", w["queue_jain"], ">=", 0.95),
            ("Jain index, weighted profile, queue, two edges", w["queue_2_edges_jain"],
             ">=", 0.95),
            ("total tokens/s, queue / shed (flood)",
             _ratio(f["queue_total_tokens_per_s"], f["shed_total_tokens_per_s"]), ">=", 0.95),
            ("total tokens/s, queue / shed (weighted)",
             _ratio(w["queue_total_tokens_per_s"], w["shed_total_tokens_per_s"]), ">=", 0.95)]
    return results.judge(rows)


def render(out: dict[str, Any]) -> list[Table]:
    tables = []
    for profile in ("flood", "weighted"):
        t = Table(title=f"{profile} profile")
        for c in ("mode", "tenant", "offered req/s", "share", "served tok/s", "TTFT p50 ms",
                  "TTFT p99 ms", "refused", "answered"):
            t.add_column(c, justify="right" if c not in ("mode", "tenant") else "left")
        for mode, runs in out[profile].items():
            if not isinstance(runs, dict):
                continue
            for name, v in runs.items():
                t.add_row(mode, name, f"{v['offered_rps']:.1f}", f"{v['share']:g}",
                          f"{v['served_tokens_per_s']:.0f}", f"{v['ttft_p50_ms'] or 0:.0f}",
                          f"{v['ttft_p99_ms'] or 0:.0f}", str(v["refused"]), str(v["ok"]))
        for mode in ("shed", "queue", "queue_2_edges"):
            if f"{mode}_jain" not in out[profile]:
                continue
            j = out[profile].get(f"{mode}_jain")
            t.add_row(mode, "all", "", "", f"{out[profile][f'{mode}_total_tokens_per_s']:.0f}",
                      "", "", "", f"Jain {j:.3f}" if j is not None else "")
        tables.append(t)
    tables.append(results.aims_table(out["aims"], "aims"))
    return tables


def main(argv: list[str] | None = None) -> None:
    d = Options()
    p = argparse.ArgumentParser(prog="make bench-fairness", description=__doc__.split("\n")[0])
    p.add_argument("--slots", type=int, default=d.slots)
    p.add_argument("--ttft-ms", type=float, default=d.ttft_ms)
    p.add_argument("--itl-ms", type=float, default=d.itl_ms)
    p.add_argument("--duration-s", type=float, default=d.duration_s)
    p.add_argument("--flood-factor", type=float, default=d.flood_factor)
    p.add_argument("--light-share", type=float, default=d.light_share)
    args = p.parse_args(argv)
    opts = Options(slots=args.slots, ttft_ms=args.ttft_ms, itl_ms=args.itl_ms,
                   duration_s=args.duration_s, flood_factor=args.flood_factor,
                   light_share=args.light_share)
    console = Console()
    out = run_bench(opts, console)
    for t in render(out):
        console.print(t)
    console.print(f"results: {results.write(out, 'fairness')}")


if __name__ == "__main__":
    main()

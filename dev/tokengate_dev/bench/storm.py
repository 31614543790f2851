"""``make bench``: the gateway against the fast upstream, side by side, on this machine.
(Over 600 lines: one benchmark whose sections share its runs' bookkeeping, ``_run`` and
``_spec``, and one dictionary of figures that the aims and the table read; the parts it
starts are in ``bench.stack``, the cold and warm paths in ``bench.paths``.)

One command, a few minutes, loopback only:

1. **TokenStorm's ceiling** against a null server (the fast upstream with no latency),
   closed loop, streamed and not.
2. **``vllm bench serve``'s client** against the same null server at the same
   concurrency (its chat backend always streams): the ratio of the two ceilings.
3. **Direct vs plain nginx vs through the gateway**, non-streaming and streaming,
   1000-token prompts (exact, counted by the gateway's counter) and 16 output tokens:
   the fast upstream alone, a plain nginx ``proxy_pass`` in front of it (the same nginx
   binary and worker count, the edge's keepalive and proxy settings, no Lua:
   ``PLAIN_NGINX_CONF``), then the nginx edge with everything on (exact count, RPM and
   TPM limits with reservations, usage watch on every response, usage events written).
   Each at saturation (closed loop), with the CPU per request of every part, and direct
   and gateway at fixed open-loop rates below it (by default 100 req/s and 25 % of the
   gateway's non-streaming saturation). Reports the RPS ratios, the edge's CPU per
   request over plain nginx's, added p50/p99 end-to-end latency and added TTFT
   (streams).
4. **Tracing on vs off**: two gateways, each with a ledger on one Redis, one tracing
   every request and exporting its spans over OTLP gRPC to a receiver process; the
   saturation RPS ratio (on / off) and the added latency at the lowest fixed rate.
5. **Cold and warm paths**: every run above sends prompts of its own (a seed per run:
   no count can come from the edge's cache of identical bodies or the counter's
   segment cache), so the gateway's figures are the cold path's, what a new
   conversation pays. The warm paths are runs of their own, each labelled: a
   conversation's *next turn* (``NEXT_TURN_HISTORY`` of the prompt a system message
   seen before, the rest new) and an *identical resend* (the cold saturation run's
   bodies again), each at saturation (CPU per request by part) and at ``AIM_RATE``
   (added p50/p99 over the upstream alone, and the mean count as the edge waited for
   it: ``Gateway.count_seconds``). Beside them the **physical floor** of a
   cold count in the same run: encoding the same rendered prompts (the counter's own
   exact encoder and HF ``tokenizers``, µs per prompt, this process, one core) plus
   plain nginx's CPU per request.
6. **A process round trip**, back to back and after the lowest fixed rate's gap between
   requests idle: the wake-up cost every extra process on the gateway's path pays at
   low rates (``process_round_trip_us``).

Direct and plain nginx runs send ``X-Token-Count`` themselves (what the gateway sends
upstream), so every side sees the same upstream work. Results: ``bench/results/bench-<time>.json``
(every run's summary plus the derived figures) and ``bench/results/latest.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table
from tokengate import config as tg_config
from tokenstorm import report
from tokenstorm.arrivals import ArrivalSpec
from tokenstorm.null_server import FastUpstream, free_port
from tokenstorm.process import Service, tcp_ready
from tokenstorm.profiles import OutputPolicy
from tokenstorm.prompts import Sharing, StreamOptions
from tokenstorm.runner import RunResult, RunSpec, execute
from tokenstorm.upstream import UpstreamOptions

from tokengate_dev import devstack
from tokengate_dev.bench.paths import (
    FLOOR_PATHS,
    SESSION_CLIENTS,
    cold_floor_ratio,
    encode_floor_us,
    next_turn_sharing,
    paths_cpu,
    session_turns,
)
from tokengate_dev.bench.stack import (
    BENCH_KEY,
    BENCH_VAR,
    RESULTS,
    BenchOptions,
    Gateway,
    cpu_seconds,
    machine,
    plain_nginx_service,
    prompt_seed,
)

# The aims, as (label, figure name, comparison, target). The edge's ratios to plain
# nginx and the latencies are the worse of streamed and not; the cold path's against
# its floor and at AIM_RATE are non-streamed 1k-token chats on prompts never seen.
AIMS = [
    ("gateway CPU per cold chat / physical floor (encode + plain nginx)",
     "cold_cpu_floor_ratio", "<=", 2.0),
    ("added p50 latency, cold, 100 req/s (ms)", "cold_added_p50_ms", "<=", 1.5),
    ("added p99 latency, cold, 100 req/s (ms)", "cold_added_p99_ms", "<=", 4.0),
    ("gateway throughput, full accounting (req/s)", "gateway_rps", ">=", 2200.0),
    ("edge nginx CPU per request / plain nginx's, at saturation", "edge_cpu_ratio", "<=",
     3.0),
    ("gateway saturation / plain nginx's (req/s ratio)", "plain_rps_ratio", ">=", 0.3),
    ("added p50 latency, lowest fixed rate (ms)", "added_p50_ms", "<=", 1.0),
    ("added p99 latency, lowest fixed rate (ms)", "added_p99_ms", "<=", 3.0),
    ("added TTFT p50, lowest fixed rate (ms)", "added_ttft_p50_ms", "<=", 1.0),
    ("TokenStorm ceiling / vllm bench serve ceiling", "ceiling_ratio", ">=", 2.0),
    ("gateway saturation, tracing on / off (req/s ratio)", "tracing_rps_ratio",
     ">=", 0.95),
]
# the fixed rate of the cold and warm paths' added latency (req/s): where a GPU fleet's
# gateway mostly lives
AIM_RATE = 100.0


def _spec(name: str, url: str, cfg: tg_config.ModelConfig, opts: BenchOptions, *,
          stream: bool, rate: float | None = None, concurrency: int = 0,
          direct: bool, seed: int | None = None, sharing: Sharing | None = None) -> RunSpec:
    """A run's spec; its prompts are ``seed``'s (None: ``prompt_seed``, fresh ones)."""
    return RunSpec(
        seed=prompt_seed(opts) if seed is None else seed, sharing=sharing or Sharing(),
        url=url, model=cfg.name, model_dir=cfg.dir, max_model_len=cfg.max_model_len,
        arrival=ArrivalSpec("poisson", rate=rate) if rate else None, concurrency=concurrency,
        duration_s=opts.duration_s, profile=f"normal:mean={opts.prompt_tokens},sd=0",
        output=OutputPolicy(fixed=opts.output_tokens), stream=StreamOptions(stream=stream),
        keys=() if direct else (BENCH_KEY,), send_token_count=direct, workers=opts.workers,
        name=name, connections=64)


def _vllm_bench(url: str, cfg: tg_config.ModelConfig, opts: BenchOptions,
                console: Console) -> dict[str, Any]:
    """``vllm bench serve`` (random dataset, same lengths, same concurrency) against
    ``url``; returns its result JSON."""
    out = BENCH_VAR / "vllm-bench.json"
    out.unlink(missing_ok=True)
    root = url.removesuffix("/v1")
    argv = [sys.executable, "-m", "tokengate_dev.bench.vllm_serve", "--backend", "openai-chat",
            "--base-url", root, "--endpoint", "/v1/chat/completions", "--model", cfg.name,
            "--tokenizer", str(cfg.dir), "--dataset-name", "random",
            "--random-input-len", str(opts.prompt_tokens),
            "--random-output-len", str(opts.output_tokens),
            "--num-prompts", str(opts.vllm_bench_prompts),
            "--max-concurrency", str(opts.concurrency), "--request-rate", "inf",
            "--ignore-eos", "--disable-tqdm", "--num-warmups", "0",
            "--save-result", "--result-dir", str(BENCH_VAR), "--result-filename", out.name]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "TOKENIZERS_PARALLELISM": "false"}
    console.print(f"  vllm bench serve: sampling {opts.vllm_bench_prompts} random prompts, "
                  "then running them ...")
    with console.status("vllm bench serve against the null server ..."):
        p = subprocess.run(argv, check=False, capture_output=True, text=True, env=env, timeout=300)
    if p.returncode != 0 or not out.exists():
        raise RuntimeError(f"vllm bench serve failed ({p.returncode}):\n{p.stdout[-2000:]}\n"
                           f"{p.stderr[-2000:]}")
    data: dict[str, Any] = json.loads(out.read_text())
    return {k: data.get(k) for k in ("completed", "failed", "duration", "request_throughput",
                                     "output_throughput", "median_ttft_ms", "median_e2el_ms",
                                     "max_concurrency", "num_prompts")}


def _run(spec: RunSpec, console: Console, runs: dict[str, Any],
         groups: dict[str, int] | None = None, gateway: Gateway | None = None) -> RunResult:
    """One TokenStorm run, its summary into ``runs[spec.name]``; with ``groups``, the CPU
    per request of each process group (µs: ``cpu_us_per_request``); with ``gateway``,
    the mean of the run's counts as the edge timed them (ms: ``count_ms``)."""
    before = cpu_seconds(groups) if groups else {}
    counts_before = gateway.count_seconds() if gateway else (0.0, 0.0)
    result = execute(spec, console=console)
    s = result.summary
    runs[spec.name] = s.to_json()
    if gateway:
        counts_after = gateway.count_seconds()
        n = counts_after[1] - counts_before[1]
        if n:
            runs[spec.name]["count_ms"] = round(
                (counts_after[0] - counts_before[0]) / n * 1000, 3)
    if groups and s.all.ok:
        after = cpu_seconds(groups)
        per = {k: round((after[k] - before[k]) / s.all.ok * 1e6, 1) for k in groups}
        # TokenStorm: its workers' own CPU during the run (the process group would add
        # the per-run setup: planning, forking, the summary).
        per["tokenstorm"] = round(s.meta["client_cpu_s"] / s.all.ok * 1e6, 1)
        runs[spec.name]["cpu_us_per_request"] = per
    e2e, ttft = s.all.e2e_ms, s.all.ttft_ms
    line = (f"  {spec.name:<30}{s.all.rps:>8,.0f}/s  E2E p50 {report._f(e2e.p50, 2):>6} "
            f"p99 {report._f(e2e.p99, 2):>7}")
    if spec.stream.stream:
        line += f"  TTFT p50 {report._f(ttft.p50, 2):>6}"
    if s.errors or s.all.ok < s.requests:
        line += f"  [red]{s.requests - s.all.ok} failed[/]"
    console.print(line)
    if not s.valid:
        console.print("    [red]INVALID: " + "; ".join(s.invalid_reasons) + "[/]")
    return result


def run_bench(opts: BenchOptions, console: Console) -> dict[str, Any]:
    """Everything ``make bench`` measures, as the JSON it writes."""
    cfg = tg_config.load(devstack.ROOT / "tokengate.yaml").models
    model = next(iter(cfg.values()))
    out: dict[str, Any] = {"started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                           "machine": machine(), "options": vars(opts).copy(), "runs": {},
                           "figures": {}}
    runs: dict[str, Any] = out["runs"]
    fig: dict[str, Any] = out["figures"]
    up_opts = UpstreamOptions(model=model.name, max_model_len=model.max_model_len)
    with FastUpstream(up_opts, name="bench-upstream", state_dir=devstack.VAR) as up:
        assert up.service.proc is not None
        groups = {"tokenstorm": os.getpgrp(), "fast upstream": up.service.proc.pid}
        console.rule("ceilings against a null server (the fast upstream, no latency)")
        console.print(f"  closed loop, {opts.concurrency} in flight, best of "
                      f"{opts.ceiling_tries}; vllm bench serve's chat client always streams")
        best: dict[str, float] = {}
        for i in range(opts.ceiling_tries):
            for stream in (False, True):
                k = "stream" if stream else "nostream"
                r = _run(_spec(f"TokenStorm {k} #{i + 1}", up.url, model, opts,
                               stream=stream, concurrency=opts.concurrency, direct=True),
                         console, runs, groups)
                best[k] = max(best.get(k, 0.0), r.summary.all.rps)
            if not opts.skip_vllm_bench:
                vb = _vllm_bench(up.url, model, opts, console)
                out.setdefault("vllm_bench_serve", []).append(vb)
                best["vllm"] = max(best.get("vllm", 0.0), vb["request_throughput"])
                console.print(f"  {f'vllm bench serve stream #{i + 1}':<30}"
                              f"{vb['request_throughput']:>8,.0f}/s  (its duration "
                              f"{vb['duration']:.1f} s, {vb['failed']} failed)")
        fig["tokenstorm_ceiling_nostream_rps"] = best["nostream"]
        fig["tokenstorm_ceiling_stream_rps"] = best["stream"]
        if "vllm" in best:
            fig["vllm_bench_ceiling_rps"] = best["vllm"]
            fig["ceiling_ratio"] = best["stream"] / best["vllm"]
        if opts.skip_gateway:
            return out
        gw = Gateway(up.port, opts)
        plain, plain_port = plain_nginx_service(up.port, opts.edge_workers)
        with console.status("starting the gateway (counter + nginx edge) and plain nginx ..."):
            gw.start()
            plain.start()
        try:
            assert plain.proc is not None
            groups.update(gw.groups())
            groups["plain nginx"] = plain.proc.pid
            _direct_vs_gateway(up.url, f"http://127.0.0.1:{plain_port}/v1", gw, model, opts,
                               console, runs, fig, groups)
        finally:
            plain.stop()
            gw.stop()
        lines = gw.usage_file.read_text().count("\n") if gw.usage_file.exists() else 0
        fig["usage_events_written"] = lines
        if not opts.skip_tracing:
            _tracing_on_off(up.port, model, opts, console, runs, fig,
                            {k: v for k, v in groups.items()
                             if k in ("tokenstorm", "fast upstream")})
    gap_s = 1.0 / min(fig["fixed_rates_rps"])
    fig["process_round_trip_us"] = {"back to back": process_round_trip_us(0.0),
                                    f"after {gap_s * 1e3:.1f} ms idle": process_round_trip_us(gap_s)}
    return out


_ECHO = ("import socket, sys\n"
         "s = socket.socket(fileno=int(sys.argv[1]))\n"
         "while (d := s.recv(64)):\n"
         "    s.send(d)\n")


def process_round_trip_us(gap_s: float, n: int = 200) -> float:
    """The p50 of a 1-byte round trip (µs) over a unix socket pair to an echoing process,
    each after ``gap_s`` seconds idle: what waking an idle process costs on this machine
    (in a VM, an idle vCPU wakes far slower than a busy one answers). At a low rate each
    request of the gateway crosses more processes than a direct one (client, edge,
    counter, edge, upstream, edge), and each crossing pays it: the floor under the added
    latency that no edge code sets."""
    import socket
    import statistics

    a, b = socket.socketpair()
    child = subprocess.Popen([sys.executable, "-c", _ECHO, str(b.fileno())],
                             pass_fds=[b.fileno()])
    b.close()
    try:
        a.send(b"x")
        a.recv(64)  # the child is up
        times = []
        for _ in range(n):
            if gap_s:
                time.sleep(gap_s)
            start = time.perf_counter()
            a.send(b"x")
            a.recv(64)
            times.append((time.perf_counter() - start) * 1e6)
        return statistics.median(times)
    finally:
        a.close()
        child.wait(10)


def _direct_vs_gateway(direct_url: str, plain_url: str, gw: Gateway,
                       model: tg_config.ModelConfig, opts: BenchOptions, console: Console,
                       runs: dict[str, Any], fig: dict[str, Any],
                       groups: dict[str, int]) -> None:
    console.rule(f"direct vs plain nginx vs gateway: {opts.prompt_tokens}-token prompts, "
                 f"{opts.output_tokens} output tokens, {opts.duration_s:g} s per run")
    sat: dict[tuple[str, bool], float] = {}
    cpu: dict[str, dict[str, float]] = {}
    cold_seed = 0
    for stream in (False, True):
        mode = "stream" if stream else "no stream"
        for where, url in (("direct", direct_url), ("plain nginx", plain_url),
                           ("gateway", gw.url)):
            r = _run(_spec(f"{where} {mode} saturation", url, model, opts, stream=stream,
                           concurrency=opts.concurrency, direct=where != "gateway"),
                     console, runs, groups)
            sat[(where, stream)] = r.summary.all.rps
            cpu[f"{where} {mode}"] = runs[r.spec.name].get("cpu_us_per_request", {})
            if where == "gateway" and not stream:
                cold_seed = r.spec.seed
    # the warm paths at saturation: their own labelled runs, after the cold one
    warm = {"next turn": {"sharing": next_turn_sharing(opts.prompt_tokens)},
            "identical resend": {"seed": cold_seed}}
    for path, how in warm.items():
        r = _run(_spec(f"gateway no stream saturation, {path}", gw.url, model, opts,
                       stream=False, concurrency=opts.concurrency, direct=False, **how),
                 console, runs, groups)
        cpu[f"gateway no stream, {path}"] = runs[r.spec.name].get("cpu_us_per_request", {})
    # a session's turns: histories as messages, which TokenStorm's prompts are not
    session = runs["gateway no stream, session turns"] = session_turns(
        gw.url, model, prompt_seed(opts), groups)
    console.print(f"  {'gateway no stream, session turns':<30}{session['rps']:>8,.0f}/s  "
                  f"{session['requests']} requests, {SESSION_CLIENTS} clients"
                  + ("" if session["valid"] else "  [red]not all counted by the counter[/]"))
    cpu["gateway no stream, session turns"] = session["cpu_us_per_request"]
    fig["cpu_us_per_request_at_saturation"] = cpu
    console.print(_cpu_table(cpu, list(groups)))
    fig["floor"] = floor = encode_floor_us(model, cold_seed, opts, 1.0 / AIM_RATE)
    console.print(f"  floor: encoding the cold run's prompts, µs per prompt: "
                  f"{floor['encoder']} {floor['encoder_us']:,.0f}, HF tokenizers "
                  f"{floor['hf_tokenizers_us']:,.0f}")
    paths_cpu(fig, cpu, floor, {
        **{path: runs[f"gateway no stream saturation{suffix}"]["valid"]
           for path, suffix in (("cold", ""), *((p, f", {p}") for p in warm))},
        "session turns": session["valid"]})
    # The edge's aims: the worse of streamed and not.
    edge_cpu, plain_rps = [], []
    for stream in (False, True):
        mode, k = ("stream", "stream") if stream else ("no stream", "nostream")
        edge, plain = (cpu[f"gateway {mode}"].get("edge nginx"),
                       cpu[f"plain nginx {mode}"].get("plain nginx"))
        if edge and plain:
            fig[f"edge_cpu_ratio_{k}"] = edge / plain
            edge_cpu.append(edge / plain)
        fig[f"plain_nginx_{k}_rps"] = sat[("plain nginx", stream)]
        if sat[("plain nginx", stream)]:
            fig[f"plain_rps_ratio_{k}"] = sat[("gateway", stream)] / sat[("plain nginx", stream)]
            plain_rps.append(fig[f"plain_rps_ratio_{k}"])
    if edge_cpu:
        fig["edge_cpu_ratio"] = max(edge_cpu)
    if plain_rps:
        fig["plain_rps_ratio"] = min(plain_rps)
    rates = opts.rates or sorted({AIM_RATE, max(50.0, round(sat[("gateway", False)] * 0.25
                                                            / 50) * 50)})
    fig["fixed_rates_rps"] = rates
    direct_nostream: dict[float, report.Summary] = {}
    for stream in (False, True):
        mode = "stream" if stream else "no stream"
        for rate in rates:
            # A pair with an invalid run (the machine stalled the generator, or the
            # gateway fell back to estimated counts) is run once more.
            for attempt in (1, 2):
                res = {}
                for where, url in (("direct", direct_url), ("gateway", gw.url)):
                    name = f"{where} {mode} {rate:g} req/s" + (" (again)" if attempt > 1
                                                               else "")
                    on_gw = where == "gateway"
                    res[where] = _run(_spec(name, url, model, opts, stream=stream, rate=rate,
                                            direct=not on_gw), console, runs,
                                      groups if on_gw else None, gw if on_gw else None).summary
                if res["direct"].valid and res["gateway"].valid:
                    break
            d, g = res["direct"], res["gateway"]
            if not stream:
                direct_nostream[rate] = d
            key = f"{'stream' if stream else 'nostream'}_{rate:g}"
            valid = d.valid and g.valid
            entry = {"valid": valid,
                     "added_p50_ms": _sub(g.all.e2e_ms.p50, d.all.e2e_ms.p50),
                     "added_p99_ms": _sub(g.all.e2e_ms.p99, d.all.e2e_ms.p99)}
            if stream:
                entry["added_ttft_p50_ms"] = _sub(g.all.ttft_ms.p50, d.all.ttft_ms.p50)
                entry["added_ttft_p99_ms"] = _sub(g.all.ttft_ms.p99, d.all.ttft_ms.p99)
            fig[f"added_{key}"] = entry
    _paths_at_rate(direct_url, gw, model, opts, console, runs, fig, warm,
                   direct_nostream.get(AIM_RATE), groups)
    for stream in (False, True):
        k = "stream" if stream else "nostream"
        fig[f"direct_{k}_rps"] = sat[("direct", stream)]
        fig[f"gateway_{k}_rps"] = sat[("gateway", stream)]
        fig[f"rps_ratio_{k}"] = sat[("gateway", stream)] / sat[("direct", stream)]
    fig["gateway_rps"] = sat[("gateway", False)]
    # The aims' latency figures: the worse of streamed and not at the lowest fixed rate
    # (well below saturation); every rate's figures are in fig["added_<mode>_<rate>"].
    low = [fig[f"added_{k}_{min(rates):g}"] for k in ("nostream", "stream")]
    for name in ("added_p50_ms", "added_p99_ms", "added_ttft_p50_ms", "added_ttft_p99_ms"):
        vals = [e[name] for e in low if e.get(name) is not None and e["valid"]]
        fig[name] = max(vals) if vals else None


def _paths_at_rate(direct_url: str, gw: Gateway, model: tg_config.ModelConfig,
                   opts: BenchOptions, console: Console, runs: dict[str, Any],
                   fig: dict[str, Any], warm: dict[str, dict[str, Any]],
                   direct: report.Summary | None, groups: dict[str, int]) -> None:
    """Each path's added p50/p99 (ms) over the upstream alone at ``AIM_RATE``, no
    stream, and the gateway's CPU per request there by part (µs: ``cpu_us_at_rate``,
    the idle wake-ups included), into ``fig["paths"]``: the cold path's from the fixed
    rates' run when one was at that rate (else run here), the warm paths' runs
    (``warm``: their spec arguments) against the same direct run; ``cold_added_p50_ms``
    and ``cold_added_p99_ms`` for the aims."""
    rate = AIM_RATE
    if direct is None:
        direct = _run(_spec(f"direct no stream {rate:g} req/s", direct_url, model, opts,
                            stream=False, rate=rate, direct=True), console, runs).summary
    todo: dict[str, dict[str, Any]] = dict(warm)
    if f"added_nostream_{rate:g}" not in fig:
        todo = {"cold": {}, **todo}
    paths = fig.setdefault("paths", {})
    for path, how in todo.items():
        g = _run(_spec(f"gateway no stream {rate:g} req/s" + ("" if path == "cold"
                                                              else f", {path}"),
                       gw.url, model, opts, stream=False, rate=rate, direct=False, **how),
                 console, runs, groups, gw).summary
        paths.setdefault(path, {}).update(
            valid=direct.valid and g.valid, added_p50_ms=_sub(g.all.e2e_ms.p50,
                                                              direct.all.e2e_ms.p50),
            added_p99_ms=_sub(g.all.e2e_ms.p99, direct.all.e2e_ms.p99))
    if "cold" not in todo:
        e = fig[f"added_nostream_{rate:g}"]
        paths.setdefault("cold", {}).update(valid=e["valid"], added_p50_ms=e["added_p50_ms"],
                                            added_p99_ms=e["added_p99_ms"])
    for path in ("cold", *warm):  # the paths run at the rate (not the session turns)
        paths[path]["rate_rps"] = rate
        run = runs.get(f"gateway no stream {rate:g} req/s"
                       + ("" if path == "cold" else f", {path}"), {})
        per = run.get("cpu_us_per_request")
        if per:
            paths[path]["cpu_us_at_rate"] = {k: per[k] for k in ("edge nginx", "counter")
                                              if k in per}
        if "count_ms" in run:
            paths[path]["count_ms_at_rate"] = run["count_ms"]
    if paths["cold"]["valid"]:
        fig["cold_added_p50_ms"] = paths["cold"]["added_p50_ms"]
        fig["cold_added_p99_ms"] = paths["cold"]["added_p99_ms"]
    cold_floor_ratio(fig)


def _tracing_on_off(upstream_port: int, model: tg_config.ModelConfig, opts: BenchOptions,
                    console: Console, runs: dict[str, Any], fig: dict[str, Any],
                    groups: dict[str, int]) -> None:
    """Tracing's cost: three gateways, each with a ledger on one Redis: tracing off, every
    request traced (sample_ratio 1), and 10 % of traces sampled, the spans exported over
    OTLP gRPC to a receiver process; saturation runs taken in turns (best of two), then the
    lowest fixed rate for the added latency. Figures: ``tracing_rps_ratio`` (the worse of
    streamed and not, on / off), ``tracing_added_*`` (on - off, ms), the spans received,
    exported and lost, and the CPU per request of every part."""
    console.rule("tracing on vs off (every request traced, spans exported over OTLP gRPC)")
    redis_port, otlp_port = free_port(), free_port()
    redis = devstack.redis_service(port=redis_port, name="bench-redis")
    rx = Service("bench-otlp-receiver",
                 [sys.executable, "-m", "tokengate_dev.otlp_receiver", "--grpc-port",
                  str(otlp_port)], tcp_ready("127.0.0.1", otlp_port), {}, 30.0,
                 cwd=devstack.ROOT, log_dir=devstack.VAR / "log")
    url = f"redis://127.0.0.1:{redis_port}/0"
    tracing = {"enabled": True, "endpoint": f"http://127.0.0.1:{otlp_port}",
               "sample_ratio": 1.0}
    gws = {"off": Gateway(upstream_port, opts, "tracing-off", redis_url=url),
           "on": Gateway(upstream_port, opts, "tracing-on", redis_url=url, tracing=tracing),
           "on 10%": Gateway(upstream_port, opts, "tracing-sampled", redis_url=url,
                             tracing={**tracing, "sample_ratio": 0.1})}
    started: list[Any] = []
    try:
        with console.status("starting Redis, an OTLP receiver and two gateways ..."):
            for svc in (redis, rx, *gws.values()):
                started.append(svc.start())
        assert rx.proc is not None
        all_groups = {**groups, "otlp receiver": rx.proc.pid}
        for side, gw in gws.items():
            all_groups.update({f"{k} ({side})": v for k, v in gw.groups().items()})
        sat: dict[tuple[str, bool], float] = {}
        cpu: dict[str, dict[str, float]] = {}
        for i in range(2):
            for stream in (False, True):
                mode = "stream" if stream else "no stream"
                for side in ("off", "on", "on 10%") if i == 0 else ("on 10%", "on", "off"):
                    name = f"tracing {side} {mode} #{i + 1}"
                    r = _run(_spec(name, gws[side].url, model, opts, stream=stream,
                                   concurrency=opts.concurrency, direct=False),
                             console, runs, all_groups)
                    if r.summary.all.rps > sat.get((side, stream), 0.0):
                        sat[(side, stream)] = r.summary.all.rps
                        cpu[f"{side} {mode}"] = runs[name].get("cpu_us_per_request", {})
        rate = min(fig.get("fixed_rates_rps") or [200.0])
        for stream in (False, True):
            mode, k = ("stream", "stream") if stream else ("no stream", "nostream")
            res = {side: _run(_spec(f"tracing {side} {mode} {rate:g} req/s", gws[side].url,
                                    model, opts, stream=stream, rate=rate, direct=False),
                              console, runs).summary for side in ("off", "on")}
            fig[f"tracing_rps_ratio_{k}"] = sat[("on", stream)] / sat[("off", stream)]
            fig[f"tracing_sampled_rps_ratio_{k}"] = sat[("on 10%", stream)] / sat[("off", stream)]
            fig[f"tracing_{k}_rps"] = {side: sat[(side, stream)] for side in gws}
            fig[f"tracing_added_{k}_{rate:g}"] = {
                "valid": res["off"].valid and res["on"].valid,
                "added_p50_ms": _sub(res["on"].all.e2e_ms.p50, res["off"].all.e2e_ms.p50),
                "added_p99_ms": _sub(res["on"].all.e2e_ms.p99, res["off"].all.e2e_ms.p99)}
        fig["tracing_rps_ratio"] = min(fig["tracing_rps_ratio_nostream"],
                                       fig["tracing_rps_ratio_stream"])
        fig["tracing_cpu_us_per_request_at_saturation"] = cpu
        console.print(_cpu_table(cpu, list(all_groups)))
        time.sleep(1.5)  # the last batch's spans
        m = gws["on"].ledger_metrics()
        fig["tracing_spans"] = {
            "exported": m.get("tokengate_trace_spans_exported_total"),
            "lost": sum(v for k, v in m.items() if k.startswith("tokengate_trace_spans_lost")),
            "queued": m.get("tokengate_trace_spans_queued"),
            "events_applied": m.get("tokengate_ledger_events_applied_total")}
    finally:
        for svc in reversed(started):
            svc.stop()
    log = (devstack.VAR / "log" / "bench-otlp-receiver.log")
    last = log.read_text().strip().splitlines()[-1:] if log.exists() else []
    if last and last[0].startswith("spans "):
        fig["tracing_spans"]["received"] = int(last[0].split()[1])


def _cpu_table(cpu: dict[str, dict[str, float]], names: list[str]) -> Table:
    t = Table(title="CPU per request at saturation (µs, all processes of each part)",
              header_style="bold")
    t.add_column("run")
    for n in names:
        t.add_column(n, justify="right")
    for run, per in cpu.items():
        t.add_row(run, *(f"{per[n]:,.0f}" if n in per else "-" for n in names))
    return t


def _sub(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b


def render(out: dict[str, Any]) -> Table:
    """The aims against what was measured, as ratios."""
    fig = out["figures"]
    t = Table(title="make bench: aims vs measured", header_style="bold")
    for c in ("figure", "measured", "aim", "ratio to aim", ""):
        t.add_column(c, justify="right" if c != "figure" else "left")
    for label, name, op, target in AIMS:
        v = fig.get(name)
        if v is None:
            t.add_row(label, "-", f"{op} {target:g}", "-", "not measured")
            continue
        if name == "cold_cpu_floor_ratio":
            label += f" ({fig['cold_cpu_floor_source']})"
        if op == ">=":
            ratio, met = v / target, v >= target
        else:
            ratio = (v / target) if target else float("inf")
            met = v <= target
        t.add_row(label, f"{v:,.2f}", f"{op} {target:g}", f"{ratio:.2f}x",
                  "[green]met[/]" if met else "[red]not met[/]")
    for rate in fig.get("fixed_rates_rps", []):
        for k in ("nostream", "stream"):
            e = fig.get(f"added_{k}_{rate:g}")
            if e is None:
                continue
            ttft = (f", TTFT p50 {e['added_ttft_p50_ms']:+.2f}"
                    if e.get("added_ttft_p50_ms") is not None else "")
            t.add_row(f"added at {rate:g} req/s, {k.replace('no', 'no ')} (ms)",
                      f"p50 {e['added_p50_ms']:+.2f}, p99 {e['added_p99_ms']:+.2f}{ttft}", "",
                      "", "" if e["valid"] else "[red]invalid run[/]")
    for k in ("nostream", "stream"):
        if f"plain_rps_ratio_{k}" in fig:
            t.add_row(f"gateway / plain nginx saturation RPS ({k.replace('no', 'no ')})",
                      f"{fig[f'gateway_{k}_rps']:,.0f} / {fig[f'plain_nginx_{k}_rps']:,.0f}",
                      "", f"{fig[f'plain_rps_ratio_{k}']:.3f}", "")
        if f"edge_cpu_ratio_{k}" in fig:
            cpu = fig["cpu_us_per_request_at_saturation"]
            mode = k.replace("no", "no ")
            t.add_row(f"edge / plain nginx CPU per request ({mode}, µs)",
                      f"{cpu[f'gateway {mode}']['edge nginx']:,.0f} / "
                      f"{cpu[f'plain nginx {mode}']['plain nginx']:,.0f}", "",
                      f"{fig[f'edge_cpu_ratio_{k}']:.2f}", "")
    for k in ("nostream", "stream"):
        if f"rps_ratio_{k}" in fig:
            t.add_row(f"gateway / direct saturation RPS ({k.replace('no', 'no ')})",
                      f"{fig[f'gateway_{k}_rps']:,.0f} / {fig[f'direct_{k}_rps']:,.0f}",
                      "", f"{fig[f'rps_ratio_{k}']:.3f}", "")
    for k in ("nostream", "stream"):
        if f"tracing_{k}_rps" in fig:
            on_off = fig[f"tracing_{k}_rps"]
            t.add_row(f"gateway saturation RPS, tracing on / off ({k.replace('no', 'no ')})",
                      f"{on_off['on']:,.0f} / {on_off['off']:,.0f}", "",
                      f"{fig[f'tracing_rps_ratio_{k}']:.3f}", "")
            t.add_row(f"  the same, 10 % of traces sampled ({k.replace('no', 'no ')})",
                      f"{on_off['on 10%']:,.0f} / {on_off['off']:,.0f}", "",
                      f"{fig[f'tracing_sampled_rps_ratio_{k}']:.3f}", "")
        for name, e in fig.items():
            if name.startswith(f"tracing_added_{k}_"):
                rate = name.rpartition("_")[2]
                t.add_row(f"tracing on - off at {rate} req/s, {k.replace('no', 'no ')} (ms)",
                          f"p50 {e['added_p50_ms']:+.2f}, p99 {e['added_p99_ms']:+.2f}", "",
                          "", "" if e["valid"] else "[red]invalid run[/]")
    if "tracing_spans" in fig:
        sp = fig["tracing_spans"]
        t.add_row("spans: received / exported / lost", f"{sp.get('received', '-')} / "
                  f"{sp.get('exported')} / {sp.get('lost')}", "", "", "")
    floor = fig.get("floor", {})
    if "total_us" in floor:
        t.add_row("floor of a cold count: encode + plain nginx (µs)",
                  f"{floor['encode_us']:,.0f} + {floor['plain_nginx_us']:,.0f}", "",
                  "", f"{floor['encoder']} {floor['encoder_us']:,.0f}, HF tokenizers "
                      f"{floor['hf_tokenizers_us']:,.0f}")
    for path, e in fig.get("paths", {}).items():
        if "gateway_cpu_us" in e:
            t.add_row(f"{path}: CPU per request, edge + counter (µs)",
                      f"{e['edge_cpu_us']:,.0f} + {e['counter_cpu_us']:,.0f}", "",
                      f"{e['gateway_cpu_us'] / floor['total_us']:.2f}x floor"
                      if "total_us" in floor and path in FLOOR_PATHS else "",
                      "" if e["saturation_valid"] else "[red]invalid run[/]")
        at = e.get("cpu_us_at_rate", {})
        if "edge nginx" in at and "counter" in at:
            t.add_row(f"{path}: CPU per request at {e['rate_rps']:g} req/s, edge + counter "
                      "(µs)", f"{at['edge nginx']:,.0f} + {at['counter']:,.0f}", "", "", "")
        if e.get("added_p50_ms") is not None:
            t.add_row(f"{path}: added at {e['rate_rps']:g} req/s, no stream (ms)",
                      f"p50 {e['added_p50_ms']:+.2f}, p99 {e['added_p99_ms']:+.2f}", "", "",
                      "" if e["valid"] else "[red]invalid run[/]")
        if "count_ms_at_rate" in e:
            t.add_row(f"{path}: the count at {e['rate_rps']:g} req/s, as the edge waits for "
                      "it (ms, mean)", f"{e['count_ms_at_rate']:.2f}", "", "", "")
    for label, us in fig.get("process_round_trip_us", {}).items():
        t.add_row(f"round trip to another process, {label} (µs p50)", f"{us:,.0f}", "", "",
                  "")
    for label, us in floor.get("encode_idle_us", {}).items():
        t.add_row(f"floor's encode of a new prompt, {label} (µs p50)", f"{us:,.0f}", "", "",
                  "")
    for label, us in floor.get("count_idle_us", {}).items():
        t.add_row(f"the counter's call on a new prompt in the bench's process, {label} "
                  "(µs p50)", f"{us:,.0f}", "", "", "")
    if "tokenstorm_ceiling_stream_rps" in fig and "vllm_bench_ceiling_rps" in fig:
        t.add_row("ceilings, stream: TokenStorm / vllm bench serve (req/s)",
                  f"{fig['tokenstorm_ceiling_stream_rps']:,.0f} / "
                  f"{fig['vllm_bench_ceiling_rps']:,.0f}", "", "", "")
    return t


def arguments(module: str, doc: str | None) -> argparse.ArgumentParser:
    """A bench's command line (``python -m <module>``, ``doc`` its help): the options
    every TokenStorm bench takes, ``--duration`` and ``--concurrency``."""
    p = argparse.ArgumentParser(prog=f"python -m {module}", description=doc,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duration", type=float, default=4.0, metavar="S",
                   help="seconds per run (default: %(default)s)")
    p.add_argument("--concurrency", type=int, default=64, metavar="N",
                   help="in-flight requests at saturation (default: %(default)s)")
    return p


def main(argv: list[str] | None = None) -> None:
    p = arguments("tokengate_dev.bench.storm", __doc__)
    p.add_argument("--rates", default="", metavar="R1,R2",
                   help="fixed open-loop rates in req/s (default: 100 and 25%% of the "
                        "gateway's saturation)")
    p.add_argument("--prompt-tokens", type=int, default=1000)
    p.add_argument("--output-tokens", type=int, default=16)
    p.add_argument("--workers", type=int, default=1, help="TokenStorm worker processes")
    p.add_argument("--edge-workers", type=int, default=2, help="nginx edge workers")
    p.add_argument("--counter-workers", type=int, default=2, help="counter processes")
    p.add_argument("--skip-vllm-bench", action="store_true")
    p.add_argument("--skip-gateway", action="store_true")
    p.add_argument("--skip-tracing", action="store_true",
                   help="leave out tracing on vs off")
    p.add_argument("--same-prompts", action="store_true",
                   help="every run sends the same prompts (seed 0), as before fresh "
                        "prompts were the default: warm caches in every run")
    p.add_argument("--out", type=Path, default=None, metavar="FILE.json",
                   help="result file (default: bench/results/bench-<time>.json)")
    a = p.parse_args(argv)
    opts = BenchOptions(prompt_tokens=a.prompt_tokens, output_tokens=a.output_tokens,
                        duration_s=a.duration, concurrency=a.concurrency,
                        rates=[float(x) for x in a.rates.split(",") if x],
                        workers=a.workers, edge_workers=a.edge_workers,
                        counter_workers=a.counter_workers, skip_vllm_bench=a.skip_vllm_bench,
                        skip_gateway=a.skip_gateway, skip_tracing=a.skip_tracing,
                        same_prompts=a.same_prompts)
    console = Console(width=None if sys.stdout.isatty() else 110)
    m = machine()
    console.print(f"make bench: {m['cpus']} CPUs, load average {m['loadavg_before']} "
                  "(numbers are this machine's, loopback only)")
    t0 = time.monotonic()
    out = run_bench(opts, console)
    out["elapsed_s"] = round(time.monotonic() - t0, 1)
    path = a.out or RESULTS / f"bench-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(report._clean(out), indent=2) + "\n"
    path.write_text(text)
    (path.parent / "latest.json").write_text(text)
    console.print(render(out))
    console.print(f"results: {path} ({out['elapsed_s']:g} s)")


if __name__ == "__main__":
    main()

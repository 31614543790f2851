"""``make bench-batch``: a batch on spare capacity beside steady interactive traffic.

The fleet is ``--replicas`` simulated vLLM replicas on GPUs (``tokenstorm sim-replica
--gpu h100``, as ``make bench-slo`` builds them: vLLM's scheduler stepped with a token
budget per step, decodes first, chunked prefill, ``--max-num-seqs`` seats; each step
timed by the roofline of ``--model-config``, Qwen3-8B's shape by default; the KV cache
sized from the GPU's memory; vLLM's ``--scheduling-policy``, ``priority`` by default,
with the rules of tokengate's vLLM plugin scheduler for the lines, ``--spare-chunk``
32: a waiting interactive request preempts a line for a seat, no line prefill beside
an interactive one, line prefills in chunks of 32 tokens),
behind a real edge, counter, Redis and tokengate-batch. Interactive traffic is one
open-loop TokenStorm run (Poisson arrivals at ``--interactive-share`` of the fleet's
seats, streaming) of a ``normal`` key; the batch's lines go through the edge at
``batch.priority`` ``low`` (with the ``priority`` policy the model's
``scheduling_policy`` is ``priority`` and ``low``'s ``vllm_priority`` 1: vLLM admits a
waiting interactive request, priority 0, before any waiting line and preempts lines
first when its KV cache runs short), admitted only while a replica runs fewer than
``--batch-seats`` of its seats (``max_running``), has at most ``--max-waiting``
requests waiting, its KV cache is below ``--low-kv-threshold`` and, with
``--prefill-tokens`` (``max_prefill_tokens``; none by default: the plugin's chunks pace
the lines' prefills), its prefill lane is free; a line that finds no such replica is
held at the edge up to ``--hold-ms`` for one, then refused.

Two runs of the same interactive schedule: alone, then with a batch of ``--lines``
chat lines created when the interactive run starts. Both are measured over the
batch's steady window, read from the replicas' engine usage records: from the first
moment every replica had run ``max_running`` requests (the batch had grown to the
seats left to it) to the last line's arrival at a replica (then only the lines out
drain); in the run alone, the same offsets of the schedule. The ramp before it and the
drain after it measure how the benchmark starts and ends a batch of 2,000 lines, not
the scheduler: a batch of hours has neither in its figures (the busy share of the
batch's whole span is reported beside).

- the interactive TTFT p99 of the requests scheduled in the window, ms from the
  scheduled send (the aim's figure), and the engine's TTFT p99 (queued + prefill, from
  the engine records: the replicas' part, free of what this machine's shared cores add
  to the edge, the load generator and the network), with its queued part's p99 (the
  wait for a seat or the next step);
- the fleet's busy share: the time-weighted share of the replicas' seats in use, each
  request counted from its admission to vLLM's running batch to its end (the records'
  queued and e2e times: what vllm:num_requests_running counts), over replicas x
  max_num_seqs. Why seats: a decode step reads every weight once whatever its batch,
  so below the roofline's ridge (about 260 tokens a step for Qwen3-8B on an H100) a
  step with more seats taken costs about the same time and yields more tokens; the
  step's token budget is spent by prefills only (32 decodes use 0.4 % of it), and the
  share of time the GPU steps is near 1 as soon as one request runs.

The time scale (``--time-scale K``, default ``slo.TIME_SCALE``, as ``make bench-slo``):
every simulated step lasts K times an H100's (``slo.time_scaled``), the interactive
arrivals are K times sparser for K times ``--duration-s``, and the edge's waits on the
fleet (``hold_ms``, the replicas' metrics poll) K times longer: the same traffic and
batch in the GPU's own time, while what this machine's shared cores add to each
client's TTFT (the edge, the load generator, HTTP; a few ms at p99 that vary from run
to run) weighs K times less against the steps. Latencies and rates print on the scaled
clock; the ratios the aims judge need no conversion.

Also: the batch's completion time (creation to ``completed``, s) and its lines per
second. Aims, each printed with met / not met: TTFT p99 with the batch at most 1.1x
without (and the same for the engine's TTFT, in parentheses); busy share with the
batch at least 0.90. Results: ``bench/results/batch-<time>.json`` and
``batch-latest.json``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import threading
import time
import urllib.request
from dataclasses import asdict, dataclass, replace
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np
import openai
import yaml
from rich.console import Console
from rich.table import Table
from tokengate import config as tg_config
from tokengate_vllm.settings import DEFAULT_SPARE_CHUNK
from tokenstorm import report
from tokenstorm.arrivals import ArrivalSpec
from tokenstorm.process import free_port
from tokenstorm.profiles import OutputPolicy
from tokenstorm.prompts import StreamOptions
from tokenstorm.runner import RunResult, RunSpec, execute
from tokenstorm.upstream.roofline import GPUS
from tokenstorm.upstream.sim import SimReplica, SimSettings

from tokengate_dev import devstack
from tokengate_dev.bench import results, routing, slo

BENCH_VAR = devstack.VAR / "bench-batch"
MODEL = routing.MODEL
INTERACTIVE_KEY = "tg-bench-batch-interactive"
TENANT_KEY = "tg-bench-batch-tenant"
WORKER_SECRET = "tg-bench-batch-worker"


@dataclass(frozen=True)
class Options:
    replicas: int = 2
    slots: int = 32                 # --max-num-seqs of each replica
    gpu: str = "h100"
    model_config: str = "qwen3-8b"
    prompt_tokens: int = 200
    output_tokens: int = 48         # of an interactive request
    line_output_tokens: int = 48    # of a batch line
    interactive_share: float = 0.35  # of the fleet's seats, on average
    duration_s: float = 40.0
    lines: int = 2000
    batch_seats: float = 0.94       # of a replica's seats the batch may fill up to
    low_kv_threshold: float = 0.8
    prefill_tokens: int | None = None  # max_prefill_tokens of the batch's priority
    hold_ms: int = 200              # hold_ms of the batch's priority
    max_waiting: int = 2            # max_waiting of the batch's priority
    scheduling_policy: str = "priority"  # the replicas' --scheduling-policy
    spare_chunk: int = DEFAULT_SPARE_CHUNK  # the replicas' --spare-chunk (0: vLLM's alone)
    time_scale: float = slo.TIME_SCALE  # every step K times an H100's (module text)
    seed: int = 11

    def sim(self, model: tg_config.ModelConfig) -> SimSettings:
        """One replica: vLLM's steps on ``gpu``, ``slots`` seats, the KV cache sized from
        the GPU's memory (``make bench-slo``'s replicas with fewer seats: this machine's
        cores drive a few dozen streams per replica, not vLLM's default 256), every step
        ``time_scale`` times as long."""
        return slo.sim_settings(model, 4096, self.gpu, self.model_config,
                                max_num_seqs=self.slots,
                                scheduling_policy=self.scheduling_policy,
                                spare_chunk=self.spare_chunk,
                                **slo.time_scaled(self.gpu, self.time_scale))

    def replica(self, model: tg_config.ModelConfig, i: int) -> SimReplica:
        """Replica ``i``, writing its engine usage records to ``records(i)``."""
        return SimReplica(replace(self.sim(model), engine_usage_file=records_file(i)),
                          name=f"bench-batch-sim{i}", state_dir=BENCH_VAR)

    def request_s(self, model: tg_config.ModelConfig) -> float:
        """How long one interactive request holds a seat (s): the roofline's prefill
        step, then a decode step per output token with its share of the seats taken."""
        rf = self.sim(model).roofline()
        assert rf is not None
        ctx = self.prompt_tokens + self.output_tokens // 2
        batch = max(1, round(self.interactive_share * self.slots))
        return rf.step_s([(self.prompt_tokens, 0, 1)]) \
            + self.output_tokens * rf.step_s([(1, ctx, 1)] * batch)

    def interactive_rps(self, model: tg_config.ModelConfig) -> float:
        """The interactive arrival rate (requests/s on the scaled clock)."""
        return self.interactive_share * self.replicas * self.slots / self.request_s(model)

    def arrivals_s(self) -> float:
        """How long each interactive run sends (s): ``duration_s`` at this time scale."""
        return self.duration_s * self.time_scale

    def scaled_ms(self, ms: float) -> int:
        """A wait of the edge on the fleet (ms) at this time scale."""
        return round(ms * self.time_scale)

    @property
    def max_running(self) -> int:
        """``max_running`` of the batch's priority: seats the batch may fill up to."""
        return max(1, int(self.batch_seats * self.slots))


def records_file(i: int) -> Path:
    return BENCH_VAR / f"engine-records-{i}.jsonl"


@dataclass(frozen=True)
class Seat:
    """One request as a replica's engine record gives it: ``replica``, ``key_id``,
    wall-clock s of its ``arrival``, of its admission to the running batch (``start``:
    arrival + queued) and of its ``end`` (start + prefill + decode: the engine's clock,
    which a late event loop does not move, tokenstorm.upstream.sim_steps; e2e, which
    it does, only for a request that had no first token); ``ttft_ms`` (queued +
    prefill), None when it had no first token."""

    replica: int
    key_id: str | None
    arrival: float
    start: float
    end: float
    ttft_ms: float | None

    @classmethod
    def read(cls, replicas: int) -> list[Seat]:
        """Every request of the replicas' engine records (the first choice's)."""
        out = []
        for i in range(replicas):
            for line in records_file(i).read_text().splitlines():
                r = json.loads(line)
                if r["index"] != 0:
                    continue
                arrival = datetime.fromisoformat(r["arrival_ts"]).timestamp()
                queued = r["queued_ms"] or 0.0
                ttft = None if r["prefill_ms"] is None else queued + r["prefill_ms"]
                ran = r["e2e_ms"] if ttft is None or r["decode_ms"] is None \
                    else ttft + r["decode_ms"]
                out.append(cls(i, r["key_id"], arrival, arrival + queued / 1000,
                               arrival + ran / 1000, ttft))
        return out


def answered(seats: list[Seat], key_id: str, window: tuple[float, float]) -> list[Seat]:
    """``key_id``'s requests that arrived at a replica in ``window`` (wall-clock s) and
    got a first token (their engine records have a prefill time)."""
    return [s for s in seats if s.key_id == key_id and s.ttft_ms is not None
            and window[0] <= s.arrival <= window[1]]


def engine_ttft(seats: list[Seat], key_id: str, window: tuple[float, float]
                ) -> tuple[int, float | None]:
    """(requests, TTFT p99 ms) of the ``answered`` requests, as the replicas' engine
    records give it: queued_ms + prefill_ms, the GPU's part of TTFT without the edge,
    the network or this machine's other processes."""
    xs = [s.ttft_ms for s in answered(seats, key_id, window) if s.ttft_ms is not None]
    return len(xs), float(np.percentile(xs, 99)) if xs else None


def engine_queued(seats: list[Seat], key_id: str, window: tuple[float, float]
                  ) -> float | None:
    """The queued p99 (ms: arrival at the replica to admission to its running batch, the
    wait for a seat or a step) of the ``answered`` requests; the rest of the engine's
    TTFT is the steps that computed the prompt."""
    xs = [(s.start - s.arrival) * 1000 for s in answered(seats, key_id, window)]
    return float(np.percentile(xs, 99)) if xs else None


def busy_share(seats: list[Seat], window: tuple[float, float], replicas: int,
               slots: int) -> float:
    """The share of the fleet's seats in use over ``window`` (wall-clock s): the seconds
    each request ran within it, summed, over replicas x slots x its length."""
    a, b = window
    used = sum(max(0.0, min(s.end, b) - max(s.start, a)) for s in seats)
    return used / (replicas * slots * (b - a)) if b > a else 0.0


def steady_window(seats: list[Seat], key_id: str, replicas: int, bound: int
                  ) -> tuple[float, float]:
    """The batch's steady window (wall-clock s): from the first moment every replica
    had run ``bound`` requests at once since the batch's first line arrived (its window
    had grown to the seats left to it; that arrival when one never did) to its last
    line's arrival."""
    lines = [s for s in seats if s.key_id == key_id]
    first, last = min(s.arrival for s in lines), max(s.arrival for s in lines)
    reached = []
    for i in range(replicas):
        mine = [s for s in seats if s.replica == i and s.end > first]
        running = sum(1 for s in mine if s.start <= first)
        changes = sorted([(s.start, 1) for s in mine if s.start > first]
                         + [(s.end, -1) for s in mine])
        for t, d in changes:
            running += d
            if running >= bound:
                reached.append(t)
                break
    start = max(reached) if len(reached) == replicas else first
    return (start, last) if start < last else (first, last)


def write_config(path: Path, upstreams: list[str], opts: Options, edge_port: int,
                 status_port: int, batch_port: int, redis_port: int) -> Path:
    """tokengate.yaml of the bench: the model on the simulated replicas, the interactive
    key (normal) and the batch's tenant, batch enabled with the bench's secret, the low
    priority refused above ``low_kv_threshold`` of the KV cache, with more than 2
    requests waiting or ``max_running`` requests running, paced by
    ``max_prefill_tokens`` and held ``hold_ms``."""
    raw = yaml.safe_load((devstack.ROOT / "tokengate.yaml").read_text())
    for m in raw["models"].values():
        m["dir"] = str((devstack.ROOT / m["dir"]).resolve())
    m = raw["models"][MODEL]
    m.update(upstreams=upstreams, embedded=False, max_model_len=4096,
             scheduling_policy=opts.scheduling_policy)
    m["routing"] = {"policy": "least_outstanding"}
    digest = lambda k: hashlib.sha256(k.encode()).hexdigest()
    raw["keys"] = {"interactive": {"sha256": digest(INTERACTIVE_KEY), "rpm": 10**9,
                                   "tpm": 10**12},
                   "tenant": {"sha256": digest(TENANT_KEY), "rpm": 10**9, "tpm": 10**12}}
    raw["redis"] = {"url": f"redis://127.0.0.1:{redis_port}/0"}
    raw["ledger"] = {"usage_file": str(BENCH_VAR / "usage.jsonl")}
    raw["access_log"] = {"file": False}
    # set only when on: a checkout without them runs the bench as it was
    pacing = {k: v for k, v in (("max_prefill_tokens", opts.prefill_tokens),
                                ("hold_ms", opts.scaled_ms(opts.hold_ms))) if v}
    raw["edge"] = {"listen": f"127.0.0.1:{edge_port}", "status_listen":
                   f"127.0.0.1:{status_port}", "count_timeout_ms": 3000,
                   "admission": {"metrics_interval_ms": opts.scaled_ms(100), "priorities": {
                       "low": {"kv_cache_threshold": opts.low_kv_threshold,
                               "max_waiting": opts.max_waiting,
                               "max_running": opts.max_running, "vllm_priority": 1,
                               **pacing},
                       "normal": {}}}}
    (BENCH_VAR / "worker.key").write_text(WORKER_SECRET + "\n")
    raw["batch"] = {"enabled": True, "listen": f"127.0.0.1:{batch_port}",
                    "edge_url": f"http://127.0.0.1:{edge_port}",
                    "worker_sha256": digest(WORKER_SECRET),
                    "worker_secret_file": str(BENCH_VAR / "worker.key"),
                    "files_dir": str(BENCH_VAR / "files"), "max_in_flight": 2 * opts.slots
                    * opts.replicas}
    raw.pop("tracing", None)
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def batch_file(opts: Options) -> bytes:
    """``opts.lines`` chat lines, prompts of about ``prompt_tokens`` tokens, distinct."""
    words = ("alpha", "river", "stone", "cloud", "forest", "lantern", "copper", "meadow")
    rows = []
    for i in range(opts.lines):
        text = " ".join(words[(i + j) % len(words)] for j in range(opts.prompt_tokens - 20))
        rows.append({"custom_id": f"line-{i}", "method": "POST",
                     "url": "/v1/chat/completions",
                     "body": {"model": MODEL, "max_tokens": opts.line_output_tokens,
                              "messages": [{"role": "user", "content": f"{i}: {text}"}]}})
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


def interactive(opts: Options, edge_port: int, model: tg_config.ModelConfig,
                name: str) -> RunResult:
    spec = RunSpec(url=f"http://127.0.0.1:{edge_port}/v1", model=MODEL,
                   model_dir=Path(model.dir), max_model_len=4096,
                   arrival=ArrivalSpec("poisson", rate=opts.interactive_rps(model)),
                   duration_s=opts.arrivals_s(),
                   profile=f"normal:mean={opts.prompt_tokens},sd=0",
                   output=OutputPolicy(fixed=opts.output_tokens),
                   stream=StreamOptions(stream=True), keys=(INTERACTIVE_KEY,), seed=opts.seed,
                   max_lag_ms=50.0, timeout_s=120 * opts.time_scale, connections=128, name=name)
    return execute(spec, progress=False)


def figures(run: RunResult, seats: list[Seat], window: tuple[float, float],
            replicas: int, slots: int) -> dict[str, Any]:
    """What one interactive run gave over ``window`` (offsets of its schedule, s): the
    TTFT of the requests scheduled in it (ms, from the scheduled send: p50, p99), the
    engine's TTFT p99 (``engine_ttft``) and the fleet's busy share (``busy_share``);
    and the whole run's request counts."""
    r, s = run.records, run.summary
    wall = wall_start(run)
    at = (wall + window[0], wall + window[1])
    n, engine_p99 = engine_ttft(seats, "interactive", at)
    inside = (r.sched >= window[0]) & (r.sched <= window[1])
    ttft = report.Dist.of(np.where((r.status == 200) & (r.error == 0) & inside,
                                   r.first - r.sched, np.nan))
    return {"ok": s.all.ok, "requests": s.requests, "status_counts": dict(s.status_counts),
            "window_requests": ttft.n, "ttft_p50_ms": ttft.p50, "ttft_p99_ms": ttft.p99,
            "engine_ttft_p99_ms": engine_p99, "engine_requests": n,
            "engine_queued_p99_ms": engine_queued(seats, "interactive", at),
            "busy_share": busy_share(seats, at, replicas, slots)}


def wall_start(run: RunResult) -> float:
    """The wall-clock time (s) of ``run``'s start (its schedule's offset 0)."""
    return time.time() - time.monotonic() + run.start


class BatchWatch:
    """Polls a batch until it ends (4 times a second): when it ended (``ended_at``,
    monotonic s) and its last state."""

    def __init__(self, client: openai.OpenAI, batch_id: str) -> None:
        self.client, self.batch_id = client, batch_id
        self.ended_at: float | None = None
        self.state: Any = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            self.state = self.client.batches.retrieve(self.batch_id)
            if self.state.status in ("completed", "failed", "expired", "cancelled"):
                self.ended_at = time.monotonic()
                return
            time.sleep(0.25)


def run_bench(opts: Options, console: Console) -> dict[str, Any]:
    BENCH_VAR.mkdir(parents=True, exist_ok=True)
    model = tg_config.load(devstack.ROOT / "tokengate.yaml").models[MODEL]
    for i in range(opts.replicas):
        records_file(i).unlink(missing_ok=True)
    reps = [opts.replica(model, i) for i in range(opts.replicas)]
    edge_port, status_port = free_port(), free_port()
    batch_port, redis_port = free_port(), free_port()
    cfg = write_config(BENCH_VAR / "tokengate.yaml", [r.address for r in reps], opts,
                       edge_port, status_port, batch_port, redis_port)
    sock = BENCH_VAR / "counter.sock"
    services = [r.service for r in reps] + [
        devstack.redis_service(port=redis_port, name="bench-batch-redis"),
        devstack.counter_service(cfg, port=free_port(), unix_socket=sock,
                                 name="bench-batch-counter", metrics_listen="none"),
        devstack.nginx_service(cfg, port=edge_port, counter_socket=sock,
                               name="bench-batch-edge", prefix=BENCH_VAR / "edge"),
        devstack.batch_service(cfg, name="bench-batch-service")]
    out: dict[str, Any] = {"options": asdict(opts),
                           "interactive_rps": opts.interactive_rps(model),
                           "batch_max_running": opts.max_running}
    urls = [f"http://{r.address}" for r in reps]
    console.print(f"{opts.replicas} simulated {opts.gpu.upper()} replicas of "
                  f"{opts.model_config}, {opts.slots} seats each; interactive "
                  f"{opts.interactive_rps(model):.1f} requests/s (~"
                  f"{opts.interactive_share:.0%} of the seats), {opts.arrivals_s():.0f} s; a "
                  f"batch of {opts.lines} lines on up to {opts.max_running} seats a replica; "
                  f"vLLM's {opts.scheduling_policy} policy"
                  + (f" with the plugin's spare rules (chunks of {opts.spare_chunk})"
                     if opts.spare_chunk else "")
                  + (f", prefill lane {opts.prefill_tokens}" if opts.prefill_tokens else "")
                  + f"; time scale {opts.time_scale:g} (every step {opts.time_scale:g}x an "
                    f"{opts.gpu.upper()}'s; latencies and rates on that clock)")
    with console.status("starting the replicas, Redis, the counter, the edge and "
                        "tokengate-batch ..."):
        routing.start_all(services)
    try:
        for u in urls:
            routing.warm_up(u, model)
        console.print("interactive alone ...")
        alone = interactive(opts, edge_port, model, "alone")
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{edge_port}/v1",
                               api_key=TENANT_KEY, max_retries=2)
        f = client.files.create(file=("bench.jsonl", batch_file(opts)), purpose="batch")
        console.print("interactive with the batch ...")
        t0 = time.monotonic()
        b = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                  completion_window="24h")
        watch = BatchWatch(client, b.id)
        both = interactive(opts, edge_port, model, "with batch")
        console.print("  waiting for the batch ...")
        watch.thread.join()
        st, t1 = watch.state, watch.ended_at or time.monotonic()
        seats = Seat.read(opts.replicas)
        lines = [s for s in seats if s.key_id == "tenant"]
        span = (wall_start(both) + t0 - both.start, max(s.end for s in lines))
        # the batch's steady window, in offsets of the interactive schedule
        at = steady_window(seats, "tenant", opts.replicas, opts.max_running)
        window = (max(0.0, at[0] - wall_start(both)),
                  min(at[1] - wall_start(both), opts.arrivals_s()))
        out["window_s"] = list(window)
        out["alone"] = figures(alone, seats, window, opts.replicas, opts.slots)
        out["with_batch"] = figures(both, seats, window, opts.replicas, opts.slots)
        out["with_batch"]["busy_share_whole_batch"] = busy_share(seats, span, opts.replicas,
                                                                 opts.slots)
        elapsed = t1 - t0
        n = st.request_counts
        with urllib.request.urlopen(f"http://127.0.0.1:{status_port}/tokengate/status",
                                    timeout=5) as resp:
            edge = json.loads(resp.read())
        # lines held for a seat or a prefill lane, and refused after all (both runs)
        out["edge"] = {k: edge.get(k) for k in ("admission_held", "admission_shed")}
        out["batch"] = {"status": st.status, "completion_s": elapsed,
                        "completed": n.completed if n else 0, "failed": n.failed if n else 0,
                        "lines_per_s": (n.completed if n else 0) / elapsed}
        console.print(f"  batch {st.status} in {elapsed:.1f} s")
    finally:
        for svc in reversed(services):
            svc.stop()
    out["aims"] = aims(out)
    return out


def aims(out: dict[str, Any]) -> list[dict[str, Any]]:
    """The aims: the clients' TTFT p99 with the batch over without (the aim), the same
    for the engine's TTFT (the replicas' part: what carries over to GPUs, where the
    edge does not share cores with the replicas and the load generator), the busy
    share, the batch's completion."""
    def ratio(field: str) -> float | None:
        a, w = out["alone"][field], out["with_batch"][field]
        return w / a if a and w else None

    rows = [("interactive TTFT p99, with batch / alone", ratio("ttft_p99_ms"), "<=", 1.1),
            ("(engine TTFT p99, with batch / alone)", ratio("engine_ttft_p99_ms"), "<=",
             1.1),
            ("fleet busy share with the batch", out["with_batch"]["busy_share"], ">=", 0.90),
            ("batch completed", 1.0 if out["batch"]["status"] == "completed" else 0.0,
             ">=", 1.0)]
    return results.judge(rows)


def render(out: dict[str, Any]) -> list[Table]:
    w = out["window_s"]
    t = Table(title=f"interactive traffic in the batch's steady window ({w[0]:.1f} to "
                    f"{w[1]:.1f} s of the schedule)")
    for c in ("run", "requests", "in window", "TTFT p50 ms", "TTFT p99 ms",
              "engine TTFT p99 ms", "engine queued p99 ms", "busy share"):
        t.add_column(c, justify="left" if c == "run" else "right")
    for name in ("alone", "with_batch"):
        v = out[name]
        t.add_row(name, str(v["requests"]), str(v["window_requests"]),
                  f"{v['ttft_p50_ms'] or 0:.0f}",
                  f"{v['ttft_p99_ms'] or 0:.0f}", f"{v['engine_ttft_p99_ms'] or 0:.1f}",
                  f"{v['engine_queued_p99_ms'] or 0:.1f}", f"{v['busy_share']:.3f}")
    b = out["batch"]
    t.add_row("batch", f"{b['completed'] + b['failed']}", str(b["completed"]),
              f"{b['completion_s']:.1f} s", f"{b['lines_per_s']:.1f} lines/s", "", "",
              f"{out['with_batch']['busy_share_whole_batch']:.3f} whole")
    return [t, results.aims_table(out["aims"])]


def main(argv: list[str] | None = None) -> None:
    d = Options()
    p = argparse.ArgumentParser(prog="make bench-batch", description=__doc__.split("\n")[0])
    p.add_argument("--replicas", type=int, default=d.replicas)
    p.add_argument("--slots", type=int, default=d.slots,
                   help="--max-num-seqs of each replica (default: %(default)s)")
    p.add_argument("--gpu", choices=tuple(GPUS), default=d.gpu)
    p.add_argument("--model-config", default=d.model_config,
                   help="the replicas' model shape (default: %(default)s)")
    p.add_argument("--batch-seats", type=float, default=d.batch_seats,
                   help="share of a replica's seats the batch may fill up to "
                        "(default: %(default)s)")
    p.add_argument("--lines", type=int, default=d.lines)
    p.add_argument("--line-output-tokens", type=int, default=d.line_output_tokens,
                   help="max_tokens of each batch line (default: %(default)s)")
    p.add_argument("--duration-s", type=float, default=d.duration_s)
    p.add_argument("--interactive-share", type=float, default=d.interactive_share)
    p.add_argument("--low-kv-threshold", type=float, default=d.low_kv_threshold)
    p.add_argument("--prefill-tokens", type=int, default=d.prefill_tokens or 0,
                   help="max_prefill_tokens of the batch's priority; 0: no bound "
                        "(default: %(default)s)")
    p.add_argument("--hold-ms", type=int, default=d.hold_ms,
                   help="hold_ms of the batch's priority (default: %(default)s)")
    p.add_argument("--max-waiting", type=int, default=d.max_waiting,
                   help="max_waiting of the batch's priority (default: %(default)s)")
    p.add_argument("--scheduling-policy", choices=("fcfs", "priority"),
                   default=d.scheduling_policy,
                   help="the replicas' vLLM --scheduling-policy (and the model's "
                        "scheduling_policy): priority sends the batch's lines at "
                        "vllm_priority 1, behind the interactive requests' 0 "
                        "(default: %(default)s)")
    p.add_argument("--spare-chunk", type=int, default=d.spare_chunk, metavar="TOKENS",
                   help="with --scheduling-policy priority: the replicas run the rules of "
                        "tokengate's vLLM plugin scheduler for the lines, prefill chunks "
                        "of TOKENS (32: its default); 0: vLLM's policy alone "
                        "(default: %(default)s)")
    p.add_argument("--time-scale", type=float, default=d.time_scale, metavar="K",
                   help="every simulated step K times an H100's, arrivals K times sparser "
                        "for K times --duration-s, the edge's holds and polls K times "
                        "longer (default: %(default)s)")
    args = p.parse_args(argv)
    if args.time_scale < 1:
        p.error("--time-scale must be at least 1")
    opts = Options(replicas=args.replicas, slots=args.slots, gpu=args.gpu,
                   model_config=args.model_config, batch_seats=args.batch_seats,
                   lines=args.lines, line_output_tokens=args.line_output_tokens,
                   duration_s=args.duration_s, interactive_share=args.interactive_share,
                   low_kv_threshold=args.low_kv_threshold,
                   prefill_tokens=args.prefill_tokens or None, hold_ms=args.hold_ms,
                   max_waiting=args.max_waiting, scheduling_policy=args.scheduling_policy,
                   spare_chunk=args.spare_chunk, time_scale=args.time_scale)
    console = Console()
    out = run_bench(opts, console)
    for t in render(out):
        console.print(t)
    console.print(f"results: {results.write(out, 'batch')}")


if __name__ == "__main__":
    main()

"""``make bench-batch``: a batch on spare capacity beside steady interactive traffic.

The fleet is ``--replicas`` simulated vLLM replicas (``tokenstorm sim-replica``: a real
scheduler with ``--max-num-seqs`` slots and a KV cache sized so that the slots fill it,
a serial prefill queue, a decode clock), behind a real edge, counter, Redis and
tokengate-batch. Interactive traffic is one open-loop TokenStorm run (Poisson arrivals
at ``--interactive-share`` of the fleet's slots, streaming) of a ``normal`` key; the
batch's lines go through the edge at ``batch.priority`` ``low`` (admitted only below
``--low-kv-threshold`` of a replica's KV cache and with no request waiting).

Two runs of the same interactive schedule: alone, then with a batch of ``--lines``
chat lines created when the interactive run starts. Measured: the interactive TTFT p99
(ms, from the scheduled send), the fleet's busy share over the interactive run (the
mean over replicas and 4 samples a second of vllm:num_requests_running /
max_num_seqs), the batch's completion time (creation to ``completed``, s) and its
lines per second. Aims, each printed with met / not met: TTFT p99 with the batch at
most 1.1x without; busy share with the batch at least 0.90. Results:
``bench/results/batch-<time>.json`` and ``batch-latest.json``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import threading
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Self

import openai
import yaml
from rich.console import Console
from rich.table import Table
from tokengate import config as tg_config
from tokenstorm.arrivals import ArrivalSpec
from tokenstorm.process import free_port
from tokenstorm.profiles import OutputPolicy
from tokenstorm.prompts import StreamOptions
from tokenstorm.runner import RunSpec, execute
from tokenstorm.upstream.sim import SimReplica, SimSettings

from tokengate_dev import devstack
from tokengate_dev.bench import results

BENCH_VAR = devstack.VAR / "bench-batch"
MODEL = "tiny-qwen3"
INTERACTIVE_KEY = "tg-bench-batch-interactive"
TENANT_KEY = "tg-bench-batch-tenant"
WORKER_SECRET = "tg-bench-batch-worker"
_RUNNING = re.compile(r"^vllm:num_requests_running\{[^}]*\} ([0-9.e+]+)$", re.MULTILINE)


@dataclass(frozen=True)
class Options:
    replicas: int = 2
    slots: int = 24                 # --max-num-seqs of each replica
    itl_ms: float = 15.0
    prompt_tokens: int = 200
    output_tokens: int = 48
    interactive_share: float = 0.35  # of the fleet's slots, on average
    duration_s: float = 60.0
    lines: int = 2000
    low_kv_threshold: float = 0.8
    seed: int = 11

    @property
    def request_s(self) -> float:
        """How long one request holds a slot: its decode (s)."""
        return self.output_tokens * self.itl_ms / 1000

    @property
    def interactive_rps(self) -> float:
        return self.interactive_share * self.replicas * self.slots / self.request_s

    def sim(self, model: tg_config.ModelConfig) -> SimSettings:
        per_request = -(-(self.prompt_tokens + 40 + self.output_tokens) // 16)
        return SimSettings(model=MODEL, model_dir=Path(model.dir), max_model_len=4096,
                           num_gpu_blocks=max(self.slots * per_request + 1, 4096 // 16 + 2),
                           max_num_seqs=self.slots, itl_ms=self.itl_ms,
                           prefill_tokens_per_s=50_000.0, tokenizer="counter")


def write_config(path: Path, upstreams: list[str], opts: Options, edge_port: int,
                 batch_port: int, redis_port: int) -> Path:
    """tokengate.yaml of the bench: the model on the simulated replicas, the interactive
    key (normal) and the batch's tenant, batch enabled with the bench's secret, the low
    priority refused above ``low_kv_threshold`` of the KV cache or with any request
    waiting."""
    raw = yaml.safe_load((devstack.ROOT / "tokengate.yaml").read_text())
    for m in raw["models"].values():
        m["dir"] = str((devstack.ROOT / m["dir"]).resolve())
    m = raw["models"][MODEL]
    m.update(upstreams=upstreams, embedded=False, max_model_len=4096)
    m["routing"] = {"policy": "least_outstanding"}
    digest = lambda k: hashlib.sha256(k.encode()).hexdigest()
    raw["keys"] = {"interactive": {"sha256": digest(INTERACTIVE_KEY), "rpm": 10**9,
                                   "tpm": 10**12},
                   "tenant": {"sha256": digest(TENANT_KEY), "rpm": 10**9, "tpm": 10**12}}
    raw["redis"] = {"url": f"redis://127.0.0.1:{redis_port}/0"}
    raw["ledger"] = {"usage_file": str(BENCH_VAR / "usage.jsonl")}
    raw["access_log"] = {"file": False}
    raw["edge"] = {"listen": f"127.0.0.1:{edge_port}", "status_listen":
                   f"127.0.0.1:{free_port()}", "count_timeout_ms": 3000,
                   "admission": {"metrics_interval_ms": 100, "priorities": {
                       "low": {"kv_cache_threshold": opts.low_kv_threshold, "max_waiting": 0},
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


class BusySampler:
    """vllm:num_requests_running / slots of every replica, 4 times a second."""

    def __init__(self, urls: list[str], slots: int) -> None:
        self.urls, self.slots = urls, slots
        self.samples: list[float] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.wait(0.25):
            for u in self.urls:
                with urllib.request.urlopen(f"{u}/metrics", timeout=2) as r:
                    text = r.read().decode()
                m = _RUNNING.search(text)
                self.samples.append(min(1.0, float(m.group(1)) / self.slots) if m else 0.0)

    def __enter__(self) -> Self:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()

    def share(self) -> float:
        return sum(self.samples) / len(self.samples) if self.samples else 0.0


def batch_file(opts: Options) -> bytes:
    """``opts.lines`` chat lines, prompts of about ``prompt_tokens`` tokens, distinct."""
    words = ("alpha", "river", "stone", "cloud", "forest", "lantern", "copper", "meadow")
    rows = []
    for i in range(opts.lines):
        text = " ".join(words[(i + j) % len(words)] for j in range(opts.prompt_tokens - 20))
        rows.append({"custom_id": f"line-{i}", "method": "POST",
                     "url": "/v1/chat/completions",
                     "body": {"model": MODEL, "max_tokens": opts.output_tokens,
                              "messages": [{"role": "user", "content": f"{i}: {text}"}]}})
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


def interactive(opts: Options, edge_port: int, model: tg_config.ModelConfig,
                name: str) -> dict[str, Any]:
    spec = RunSpec(url=f"http://127.0.0.1:{edge_port}/v1", model=MODEL,
                   model_dir=Path(model.dir), max_model_len=4096,
                   arrival=ArrivalSpec("poisson", rate=opts.interactive_rps),
                   duration_s=opts.duration_s,
                   profile=f"normal:mean={opts.prompt_tokens},sd=0",
                   output=OutputPolicy(fixed=opts.output_tokens),
                   stream=StreamOptions(stream=True), keys=(INTERACTIVE_KEY,), seed=opts.seed,
                   max_lag_ms=50.0, timeout_s=120, connections=128, name=name)
    s = execute(spec, progress=False).summary
    return {"ok": s.all.ok, "requests": s.requests, "ttft_p50_ms": s.all.ttft_ms.p50,
            "ttft_p99_ms": s.all.ttft_ms.p99, "status_counts": dict(s.status_counts)}


def run_bench(opts: Options, console: Console) -> dict[str, Any]:
    BENCH_VAR.mkdir(parents=True, exist_ok=True)
    model = tg_config.load(devstack.ROOT / "tokengate.yaml").models[MODEL]
    reps = [SimReplica(opts.sim(model), name=f"bench-batch-sim{i}", state_dir=BENCH_VAR)
            for i in range(opts.replicas)]
    edge_port, batch_port, redis_port = free_port(), free_port(), free_port()
    cfg = write_config(BENCH_VAR / "tokengate.yaml", [r.address for r in reps], opts,
                       edge_port, batch_port, redis_port)
    sock = BENCH_VAR / "counter.sock"
    services = [devstack.redis_service(port=redis_port, name="bench-batch-redis"),
                devstack.counter_service(cfg, port=free_port(), unix_socket=sock,
                                         name="bench-batch-counter", metrics_listen="none"),
                devstack.nginx_service(cfg, port=edge_port, counter_socket=sock,
                                       name="bench-batch-edge", prefix=BENCH_VAR / "edge"),
                devstack.batch_service(cfg, name="bench-batch-service")]
    out: dict[str, Any] = {"options": asdict(opts),
                           "interactive_rps": opts.interactive_rps}
    urls = [f"http://{r.address}" for r in reps]
    console.print(f"{opts.replicas} simulated replicas of {opts.slots} slots; interactive "
                  f"{opts.interactive_rps:.1f} requests/s (~{opts.interactive_share:.0%} of "
                  f"the slots), {opts.duration_s:.0f} s; a batch of {opts.lines} lines")
    for r in reps:
        r.start()
    try:
        for svc in services:
            svc.start()
        console.print("interactive alone ...")
        with BusySampler(urls, opts.slots) as busy:
            alone = interactive(opts, edge_port, model, "alone")
        alone["busy_share"] = busy.share()
        console.print(f"  TTFT p99 {alone['ttft_p99_ms'] or 0:.0f} ms, busy share "
                      f"{alone['busy_share']:.2f}")
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{edge_port}/v1",
                               api_key=TENANT_KEY, max_retries=2)
        f = client.files.create(file=("bench.jsonl", batch_file(opts)), purpose="batch")
        console.print("interactive with the batch ...")
        t0 = time.monotonic()
        b = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                  completion_window="24h")
        with BusySampler(urls, opts.slots) as busy:
            both = interactive(opts, edge_port, model, "with batch")
        both["busy_share"] = busy.share()
        console.print(f"  TTFT p99 {both['ttft_p99_ms'] or 0:.0f} ms, busy share "
                      f"{both['busy_share']:.2f}; waiting for the batch ...")
        while True:
            st = client.batches.retrieve(b.id)
            if st.status in ("completed", "failed", "expired", "cancelled"):
                break
            time.sleep(0.5)
        elapsed = time.monotonic() - t0
        n = st.request_counts
        out["batch"] = {"status": st.status, "completion_s": elapsed,
                        "completed": n.completed if n else 0, "failed": n.failed if n else 0,
                        "lines_per_s": (n.completed if n else 0) / elapsed}
        console.print(f"  batch {st.status} in {elapsed:.1f} s")
    finally:
        for svc in reversed(services):
            svc.stop()
        for r in reps:
            r.stop()
    out["alone"], out["with_batch"] = alone, both
    out["aims"] = aims(out)
    return out


def aims(out: dict[str, Any]) -> list[dict[str, Any]]:
    a, w = out["alone"]["ttft_p99_ms"], out["with_batch"]["ttft_p99_ms"]
    ratio = w / a if a and w else None
    rows = [("interactive TTFT p99, with batch / alone", ratio, "<=", 1.1),
            ("fleet busy share with the batch", out["with_batch"]["busy_share"], ">=", 0.90),
            ("batch completed", 1.0 if out["batch"]["status"] == "completed" else 0.0,
             ">=", 1.0)]
    return results.judge(rows)


def render(out: dict[str, Any]) -> list[Table]:
    t = Table(title="interactive traffic")
    for c in ("run", "requests", "answered", "TTFT p50 ms", "TTFT p99 ms", "busy share"):
        t.add_column(c, justify="left" if c == "run" else "right")
    for name in ("alone", "with_batch"):
        v = out[name]
        t.add_row(name, str(v["requests"]), str(v["ok"]), f"{v['ttft_p50_ms'] or 0:.0f}",
                  f"{v['ttft_p99_ms'] or 0:.0f}", f"{v['busy_share']:.3f}")
    b = out["batch"]
    t.add_row("batch", f"{b['completed'] + b['failed']}", str(b["completed"]),
              f"{b['completion_s']:.1f} s", f"{b['lines_per_s']:.1f} lines/s", b["status"])
    return [t, results.aims_table(out["aims"])]


def main(argv: list[str] | None = None) -> None:
    d = Options()
    p = argparse.ArgumentParser(prog="make bench-batch", description=__doc__.split("\n")[0])
    p.add_argument("--replicas", type=int, default=d.replicas)
    p.add_argument("--slots", type=int, default=d.slots)
    p.add_argument("--lines", type=int, default=d.lines)
    p.add_argument("--duration-s", type=float, default=d.duration_s)
    p.add_argument("--interactive-share", type=float, default=d.interactive_share)
    p.add_argument("--low-kv-threshold", type=float, default=d.low_kv_threshold)
    args = p.parse_args(argv)
    opts = Options(replicas=args.replicas, slots=args.slots, lines=args.lines,
                   duration_s=args.duration_s, interactive_share=args.interactive_share,
                   low_kv_threshold=args.low_kv_threshold)
    console = Console()
    out = run_bench(opts, console)
    for t in render(out):
        console.print(t)
    console.print(f"results: {results.write(out, 'batch')}")


if __name__ == "__main__":
    main()

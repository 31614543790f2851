"""The workload and the figures of ``dev/gpu_check.sh``: one run against one vLLM server
with the tokengate plugin, then a side-by-side of two runs (FCFS, token-weighted).

From the checkout, in the vLLM environment (``PYTHONPATH=dev``: nothing to install)::

    python -m tokengate_dev.bench.gpu_check run --url http://127.0.0.1:8000 \\
        --model tiny-qwen3 --usage-file engine.jsonl --duration 50 --label fcfs \\
        --out fcfs.json
    python -m tokengate_dev.bench.gpu_check compare fcfs.json weighted.json
    python -m tokengate_dev.bench.gpu_check sleep --url http://127.0.0.1:8000 \\
        --model tiny-qwen3 --out sleep.json

``run`` sends a seeded open-loop workload (Poisson arrivals plus a burst every 10 s):
short streaming chats, long ones (prompts of 1500-3000 tokens), streams whose client
leaves after a few chunks, non-streaming ``n = 2`` chats and non-streaming clients
that time out. Each request carries an ``X-Request-Id`` as the edge sends it. After
the last answer it waits for the engine records of every request and reports:

- TTFT p50/p99 of completed short and long streams (client side, ms);
- the engine side, as ``tokengate_dev.bench.scheduler_figures`` defines it (``make bench-scheduler``
  reports the same): the longest engine queue wait (the records' ``queued_ms``), output
  tokens/s (the records' generated tokens over the run's wall time), vLLM's own batch
  figures from ``/metrics`` (mean ``vllm:num_requests_running``, sampled every 0.5 s while
  requests are in flight, and tokens per engine iteration, ``vllm:iteration_tokens_total``
  sum / count over the run);
- the reconciliation: one record per engine request sent (``n = 2``: two), Σ
  ``num_generation_tokens`` = growth of ``vllm:generation_tokens_total``, Σ
  ``num_prompt_tokens`` of prefilled records = growth of ``vllm:prompt_tokens_total``;
  exit status 1 when any of these fails.

``sleep`` checks what the edge's idle unload calls on a server started with
``--enable-sleep-mode`` and ``VLLM_SERVER_DEV_MODE=1``: a request, ``POST /sleep?level=1``
(then ``GET /is_sleeping`` must say true), ``POST /wake_up`` (then false), and a request
after waking that must generate exactly its ``max_tokens`` (``ignore_eos``); it reports
how long sleeping and waking took and the GPU memory in use (``nvidia-smi``) awake,
asleep and woken; exit status 1 when a check fails.

Standard library only (with ``scheduler_figures`` beside it; the packages above it hold
only docstrings): it runs in any vLLM environment.
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import subprocess
import sys
import time
import urllib.parse
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tokengate_dev.bench.scheduler_figures import (
    RUNNING,
    WAITING,
    EngineFigures,
    GaugeSampler,
    engine_figures,
    metrics,
    percentile,
    record_key,
    settled_metrics,
    wait_for_records,
)

CLASSES = ("short", "long", "leave", "n2", "timeout")
WEIGHTS = (0.62, 0.18, 0.08, 0.07, 0.05)


@dataclass
class Sent:
    """One request of the workload and what its client saw (times: monotonic s)."""

    request_id: str
    kind: str
    n: int
    arrival: float
    ttft: float | None = None       # first content token, s after arrival
    end: float | None = None
    completion_tokens: int | None = None  # the last usage the client saw
    error: str | None = None


@dataclass
class Figures(EngineFigures):
    """What one run measured (see the module docstring): the engine side plus what the
    clients saw."""

    label: str = ""
    duration_s: float = 0.0
    requests: dict[str, int] = field(default_factory=dict)
    ttft_ms: dict[str, dict[str, float | None]] = field(default_factory=dict)
    errors: int = 0
    error_kinds: dict[str, int] = field(default_factory=dict)


def _words(rng: random.Random, n: int) -> str:
    return " ".join(f"w{rng.randrange(5000)}" for _ in range(n))


def send(base: str, model: str, s: Sent, body: dict[str, Any], leave_after: int | None,
         timeout_s: float) -> None:
    """One chat request over HTTP/1.1; fills ``s``. A client that leaves closes the
    connection, which is how vLLM learns it (and aborts the request)."""
    u = urllib.parse.urlsplit(base)
    conn = http.client.HTTPConnection(u.hostname or "localhost", u.port, timeout=timeout_s)
    try:
        conn.request("POST", "/v1/chat/completions", json.dumps({"model": model, **body}),
                     {"Content-Type": "application/json", "X-Request-Id": s.request_id})
        resp = conn.getresponse()
        if resp.status != 200:
            s.error = f"HTTP {resp.status}"
            resp.read()
            return
        if not body.get("stream"):
            out = json.loads(resp.read())
            s.completion_tokens = out["usage"]["completion_tokens"]
            return
        chunks = 0
        for raw in resp:
            line = raw.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            ev = json.loads(line[6:])
            if ev.get("usage"):
                s.completion_tokens = ev["usage"]["completion_tokens"]
            if any(c.get("delta", {}).get("content") for c in ev.get("choices", [])):
                chunks += 1
                if s.ttft is None:
                    s.ttft = time.monotonic() - s.arrival
                if leave_after is not None and chunks >= leave_after:
                    return  # finally closes the socket mid-stream
    except TimeoutError:
        s.error = None if s.kind == "timeout" else "timeout"
    except (OSError, http.client.HTTPException, ValueError) as e:
        s.error = type(e).__name__
    finally:
        s.end = time.monotonic()
        conn.close()


def _call(base: str, method: str, path: str, body: dict[str, Any] | None = None,
          timeout_s: float = 600) -> tuple[int, Any]:
    """(status, decoded JSON answer) of one request to the server."""
    u = urllib.parse.urlsplit(base)
    conn = http.client.HTTPConnection(u.hostname or "localhost", u.port, timeout=timeout_s)
    try:
        conn.request(method, path, json.dumps(body) if body is not None else None,
                     {"Content-Type": "application/json"})
        resp = conn.getresponse()
        raw = resp.read()
        return resp.status, json.loads(raw) if raw else None
    finally:
        conn.close()


def gpu_memory_mib() -> int | None:
    """MiB of GPU memory in use on the first GPU (nvidia-smi), None without one."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used",
                              "--format=csv,noheader,nounits"], capture_output=True,
                             text=True, timeout=30, check=True).stdout
        return int(out.split()[0])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


def sleep_check(base: str, model: str, max_tokens: int = 16) -> dict[str, Any]:
    """The sleep-mode round trip (module docstring); returns the figures, with ``ok``."""
    chat = {"model": model, "messages": [{"role": "user", "content": "Hello!"}],
            "max_tokens": max_tokens, "ignore_eos": True}
    fig: dict[str, Any] = {"checks": {}}
    checks = fig["checks"]
    status, out = _call(base, "POST", "/v1/chat/completions", chat)
    checks["request before sleeping"] = status == 200
    fig["memory_awake_mib"] = gpu_memory_mib()
    t0 = time.monotonic()
    status, out = _call(base, "POST", "/sleep?level=1")
    fig["sleep_s"] = round(time.monotonic() - t0, 3)
    checks["POST /sleep?level=1 answers sleeping"] = \
        (status, out) == (200, {"status": "sleeping", "level": 1})
    checks["GET /is_sleeping is true"] = \
        _call(base, "GET", "/is_sleeping") == (200, {"is_sleeping": True})
    fig["memory_asleep_mib"] = gpu_memory_mib()
    t0 = time.monotonic()
    status, out = _call(base, "POST", "/wake_up")
    fig["wake_s"] = round(time.monotonic() - t0, 3)
    checks["POST /wake_up answers awake"] = status == 200 and out["status"] == "awake"
    checks["GET /is_sleeping is false"] = \
        _call(base, "GET", "/is_sleeping") == (200, {"is_sleeping": False})
    fig["memory_woken_mib"] = gpu_memory_mib()
    status, out = _call(base, "POST", "/v1/chat/completions", chat)
    fig["usage_after_wake"] = out.get("usage") if status == 200 else None
    checks[f"request after waking generates {max_tokens} tokens"] = \
        status == 200 and out["usage"]["completion_tokens"] == max_tokens
    fig["ok"] = all(checks.values())
    return fig


def workload(rng: random.Random, duration_s: float, rate: float, burst: int
             ) -> list[tuple[float, str]]:
    """(start offset s, class) of every request: Poisson arrivals at ``rate`` per
    second, plus ``burst`` requests at once every 10 s."""
    out: list[tuple[float, str]] = []
    t = 0.0
    while True:
        t += rng.expovariate(rate)
        if t >= duration_s:
            break
        out.append((t, rng.choices(CLASSES, WEIGHTS)[0]))
    for b in range(1, int(duration_s // 10) + 1):
        out += [(b * 10.0 - 5.0, rng.choices(CLASSES, WEIGHTS)[0]) for _ in range(burst)]
    return sorted(out)


def body_for(rng: random.Random, kind: str) -> tuple[dict[str, Any], int | None, float, int]:
    """(request body, chunks after which the client leaves, client timeout s, n)."""
    stream = {"stream": True, "stream_options": {"include_usage": True,
                                                 "continuous_usage_stats": True}}
    if kind == "short":
        return ({"messages": [{"role": "user", "content": _words(rng, rng.randint(10, 80))}],
                 "max_tokens": rng.randint(8, 48), "ignore_eos": True, **stream}, None, 300, 1)
    if kind == "long":
        return ({"messages": [{"role": "user",
                               "content": _words(rng, rng.randint(300, 600))}],
                 "max_tokens": rng.randint(200, 400), "ignore_eos": True, **stream},
                None, 300, 1)
    if kind == "leave":
        return ({"messages": [{"role": "user", "content": _words(rng, 50)}],
                 "max_tokens": 1000, "ignore_eos": True, **stream}, rng.randint(1, 12), 300, 1)
    if kind == "n2":
        return ({"messages": [{"role": "user", "content": _words(rng, 30)}], "n": 2,
                 "max_tokens": rng.randint(8, 32), "ignore_eos": True}, None, 300, 2)
    return ({"messages": [{"role": "user", "content": _words(rng, 40)}],
             "max_tokens": 4000, "ignore_eos": True}, None, 0.5, 1)


def run(base: str, model: str, usage_file: Path, duration_s: float, rate: float, burst: int,
        seed: int, label: str, progress: Callable[[str], None] = print) -> Figures:
    """Send the workload, wait for its engine records, measure (module docstring)."""
    rng = random.Random(seed)
    plan = workload(rng, duration_s, rate, burst)
    offset = usage_file.stat().st_size if usage_file.exists() else 0
    before = metrics(base)
    sent: list[Sent] = []
    progress(f"{label}: {len(plan)} requests over {duration_s:.0f} s")
    sampler = GaugeSampler(base, (RUNNING, WAITING))
    with sampler:
        t0 = time.monotonic()
        with ThreadPoolExecutor(256) as pool:
            futs = []
            for at, kind in plan:
                delay = t0 + at - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
                body, leave_after, timeout_s, n = body_for(rng, kind)
                s = Sent(uuid.uuid4().hex, kind, n, time.monotonic())
                sent.append(s)
                futs.append(pool.submit(send, base, model, s, body, leave_after, timeout_s))
            for f in futs:
                f.result()
        wall = time.monotonic() - t0
    keys = {f"chatcmpl-{s.request_id}#{i}" for s in sent if s.error is None for i in range(s.n)}
    recs = wait_for_records(usage_file, offset,
                            lambda rs: keys <= {record_key(r) for r in rs})
    after = settled_metrics(base)
    return summarize(label, wall, sent, recs, keys, before, after, sampler.samples[RUNNING],
                     sampler.samples[WAITING])


def summarize(label: str, wall_s: float, sent: list[Sent], recs: list[dict[str, Any]],
              keys: set[str], before: dict[str, float], after: dict[str, float],
              running: list[float], waiting: list[float] | None = None) -> Figures:
    """The figures of one run from what was sent, the engine records written after the
    run began (only those of ``keys`` count), ``/metrics`` before and after and the
    ``vllm:num_requests_running`` and ``_waiting`` samples."""
    e = engine_figures(recs, wall_s, before, after,
                       {RUNNING: running, WAITING: waiting or []}, keys=keys)
    f = Figures(label=label, duration_s=round(wall_s, 1), **vars(e))
    for kind in CLASSES:
        f.requests[kind] = sum(1 for s in sent if s.kind == kind)
    for kind in ("short", "long"):
        ttfts = [s.ttft * 1000 for s in sent if s.kind == kind and s.ttft is not None
                 and s.error is None]
        f.ttft_ms[kind] = {"p50": percentile(ttfts, 50), "p99": percentile(ttfts, 99)}
    f.errors = sum(1 for s in sent if s.error is not None)
    for s in sent:
        if s.error is not None:
            f.error_kinds[f"{s.kind}: {s.error}"] = f.error_kinds.get(f"{s.kind}: {s.error}",
                                                                      0) + 1
    return f


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.1f}"
    return str(v)


def compare(runs: list[dict[str, Any]]) -> str:
    """A side-by-side table of run figures (``Figures`` as JSON)."""
    rows: list[tuple[str, list[Any]]] = [
        ("requests", [sum(r["requests"].values()) for r in runs]),
        ("TTFT short p50 ms", [r["ttft_ms"]["short"]["p50"] for r in runs]),
        ("TTFT short p99 ms", [r["ttft_ms"]["short"]["p99"] for r in runs]),
        ("TTFT long p50 ms", [r["ttft_ms"]["long"]["p50"] for r in runs]),
        ("TTFT long p99 ms", [r["ttft_ms"]["long"]["p99"] for r in runs]),
        ("longest queue wait ms", [r["max_queued_ms"] for r in runs]),
        ("output tokens/s", [r["output_tokens_per_s"] for r in runs]),
        ("mean running requests", [r["mean_running"] for r in runs]),
        ("tokens per iteration", [r["tokens_per_iteration"] for r in runs]),
        ("records / expected", [f"{r['records']}/{r['records_expected']}" for r in runs]),
        ("generated: records / counter",
         [f"{r['generation_tokens']}/{r['generation_counter']:.0f}" for r in runs]),
        ("prompt: records / counter",
         [f"{r['prompt_tokens']}/{r['prompt_counter']:.0f}" for r in runs]),
        ("reconciled", ["yes" if r["reconciled"] else "NO" for r in runs]),
        ("client errors", [r["errors"] for r in runs]),
    ]
    width = max(len(name) for name, _ in rows)
    head = " " * width + "".join(f"{r['label']:>18}" for r in runs)
    return "\n".join([head] + [f"{name:<{width}}" + "".join(f"{_fmt(v):>18}" for v in vals)
                               for name, vals in rows])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="one run against one server; figures as JSON")
    r.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:8000")
    r.add_argument("--model", required=True, help="served model name")
    r.add_argument("--usage-file", type=Path, required=True,
                   help="the server's TOKENGATE_ENGINE_USAGE_FILE")
    r.add_argument("--duration", type=float, default=50.0, help="seconds of arrivals")
    r.add_argument("--rate", type=float, default=8.0, help="Poisson arrivals per second")
    r.add_argument("--burst", type=int, default=40, help="requests at once every 10 s")
    r.add_argument("--seed", type=int, default=0, help="workload seed (same for every run)")
    r.add_argument("--label", default="run", help="name of the run in the table")
    r.add_argument("--out", type=Path, required=True, help="figures JSON to write")
    c = sub.add_parser("compare", help="side-by-side table of runs")
    c.add_argument("runs", type=Path, nargs="+", help="figures JSON files")
    s = sub.add_parser("sleep", help="sleep mode: sleep, wake, then a request")
    s.add_argument("--url", required=True, help="server base URL, started with "
                   "--enable-sleep-mode and VLLM_SERVER_DEV_MODE=1")
    s.add_argument("--model", required=True, help="served model name")
    s.add_argument("--out", type=Path, required=True, help="figures JSON to write")
    a = p.parse_args(argv)
    if a.cmd == "sleep":
        fig = sleep_check(a.url, a.model)
        a.out.write_text(json.dumps(fig, indent=2))
        for name, ok in fig["checks"].items():
            print(f"sleep mode: {'ok ' if ok else 'FAILED'} {name}")
        print(f"sleep mode: sleep {fig['sleep_s']} s, wake {fig['wake_s']} s; GPU memory "
              f"awake {fig['memory_awake_mib']} MiB, asleep {fig['memory_asleep_mib']} MiB, "
              f"woken {fig['memory_woken_mib']} MiB")
        return 0 if fig["ok"] else 1
    if a.cmd == "compare":
        runs = [json.loads(x.read_text()) for x in a.runs]
        print(compare(runs))
        return 0 if all(x["reconciled"] for x in runs) else 1
    f = run(a.url, a.model, a.usage_file, a.duration, a.rate, a.burst, a.seed, a.label,
            progress=lambda m: print(m, flush=True))
    a.out.write_text(json.dumps({**asdict(f), "reconciled": f.reconciled}, indent=2))
    print(compare([{**asdict(f), "reconciled": f.reconciled}]))
    return 0 if f.reconciled else 1


if __name__ == "__main__":
    sys.exit(main())

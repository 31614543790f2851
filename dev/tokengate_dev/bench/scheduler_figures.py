"""What a scheduler comparison measures on the engine side, from vLLM's ``/metrics`` and
the engine usage records: the figures ``gpu_check`` (the GPU check, ``dev/gpu_check.sh``)
and ``make bench-scheduler`` (``scheduler``, the CPU bench) both report.

- the longest engine queue wait: the records' ``queued_ms`` (queued to first scheduled);
  the mean one from vLLM's ``vllm:request_queue_time_seconds`` histogram;
- output tokens/s: Σ ``num_generation_tokens`` of the run's records over its wall time;
- vLLM's batch figures: mean ``vllm:num_requests_running`` and
  ``vllm:num_requests_waiting`` (gauges sampled while the run's requests are in flight),
  tokens per engine iteration (``vllm:iteration_tokens_total`` histogram: sum / count
  over the run; vLLM observes prompt tokens computed + tokens generated per engine
  output batch, vllm/v1/metrics/loggers.py);
- the reconciliation: one record per engine request, Σ ``num_generation_tokens`` = the
  growth of ``vllm:generation_tokens_total``, Σ ``num_prompt_tokens`` of prefilled records
  = the growth of ``vllm:prompt_tokens_total`` (``record`` gives why).

Standard library only: ``gpu_check`` runs in any vLLM environment straight from the
checkout (``PYTHONPATH=dev``), where no tokengate package but the plugin is installed.
"""

from __future__ import annotations

import http.client
import json
import statistics
import threading
import time
import urllib.parse
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
GENERATION = "vllm:generation_tokens_total"
PROMPT = "vllm:prompt_tokens_total"
ITERATION = "vllm:iteration_tokens_total"
QUEUE_TIME = "vllm:request_queue_time_seconds"


def percentile(values: list[float], p: float) -> float | None:
    """The p-th percentile (0..100, nearest rank) of ``values``; None when empty."""
    if not values:
        return None
    s = sorted(values)
    k = max(0, min(len(s) - 1, int(-(-p * len(s) // 100)) - 1))
    return s[k]


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text: every ``vllm:*`` sample summed over its label sets (engines,
    models, finish reasons), keyed by the sample name (``..._sum``, ``..._count``)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("vllm:") and " " in line:
            name, _, value = line.rpartition(" ")
            key = name.split("{", 1)[0]
            out[key] = out.get(key, 0.0) + float(value)
    return out


def metrics(base: str, timeout_s: float = 10.0) -> dict[str, float]:
    """vLLM's ``/metrics`` at ``base`` (``http://host:port``, a ``/v1`` suffix is
    ignored), as ``parse_metrics`` gives it. Raises ``OSError`` when unreachable."""
    u = urllib.parse.urlsplit(base)
    conn = http.client.HTTPConnection(u.hostname or "127.0.0.1", u.port, timeout=timeout_s)
    try:
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
    finally:
        conn.close()
    return parse_metrics(text)


def delta(before: Mapping[str, float], after: Mapping[str, float], name: str) -> float:
    """How much the sample ``name`` grew between two ``metrics`` snapshots."""
    return after.get(name, 0.0) - before.get(name, 0.0)


def read_records(path: Path, offset: int = 0) -> list[dict[str, Any]]:
    """Engine records in the complete lines after byte ``offset`` of ``path`` (a line
    being written is not read)."""
    if not path.exists():
        return []
    data = path.read_bytes()[offset:]
    return [json.loads(x) for x in data[: data.rfind(b"\n") + 1].splitlines() if x.strip()]


def record_key(record: Mapping[str, Any]) -> str:
    """``<request_id>#<index>``: one engine request (a child of ``n > 1`` has its own)."""
    return f"{record['request_id']}#{record['index']}"


def wait_for_records(path: Path, offset: int, done: Callable[[list[dict[str, Any]]], bool],
                     timeout_s: float = 120.0) -> list[dict[str, Any]]:
    """The records after ``offset`` once ``done(records)`` holds, or those there are
    after ``timeout_s`` (the caller sees what is missing)."""
    deadline = time.monotonic() + timeout_s
    while True:
        recs = read_records(path, offset)
        if done(recs) or time.monotonic() > deadline:
            return recs
        time.sleep(0.2)


def settled_metrics(base: str, interval_s: float = 0.5) -> dict[str, float]:
    """``metrics`` once two snapshots ``interval_s`` apart are equal: the counters move
    in the engine loop iteration that finishes a request, which may come after the
    client saw its last byte."""
    prev = metrics(base)
    while True:
        time.sleep(interval_s)
        now = metrics(base)
        if now == prev:
            return now
        prev = now


class GaugeSampler:
    """Samples vLLM gauges (``names``) every ``interval_s`` in a thread while a ``with
    sampler:`` block runs; ``samples[name]`` holds the values. A failed scrape is skipped
    (the server is busy, not gone: the run itself reports errors)."""

    def __init__(self, base: str, names: Iterable[str] = (RUNNING, WAITING),
                 interval_s: float = 0.5) -> None:
        self.base = base
        self.interval_s = interval_s
        self.samples: dict[str, list[float]] = {n: [] for n in names}
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self._done.wait(self.interval_s):
            try:
                m = metrics(self.base)
            except (OSError, http.client.HTTPException, ValueError):
                continue
            for name, values in self.samples.items():
                values.append(m.get(name, 0.0))

    def __enter__(self) -> None:
        self._thread.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._done.set()
        self._thread.join(5)


@dataclass
class EngineFigures:
    """The engine side of one run (module docstring). Times in ms; None where nothing
    was observed."""

    max_queued_ms: float | None = None
    mean_queue_ms: float | None = None
    output_tokens_per_s: float = 0.0
    mean_running: float | None = None
    mean_waiting: float | None = None
    tokens_per_iteration: float | None = None
    records: int = 0
    records_expected: int = 0
    missing: list[str] = field(default_factory=list)
    generation_tokens: int = 0
    generation_counter: float = 0.0
    prompt_tokens: int = 0
    prompt_counter: float = 0.0

    @property
    def reconciled(self) -> bool:
        return (not self.missing and self.records == self.records_expected
                and self.generation_tokens == self.generation_counter
                and self.prompt_tokens == self.prompt_counter)


def _mean(values: list[float] | None) -> float | None:
    return round(statistics.fmean(values), 2) if values else None


def engine_figures(records: list[dict[str, Any]], wall_s: float,
                   before: Mapping[str, float], after: Mapping[str, float],
                   gauges: Mapping[str, list[float]], *,
                   keys: Collection[str] | None = None,
                   expected: int | None = None) -> EngineFigures:
    """The figures of one run from its engine records, ``/metrics`` before and after it
    (``settled_metrics``), its wall time (s) and the gauge samples taken during it.

    ``keys`` (``record_key`` values): only those records count, and those without one
    are ``missing`` (a server other clients use too); without ``keys`` every record
    counts and ``expected`` (default: as many as there are) is how many there should be.
    """
    if keys is not None:
        wanted = set(keys)
        mine = [r for r in records if record_key(r) in wanted]
        missing = sorted(wanted - {record_key(r) for r in mine})[:20]
        n_expected = len(wanted)
    else:
        mine, missing = list(records), []
        n_expected = len(records) if expected is None else expected
    f = EngineFigures(records=len(mine), records_expected=n_expected, missing=missing)
    queued = [r["queued_ms"] for r in mine if r["queued_ms"] is not None]
    f.max_queued_ms = max(queued) if queued else None
    n_queue = delta(before, after, QUEUE_TIME + "_count")
    if n_queue:
        f.mean_queue_ms = round(delta(before, after, QUEUE_TIME + "_sum") / n_queue * 1000, 1)
    f.generation_tokens = sum(r["num_generation_tokens"] for r in mine)
    f.prompt_tokens = sum(r["num_prompt_tokens"] for r in mine if r["prefilled"])
    f.output_tokens_per_s = round(f.generation_tokens / wall_s, 1) if wall_s else 0.0
    f.generation_counter = delta(before, after, GENERATION)
    f.prompt_counter = delta(before, after, PROMPT)
    f.mean_running = _mean(gauges.get(RUNNING))
    f.mean_waiting = _mean(gauges.get(WAITING))
    n_iter = delta(before, after, ITERATION + "_count")
    if n_iter:
        f.tokens_per_iteration = round(delta(before, after, ITERATION + "_sum") / n_iter, 2)
    return f

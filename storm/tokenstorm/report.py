"""Measures of one TokenStorm run: from per-request records to a summary, a table,
a JSON file and PNG plots.

Definitions (times in ms, measured from each request's **scheduled** send time in
open-loop runs, from the actual send in closed-loop runs):

- **TTFT**: first token event minus scheduled send. Non-streaming: the whole
  answer is the first token, so TTFT = E2E.
- **ITL**: gaps between consecutive token events of a stream, all streams pooled
  (as ``vllm/benchmarks/serve.py``: one sample per event gap).
- **TPOT**: per request ``(e2e - ttft) / (completion_tokens - 1)`` for requests with
  more than one output token (vLLM's benchmark definition).
- **E2E**: end of the response minus scheduled send.
- **Throughput**: successful requests, output tokens and prompt + output tokens per
  second of the run's span (first scheduled send to last response end).
- **Cached-token ratio**: prompt tokens the server served from its prefix cache
  (``usage.prompt_tokens_details.cached_tokens``: vLLM counts whole KV blocks, with
  ``--enable-prompt-tokens-details``) over all prompt tokens, of successful requests.
- **Goodput**: successful requests/s that meet every SLO given (TTFT, TPOT, E2E),
  the metric of DistServe (Zhong et al., OSDI 2024) as in vLLM's ``--goodput``.
- **429s**: split by the limit that refused (requests or tokens); *rejected tokens*
  are the prompt + planned output of refused requests, *admitted tokens* the
  reported prompt + completion tokens of served ones.
- **Send lag**: when the generator dispatched the request (wrote it on a keep-alive
  connection, or began connecting for it: a slow connect is the server's latency)
  minus its scheduled time (ms). An open-loop run is **invalid**
  when more than 1 % of requests left more than ``max_lag_ms`` late: the generator
  fell behind its own schedule and the offered load was not the one asked for.
- **Prompt token check**: each request's expected prompt tokens against the
  server's ``usage.prompt_tokens`` (and the gateway's ``X-Token-Count`` response
  header when present); any mismatch marks the run invalid.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tokenstorm.client import ERROR_NAMES, L_REQUESTS, L_TOKENS, L_UNKNOWN

LATE_FRACTION = 0.01


@dataclass(frozen=True)
class SLO:
    """Service-level objectives for goodput (ms); None: not applied."""

    ttft_ms: float | None = 1000.0
    tpot_ms: float | None = 100.0
    e2e_ms: float | None = None

    @classmethod
    def parse(cls, text: str) -> SLO:
        """``ttft=500,tpot=50,e2e=10000`` (ms); keys left out are not applied."""
        vals: dict[str, float | None] = {"ttft_ms": None, "tpot_ms": None, "e2e_ms": None}
        for item in filter(None, text.split(",")):
            k, eq, v = item.partition("=")
            key = f"{k.strip()}_ms"
            if not eq or key not in vals:
                raise ValueError(f"SLO item {item!r}: expected ttft=MS, tpot=MS or e2e=MS")
            vals[key] = float(v)
        return cls(**vals)


@dataclass
class Records:
    """All requests of a run as numpy columns (one row per request, seconds)."""

    sched: np.ndarray
    sent: np.ndarray
    first: np.ndarray
    end: np.ndarray
    status: np.ndarray
    prompt: np.ndarray
    completion: np.ndarray
    header_count: np.ndarray
    chunks: np.ndarray
    error: np.ndarray
    limit: np.ndarray
    retry_after: np.ndarray
    expected_prompt: np.ndarray
    planned_output: np.ndarray
    key: np.ndarray
    burst: np.ndarray
    itl: np.ndarray
    # prompt tokens served from the prefix cache (-1: no usage); none given: all -1
    cached: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int64))
    # 1: sent on a connection opened before it (idle or pre-opened); none given: all 0
    reused: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int8))
    # the answer's X-Request-Id ("" without one), object array; none given: all ""
    request_id: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=object))

    def __post_init__(self) -> None:
        n = self.sched.shape[0]
        if self.cached.size == 0 and n:
            self.cached = np.full(n, -1, dtype=np.int64)
        if self.reused.size == 0 and n:
            self.reused = np.zeros(n, dtype=np.int8)
        if self.request_id.size == 0 and n:
            self.request_id = np.full(n, "", dtype=object)

    def __len__(self) -> int:
        return int(self.sched.shape[0])

    def subset(self, mask: np.ndarray) -> Records:
        cols = {k: (v if k == "itl" else v[mask]) for k, v in vars(self).items()}
        return Records(**cols)


@dataclass
class Dist:
    """Distribution of one latency (ms)."""

    n: int
    mean: float | None
    p50: float | None
    p90: float | None
    p99: float | None
    max: float | None

    @classmethod
    def of(cls, values_s: np.ndarray) -> Dist:
        v = values_s[np.isfinite(values_s)] * 1000.0
        if v.size == 0:
            return cls(0, None, None, None, None, None)
        p50, p90, p99 = np.percentile(v, [50, 90, 99])
        return cls(int(v.size), float(v.mean()), float(p50), float(p90), float(p99),
                   float(v.max()))


@dataclass
class Limits429:
    """429 responses by the limit that refused, and tokens refused vs admitted."""

    total: int = 0
    requests: int = 0
    tokens: int = 0
    unknown: int = 0
    rejected_tokens: int = 0
    rejected_tokens_by_requests_limit: int = 0
    rejected_tokens_by_tokens_limit: int = 0
    admitted_tokens: int = 0
    retry_after_s: Dist | None = None


@dataclass
class Window:
    """Figures for one slice of a run (all, steady windows, burst windows)."""

    requests: int
    ok: int
    span_s: float
    rps: float
    output_tokens_per_s: float
    total_tokens_per_s: float
    goodput_rps: float | None
    cached_tokens: int
    cached_token_ratio: float | None
    ttft_ms: Dist
    tpot_ms: Dist
    itl_ms: Dist
    e2e_ms: Dist
    limits: Limits429


@dataclass
class Summary:
    """Everything a run reports; ``to_json`` writes it as is."""

    name: str
    target: str
    mode: str
    offered: str
    stream: bool
    workers: int
    duration_s: float
    requests: int
    status_counts: dict[str, int]
    errors: dict[str, int]
    all: Window
    windows: dict[str, Window]
    send_lag_ms: Dist
    late_fraction: float
    max_lag_ms: float
    prompt_check: dict[str, Any]
    keys: dict[str, dict[str, int]]
    valid: bool
    invalid_reasons: list[str]
    slo: SLO
    meta: dict[str, Any] = field(default_factory=dict)
    error_samples: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return _clean(asdict(self))


def _clean(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {k: _clean(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_clean(x) for x in v]
    return v


def _window(r: Records, slo: SLO, itl: np.ndarray, span_s: float | None = None) -> Window:
    n = len(r)
    ok = (r.status == 200) & (r.error == 0)
    span = float(np.nanmax(r.end) - np.nanmin(r.sched)) if n else 0.0
    if span_s is not None:
        span = span_s
    span = span if span > 0 else float("nan")
    ttft = np.where(ok, r.first - r.sched, np.nan)
    e2e = np.where(ok, r.end - r.sched, np.nan)
    comp = r.completion.astype(np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        tpot = np.where(ok & (comp > 1) & (r.chunks > 0), (r.end - r.first) / (comp - 1),
                        np.nan)
    out_tokens = int(np.clip(r.completion[ok], 0, None).sum())
    in_tokens = int(np.clip(r.prompt[ok], 0, None).sum())
    cached = int(np.clip(r.cached[ok], 0, None).sum())
    good: float | None = None
    if slo.ttft_ms is not None or slo.tpot_ms is not None or slo.e2e_ms is not None:
        meets = ok.copy()
        if slo.ttft_ms is not None:
            meets &= np.nan_to_num(ttft, nan=np.inf) * 1000 <= slo.ttft_ms
        if slo.tpot_ms is not None:
            meets &= ~(np.nan_to_num(tpot, nan=0.0) * 1000 > slo.tpot_ms)
        if slo.e2e_ms is not None:
            meets &= np.nan_to_num(e2e, nan=np.inf) * 1000 <= slo.e2e_ms
        good = float(meets.sum()) / span if math.isfinite(span) else None
    lim = Limits429()
    rej = r.status == 429
    lim.total = int(rej.sum())
    lim.requests = int((rej & (r.limit == L_REQUESTS)).sum())
    lim.tokens = int((rej & (r.limit == L_TOKENS)).sum())
    lim.unknown = int((rej & (r.limit == L_UNKNOWN)).sum())
    planned = r.expected_prompt + r.planned_output
    lim.rejected_tokens = int(planned[rej].sum())
    lim.rejected_tokens_by_requests_limit = int(planned[rej & (r.limit == L_REQUESTS)].sum())
    lim.rejected_tokens_by_tokens_limit = int(planned[rej & (r.limit == L_TOKENS)].sum())
    lim.admitted_tokens = in_tokens + out_tokens
    if lim.total:
        lim.retry_after_s = Dist.of(r.retry_after[rej] / 1000.0)
    return Window(
        requests=n, ok=int(ok.sum()), span_s=span,
        rps=float(ok.sum()) / span if math.isfinite(span) else 0.0,
        output_tokens_per_s=out_tokens / span if math.isfinite(span) else 0.0,
        total_tokens_per_s=(in_tokens + out_tokens) / span if math.isfinite(span) else 0.0,
        goodput_rps=good, cached_tokens=cached,
        cached_token_ratio=cached / in_tokens if in_tokens else None,
        ttft_ms=Dist.of(ttft), tpot_ms=Dist.of(tpot), itl_ms=Dist.of(itl),
        e2e_ms=Dist.of(e2e), limits=lim)


def summarize(r: Records, *, name: str, target: str, mode: str, offered: str, stream: bool,
              workers: int, duration_s: float, slo: SLO, max_lag_ms: float,
              open_loop: bool, key_names: list[str], check_prompt: bool,
              meta: dict[str, Any] | None = None,
              error_samples: list[str] | None = None,
              burst_seconds: float | None = None) -> Summary:
    """The run's ``Summary``; see the module docstring for every definition.

    ``burst_seconds``: how much of the run's span lies in burst windows (s); the burst
    and steady windows' rates are per second of their own time.
    """
    statuses: dict[str, int] = {}
    for s, c in zip(*np.unique(r.status[r.error == 0], return_counts=True)):
        statuses[str(int(s))] = int(c)
    errors: dict[str, int] = {}
    for e, c in zip(*np.unique(r.error[r.error != 0], return_counts=True)):
        errors[ERROR_NAMES[int(e)]] = int(c)
    windows: dict[str, Window] = {}
    if r.burst.any():
        span = float(np.nanmax(r.end) - np.nanmin(r.sched))
        bs = burst_seconds if burst_seconds is not None else None
        windows["steady"] = _window(r.subset(~r.burst), slo, np.empty(0),
                                    None if bs is None else max(span - bs, 1e-9))
        windows["burst"] = _window(r.subset(r.burst), slo, np.empty(0), bs)
    lag = r.sent - r.sched
    sent = np.isfinite(lag)
    late = float((lag[sent] * 1000 > max_lag_ms).mean()) if sent.any() else 0.0
    reasons: list[str] = []
    lag_dist = Dist.of(lag)
    if open_loop and late > LATE_FRACTION:
        reasons.append(f"generator fell behind its schedule: {100 * late:.1f}% of requests "
                       f"left more than {max_lag_ms:g} ms late (p99 send lag "
                       f"{lag_dist.p99:.1f} ms)")
    ok = (r.status == 200) & (r.error == 0)
    reported = ok & (r.prompt >= 0)
    mism = reported & (r.prompt != r.expected_prompt)
    hdr = r.header_count >= 0
    hdr_mism = hdr & (r.header_count != r.expected_prompt)
    prompt_check: dict[str, Any] = {"checked": int(reported.sum()), "mismatches": int(mism.sum()),
                    "header_checked": int(hdr.sum()), "header_mismatches": int(hdr_mism.sum()),
                    "enabled": check_prompt}
    if mism.any():
        i = int(np.argmax(mism))
        prompt_check["example"] = {"expected": int(r.expected_prompt[i]),
                                   "reported": int(r.prompt[i])}
    if check_prompt and (mism.any() or hdr_mism.any()):
        reasons.append(f"prompt tokens differ from the planned count on "
                       f"{int(mism.sum()) + int(hdr_mism.sum())} responses")
    keys: dict[str, dict[str, int]] = {}
    if len(key_names) > 1:
        for k, kname in enumerate(key_names):
            sel = r.key == k
            keys[kname] = {"requests": int(sel.sum()), "ok": int((sel & ok).sum()),
                           "429": int((sel & (r.status == 429)).sum())}
    return Summary(
        name=name, target=target, mode=mode, offered=offered, stream=stream, workers=workers,
        duration_s=duration_s, requests=len(r), status_counts=statuses, errors=errors,
        all=_window(r, slo, r.itl), windows=windows, send_lag_ms=lag_dist,
        late_fraction=late, max_lag_ms=max_lag_ms, prompt_check=prompt_check, keys=keys,
        valid=not reasons, invalid_reasons=reasons, slo=slo, meta=meta or {},
        error_samples=error_samples or [])


# -- output ------------------------------------------------------------------------------

def _f(v: float | None, digits: int = 1) -> str:
    return "-" if v is None or not math.isfinite(v) else f"{v:,.{digits}f}"


def render(s: Summary) -> Any:
    """A rich renderable: the final table of a run."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    head = Text.assemble(
        (f"{s.name}", "bold"), f"  {s.mode}, {s.offered}, {'stream' if s.stream else 'no stream'}"
        f", {s.workers} worker(s) → {s.target}\n",
        ("VALID" if s.valid else "INVALID: " + "; ".join(s.invalid_reasons),
         "green" if s.valid else "bold red"))
    t = Table(show_header=True, header_style="bold", box=None, pad_edge=False)
    t.add_column("latency (ms)")
    for c in ("n", "mean", "p50", "p90", "p99", "max"):
        t.add_column(c, justify="right")
    rows = [("TTFT", s.all.ttft_ms), ("ITL", s.all.itl_ms), ("TPOT", s.all.tpot_ms),
            ("E2E", s.all.e2e_ms), ("send lag", s.send_lag_ms)]
    for label, d in rows:
        t.add_row(label, str(d.n), _f(d.mean, 2), _f(d.p50, 2), _f(d.p90, 2), _f(d.p99, 2),
                  _f(d.max, 2))
    w = s.all
    lim = w.limits
    th = Table(show_header=False, box=None, pad_edge=False)
    th.add_column()
    th.add_column(justify="right")
    th.add_row("requests sent / ok", f"{s.requests:,} / {w.ok:,}")
    th.add_row("throughput (req/s)", _f(w.rps))
    th.add_row("output tokens/s", _f(w.output_tokens_per_s, 0))
    th.add_row("total tokens/s", _f(w.total_tokens_per_s, 0))
    if w.cached_tokens:
        th.add_row("cached-token ratio (prefix cache)", _f(w.cached_token_ratio, 3))
    slo_txt = ", ".join(f"{k[:-3]}≤{v:g}" for k, v in asdict(s.slo).items() if v is not None)
    th.add_row(f"goodput req/s ({slo_txt or 'no SLO'})", _f(w.goodput_rps))
    th.add_row("status counts", " ".join(f"{k}:{v:,}" for k, v in s.status_counts.items())
               or "-")
    if s.errors:
        th.add_row("errors", " ".join(f"{k}:{v:,}" for k, v in s.errors.items()))
    if lim.total:
        th.add_row("429 requests / tokens / ?", f"{lim.requests:,} / {lim.tokens:,} / "
                   f"{lim.unknown:,}")
        th.add_row("tokens rejected / admitted", f"{lim.rejected_tokens:,} / "
                   f"{lim.admitted_tokens:,}")
    pc = s.prompt_check
    th.add_row("prompt tokens checked / mismatched",
               f"{pc['checked']:,} / {pc['mismatches']:,}"
               + (f" (header {pc['header_checked']:,} / {pc['header_mismatches']:,})"
                  if pc["header_checked"] else ""))
    parts: list[Any] = [head, t, th]
    if s.windows:
        tw = Table(show_header=True, header_style="bold", box=None, pad_edge=False)
        for c in ("window", "requests", "ok", "req/s", "out tok/s", "TTFT p50", "TTFT p99",
                  "E2E p99", "429"):
            tw.add_column(c, justify="right")
        for name, win in s.windows.items():
            tw.add_row(name, f"{win.requests:,}", f"{win.ok:,}", _f(win.rps),
                       _f(win.output_tokens_per_s, 0), _f(win.ttft_ms.p50), _f(win.ttft_ms.p99),
                       _f(win.e2e_ms.p99), f"{win.limits.total:,}")
        parts.append(tw)
    if s.keys:
        tk = Table(show_header=True, header_style="bold", box=None, pad_edge=False)
        for c in ("key", "requests", "ok", "429"):
            tk.add_column(c, justify="right")
        for name, kv in s.keys.items():
            tk.add_row(name, f"{kv['requests']:,}", f"{kv['ok']:,}", f"{kv['429']:,}")
        parts.append(tk)
    return Group(*parts)


def write_json(s: Summary, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(s.to_json(), indent=2) + "\n")


def plot(r: Records, s: Summary, out_dir: Path, stem: str) -> list[Path]:
    """PNG plots: latency CDFs (TTFT, ITL, TPOT, E2E) and tokens/s, requests/s and 429s
    per second over the run. Returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    ok = (r.status == 200) & (r.error == 0)
    files = []
    fig, ax = plt.subplots(figsize=(7, 4.5))
    comp = r.completion.astype(np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        series = {"TTFT": (r.first - r.sched)[ok], "E2E": (r.end - r.sched)[ok],
                  "TPOT": ((r.end - r.first) / (comp - 1))[ok & (comp > 1) & (r.chunks > 0)],
                  "ITL": r.itl}
    for label, v in series.items():
        v = np.sort(v[np.isfinite(v)]) * 1000
        if v.size:
            ax.plot(v, np.arange(1, v.size + 1) / v.size, label=label)
    ax.set_xscale("log")
    ax.set_xlabel("ms (from the scheduled send)")
    ax.set_ylabel("fraction of requests (ITL: of gaps)")
    ax.set_title(f"{s.name}: latency CDFs")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    p = out_dir / f"{stem}-latency.png"
    fig.tight_layout()
    fig.savefig(p, dpi=110)
    plt.close(fig)
    files.append(p)

    end = r.end[np.isfinite(r.end)]
    if end.size:
        bins = np.arange(0, math.ceil(float(end.max())) + 1, 1.0)
        if bins.size < 2:
            bins = np.array([0.0, 1.0])
        tok, _ = np.histogram(r.end[ok], bins, weights=np.clip(r.completion[ok], 0, None))
        tot, _ = np.histogram(r.end[ok], bins,
                              weights=np.clip(r.completion[ok], 0, None)
                              + np.clip(r.prompt[ok], 0, None))
        rej, _ = np.histogram(r.end[r.status == 429], bins)
        done, _ = np.histogram(r.end[ok], bins)
        fig, (a1, a2) = plt.subplots(2, 1, figsize=(7, 5.5), sharex=True)
        if r.burst.any():  # shade the seconds whose requests were due in a burst window
            for sec in np.unique(np.floor(r.sched[r.burst])):
                for ax in (a1, a2):
                    ax.axvspan(sec, sec + 1, color="tab:orange", alpha=0.12, lw=0)
        a1.step(bins[:-1], tok, where="post", label="output tokens/s")
        a1.step(bins[:-1], tot, where="post", label="total tokens/s")
        a1.set_ylabel("tokens/s")
        a1.legend()
        a1.grid(True, alpha=0.3)
        a2.step(bins[:-1], done, where="post", label="ok req/s")
        a2.step(bins[:-1], rej, where="post", label="429/s", color="tab:red")
        a2.set_ylabel("per s")
        a2.set_xlabel("s from start")
        a2.legend()
        a2.grid(True, alpha=0.3)
        a1.set_title(f"{s.name}: throughput over time")
        p = out_dir / f"{stem}-throughput.png"
        fig.tight_layout()
        fig.savefig(p, dpi=110)
        plt.close(fig)
        files.append(p)
    return files

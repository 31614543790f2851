"""The usage and Live pages' charts, drawn on the server by matplotlib (its Agg backend, no
display, nothing fetched) as SVG and handed to the page as ``data:`` URLs, which the
console's content security policy allows for images (``img-src 'self' data:``): no
script runs in the browser and nothing comes from outside the host.

Each chart takes the ledger's rows (``tokengate.ledger.report.UsageRow``: per day) or the
usage events' buckets (``tokengate.console.traffic.Bucket``: per minute or hour) and
returns the data URL, or None when there is nothing to draw.
"""

from __future__ import annotations

import base64
import io
import threading
from collections.abc import Sequence
from typing import Any

from tokengate.console.traffic import Bucket
from tokengate.ledger import report

TOP_KEYS = 10
# pyplot keeps global state: one figure is drawn at a time in a process
_drawing = threading.Lock()

COLORS = {"prompt": "#4c78a8", "cached": "#9ecae9", "completion": "#f58518",
          "answered": "#54a24b", "refused": "#e45756"}


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    matplotlib.rcParams.update({
        "svg.fonttype": "none",        # text stays text (small, selectable)
        "svg.hashsalt": "tokengate",   # the same rows give the same SVG
        "font.family": "sans-serif", "font.size": 9,
        "axes.spines.top": False, "axes.spines.right": False,
        "axes.edgecolor": "#888888", "axes.titlesize": 10, "axes.titleweight": "bold",
    })
    import matplotlib.pyplot as plt

    return plt


def _data_url(fig: Any) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="svg", bbox_inches="tight", metadata={"Date": None})
    return "data:image/svg+xml;base64," + base64.b64encode(buf.getvalue()).decode()


def _stacked(title: str, labels: Sequence[str], series: Sequence[tuple[str, str,
                                                                      Sequence[float]]],
             ylabel: str) -> str:
    """Stacked bars, one per label: ``series`` (legend, color, a value per label) from
    the bottom up. Each series is one collection of rectangles: a third of the time of
    matplotlib's ``bar`` (one artist per bar), which Live redraws at every refresh."""
    with _drawing:
        plt = _plt()
        from matplotlib.collections import PolyCollection
        from matplotlib.patches import Patch

        fig, ax = plt.subplots(figsize=(10, 2.4))
        try:
            x = range(len(labels))
            bottom = [0.0] * len(labels)
            handles = []
            for legend, color, values in series:
                ax.add_collection(PolyCollection(
                    [[(i - 0.4, b), (i - 0.4, b + v), (i + 0.4, b + v), (i + 0.4, b)]
                     for i, (b, v) in enumerate(zip(bottom, values, strict=True))],
                    facecolors=color, linewidths=0))
                handles.append(Patch(color=color, label=legend))
                bottom = [b + v for b, v in zip(bottom, values, strict=True)]
            ax.set_xlim(-0.6, len(labels) - 0.4)
            ax.set_ylim(0, max(bottom, default=0) * 1.05 or 1)
            step = max(1, len(labels) // 12)
            ax.set_xticks(list(x)[::step], list(labels)[::step])
            ax.set_ylabel(ylabel)
            ax.set_title(title, loc="left")
            # counts: whole ticks only (a few requests gave 0, 0, 1, 1 at 0.2 steps)
            ax.yaxis.set_major_locator(plt.MaxNLocator(integer=True))
            ax.yaxis.set_major_formatter(plt.FuncFormatter(lambda v, _: f"{v:,.0f}"))
            ax.legend(handles=handles, frameon=False, fontsize=8, ncols=len(series),
                      loc="upper left", bbox_to_anchor=(0, -0.12))
            return _data_url(fig)
        finally:
            plt.close(fig)


def _tokens(title: str, labels: Sequence[str],
            counts: Sequence[tuple[int, int, int]]) -> str:
    """Stacked tokens per label: (prompt, cached, completion) each, prompt including the
    cached ones (vLLM's usage)."""
    return _stacked(title, labels, [
        ("prompt (uncached)", COLORS["prompt"], [p - c for p, c, _ in counts]),
        ("prompt (cached)", COLORS["cached"], [c for _, c, _ in counts]),
        ("completion", COLORS["completion"], [o for _, _, o in counts])], "tokens")


def tokens_per_day(rows: Sequence[report.UsageRow], days: Sequence[str]) -> str | None:
    """Stacked bars per UTC day of ``days``: uncached prompt, cached prompt and
    completion tokens."""
    per_day = {r.day: r for r in report.group(rows, ["day"])}
    if not per_day:
        return None
    zero = report.UsageRow(None, None, None)
    return _tokens("Tokens per day (UTC)", [d[5:] for d in days],  # MM-DD
                   [(r.prompt_tokens, r.cached_tokens, r.completion_tokens)
                    for r in (per_day.get(d, zero) for d in days)])


def _clock_labels(buckets: Sequence[Bucket]) -> list[str]:
    return [b.start.strftime("%H:%M") for b in buckets]


def requests_per_step(buckets: Sequence[Bucket], step: str) -> str | None:
    """Stacked bars per bucket (``traffic.Traffic.buckets``): answered and refused
    requests; None when there were none."""
    if not any(b.counts.requests for b in buckets):
        return None
    return _stacked(f"Requests per {step} (UTC)", _clock_labels(buckets), [
        ("answered", COLORS["answered"], [b.counts.requests - b.counts.refused
                                          for b in buckets]),
        ("refused (>= 400)", COLORS["refused"], [b.counts.refused for b in buckets])],
        "requests")


def tokens_per_step(buckets: Sequence[Bucket], step: str) -> str | None:
    """Stacked bars per bucket: uncached prompt, cached prompt and completion tokens;
    None when there were none."""
    counts = [(b.counts.prompt_tokens, b.counts.cached_tokens, b.counts.completion_tokens)
              for b in buckets]
    if not any(sum(c) for c in counts):
        return None
    return _tokens(f"Tokens per {step} (UTC)", _clock_labels(buckets), counts)


def latency(buckets: Sequence[Bucket], step: str) -> str | None:
    """Lines per bucket: the median and 95th percentile of answered requests' time and
    the median time to first byte of answered streams, ms (a gap where a bucket had
    none); None when no request was answered."""
    if all(b.p50_ms is None for b in buckets):
        return None
    labels = _clock_labels(buckets)
    nan = float("nan")
    with _drawing:
        plt = _plt()
        fig, ax = plt.subplots(figsize=(10, 2.4))
        try:
            x = range(len(buckets))
            for legend, color, values in (
                    ("p95 request time", COLORS["refused"], [b.p95_ms for b in buckets]),
                    ("p50 request time", COLORS["prompt"], [b.p50_ms for b in buckets]),
                    ("p50 time to first byte", COLORS["completion"],
                     [b.ttft_p50_ms for b in buckets])):
                ax.plot(x, [nan if v is None else v for v in values], color=color,
                        label=legend, marker="." if len(buckets) <= 60 else None)
            step_n = max(1, len(labels) // 12)
            ax.set_xticks(list(x)[::step_n], labels[::step_n])
            ax.set_ylabel("ms")
            ax.set_ylim(bottom=0)
            ax.set_title(f"Latency per {step}, answered requests (UTC)", loc="left")
            ax.yaxis.set_major_formatter(plt.FuncFormatter(lambda v, _: f"{v:,.0f}"))
            ax.legend(frameon=False, fontsize=8, ncols=3, loc="upper left",
                      bbox_to_anchor=(0, -0.12))
            return _data_url(fig)
        finally:
            plt.close(fig)


def _amount(value: float) -> str:
    """An amount as the tables show it: at most 9 decimals, no trailing zeros."""
    return f"{value:.9f}".rstrip("0").rstrip(".")


def _barh(title: str, names: list[str], values: list[float], currency: str,
          color: str) -> str:
    with _drawing:
        plt = _plt()
        fig, ax = plt.subplots(figsize=(5, 1.1 + 0.3 * len(names)))
        try:
            y = range(len(names))
            ax.barh(y, values, color=color)
            ax.set_yticks(list(y), names)
            ax.invert_yaxis()
            ax.set_title(title, loc="left")
            ax.xaxis.set_major_formatter(plt.FuncFormatter(lambda v, _: _amount(v)))
            ax.xaxis.set_major_locator(plt.MaxNLocator(4))
            for i, v in enumerate(values):
                ax.annotate(_amount(v), (v, i), xytext=(4, 0), textcoords="offset points",
                            va="center", fontsize=9)
            ax.margins(x=0.25)
            return _data_url(fig)
        finally:
            plt.close(fig)


def top_keys(rows: Sequence[report.UsageRow], currency: str) -> str | None:
    """Horizontal bars: the ``TOP_KEYS`` keys that spent most."""
    per_key = sorted(report.group(rows, ["key"]), key=lambda r: (-r.cost, r.key_id or ""))
    per_key = [r for r in per_key if r.requests][:TOP_KEYS]
    if not per_key:
        return None
    return _barh(f"Top keys by spend ({currency})",
                 [r.key_id if r.key_id is not None else "(no key)" for r in per_key],
                 [r.cost for r in per_key], currency, "#54a24b")


def spend_per_model(rows: Sequence[report.UsageRow], currency: str) -> str | None:
    """Horizontal bars: the spend of each model."""
    per_model = sorted(report.group(rows, ["model"]), key=lambda r: (-r.cost, r.model or ""))
    per_model = [r for r in per_model if r.requests]
    if not per_model:
        return None
    return _barh(f"Spend per model ({currency})",
                 [r.model if r.model is not None else "(none)" for r in per_model],
                 [r.cost for r in per_model], currency, "#b279a2")

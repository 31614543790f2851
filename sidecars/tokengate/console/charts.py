"""The usage page's charts, drawn on the server by matplotlib (its Agg backend, no
display, nothing fetched) as SVG and handed to the page as ``data:`` URLs, which the
console's content security policy allows for images (``img-src 'self' data:``): no
script runs in the browser and nothing comes from outside the host.

Each chart takes the ledger's rows (``tokengate.ledger.report.UsageRow``) and returns
the data URL, or None when there is nothing to draw.
"""

from __future__ import annotations

import base64
import io
import threading
from collections.abc import Sequence
from typing import Any

from tokengate.ledger import report

TOP_KEYS = 10
# pyplot keeps global state: one figure is drawn at a time in a process
_drawing = threading.Lock()

COLORS = {"prompt": "#4c78a8", "cached": "#9ecae9", "completion": "#f58518"}


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


def tokens_per_day(rows: Sequence[report.UsageRow], days: Sequence[str]) -> str | None:
    """Stacked bars per UTC day of ``days``: uncached prompt, cached prompt and
    completion tokens."""
    per_day = {r.day: r for r in report.group(rows, ["day"])}
    if not per_day:
        return None
    prompt = [(per_day[d].prompt_tokens - per_day[d].cached_tokens) if d in per_day else 0
              for d in days]
    cached = [per_day[d].cached_tokens if d in per_day else 0 for d in days]
    completion = [per_day[d].completion_tokens if d in per_day else 0 for d in days]
    labels = [d[5:] for d in days]  # MM-DD
    with _drawing:
        plt = _plt()
        fig, ax = plt.subplots(figsize=(10, 2.4))
        try:
            x = range(len(days))
            ax.bar(x, prompt, color=COLORS["prompt"], label="prompt (uncached)")
            ax.bar(x, cached, bottom=prompt, color=COLORS["cached"], label="prompt (cached)")
            ax.bar(x, completion, bottom=[p + c for p, c in zip(prompt, cached, strict=True)],
                   color=COLORS["completion"], label="completion")
            step = max(1, len(days) // 12)
            ax.set_xticks(list(x)[::step], labels[::step])
            ax.set_ylabel("tokens")
            ax.set_title("Tokens per day (UTC)", loc="left")
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

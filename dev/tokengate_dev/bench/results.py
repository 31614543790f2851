"""Where the benchmarks' results go: one JSON file per run in ``bench/results/`` (not
committed; ``bench/README.md``), and a copy of the latest run's beside it."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from rich.table import Table
from tokenstorm import report

from tokengate_dev import devstack

RESULTS = devstack.ROOT / "bench" / "results"


def write(out: dict[str, Any], stem: str, path: Path | None = None) -> Path:
    """Write ``out`` as indented JSON (NaN and infinities as null, numpy values as
    numbers: ``tokenstorm.report._clean``) to ``path``, by default
    ``bench/results/<stem>-<local time>.json`` and then also to ``<stem>-latest.json``
    beside it; returns the file written."""
    target = path or RESULTS / f"{stem}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    target.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(report._clean(out), indent=2) + "\n"
    target.write_text(text)
    if path is None:
        (target.parent / f"{stem}-latest.json").write_text(text)
    return target


def events(path: Path) -> list[dict[str, Any]]:
    """The usage events of a usage file (one JSON object per line), lines that do not
    parse (a write cut short) skipped; [] when the file does not exist."""
    out = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
    return out


def judge(rows: list[tuple[str, float | None, str, float]]) -> list[dict[str, Any]]:
    """Aims as the results record them: each (name, value, "<=" | ">=", bound) as
    ``{aim, value, bound: "<op> <bound>", met}``; a value of None is not met."""
    return [{"aim": name, "value": v, "bound": f"{op} {bound}",
             "met": v is not None and (v <= bound if op == "<=" else v >= bound)}
            for name, v, op, bound in rows]


def aims_table(aims: list[dict[str, Any]], title: str = "aims") -> Table:
    """``judge``'s aims as a table: aim, value (3 decimals), bound, met / not met."""
    a = Table(title=title)
    for c in ("aim", "value", "bound", "met"):
        a.add_column(c)
    for row in aims:
        v = row["value"]
        a.add_row(row["aim"], f"{v:.3f}" if v is not None else "-", row["bound"],
                  "met" if row["met"] else "not met")
    return a

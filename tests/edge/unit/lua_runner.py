"""Runs every Lua spec of tests/edge/unit/lua/ in ONE nginx process and hands each case to
pytest as a test of its own.

The process is Debian's nginx with ngx_lua, ``master_process off``, prefix a temporary
folder: its ``init_by_lua_block`` loads ``lua/harness.lua``, runs the specs (the edge's
modules on ``lua_package_path``, the shared dict ``tokengate_limits`` empty before each
case),
writes one JSON result file and exits before nginx opens any socket. It runs once per
pytest process, when the first test module is collected (about 0.1 s), so each Lua case
is a parametrized pytest test; a case the spec marks ``xfail`` is a strict xfail (a fix
makes it fail until the mark goes).

The nginx run is tests/fixtures_edge.py's ``run_init_lua`` (the one ``run_lua`` uses).
"""

from __future__ import annotations

import functools
import json
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.fixtures_edge import run_init_lua

SPEC_DIR = Path(__file__).resolve().parent / "lua"

# the harness's call in run_init_lua's init_by_lua (the cases' results go to a file)
_INIT = """
        local run = dofile("{specs}/harness.lua")
        run("{specs}", {names}, "{d}/results.json", {{"tokengate_limits"}})"""


@dataclass(frozen=True)
class LuaCase:
    """One case of a spec: its result as the nginx run wrote it."""

    spec: str  # the spec's name: "json" for lua/json_spec.lua
    name: str
    passed: bool
    message: str  # why it failed ("" when it passed)
    xfail: str | None  # the reason of a case the spec marks as a known bug
    ms: float  # run time inside nginx


def _lua_list(items: list[str]) -> str:
    return "{" + ", ".join(json.dumps(s) for s in items) + "}"


def spec_names() -> list[str]:
    """Every spec of SPEC_DIR, by name ("json" for json_spec.lua), sorted."""
    return sorted(p.name.removesuffix("_spec.lua") for p in SPEC_DIR.glob("*_spec.lua"))


@functools.cache
def results() -> dict[str, list[LuaCase]]:
    """Runs nginx once over every spec; returns the cases by spec, in declaration order.
    A run that writes no result file (nginx or the harness failed) gives each spec one
    failed case "nginx run" with nginx's output."""
    names = spec_names()
    with tempfile.TemporaryDirectory(prefix="tg-lua-unit-") as d:
        try:
            r = run_init_lua(Path(d), _INIT.format(specs=SPEC_DIR, names=_lua_list(names), d=d),
                             timeout_s=60)
            output = f"nginx exited {r.returncode}:\n{r.stdout}{r.stderr}"
        except (OSError, subprocess.TimeoutExpired) as e:
            output = f"nginx did not run: {e}"
        path = Path(d, "results.json")
        raw: list[dict[str, Any]] | None = None
        if path.exists():
            raw = json.loads(path.read_bytes().decode("utf-8", "backslashreplace"))
    by_spec: dict[str, list[LuaCase]] = {n: [] for n in names}
    if raw is None:
        for n in names:
            by_spec[n].append(LuaCase(n, "nginx run", False, output, None, 0.0))
        return by_spec
    for c in raw:
        by_spec.setdefault(c["spec"], []).append(LuaCase(
            c["spec"], c["name"], c["status"] == "pass", c["message"], c["xfail"],
            float(c["ms"])))
    return by_spec


def params(spec: str) -> list[Any]:
    """The cases of lua/<spec>_spec.lua as pytest parameters (id: the case's name; a
    strict xfail mark on those the spec marks)."""
    cases = results().get(spec) or [LuaCase(spec, "exists", False,
                                            f"no spec {SPEC_DIR}/{spec}_spec.lua", None, 0.0)]
    return [pytest.param(c, id=c.name, marks=[pytest.mark.xfail(strict=True, reason=c.xfail)]
                         if c.xfail else []) for c in cases]


def check(case: LuaCase) -> None:
    """Fails the running test with the Lua case's message unless the case passed."""
    if not case.passed:
        pytest.fail(f"{case.spec}_spec.lua: {case.name}\n{case.message}", pytrace=False)

"""The import graph of the ``tokengate`` package: its groups (a subpackage, or a top-level
module) import only groups of their own layer or of a layer below, and never each other
in a cycle.

Layers, lowest first:

- base: the Redis layout, scripts and clients, the configuration, the gRPC server, the
  metrics endpoint, the generated protobuf code, vLLM's prefix-cache hash;
- services: the sidecars (counter, ledger, limits), each run as a process of its own;
- operator: the ``tokengate`` command line and what only it runs (keys, install,
  doctor, the config tools), and the operator console (``tokengate-console``, a process
  of its own), which makes key changes through the key commands' own functions.

No import is left out of the graph: a service never hosts a part of a higher layer.

Every import counts: at the top of a module, inside a function (the lazy ones that keep
a command fast), under ``TYPE_CHECKING``. ``tokengate.config`` and ``tokengate.config.*``
are one group, as every subpackage is.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

PACKAGE = Path(__file__).resolve().parents[2] / "sidecars" / "tokengate"

LAYERS: dict[str, tuple[str, ...]] = {
    "base": ("redis_keys", "redis_scripts", "redis_client", "budget_store", "grpc_server",
             "metrics", "v1", "config", "prefix_hash", "version", "entry", "http_server"),
    "services": ("counter", "ledger", "limits", "batch"),
    "operator": ("keys", "install", "doctor", "tools", "cli", "console"),
}
RANK = {group: rank for rank, groups in enumerate(LAYERS.values()) for group in groups}
LAYER = {group: layer for layer, groups in LAYERS.items() for group in groups}

# (importing group, imported group) -> "path:line" of each import
Arrows = dict[tuple[str, str], list[str]]


def _module(path: Path) -> tuple[str, ...]:
    """``sidecars/tokengate/ledger/admin.py`` -> ("tokengate", "ledger", "admin");
    a package's ``__init__.py`` is the package."""
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return parts[:-1] if parts[-1] == "__init__" else parts


def _imported(node: ast.Import | ast.ImportFrom, module: tuple[str, ...],
              is_package: bool) -> list[tuple[str, ...]]:
    """The dotted names ``node`` imports, relative ones resolved against ``module``;
    ``from tokengate import x`` imports ``tokengate.x``."""
    if isinstance(node, ast.Import):
        return [tuple(a.name.split(".")) for a in node.names]
    if node.level:
        here = module if is_package else module[:-1]
        base = here[:len(here) - node.level + 1]
    else:
        base = ()
    target = base + (tuple(node.module.split(".")) if node.module else ())
    if target == ("tokengate",):
        return [target + (a.name,) for a in node.names]
    return [target]


def _arrows() -> Arrows:
    """Every import of one group by another, anywhere in a module."""
    arrows: Arrows = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        module = _module(path)
        if len(module) < 2:
            continue  # tokengate/__init__.py: a docstring
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            for name in _imported(node, module, path.name == "__init__.py"):
                if len(name) >= 2 and name[0] == "tokengate" and name[1] != module[1]:
                    where = f"{path.relative_to(PACKAGE.parent)}:{node.lineno}"
                    arrows.setdefault((module[1], name[1]), []).append(where)
    return arrows


def _groups() -> set[str]:
    return {_module(p)[1] for p in PACKAGE.rglob("*.py") if len(_module(p)) >= 2}


def _cycle(arrows: Arrows) -> list[str] | None:
    """One cycle of the group graph (its groups in order, the first repeated at the
    end), or None."""
    after: dict[str, set[str]] = {}
    for a, b in arrows:
        after.setdefault(a, set()).add(b)
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(group: str) -> list[str] | None:
        state[group] = 1
        path.append(group)
        for nxt in sorted(after.get(group, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[group] = 2
        return None

    for group in sorted(after):
        if group not in state and (found := visit(group)):
            return found
    return None


def test_every_group_of_the_package_has_a_layer():
    assert sorted(_groups() - set(RANK)) == []


def test_the_import_graph_between_groups_has_no_cycle():
    arrows = _arrows()
    cycle = _cycle(arrows)
    sites = [f"{a} -> {b}: {', '.join(arrows[(a, b)])}"
             for a, b in zip(cycle or [], (cycle or [])[1:], strict=False)]
    assert cycle is None, sites


def test_no_group_imports_a_group_of_a_higher_layer():
    up = [f"{a} ({LAYER[a]}) -> {b} ({LAYER[b]}): {', '.join(sites)}"
          for (a, b), sites in sorted(_arrows().items())
          if a in RANK and b in RANK and RANK[b] > RANK[a]]
    assert up == []


def test_the_graph_sees_lazy_and_relative_imports():
    """The parser finds an import inside a function, and resolves ``from . import x``
    and ``from tokengate import x`` to the group imported."""
    tree = ast.parse("def f():\n    from tokengate import doctor\n"
                     "from . import frames\nfrom ..ledger import report\n")
    found = [name for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))
             for name in _imported(node, ("tokengate", "counter", "server"), False)]
    assert sorted(found) == [("tokengate", "counter"), ("tokengate", "doctor"),
                             ("tokengate", "ledger")]

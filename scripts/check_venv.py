"""Check that a checkout's layered virtualenv runs the checkout's own code.

``make setup`` (scripts/setup.sh) gives each checkout a small ``.venv`` whose
site-packages reach the shared virtualenv's (vLLM, torch) through a ``.pth`` line, and
installs the project there as editable installs. The shared virtualenv is never changed
for one checkout: another checkout (or an older setup) may have installed the project,
the vLLM plugin included, there, and removing it would break that one.

What keeps two copies apart, verified here with this interpreter (the ``.venv``'s):

- entry points: ``importlib.metadata`` keeps the first distribution of a name on
  ``sys.path`` (``.venv``'s site-packages come before the shared ones), so vLLM's
  ``entry_points(group="vllm.stat_logger_plugins")`` lists ``tokengate`` once, from this
  checkout's ``tokengate-vllm``;
- imports: setuptools' editable finder is appended to ``sys.meta_path``, after the path
  finder, so a regular (non-editable) copy of a package in the shared site-packages
  would be imported instead of the checkout's. An editable copy there is not (the
  ``.pth`` line adds the folder without running its ``.pth`` files).

Usage: ``.venv/bin/python scripts/check_venv.py CHECKOUT``. Exit status 0 with nothing
printed when both hold; 1 with one line per problem and what to do.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import sys
import sysconfig
from pathlib import Path

MODULES = ("tokengate", "tokengate_client", "tokenstorm", "tokengate_dev", "tokengate_vllm")
PLUGIN_GROUP = "vllm.stat_logger_plugins"  # tokengate_vllm's entry point (vllm_patches/)


def problems(checkout: Path) -> list[str]:
    """What this interpreter would run from outside ``checkout``: one line each."""
    root = checkout.resolve()
    out = []
    for module in MODULES:
        spec = importlib.util.find_spec(module)
        origin = Path(spec.origin).resolve() if spec is not None and spec.origin else None
        if origin is None or root not in origin.parents:
            out.append(f"{module} is imported from {origin}, not from {root}")
    site = Path(sysconfig.get_paths()["purelib"]).resolve()
    eps = [e for e in importlib.metadata.entry_points(group=PLUGIN_GROUP)
           if e.name == "tokengate"]
    dist = eps[0].dist if len(eps) == 1 else None
    where = Path(str(dist.locate_file(""))).resolve() if dist is not None else None
    if where != site:
        out.append(f"vLLM's {PLUGIN_GROUP} entry point tokengate comes "
                   f"{len(eps)} time(s), from {where}, not once from {site}")
    return out


def main() -> int:
    checkout = Path(sys.argv[1] if len(sys.argv) > 1 else ".")
    found = problems(checkout)
    for line in found:
        print(f"setup: {line}", file=sys.stderr)
    if found:
        print("setup: the shared virtualenv holds a copy of the project that shadows this "
              "checkout's (it is left as it is: another checkout may use it). Set "
              "TOKENGATE_VENV to another folder for a shared virtualenv of this checkout's "
              "own, or uninstall that copy yourself if nothing else uses it.",
              file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())

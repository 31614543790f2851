"""tokengate's version: one source, the ``tokengate`` distribution's metadata (the
``version`` of ``sidecars/pyproject.toml``), plus the checkout's commit where the code
runs from a git work tree (``git describe``), so two deployments of one release number
but different code tell themselves apart.

Shown by ``tokengate --version``, the first log line of each service and the
``tokengate_build_info`` metric (gauge 1 with ``version`` and ``commit`` labels), and in
the console's footer. Releases are tagged ``v<version>`` in git.
"""

from __future__ import annotations

import functools
import subprocess
from importlib import metadata
from pathlib import Path

__all__ = ["commit", "describe", "version"]


@functools.cache
def version() -> str:
    """The release, e.g. ``"0.2.0"`` (``"unknown"`` when the distribution is not
    installed, e.g. the package imported from a bare source tree)."""
    try:
        return metadata.version("tokengate")
    except metadata.PackageNotFoundError:
        return "unknown"


@functools.cache
def commit() -> str:
    """``git describe --tags --always --dirty`` of the work tree the package's files are
    in (``"v0.1.0-12-g1a2b3c4"``), or ``""`` when they are not in one, git is missing, or
    git refuses (a tree owned by another user: a unit's user reading an operator's
    checkout). Runs git once per process, with a 2 s bound."""
    here = Path(__file__).resolve().parent
    try:
        r = subprocess.run(["git", "-C", str(here), "describe", "--tags", "--always",
                            "--dirty"], capture_output=True, text=True, timeout=2.0,
                           check=False)
    except (OSError, subprocess.SubprocessError):
        return ""
    return r.stdout.strip() if r.returncode == 0 else ""


def describe() -> str:
    """``"0.2.0"`` or ``"0.2.0 (v0.1.0-12-g1a2b3c4)"``: what ``--version`` and the
    services' first lines print."""
    c = commit()
    return f"{version()} ({c})" if c else version()
